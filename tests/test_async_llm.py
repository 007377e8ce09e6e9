"""AsyncLLM in-process: delta streams, abort, validation, and what happens when the engine dies
(in-flight streams end with an error event, /health turns 503)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.serving import OpenAIServing

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture
def engine(model_dir: str) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineConfig(model_dir, dtype="float32"), log_stats_interval_s=None)
    yield engine
    engine.shutdown()


def test_deltas_join_to_the_offline_output(engine: AsyncLLM, model_dir: str) -> None:
    prompts = ["The quick brown fox", "Once upon a time"]
    offline = LLM(model_dir, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)

    async def collect(prompt: str) -> tuple[str, list[int], int]:
        text, token_ids, num_outputs = "", [], 0
        async for output in engine.generate(prompt, GREEDY):
            text += output.outputs[0].text
            token_ids += output.outputs[0].token_ids
            num_outputs += 1
        return text, token_ids, num_outputs

    async def run_all() -> list[tuple[str, list[int], int]]:
        return await asyncio.gather(*(collect(p) for p in prompts))

    for (text, token_ids, num_outputs), want in zip(asyncio.run(run_all()), offline):
        assert (text, token_ids) == (want.outputs[0].text, want.outputs[0].token_ids)
        assert num_outputs == 12  # one delta per token


def test_abort_frees_blocks_and_ends_the_stream(engine: AsyncLLM) -> None:
    async def run() -> None:
        stream = engine.add_request("The quick brown fox", SamplingParams(max_tokens=500, ignore_eos=True))
        async for output in stream:
            if len(output.outputs[0].token_ids) and engine.engine_stats()["num_running"] == 1:
                break  # leaving the loop aborts the request
        for _ in range(200):
            stats = engine.engine_stats()
            if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the aborted request still holds blocks: {engine.engine_stats()}")

    asyncio.run(run())


def test_bad_input_raises_before_anything_is_queued(engine: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("", GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request(list(range(5000)), GREEDY)
        stream = engine.add_request("Hello", GREEDY, request_id="same")
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("Hello", GREEDY, request_id="same")
        assert len([o async for o in stream]) == 12

    asyncio.run(run())


def test_engine_death_ends_streams_with_an_error_and_health_503(engine: AsyncLLM) -> None:
    runner = engine.engine.model_runner
    original_launch = runner.launch
    launches = 0

    def failing_launch(batch):  # noqa: ANN001, ANN202 (ModelRunner.launch's own types)
        nonlocal launches
        launches += 1
        if launches > 3:
            raise RuntimeError("simulated device failure")
        return original_launch(batch)

    runner.launch = failing_launch
    app = build_app(OpenAIServing(engine, ["tiny"]))

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [line async for line in response.aiter_lines() if line]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == 500 and "engine stopped" in error["message"]
            assert len(events) >= 3  # tokens were streamed before the failure
            assert (await client.get("/health")).status_code == 503
            refused = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
            assert refused.status_code == 500 and "restart" in refused.json()["error"]["message"]

    asyncio.run(run())
    with pytest.raises(EngineDeadError):
        asyncio.run(_add(engine))


async def _add(engine: AsyncLLM) -> None:
    engine.add_request("Hello", GREEDY)
