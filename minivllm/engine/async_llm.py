"""AsyncLLM: the engine in a process of its own; each request an async stream of outputs.

The engine core process owns the LLMEngine and runs its step loop, which keeps the overlap
of one step's host work with the next step's GPU work; no HTTP handling, JSON or
tokenization competes with it for a Python interpreter lock. This (API) process tokenizes
and validates requests (bad input raises before anything is queued), sends them down a
pipe (from a thread: a full pipe must not block the event loop), and gets each step's
outputs back through another, read by a thread that hands them to the event loop in one
callback per step. Outputs are deltas: each carries only the
tokens and text that are new since the previous one.

Messages, front to core: ("add", request_id, prompt_text, prompt_token_ids, params,
arrival_time), ("abort", request_id), ("snapshot",), None (stop). Core to front: ("ready", stats),
("step", outputs, stats), ("snapshot", EngineSnapshot, stats), ("dead", error), ("stopped", None).

The core is a process this one spawns, talking over pipes (ProcessEngineCore), or, with
distributed_executor_backend="ray", a Ray actor anywhere in the cluster (engine/ray_core.py):
both run the one loop, run_engine_core, over connection-like ends (CommandSource, ResultSink).
"""

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig, cpu_threads
from minivllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import EngineSnapshot, EngineStats, ServingMetrics
from minivllm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often an idle engine core checks that the front is still alive.
_IDLE_POLL_S = 1.0
_STOP_TIMEOUT_S = 30.0

# A RequestOutput as the core sends it, without the prompt (the front has it; resending 1,000
# prompt token ids with every delta would cost more than the delta), in plain tuples: the
# front gets one per streamed token, and making and freeing dataclass instances (or
# unpickling them) costs several times as much. The server reads them as they are; other
# callers get RequestOutputs (RequestStream.next_batch).
# (request_id, completions, finished, (first_scheduled_time, first_token_time, finished_time),
# num_cached_tokens, prompt_logprobs); a completion is CompletionOutput's fields in order.
WireCompletion = tuple[int, str, list[int], float | None, SampleLogprobs | None, str | None, int | str | None]
WireOutput = tuple[str, list[WireCompletion], bool, tuple[float | None, float | None, float | None], int,
                   PromptLogprobs | None]


# A command to the core, None to stop it (see the module's docstring), and a message from it.
Command = tuple[Any, ...] | None
CoreMessage = tuple[Any, ...]


class CommandSource(Protocol):
    """The core's end of the command channel (a multiprocessing Connection is one)."""

    def poll(self, timeout: float = 0.0) -> bool: ...

    def recv(self) -> Any: ...


class ResultSink(Protocol):
    """The core's end of the results channel (a multiprocessing Connection is one)."""

    def send(self, obj: Any) -> None: ...


class EngineCore(Protocol):
    """The front's handle on its engine core: a process (ProcessEngineCore) or a Ray actor
    (engine/ray_core.py's RayEngineCore)."""

    def send(self, commands: list[Command]) -> None:
        """Deliver the commands in order; raises OSError once the core is gone."""

    def receive(self, timeout: float | None) -> list[CoreMessage]:
        """The messages that came, waiting up to timeout seconds for one ([] if none came; None:
        as long as it takes); raises EOFError once the core is gone."""
        ...

    def is_alive(self) -> bool: ...

    def stop(self, timeout: float) -> None:
        """After the stop command: wait up to timeout seconds for the core to end, then end it."""

    def exit_error(self) -> BaseException:
        """What to report of a core that ended without a word."""
        ...


class EngineDeadError(RuntimeError):
    """The engine stopped on an error; no request can be served any more."""


