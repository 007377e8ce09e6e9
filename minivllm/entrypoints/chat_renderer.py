"""Chat templates rendered in a process of their own, with a time limit and a memory limit.

A chat template is a program (Jinja), and what it runs depends on the request: its messages,
its chat_template_kwargs and, where the operator allows it (--trust-request-chat-template), a
template of its own. Rendered in the API process, a template that loops for a minute would hold
the interpreter lock every request needs, and one that builds a huge string would take the
server's memory. Here a render that runs past its time is killed with its process, one that
allocates past its budget fails (an address-space limit on the process), and the process is
started again; the request gets a 400 that says which limit it hit.

The render process is `python -m minivllm.entrypoints.chat_renderer FD MEMORY_BYTES`: it reads
the pickled tokenizer from the connection on FD, then answers (conversation,
add_generation_prompt, template kwargs) with (True, prompt token ids) or (False, error message).
"""

import asyncio
import os
import pickle
import resource
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from transformers import PreTrainedTokenizerBase

from minivllm.entrypoints.chat_utils import Conversation, chat_prompt_token_ids

RENDER_TIMEOUT_S = 5.0
RENDER_MEMORY_BYTES = 1 << 30

_Render = tuple[Conversation, bool, dict[str, Any]]


class ChatRenderer:
    """Conversations to prompt token ids, rendered one at a time in the render process."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, timeout_s: float = RENDER_TIMEOUT_S,
                 memory_bytes: int = RENDER_MEMORY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._tokenizer = pickle.dumps(tokenizer)
        self._lock = asyncio.Lock()
        # Waits on the render process off the event loop.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-chat-render")
        self._start()

    def _start(self) -> None:
        """Start the render process; it says "ready" once it has the tokenizer (awaited by the
        first render, so the start never counts against a render's time)."""
        ours, theirs = Pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(self.memory_bytes)],
            pass_fds=[theirs.fileno()], env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        theirs.close()
        ours.send_bytes(self._tokenizer)
        self._connection = ours
        self._ready = False

    async def render(self, conversation: Conversation, add_generation_prompt: bool,
                     template_kwargs: dict[str, Any]) -> list[int]:
        """The conversation's prompt token ids. Raises ValueError if the template fails, runs
        past timeout_s or allocates past memory_bytes."""
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(
                self._waiter, self._render, (conversation, add_generation_prompt, template_kwargs))

    def _render(self, request: _Render) -> list[int]:
        try:
            if not self._ready:
                self._ready = self._connection.recv() == "ready"
            self._connection.send(request)
            if not self._connection.poll(self.timeout_s):
                self._restart()
                raise ValueError(f"The chat template took longer than {self.timeout_s:g} s to render these "
                                 "messages and was stopped.")
            ok, result = self._connection.recv()
        except (EOFError, OSError) as error:  # the process died: out of memory outside Python, say
            self._restart()
            raise ValueError("The chat template's render process died on these messages (its memory is "
                             f"limited to {self.memory_bytes >> 20} MiB).") from error
        if not ok:
            raise ValueError(result)
        return result

    def _restart(self) -> None:
        self._stop()
        self._start()

    def _stop(self) -> None:
        self._connection.close()
        self._process.kill()
        self._process.wait()

    def close(self) -> None:
        """Stop the render process."""
        self._waiter.shutdown()
        self._stop()


def _serve(connection: Connection, memory_bytes: int) -> None:
    """The render process: load the tokenizer, limit memory, answer renders until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    tokenizer = pickle.loads(connection.recv_bytes())
    with open("/proc/self/statm") as f:
        address_space = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (address_space + memory_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    connection.send("ready")
    while True:
        try:
            conversation, add_generation_prompt, template_kwargs = connection.recv()
        # The server closed its end: a reset rather than EOF when it had not read our "ready"
        # (it does so at the first render), as in a server that stops before any chat request.
        except (EOFError, ConnectionResetError):
            return
        reply: tuple[bool, list[int] | str]  # (True, token ids) or (False, the error)
        try:
            reply = (True, chat_prompt_token_ids(tokenizer, conversation, add_generation_prompt, template_kwargs))
        except Exception as error:  # noqa: BLE001 (every failure is the request's: a 400)
            if isinstance(error, MemoryError) or isinstance(error.__cause__, MemoryError):
                reply = (False, f"The chat template needed more than {memory_bytes >> 20} MiB of memory to "
                                "render these messages.")
            else:
                reply = (False, str(error))
        connection.send(reply)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
