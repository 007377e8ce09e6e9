"""AsyncLLM: the engine on a background thread; each request an async stream of outputs.

One thread owns the LLMEngine (it builds it, so every CUDA call, graph and stream lives on
that thread) and runs its step loop, which keeps the overlap of one step's host work with
the next step's GPU work. The asyncio side tokenizes and validates requests itself (bad
input raises before anything is queued), hands them to the engine thread through a queue,
and receives each step's outputs in one callback on its event loop. Outputs are deltas:
each carries only the tokens and text that are new since the previous one.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine, PromptType, Request
from minivllm.engine.metrics import EngineStats, ServingMetrics
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class RequestStream:
    """One request's outputs, as an async iterator. Leaving it before the request finished
    (an exception, a cancelled task, `aclose()`) aborts the request."""

    def __init__(self, engine: "AsyncLLM", request: Request) -> None:
        self.request_id = request.request_id
        self._engine = engine
        self._items: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Outputs in lists of all that arrived since the last one: a consumer that fell
        behind catches up in one go (the server writes such a list in one send)."""
        try:
            while not self.finished:
                await self._ready.wait()
                items, self._items = self._items, []
                self._ready.clear()
                for item in items:
                    if isinstance(item, BaseException):
                        raise EngineDeadError("The engine stopped while serving this request.") from item
                self.finished = items[-1].finished
                yield items
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
                 log_stats_interval_s: float | None = 10.0) -> None:
        """Build the engine on its own thread; returns once it is ready (or raises what
        stopped it from starting). model_name labels the metrics (default: the model path);
        log_stats_interval_s: seconds between the periodic stats log lines (None: no log)."""
        self.config = config
        self.metrics = ServingMetrics(model_name or config.model, self.engine_stats)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log_stats_interval_s = log_stats_interval_s
        self.dead_error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._startup_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._engine_thread, args=(ready,), name="minivllm-engine",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # --- the asyncio side -------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        """The engine; read its config and tokenizer freely, its state only as a snapshot."""
        assert self._engine is not None
        return self._engine

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request; call from the event loop. Raises ValueError on bad
        input (nothing is queued) and EngineDeadError once the engine has stopped."""
        if not self.is_running:
            raise EngineDeadError("The engine has stopped; restart the server.") from self.dead_error
        self._loop = asyncio.get_running_loop()  # where this request's outputs go
        request_id = request_id or self.engine.next_request_id()
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        request = self.engine.make_request(request_id, prompt, params, stream=True, arrival_time=arrival_time)
        stream = RequestStream(self, request)
        self._streams[request_id] = stream
        self.metrics.on_request_added(request)
        self._commands.put(_Add(request))
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (deltas); the last has finished=True."""
        async for output in self.add_request(prompt, params, request_id):
            yield output

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (at the engine's next step boundary)."""
        if self._streams.pop(request_id, None) is not None:
            self.metrics.on_request_aborted(request_id)
            self._commands.put(_Abort(request_id))

    def engine_stats(self) -> EngineStats:
        """A snapshot of the engine's counters (read from another thread: each value is
        consistent, the set as a whole may straddle a step)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine thread (and tensor-parallel workers); unfinished requests end
        with EngineDeadError."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: route one step's outputs to their streams."""
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted meanwhile
                continue
            self.metrics.on_output(output, now)
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _fail_all(self, error: BaseException) -> None:
        """On the event loop: end every open stream with the engine's error."""
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()

    # --- the engine thread ------------------------------------------------------------------

    def _engine_thread(self, ready: threading.Event) -> None:
        try:
            self._engine = LLMEngine(self.config)
        except BaseException as error:  # noqa: BLE001 (re-raised by __init__)
            self._startup_error = error
            ready.set()
            return
        ready.set()
        engine = self._engine
        next_log = time.monotonic() + (self._log_stats_interval_s or 0)
        try:
            while True:
                busy = engine.has_unfinished_requests() or engine.in_flight is not None
                if not self._apply_commands(block=not busy):
                    break
                if engine.has_unfinished_requests() or engine.in_flight is not None:
                    outputs = engine.step()
                    if outputs and not self._loop.is_closed():
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
                if self._log_stats_interval_s and time.monotonic() >= next_log:
                    self.metrics.log_stats()
                    next_log = time.monotonic() + self._log_stats_interval_s
        except BaseException as error:
            logger.exception("The engine thread stopped on an error")
            self.dead_error = error
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, error)
        finally:
            engine.shutdown()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if block); False on stop."""
        engine = self._engine
        while True:
            try:
                # An idle thread wakes up for the next stats log line.
                command = self._commands.get(block=block, timeout=self._log_stats_interval_s if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                engine.add(command.request)
            else:
                engine.abort_request(command.request_id)