class RequestStream:
    """One request's outputs, as an async iterator. Leaving it before the request finished
    (an exception, a cancelled task, `aclose()`) aborts the request."""

    def __init__(self, engine: "AsyncLLM", request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 arrival_time: float) -> None:
        """Create it on the event loop that will read it."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # Shared by the request's outputs and updated as the engine reports (as offline).
        self.metrics = RequestMetrics(arrival_time)
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._outputs: list[WireOutput] = []
        self._error: BaseException | None = None  # what ended the stream early (the engine died, ...)
        # The reader's wake-up, while it waits (a bare future: cheaper than an asyncio.Event).
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False

    def put(self, output: WireOutput) -> None:
        self._outputs.append(output)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream early: its reader gets the outputs already put, then `error` raised."""
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: its reader was cancelled
                waiter.set_result(None)

    async def next_wire_batch(self) -> list[WireOutput]:
        """Every output that arrived since the last call, waiting for one if there is none ([]
        once the request finished): a consumer that fell behind catches up in one go (the
        server writes such a list in one send). Raises EngineDeadError if the engine stopped.
        A caller that leaves before the end must `aclose()`."""
        if self.finished:
            return []
        while not self._outputs:
            if self._error is not None:
                self.finished = True
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
        outputs, self._outputs = self._outputs, []
        _, _, self.finished, _, _, _ = outputs[-1]
        return outputs

    async def next_batch(self) -> list[RequestOutput]:
        """next_wire_batch's outputs as RequestOutputs."""
        return [self.request_output(output) for output in await self.next_wire_batch()]

    def request_output(self, output: WireOutput) -> RequestOutput:
        request_id, completions, finished, times, num_cached_tokens, prompt_logprobs = output
        metrics = self.metrics
        metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time = times
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids,
                             list(itertools.starmap(CompletionOutput, completions)), finished, metrics,
                             num_cached_tokens, prompt_logprobs)

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in next_batch's lists."""
        try:
            while batch := await self.next_batch():
                yield batch
        finally:
            await self.aclose()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for output in batch:
                yield output

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig, model_name: str | None = None,
                 log_stats_interval_s: float | None = 10.0, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1, cuda_visible_devices: str | None = None) -> None:
        """Start the engine core (a process; with distributed_executor_backend="ray", a Ray
        actor); returns once it is ready, or raises what stopped it. model_name labels the
        metrics (default: the model path); log_stats_interval_s: seconds between the periodic
        stats log lines (None: no log). As one of
        data_parallel_size replicas (engine/data_parallel.py): data_parallel_rank labels its
        metrics, its core takes its share of the CPU cores, and cuda_visible_devices its GPUs."""
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase | None = load_tokenizer(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.metrics = ServingMetrics(model_name or config.model, self.engine_stats, config.device,
                                      engine_index=data_parallel_rank)
        self.dead_error: BaseException | None = None
        self._log_stats_interval_s = log_stats_interval_s
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: EngineStats = {}
        self._closed_error: Callable[[], BaseException] | None = None  # see close()
        self._snapshot: asyncio.Future[EngineSnapshot] | None = None  # the one asked of the core
        self._stopping = False
        self._request_counter = 0
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="minivllm-tokenize")
        log_level = logging.getLogger().getEffectiveLevel()
        self.core: EngineCore
        if config.distributed_executor_backend == "ray":
            from minivllm.engine.ray_core import RayEngineCore  # ray: an optional extra

            self.core = RayEngineCore(config, data_parallel_size, log_level)
        else:
            name = "minivllm-engine" if data_parallel_size == 1 else f"minivllm-engine-{data_parallel_rank}"
            # Its intra-op threads leave a core to this process, which tokenizes, detokenizes and
            # streams meanwhile.
            self.core = ProcessEngineCore(config, name, cpu_threads(reserved_cores=1, num_engines=data_parallel_size),
                                          log_level, cuda_visible_devices)
        try:
            (kind, payload), = self.core.receive(None)
        except EOFError:
            kind, payload = "dead", self.core.exit_error()
        if kind == "dead":
            self.core.stop(_STOP_TIMEOUT_S)
            raise payload
        self._stats = payload
        self._reader = threading.Thread(target=self._read_results, name="minivllm-results", daemon=True)
        self._reader.start()
        # Commands go down the pipe from a thread of their own: a write blocks while the pipe is
        # full (the core reads between steps), and the event loop must never block.
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_commands, name="minivllm-commands", daemon=True)
        self._sender.start()

    # --- requests (call from the event loop) ------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self.core.is_alive()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests queued or running, as this front sees them."""
        return len(self._streams)

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on a worker thread. A fast tokenizer's batch call runs in Rust without
        the interpreter lock, so the event loop, the results thread and other prompts'
        tokenization go on meanwhile (its single-text call holds the lock for the whole
        encode, during which nothing else in this process runs)."""
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: pass prompts as token ids.")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self._encode, text,
                                                                 add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self.tokenizer is not None, "tokenize() refuses a model without a tokenizer"
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request. Raises ValueError on bad input (nothing is queued)
        and EngineDeadError once the engine has stopped."""
        (stream,) = await self.add_requests([prompt], params, [request_id], arrival_time)
        return stream

    async def add_requests(self, prompts: list[PromptType], params: SamplingParams | None,
                           request_ids: list[str | None], arrival_time: float | None = None) -> list[RequestStream]:
        """Validate every prompt, then queue them all (request id None: a fresh one); a bad
        prompt raises ValueError and none is queued."""
        if self._closed_error is not None:
            raise self._closed_error()
        if not self.is_running:
            raise EngineDeadError("The engine has stopped; restart the server.") from self.dead_error
        arrival_time = arrival_time or time.time()
        params = params or SamplingParams()
        checked = [self.input_processor.process(await self.with_token_ids(prompt), params) for prompt in prompts]
        # The commands thread sends the token ids after this returns, when the caller may
        # already have changed a list it passed: send copies.
        checked = [(prompt_text, list(prompt_token_ids)) for prompt_text, prompt_token_ids in checked]
        ids = [request_id or self._next_request_id() for request_id in request_ids]
        in_use = set(self._streams)
        for request_id in ids:
            if request_id in in_use:
                raise ValueError(f"Request id {request_id!r} is already in use.")
            in_use.add(request_id)
        self._loop = asyncio.get_running_loop()  # where outputs go
        streams = []
        for request_id, (prompt_text, prompt_token_ids) in zip(ids, checked):
            stream = RequestStream(self, request_id, prompt_text, prompt_token_ids, arrival_time)
            self._streams[request_id] = stream
            self.metrics.on_request_added(request_id, arrival_time, len(prompt_token_ids))
            self._outbox.put(("add", request_id, prompt_text, prompt_token_ids, params, arrival_time))
            streams.append(stream)
        return streams

    def _next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter)

    async def with_token_ids(self, prompt: PromptType) -> PromptType:
        """A text prompt with its token ids, tokenized off the event loop (see encode)."""
        text = prompt.get("prompt") if isinstance(prompt, dict) and set(prompt) == {"prompt"} else prompt
        if isinstance(text, str):
            return {"prompt": text, "prompt_token_ids": await self.encode(text)}
        return prompt

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (deltas); the last has finished=True."""
        async for output in await self.add_request(prompt, params, request_id):
            yield output

    def abort(self, request_id: str) -> None:
        """Stop a request; the engine frees its blocks at its next step boundary."""
        if self._streams.pop(request_id, None) is not None:
            self.metrics.on_request_aborted(request_id)
            self._outbox.put(("abort", request_id))

    def close(self, error: Callable[[], BaseException]) -> int:
        """Take no more requests and end every open one (the engine frees their blocks): from
        now on add_requests raises error(), and each open stream raises one after the outputs it
        already has. Returns how many requests were ended. Call from the event loop."""
        self._closed_error = error
        for request_id, stream in self._streams.items():
            stream.fail(error())
            self.metrics.on_request_aborted(request_id)
            self._outbox.put(("abort", request_id))
        ended = len(self._streams)
        self._streams.clear()
        return ended

    async def snapshot(self) -> EngineSnapshot:
        """The core's EngineSnapshot, taken between two steps: one round trip, shared by
        whoever asks while it is under way. Raises EngineDeadError once the engine has stopped."""
        if not self.is_running:
            raise EngineDeadError("The engine has stopped.") from self.dead_error
        if self._snapshot is None or self._snapshot.done():
            self._loop = asyncio.get_running_loop()  # where the answer goes
            self._snapshot = self._loop.create_future()
            self._outbox.put(("snapshot",))
        return await asyncio.shield(self._snapshot)

    def _answer_snapshot(self, snapshot: EngineSnapshot) -> None:
        if self._snapshot is not None and not self._snapshot.done():
            self._snapshot.set_result(snapshot)

    def engine_stats(self) -> EngineStats:
        """The engine's counters as of its latest step (or the latest change after one)."""
        return self._stats

    def shutdown(self) -> None:
        """Stop the engine core (and its tensor-parallel workers)."""
        self._stopping = True
        self._outbox.put(None)
        self._sender.join()
        self.core.stop(_STOP_TIMEOUT_S)
        self._reader.join()
        self._tokenizer_pool.shutdown()

    def _dispatch(self, outputs: list[WireOutput]) -> None:
        """On the event loop: route one step's outputs to their streams."""
        self.metrics.on_outputs(outputs, time.time())  # skips those of requests aborted meanwhile
        streams = self._streams
        for output in outputs:
            request_id, _, finished, _, _, _ = output
            stream = streams.get(request_id)
            if stream is None:  # aborted meanwhile
                continue
            if finished:
                del streams[request_id]
            stream.put(output)

    def _fail_all(self, error: BaseException) -> None:
        """On the event loop: end every open stream with the engine's error."""
        for stream in self._streams.values():
            dead = EngineDeadError("The engine stopped while serving this request.")
            dead.__cause__ = error
            stream.fail(dead)
        self._streams.clear()
        if self._snapshot is not None and not self._snapshot.done():
            self._snapshot.set_exception(EngineDeadError("The engine stopped."))

    # --- the command and results threads ---------------------------------------------------

    def _send_commands(self) -> None:
        """Forward queued commands to the core, those queued meanwhile together, until the stop
        command (None) is sent."""
        while True:
            commands = [self._outbox.get()]
            while commands[-1] is not None and not self._outbox.empty():
                commands.append(self._outbox.get())
            try:
                self.core.send(commands)
            except OSError:  # the core is gone: the results thread reports it
                return
            if commands[-1] is None:
                return

    def _read_results(self) -> None:
        """Hand each step's outputs to the event loop; log stats periodically; notice the
        core's death."""
        next_log = time.monotonic() + (self._log_stats_interval_s or 0)
        while True:
            timeout = max(next_log - time.monotonic(), 0) if self._log_stats_interval_s else None
            try:
                messages = self.core.receive(timeout)
            except (EOFError, OSError):  # the core is gone without a word
                if not self._stopping:
                    self._die(self.core.exit_error())
                return
            for message in messages:
                kind, payload, *stats = message
                if kind == "stopped":
                    return
                if kind == "dead":
                    self._die(payload)
                    return
                self._stats = stats[0]
                loop = self._loop
                if payload and loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self._answer_snapshot if kind == "snapshot" else self._dispatch, payload)
            if self._log_stats_interval_s and time.monotonic() >= next_log:
                self.metrics.log_stats()
                next_log = time.monotonic() + self._log_stats_interval_s

    def _die(self, error: BaseException) -> None:
        logger.error("The engine stopped: %s", error)
        self.dead_error = error
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, error)


