"""A real `minivllm serve` process on 127.0.0.1 for tests, and helpers to talk to it; a fake
server (any ASGI app) in a thread for the benchmark client's tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai


def openai_error(response: httpx.Response, status: int) -> str:
    """The message of an error answered in OpenAI's shape with this status (asserted)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"]


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """The app under uvicorn on a free port of 127.0.0.1, in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model_dir: str, *args: str, stop_signal: int = signal.SIGTERM, **kwargs: Any) -> Iterator[RemoteServer]:
    """A RemoteServer (kwargs: its own) for the block, stopped after it with stop_signal; it must
    exit with status 0 (its output says why not)."""
    server = RemoteServer(model_dir, *args, **kwargs)
    try:
        yield server
    finally:
        assert server.stop(stop_signal) == 0, server.output()


class RemoteServer:
    """`python -m minivllm serve MODEL ARGS` in a child process, up once /health answers."""

    def __init__(self, model_dir: str, *args: str, api_key: str | None = None, startup_timeout_s: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        command = [sys.executable, "-m", "minivllm", "serve", model_dir, "--host", "127.0.0.1",
                   "--port", str(self.port), "--served-model-name", "tiny", "--dtype", "float32",
                   "--disable-uvicorn-access-log", *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        # One intra-op thread: tiny models, and a busy CI machine (see conftest.py).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = f"/tmp/minivllm-test-server-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"The server exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"The server did not come up:\n{self.output()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                                  **kwargs)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples without labels' detail: {'vllm:num_requests_running': 0.0, ...}."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
            if match:
                samples[match.group(1)] = samples.get(match.group(1), 0.0) + float(match.group(3))
        return samples

    def wait_idle(self, timeout_s: float = 10) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            idle = (samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0
                    and samples["vllm:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        """Send sig, wait for the exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


class Load:
    """`concurrency` clients sending completion requests to a server, each the next as soon as
    its last one is answered, until the block ends: prompts of a few lengths, sharing a
    prefix (prefix-cache hits), each max_tokens tokens long (no EOS)."""

    def __init__(self, url: str, concurrency: int, max_tokens: int = 48, api_key: str | None = None,
                 model: str = "tiny") -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as client:
            for count in itertools.count():
                if self.stopping.is_set():
                    return
                prompt = "The quick brown fox jumps over the lazy dog. " * (1 + (index + count) % 4) + str(count)
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True}
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    self.errors.append(response.text)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        assert not self.errors, self.errors[:3]


def descendants(pid: int) -> set[int]:
    """Every process below pid, whichever thread started it (from /proc)."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                found |= {child} | descendants(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
