"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM, run by uvicorn.

`minivllm serve MODEL_DIR` (entrypoints/cli.py) binds the port, builds the engine, then
`run_server` serves until SIGINT or SIGTERM, drains (see _DrainingServer), stops the engine (and
its tensor-parallel workers) and returns.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable
from types import FrameType
from typing import Any, TypeVar, cast

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import minivllm
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.data_parallel import DataParallelAsyncLLM, EngineClient
from minivllm.entrypoints.openai.dashboard import DashboardFeed, add_dashboard_routes
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from minivllm.entrypoints.openai.serving import EventStream, OpenAIServing
from minivllm.tool_parsers import tool_parser_class

logger = logging.getLogger(__name__)

# Where _EdgeApp puts uvicorn's own `send` in a request's scope.
_RAW_SEND = "minivllm.raw_send"
_T = TypeVar("_T")
_Body = TypeVar("_Body", bound=BaseModel)
# What pydantic's JSON parser says, and what it means to whoever sent the body. A lone
# surrogate is "lone leading surrogate" or, followed by no low half, "unexpected end of hex escape".
_LONE_SURROGATE = "text must be valid Unicode: a \\ud800-\\udfff escape must be half of a surrogate pair"
_JSON_HINTS = {"surrogate": _LONE_SURROGATE, "end of hex escape": _LONE_SURROGATE,
               "invalid unicode code point": "the body must be UTF-8",
               "recursion limit": "it nests arrays and objects too deeply"}


def build_app(serving: OpenAIServing, api_key: str | None = None, enable_tokenizer_info_endpoint: bool = False,
              dashboard: DashboardFeed | None = None) -> FastAPI:
    """enable_tokenizer_info_endpoint: serve GET /tokenizer_info (off by default, as in vLLM: it
    hands out the chat template and the tokenizer's configuration); dashboard: serve the live
    page /dashboard from this feed (None: no page, a 404)."""
    app = FastAPI(title="minivllm", version=minivllm.__version__)
    engine = serving.engine
    if isinstance(engine, DataParallelAsyncLLM):
        registry = engine.metrics_registry

        @app.get("/health")
        async def health() -> Response:  # which replicas stopped; 200 while one serves
            down = engine.down_replicas
            return JSONResponse({"data_parallel_size": len(engine.replicas), "engines_down": down},
                                status_code=200 if engine.is_running else 503)
    else:
        registry = engine.metrics.registry

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if engine.is_running else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "minivllm", "root": engine.config.model,
             "parent": None, "max_model_len": serving.max_model_len} for name in serving.served_model_names]}

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        body = await _parse(raw_request, CompletionRequest)
        return await _respond(raw_request, await serving.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        body = await _parse(raw_request, ChatCompletionRequest)
        return await _respond(raw_request, await serving.create_chat_completion(body))

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> dict[str, Any]:
        body = await _parse(raw_request, TokenizeRequest)
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = await serving.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None, "TokenizeRequest takes exactly one of prompt and messages"
            tokens = await serving.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> dict[str, str]:
        body = await _parse(raw_request, DetokenizeRequest)
        serving.check_model(body.model)
        if serving.tokenizer is None:
            raise OpenAIError("This server has no tokenizer.")
        vocab_size = engine.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(f"Token ids must be in [0, {vocab_size}).", param="tokens")
        return {"prompt": cast(str, serving.tokenizer.decode(body.tokens))}  # one sequence: one string

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return serving.tokenizer_info()

    if dashboard is not None:
        add_dashboard_routes(app, dashboard, api_key)

    _add_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


async def _parse(raw_request: Request, model: type[_Body]) -> _Body:
    """The request's JSON body as `model`. pydantic's own JSON parser reads it (errors with
    their position; lone surrogates, invalid UTF-8 and deep nesting refused); a
    ValidationError becomes a 400 (see _add_error_handlers)."""
    content_type = raw_request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise OpenAIError("The request body must be a JSON object sent with Content-Type: application/json.")
    return model.model_validate_json(await raw_request.body())


async def _respond(raw_request: Request, result: Awaitable[dict[str, Any]] | EventStream) -> Response:
    """Send a streaming result as SSE; await a plain one, aborting it if the client leaves."""
    if isinstance(result, EventStream):
        return _EventStreamResponse(result)
    work = await _unless_disconnected(result, raw_request.receive)
    if work is None:
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(work.result())


class _EventStreamResponse(Response):
    """SSE written by an EventStream in a task of its own (as Starlette's StreamingResponse
    does: awaited from the request's task, every event would resume each coroutine of the
    middleware stack on its way). A client that leaves cancels the writing, whose cleanup
    aborts the engine requests.

    The events go to uvicorn's own `send` when _EdgeApp put it in the scope: the
    middleware stack wraps `send` in a coroutine per middleware, each only noting whether the
    response started (the start message still goes through them). A middleware that rewrote
    bodies (compression) would be skipped."""

    media_type = "text/event-stream"

    def __init__(self, events: EventStream) -> None:  # no body: no content-length header
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = scope.get(_RAW_SEND, send)
        writing = await _unless_disconnected(self.events.write(body_send), receive)
        if writing is not None:
            writing.result()  # errors after the start are error events: this raises on bugs only
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})