class ProcessEngineCore:
    """An engine core in a process of its own, spawned here, over two pipes."""

    def __init__(self, config: EngineConfig, name: str, num_threads: int, log_level: int,
                 cuda_visible_devices: str | None) -> None:
        ctx = mp.get_context("spawn")  # forking a process that may have touched CUDA is unsafe
        core_commands, self._commands = ctx.Pipe(duplex=False)
        self._results, core_results = ctx.Pipe(duplex=False)
        # Not a daemon: the core starts tensor-parallel workers of its own.
        self.process = ctx.Process(target=_engine_core_process, name=name,
                                   args=(config, core_commands, core_results, num_threads, log_level,
                                         cuda_visible_devices))
        self.process.start()
        core_commands.close()
        core_results.close()
        # One poll object for the handle's life (Connection.poll builds a selector per call).
        self._poller = select.poll()
        self._poller.register(self._results.fileno(), select.POLLIN)

    def send(self, commands: list[Command]) -> None:
        for command in commands:
            self._commands.send(command)

    def receive(self, timeout: float | None) -> list[CoreMessage]:
        if not self._poller.poll(None if timeout is None else timeout * 1000):
            return []
        return [self._results.recv()]

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()

    def exit_error(self) -> BaseException:
        self.process.join(_STOP_TIMEOUT_S)
        return RuntimeError(f"The engine process exited (code {self.process.exitcode}).")


