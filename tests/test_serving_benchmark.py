"""benchmarks/serving.py against a fake OpenAI server (uvicorn on 127.0.0.1) whose streams
have known token counts and delays: the figures must match what it emitted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.serving import Prompt, Regime, open_clients, random_prompts, run_regime
from tests.server_utils import serve_app

FIRST_DELAY = 0.05  # s from the request to its first token event
GAP = 0.02  # s between token events
PROMPT_TOKENS = 7  # the usage chunk's count, whatever the prompt


def fake_app() -> FastAPI:
    """/v1/completions streaming max_tokens events FIRST_DELAY then GAP apart, the usage
    chunk and [DONE]; prompt "reject" gets a 400, prompt "break" an error event mid-stream."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if body["prompt"] == "reject":
            return JSONResponse({"error": {"message": "rejected"}}, status_code=400)

        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(FIRST_DELAY)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(GAP)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}], "usage": None}) + "\n\n"
                if body["prompt"] == "break":
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    break
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve_app(fake_app()) as url:
        yield url


def run(base_url: str, prompts: list[Prompt], regime: Regime) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with open_clients(regime.max_concurrency or len(prompts)) as clients:
            return await run_regime(clients, base_url, "m", prompts, regime)
    return asyncio.run(go())


def test_concurrency_limit(base_url: str) -> None:
    tokens = 5
    metrics = run(base_url, [Prompt("p", 3, tokens)] * 4, Regime(4, max_concurrency=2, request_rate=float("inf")))
    e2e = FIRST_DELAY + (tokens - 1) * GAP  # 130 ms per request, two waves of two
    assert (metrics["completed"], metrics["failed"], metrics["errors"]) == (4, 0, [])
    assert metrics["total_output_tokens"] == 4 * tokens
    assert metrics["total_input_tokens"] == 4 * PROMPT_TOKENS  # the server's count, not the client's 3
    assert metrics["max_concurrent_requests"] == 2
    assert 2 * e2e <= metrics["duration"] < 2 * e2e + 0.3
    assert metrics["output_throughput"] == pytest.approx(4 * tokens / metrics["duration"])
    assert metrics["request_throughput"] == pytest.approx(4 / metrics["duration"])
    assert 1e3 * FIRST_DELAY <= metrics["median_ttft_ms"] < 1e3 * FIRST_DELAY + 80
    for name in ("tpot", "itl"):
        assert 1e3 * GAP * 0.9 <= metrics[f"median_{name}_ms"] < 1e3 * GAP + 15, name
    assert 1e3 * e2e <= metrics["p99_e2el_ms"] < 1e3 * e2e + 150


def test_poisson_arrivals_and_all_at_once(base_url: str) -> None:
    prompts = [Prompt("p", 3, 3)] * 4
    e2e = FIRST_DELAY + 2 * GAP
    burst = run(base_url, prompts, Regime(4, None, float("inf")))
    assert burst["max_concurrent_requests"] == 4
    assert e2e <= burst["duration"] < e2e + 0.25
    paced = run(base_url, prompts, Regime(4, None, 10.0))  # the last arrival is scaled to 4 / 10 s
    assert paced["completed"] == 4
    assert 0.4 + e2e <= paced["duration"] < 0.4 + e2e + 0.25


def test_failures_are_counted_with_their_messages(base_url: str) -> None:
    prompts = [Prompt("ok", 3, 2), Prompt("reject", 3, 2), Prompt("break", 3, 2)]
    metrics = run(base_url, prompts, Regime(3, None, float("inf")))
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (1, 2, 2)
    assert any("400" in e and "rejected" in e for e in metrics["errors"])
    assert any("engine died" in e for e in metrics["errors"])


def test_random_prompts_have_the_asked_lengths(tokenizer: Any) -> None:
    prompts = random_prompts(tokenizer, 4, input_len=64, output_len=16, range_ratio=0.0, seed=0)
    assert [p.output_len for p in prompts] == [16] * 4
    for p in prompts:
        assert p.prompt_len == len(tokenizer.encode(p.text, add_special_tokens=False))
        assert abs(p.prompt_len - 64) <= 2
    assert random_prompts(tokenizer, 4, 64, 16, 0.0, seed=0) == prompts
    assert random_prompts(tokenizer, 4, 64, 16, 0.0, seed=1) != prompts
