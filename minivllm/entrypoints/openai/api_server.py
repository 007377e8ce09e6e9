"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM, run by uvicorn.

`minivllm serve MODEL_DIR` (entrypoints/cli.py) builds the engine, then `run_server` serves
until SIGINT or SIGTERM, then stops the engine (and its tensor-parallel workers) and returns.
"""

import argparse
import asyncio
import logging
import os
import secrets
import signal
from collections.abc import Awaitable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import minivllm
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from minivllm.entrypoints.openai.serving import EventStream, OpenAIServing

logger = logging.getLogger(__name__)

# Where _RawSendApp puts uvicorn's own `send` in a request's scope.
_RAW_SEND = "minivllm.raw_send"
_T = TypeVar("_T")


def build_app(serving: OpenAIServing, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="minivllm", version=minivllm.__version__)
    engine = serving.engine

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
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "minivllm", "root": engine.config.model,
             "parent": None, "max_model_len": serving.max_model_len} for name in serving.served_model_names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await _respond(raw_request, await serving.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _respond(raw_request, await serving.create_chat_completion(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = await serving.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            tokens = await serving.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(body.model)
        if serving.tokenizer is None:
            raise OpenAIError("This server has no tokenizer.")
        vocab_size = engine.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(f"Token ids must be in [0, {vocab_size}).", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    _add_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


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

    The events go to uvicorn's own `send` when _RawSendApp put it in the scope: the
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


class _RawSendApp:
    """The outermost ASGI layer: puts uvicorn's `send` in each HTTP request's scope (see
    _EventStreamResponse)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_RAW_SEND] = send
        await self.app(scope, receive, send)


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
    def reply(error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return reply(error)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, error: ValueError) -> JSONResponse:
        return reply(OpenAIError(str(error)))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            return reply(OpenAIError("The request body is not valid JSON: check its syntax."))
        if errors and errors[0]["type"] in ("model_attributes_type", "dict_type", "missing") \
                and errors[0]["loc"] == ("body",):  # not an object: no JSON sent?
            return reply(OpenAIError("The request body must be a JSON object (send it with "
                                     "Content-Type: application/json)."))
        fields = [".".join(str(part) for part in e["loc"][1:]) for e in errors]
        problems = [f"{field or 'body'}: {e['msg'].removeprefix('Value error, ')}" for field, e in zip(fields, errors)]
        return reply(OpenAIError("Invalid request: " + "; ".join(problems), param=fields[0] or None))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return reply(OpenAIError(str(error.detail), error.status_code))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return reply(OpenAIError(str(error), 500))


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


def run_server(args: argparse.Namespace) -> None:
    """Build the engine, serve until SIGINT/SIGTERM, then stop the engine. Raises ValueError
    (before serving) on a bad configuration."""
    config = EngineConfig(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          enable_prefix_caching=args.enable_prefix_caching,
                          tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
                          kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, load_format=args.load_format,
                          enforce_eager=args.enforce_eager)
    names = args.served_model_name or [args.model]
    engine = AsyncLLM(config, model_name=names[0], log_stats_interval_s=None if args.disable_log_stats else 10.0)
    try:
        app = build_app(OpenAIServing(engine, names), args.api_key or os.environ.get("VLLM_API_KEY"))
        server = uvicorn.Server(uvicorn.Config(_RawSendApp(app), host=args.host, port=args.port, log_level="info",
                                               access_log=not args.disable_uvicorn_access_log,
                                               timeout_graceful_shutdown=5))
        # uvicorn re-raises the signal that stopped it once it is done; these handlers take
        # it, so the process goes on to stop the engine and exits with status 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("Signal %d: shutting down", signum))
        server.run()
    finally:
        engine.shutdown()
    logger.info("Server stopped")
