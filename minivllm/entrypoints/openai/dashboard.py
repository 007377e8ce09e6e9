"""The live engine page: GET /dashboard (one static HTML file of the package, its script and
plots inline: no build step, nothing fetched from elsewhere), fed by GET /dashboard/events
(server-sent events, one JSON snapshot a second) or read once with GET /dashboard/snapshot.

A snapshot shows each replica (each data-parallel engine): its queues, every KV block's state,
prefix-cache hits, token throughputs, TTFT and TPOT percentiles over the last minutes, and its
oldest unfinished requests. The engine cores are asked for their part (EngineSnapshot) at most
once a second however many pages are open, and not at all while none is.

With --api-key, the page and its data need the key: as `Authorization: Bearer <key>`, a
`minivllm_api_key` cookie (which the page asks for and sets) or a `?key=` query (the page moves it
into the cookie and drops it from its address; the server's access log has seen it, though).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any
from urllib.parse import unquote

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.data_parallel import DataParallelAsyncLLM, EngineClient
from minivllm.engine.kv_cache_manager import BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE
from minivllm.engine.metrics import kv_cache_usage
from minivllm.entrypoints.openai.protocol import OpenAIError

INTERVAL_S = 1.0  # between snapshots
RATE_WINDOW_S = 10.0  # throughputs and the recent hit rate: over this many seconds
LATENCY_WINDOW_S = 300.0  # TTFT and TPOT plots: the last five minutes...
LATENCY_BUCKET_S = 10.0  # ... in percentiles of ten-second buckets
MAX_MAP_CELLS = 32_768  # a bigger cache is drawn with several blocks a cell (the most common state)
PERCENTILES = (50, 90, 99)
KEY_COOKIE = "minivllm_api_key"

_STATIC = resources.files(__package__) / "static"


class DashboardFeed:
    """The snapshots of one server's engine (or its replicas)."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.replicas: list[AsyncLLM] = engine.replicas if isinstance(engine, DataParallelAsyncLLM) else [engine]
        self.model_name = model_name
        self.closed = asyncio.Event()  # the server drains: event streams end
        self._latest: asyncio.Future[dict[str, Any]] | None = None
        self._taken_at = 0.0
        # Per replica: (monotonic time, prompt tokens, generation tokens, prefix queries, prefix hits).
        self._counters: list[deque[tuple[float, int, int, int, int]]] = [deque() for _ in self.replicas]

    async def snapshot(self) -> dict[str, Any]:
        """The latest snapshot, taken anew once it is INTERVAL_S old."""
        now = time.monotonic()
        if self._latest is None or (self._latest.done() and now - self._taken_at >= INTERVAL_S):
            self._taken_at = now
            self._latest = asyncio.ensure_future(self._take())
        return await asyncio.shield(self._latest)

    async def events(self) -> AsyncIterator[str]:
        """A snapshot a second as server-sent events, until the server drains."""
        sent = None
        while not self.closed.is_set():
            snapshot = await self.snapshot()
            if snapshot is not sent:
                yield f"data: {json.dumps(snapshot)}\n\n"
                sent = snapshot
            with contextlib.suppress(asyncio.TimeoutError):  # till the next is due, or the server drains
                await asyncio.wait_for(self.closed.wait(), max(self._taken_at + INTERVAL_S - time.monotonic(), 0.01))

    def close(self) -> None:
        self.closed.set()

    async def _take(self) -> dict[str, Any]:
        replicas = await asyncio.gather(*(self._replica(rank) for rank in range(len(self.replicas))))
        return {"time": time.time(), "model": self.model_name, "interval_s": INTERVAL_S, "replicas": replicas}

    async def _replica(self, rank: int) -> dict[str, Any]:
        engine = self.replicas[rank]
        try:
            snapshot = await engine.snapshot()
        except EngineDeadError:
            return {"engine": rank, "up": False}
        now, clock = time.time(), time.monotonic()
        stats, metrics = snapshot.stats, engine.metrics
        current = (clock, metrics.num_prompt_tokens, metrics.num_generation_tokens, stats["prefix_cache_queries"],
                   stats["prefix_cache_hits"])
        counters = self._counters[rank]
        while counters and counters[0][0] < clock - RATE_WINDOW_S:
            counters.popleft()
        oldest = counters[0] if counters else None
        counters.append(current)
        states = np.frombuffer(snapshot.block_states, np.uint8)
        num_free, num_in_use, num_cached = np.bincount(states, minlength=3)[[BLOCK_FREE, BLOCK_IN_USE, BLOCK_CACHED]]
        cell_map, blocks_per_cell = _block_map(states)
        queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        return {
            "engine": rank, "up": True,
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
            "num_preempted": snapshot.num_preempted, "num_preemptions": stats["num_preemptions"],
            "kv_cache": {"num_blocks": len(states), "block_size": snapshot.block_size, "free": int(num_free),
                         "in_use": int(num_in_use), "cached": int(num_cached),
                         "usage": kv_cache_usage(stats),
                         "map": base64.b64encode(cell_map).decode(), "blocks_per_cell": blocks_per_cell},
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None,
                             "recent_hit_rate": _ratio(current, oldest, 4, 3)},
            "tokens": {"prompt": metrics.num_prompt_tokens, "generation": metrics.num_generation_tokens,
                       "prompt_per_s": _ratio(current, oldest, 1, 0),
                       "generation_per_s": _ratio(current, oldest, 2, 0)},
            "latency": {"window_s": LATENCY_WINDOW_S, "bucket_s": LATENCY_BUCKET_S, "percentiles": PERCENTILES,
                        "ttft": _latency(metrics.recent_ttft, now), "tpot": _latency(metrics.recent_tpot, now)},
            "requests": {"total": snapshot.num_requests, "listed": [
                {"id": request_id, "state": state, "prompt_tokens": prompt, "output_tokens": output,
                 "age_s": round(now - arrival, 3)}
                for request_id, state, prompt, output, arrival in snapshot.requests]},
        }