def _engine_core_process(config: EngineConfig, commands: CommandSource, results: ResultSink, num_threads: int,
                         log_level: int, cuda_visible_devices: str | None) -> None:
    """The engine process: run_engine_core. cuda_visible_devices: the GPUs it (and its
    tensor-parallel workers) may see, set before CUDA starts (None: those of the front)."""
    if cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front decides
    torch.set_num_threads(num_threads)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    run_engine_core(config, commands, results)


def run_engine_core(config: EngineConfig, commands: CommandSource, results: ResultSink) -> None:
    """The engine core: build the engine, then apply requests and aborts as they come and step
    while there is work, until the stop command; reports ready, each step, and death."""
    try:
        engine = LLMEngine(config)
    except BaseException as error:  # noqa: BLE001 (the front raises it)
        results.send(("dead", picklable(error)))
        return
    sent_stats = engine.stats()
    results.send(("ready", sent_stats))
    try:
        while True:
            busy = engine.has_unfinished_requests() or engine.has_steps_in_flight
            if not busy and not commands.poll(_IDLE_POLL_S):
                parent = mp.parent_process()
                if parent is not None and not parent.is_alive():
                    break
                continue
            if not _apply_commands(engine, commands, results):
                break
            outputs = []
            if engine.has_unfinished_requests() or engine.has_steps_in_flight:
                outputs = engine.step()
            stats = engine.stats()
            if outputs or stats != sent_stats:
                results.send(("step", [to_wire(output) for output in outputs], stats))
                sent_stats = stats
        results.send(("stopped", None))
    except BaseException as error:  # reported to the front (then /health says 503)
        logger.exception("The engine stopped on an error")
        try:
            results.send(("dead", picklable(error)))
        except OSError:
            pass  # the front is gone too
    finally:
        engine.shutdown()


def to_wire(output: RequestOutput) -> WireOutput:
    """The output as the core sends it (see WireOutput)."""
    metrics = output.metrics
    assert metrics is not None, "the engine's outputs carry metrics"
    return (output.request_id,
            [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
             for c in output.outputs],
            output.finished, (metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time),
            output.num_cached_tokens, output.prompt_logprobs)


def _apply_commands(engine: LLMEngine, commands: CommandSource, results: ResultSink) -> bool:
    """Apply every queued add and abort, answer a snapshot request; False once asked to stop."""
    while commands.poll():
        command = commands.recv()
        if command is None:
            return False
        if command[0] == "add":
            _, request_id, prompt_text, prompt_token_ids, params, arrival_time = command
            engine.add(engine.build_request(request_id, prompt_text, prompt_token_ids, params, stream=True,
                                            arrival_time=arrival_time))
        elif command[0] == "abort":
            engine.abort_request(command[1])
        else:
            snapshot = engine.snapshot()
            results.send(("snapshot", snapshot, snapshot.stats))
    return True


def picklable(error: BaseException) -> BaseException:
    """The error itself when it survives the pipe (a ValueError about the config, say)."""
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 (any pickling failure)
        return RuntimeError(f"{type(error).__name__}: {error}")
