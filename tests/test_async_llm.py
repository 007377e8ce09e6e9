"""AsyncLLM in-process: delta streams, abort, validation, and what happens when the engine dies
(in-flight streams end with an error, new requests are refused)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from collections.abc import Iterator

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, to_wire
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

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


def test_a_token_id_list_changed_after_add_request_is_not_what_runs(engine: AsyncLLM, model_dir: str) -> None:
    """The engine process gets the ids as they were when add_request returned, even if the
    caller reuses its list before the commands thread sends them."""
    ids = [11, 42, 7, 99]
    want = LLM(model_dir, dtype="float32").generate({"prompt_token_ids": list(ids)}, GREEDY, use_tqdm=False)

    async def run() -> list[int]:
        stream = await engine.add_request({"prompt_token_ids": ids}, GREEDY)
        ids[:] = [0] * len(ids)
        token_ids = []
        async for output in stream:
            token_ids += output.outputs[0].token_ids
        return token_ids

    assert asyncio.run(run()) == want[0].outputs[0].token_ids


def test_abort_frees_blocks_and_ends_the_stream(engine: AsyncLLM) -> None:
    async def run() -> None:
        stream = await engine.add_request("The quick brown fox", SamplingParams(max_tokens=500, ignore_eos=True))
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
            await engine.add_request("", GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request(list(range(5000)), GREEDY)
        stream = await engine.add_request("Hello", GREEDY, request_id="same")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("Hello", GREEDY, request_id="same")
        assert len([o async for o in stream]) == 12

    asyncio.run(run())


def test_engine_death_fails_streams_and_new_requests(engine: AsyncLLM) -> None:
    async def run() -> None:
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=1000, ignore_eos=True))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                os.kill(engine.core.process.pid, signal.SIGKILL)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("Hello", GREEDY)

    asyncio.run(run())


def test_outputs_cross_the_pipe_as_tuples_and_come_back_whole() -> None:
    logprobs = [{5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}]
    output = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "a", [5], -0.5, logprobs, "stop", 5),
                                              CompletionOutput(1, "", [], None, None, None)],
                           True, RequestMetrics(1.0, 2.0, 3.0, 4.0), 16)

    async def rebuild() -> RequestOutput:
        stream = RequestStream(None, "r", "p", [1, 2], arrival_time=1.0)  # type: ignore[arg-type]
        return stream.request_output(pickle.loads(pickle.dumps(to_wire(output))))

    assert asyncio.run(rebuild()) == output