class _EdgeApp:
    """The outermost ASGI layer. Puts uvicorn's `send` in each HTTP request's scope (see
    _EventStreamResponse); answers every request with a 503 once the server drains (see
    _DrainingServer); logs an error that escaped the app, whose handler already sent the JSON
    500, instead of letting it reach uvicorn (which would close the client's connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            error = OpenAIError("The server is shutting down: send the request to another server.", 503)
            await JSONResponse(error.body(), status_code=503)(scope, receive, send)
            return
        scope[_RAW_SEND] = send
        try:
            await self.app(scope, receive, send)
        except Exception:
            logger.exception("Internal error on %s %s", scope["method"], scope["path"])


async def _unless_disconnected(work: Awaitable[_T], receive: Receive) -> asyncio.Future[_T] | None:
    """Run work in a task until it ends or the client disconnects: the task once done, or
    None if the client left first (the work is cancelled then: cleanup aborts its engine
    requests)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup done before the response ends
    return None if task.cancelled() else task


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's JSON shape."""

    def reply(error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return reply(error)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, error: ValueError) -> JSONResponse:
        return reply(OpenAIError(str(error)))

    @app.exception_handler(ValidationError)
    async def invalid_request(_: Request, error: ValidationError) -> JSONResponse:
        return reply(_invalid_request(error))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return reply(OpenAIError(str(error.detail), error.status_code))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return reply(OpenAIError(str(error), 500))

    @app.exception_handler(Exception)  # a bug: logged by _EdgeApp
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return reply(OpenAIError(f"Internal server error ({type(error).__name__}); the server logged it.", 500))


def _invalid_request(error: ValidationError) -> OpenAIError:
    """A 400 that says what is wrong with the body, naming the first field at fault as param."""
    errors = error.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first["ctx"]["error"]
        hint = next((hint for key, hint in _JSON_HINTS.items() if key in reason), None)
        return OpenAIError(f"The request body is not valid JSON ({reason})" + (f": {hint}." if hint else "."))
    if first["loc"] == () and first["type"] in ("model_type", "model_attributes_type"):
        return OpenAIError("The request body must be a JSON object.")
    fields = [".".join(str(part) for part in e["loc"]) for e in errors]
    problems = [f"{field or 'body'}: {e['msg'].removeprefix('Value error, ')}" for field, e in zip(fields, errors)]
    return OpenAIError("Invalid request: " + "; ".join(problems), param=fields[0] or None)