def _ratio(current: tuple[float, ...], oldest: tuple[float, ...] | None, top: int, bottom: int) -> float | None:
    """Change of counter `top` over change of counter `bottom` (0: the clock) since `oldest`;
    None without an earlier snapshot, or when the bottom did not move."""
    if oldest is None or current[bottom] == oldest[bottom]:
        return None
    return (current[top] - oldest[top]) / (current[bottom] - oldest[bottom])


def _block_map(states: np.ndarray) -> tuple[bytes, int]:
    """The block states, a byte a cell, and how many blocks a cell shows (the most common state
    of its blocks, when the cache has more than MAX_MAP_CELLS blocks)."""
    blocks_per_cell = max(math.ceil(len(states) / MAX_MAP_CELLS), 1)
    if blocks_per_cell == 1:
        return states.tobytes(), 1
    padded = np.full(math.ceil(len(states) / blocks_per_cell) * blocks_per_cell, 255, np.uint8)  # 255: no block
    padded[:len(states)] = states
    cells = padded.reshape(-1, blocks_per_cell)
    counts = np.stack([(cells == state).sum(axis=1) for state in (BLOCK_FREE, BLOCK_IN_USE, BLOCK_CACHED)])
    return counts.argmax(axis=0).astype(np.uint8).tobytes(), blocks_per_cell


def _latency(recent: deque[tuple[float, float]], now: float) -> dict[str, Any]:
    """Percentiles of the last LATENCY_WINDOW_S: over it all, and per bucket (its start time)."""
    samples = np.array(recent, np.float64).reshape(-1, 2)
    samples = samples[samples[:, 0] >= now - LATENCY_WINDOW_S]
    if not len(samples):
        return {"count": 0, "all": None, "buckets": []}
    times, values = samples[:, 0], samples[:, 1]
    first = now - LATENCY_WINDOW_S
    index = ((times - first) // LATENCY_BUCKET_S).astype(np.int64)
    buckets = []
    for bucket in np.unique(index):
        in_bucket = values[index == bucket]
        buckets.append([first + bucket * LATENCY_BUCKET_S, *np.percentile(in_bucket, PERCENTILES).tolist(),
                        len(in_bucket)])
    return {"count": len(values), "all": np.percentile(values, PERCENTILES).tolist(), "buckets": buckets}


def add_dashboard_routes(app: FastAPI, feed: DashboardFeed, api_key: str | None) -> None:
    """GET /dashboard, /dashboard/events and /dashboard/snapshot (see the module's docstring)."""
    page = (_STATIC / "dashboard.html").read_bytes()
    key_page = (_STATIC / "dashboard_key.html").read_bytes()
    expected = api_key.encode() if api_key else None

    def authorized(request: Request) -> bool:
        if expected is None:
            return True
        header = request.headers.get("authorization", "")
        given = [header.removeprefix("Bearer ") if header.startswith("Bearer ") else None,
                 unquote(request.cookies.get(KEY_COOKIE, "")) or None, request.query_params.get("key")]
        return any(key is not None and secrets.compare_digest(key.encode(), expected) for key in given)

    def check_key(request: Request) -> None:
        if not authorized(request):
            raise OpenAIError(f"Invalid or missing API key: send 'Authorization: Bearer <key>', a {KEY_COOKIE} "
                              "cookie or a ?key= query.", 401)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        if authorized(request):
            return HTMLResponse(page)
        return HTMLResponse(key_page, status_code=401)  # a page that asks for the key (and holds nothing else)

    @app.get("/dashboard/snapshot", include_in_schema=False)
    async def dashboard_snapshot(request: Request) -> dict[str, Any]:
        check_key(request)
        return await feed.snapshot()

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> Response:
        check_key(request)
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