class _APIKeyMiddleware:
    """401 for /v1/ requests without `Authorization: Bearer <api key>` (as vLLM: /health,
    /metrics, /version, /tokenize stay open). Pure ASGI: a BaseHTTPMiddleware would sit in
    the path of every streamed event."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401)
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with a draining shutdown on SIGINT or SIGTERM: new requests get a 503
    at once, dashboard event streams end; requests in flight have shutdown_timeout_s to finish;
    then the engine ends the rest with a 503 (a stream with an error event, then [DONE]); the
    server stops once their responses are out."""

    def __init__(self, config: uvicorn.Config, edge: _EdgeApp, engine: EngineClient, shutdown_timeout_s: float,
                 dashboard: DashboardFeed | None) -> None:
        super().__init__(config)
        self.edge = edge
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.dashboard = dashboard

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("Signal %d: shutting down (requests in flight have %g s to finish)", sig,
                        self.shutdown_timeout_s)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.edge.draining = True
        if self.dashboard is not None:
            self.dashboard.close()  # its event streams would run until uvicorn's own limit
        ending = asyncio.create_task(self._end_requests_in_flight())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def _end_requests_in_flight(self) -> None:
        await asyncio.sleep(self.shutdown_timeout_s)
        ended = self.engine.close(lambda: OpenAIError("The server shut down before this request finished.", 503))
        if ended:
            logger.warning("Ended %d request(s) still running after %g s", ended, self.shutdown_timeout_s)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on once the engine is up. Raises
    ValueError if the address is taken, before the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port} ({error.strerror}): stop what uses it, or choose "
                         "another --port.") from error
    return sock


def run_server(args: argparse.Namespace) -> None:
    """Bind the port, build the engine, serve until SIGINT/SIGTERM, drain, then stop the engine.
    Raises ValueError (before the model loads) on a bad configuration or a port in use."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (the model's tool-call format).")
    # --tool-call-parser alone is checked but unused, as in vLLM: tool calls need both flags.
    tool_parser = tool_parser_class(args.tool_call_parser) if args.tool_call_parser is not None else None
    with contextlib.ExitStack() as cleanup:  # undone in reverse order, whatever stops the server
        sock = cleanup.enter_context(_bind(args.host, args.port))
        config = EngineConfig(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                              enable_prefix_caching=args.enable_prefix_caching,
                              tensor_parallel_size=args.tensor_parallel_size,
                              distributed_executor_backend=args.distributed_executor_backend, device=args.device,
                              block_size=args.block_size,
                              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, seed=args.seed,
                              load_format=args.load_format,
                              enforce_eager=args.enforce_eager, reasoning_parser=args.reasoning_parser,
                              structured_outputs_config=args.structured_outputs_config,
                              speculative_config=args.speculative_config)
        names = args.served_model_name or [args.model]
        log_stats_interval_s = None if args.disable_log_stats else 10.0
        # One replica: the AsyncLLM itself, with nothing in between.
        engine: EngineClient = (
            AsyncLLM(config, names[0], log_stats_interval_s) if args.data_parallel_size == 1
            else DataParallelAsyncLLM(config, args.data_parallel_size, names[0], log_stats_interval_s))
        cleanup.callback(engine.shutdown)
        serving = OpenAIServing(engine, names, args.trust_request_chat_template,
                                tool_parser if args.enable_auto_tool_choice else None)
        cleanup.callback(serving.close)
        dashboard = None if args.disable_dashboard else DashboardFeed(engine, names[0])
        edge = _EdgeApp(build_app(serving, args.api_key or os.environ.get("VLLM_API_KEY"),
                                  args.enable_tokenizer_info_endpoint, dashboard))
        # uvicorn's own limit, past ours: time for the ended requests' last events to go out.
        server_config = uvicorn.Config(edge, log_level="info", access_log=not args.disable_uvicorn_access_log,
                                       timeout_graceful_shutdown=args.shutdown_timeout + 5)
        server = _DrainingServer(server_config, edge, engine, args.shutdown_timeout, dashboard)
        # uvicorn re-raises the signal that stopped it once it is done; these handlers take it,
        # so the process goes on to stop the engine and exits with status 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: None)
        logger.info("Serving on http://%s:%d", args.host, sock.getsockname()[1])
        server.run(sockets=[sock])
    logger.info("Server stopped")
