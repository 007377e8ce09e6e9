"""`minivllm serve --data-parallel-size 2`: two engine replicas behind one front, on CPU: the
same greedy outputs as one engine, every request of a burst answered by one of them, /metrics
per engine, and a replica's death ending only its own requests."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.data_parallel import PrefixRouter, replica_cuda_devices
from tests.server_utils import RemoteServer, alive, descendants, serving

PROMPTS = ["The quick brown fox", "Once upon a time there was", "A language model reads a prompt",
           "The dog sleeps in the sun, and", "Seven", "In the beginning"]
MAX_MODEL_LEN = 1024  # the tiny model's longest
SERVER_ARGS = ("--data-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", str(8 << 20))
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[RemoteServer]:
    with serving(model_dir, *SERVER_ARGS, stop_signal=signal.SIGINT) as server:
        yield server


def engine_samples(server: RemoteServer, name: str) -> dict[str, float]:
    """A metric's samples summed per engine label: {"0": ..., "1": ...}."""
    per_engine: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        match = re.match(rf'^{re.escape(name)}\{{.*engine="(\d+)".*\}} (\S+)$', line)
        if match:
            per_engine[match.group(1)] = per_engine.get(match.group(1), 0.0) + float(match.group(2))
    return per_engine


def engine_pids(server: RemoteServer) -> list[int]:
    """The engine core processes (the server's other spawned child is the resource tracker)."""
    pids = []
    for pid in descendants(server.process.pid):
        with open(f"/proc/{pid}/cmdline") as f:
            cmdline = f.read()
        if "--multiprocessing-fork" in cmdline and "resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_greedy_outputs_match_one_engine(server: RemoteServer, model_dir: str) -> None:
    offline = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [output.outputs[0].text for output in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    client = server.async_client()

    async def ask(prompt: str) -> str:
        response = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                   extra_body=NO_EOS)
        assert response.usage is not None and response.usage.completion_tokens == 8
        return response.choices[0].text

    async def ask_all() -> list[str]:
        return await asyncio.gather(*(ask(prompt) for prompt in PROMPTS))

    assert asyncio.run(ask_all()) == expected


@pytest.mark.slow
def test_a_burst_is_answered_in_full_by_both_engines(server: RemoteServer) -> None:
    before = engine_samples(server, "vllm:request_success_total")
    client = server.async_client(timeout=120)

    async def ask(i: int) -> int:
        response = await client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4,
                                                   extra_body=NO_EOS)
        assert response.choices[0].finish_reason == "length"
        return len(response.choices[0].text)

    async def burst() -> list[int]:
        return await asyncio.gather(*(ask(i) for i in range(200)))

    assert len(asyncio.run(burst())) == 200
    server.wait_idle()
    after = engine_samples(server, "vllm:request_success_total")
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert set(served) == {"0", "1"} and sum(served.values()) == 200
    assert min(served.values()) >= 50, served  # the less busy engine takes each request
    generated = engine_samples(server, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(tokens > 0 for tokens in generated.values())
    assert httpx.get(f"{server.url}/health").json() == {"data_parallel_size": 2, "engines_down": []}
    replicas = httpx.get(f"{server.url}/dashboard/snapshot", timeout=30).json()["replicas"]  # each its own
    assert [(replica["engine"], replica["up"]) for replica in replicas] == [(0, True), (1, True)]
    assert {str(r["engine"]): r["tokens"]["generation"] for r in replicas} == generated


def test_the_router_keeps_a_prefix_on_its_replica_while_load_allows() -> None:
    router = PrefixRouter(3, block_size=4, slack=2)
    shared = list(range(100, 112))  # three whole blocks
    assert router.choose(shared + [1], [0, 0, 0]) == 0  # seen nowhere: the least busy, lowest rank
    assert router.choose(list(range(8)), [1, 0, 0]) == 1
    assert router.choose(shared + [2], [2, 0, 0]) == 0  # its prefix's replica, 2 requests busier
    assert router.choose(shared + [3], [3, 0, 0]) == 1  # 3 busier: past the slack, the least busy
    assert router.choose(shared[:8] + [9, 9, 9, 9], [0, 0, 0]) == 0  # the longer match (1 has all 3)
    assert router.choose(shared + [4], [0, 0, 0]) == 0  # replica 0 matches 3, replica 1 too: the first
    assert router.choose(shared + [4], [None, 1, 0]) == 1  # replica 0 down
    assert router.choose([7, 7, 7], [4, None, 2]) == 2  # no whole block: the least busy live one
    assert router.block_keys(list(range(10))) == router.block_keys(list(range(8)))  # whole blocks only


@pytest.mark.slow
def test_requests_sharing_a_prefix_hit_it_on_one_replica(model_dir: str) -> None:
    """Two prefixes, first one request each, then three each at once: each wave-two request
    goes where its prefix was computed and finds all its blocks in that replica's cache (load
    alone would send some of them to the other replica)."""
    server = RemoteServer(model_dir, *SERVER_ARGS)
    try:
        prefixes = [[5 + i % 50 for i in range(3 * 64)], [60 + i % 40 for i in range(3 * 64)]]

        async def wave(requests: list[tuple[list[int], int]]) -> None:
            client = server.async_client(timeout=120)  # one per event loop
            await asyncio.gather(*(client.completions.create(model="tiny", prompt=prefix + [suffix] * 8, max_tokens=2)
                                   for prefix, suffix in requests))

        asyncio.run(wave([(prefixes[0], 1), (prefixes[1], 2)]))
        server.wait_idle()
        before = engine_samples(server, "vllm:prefix_cache_hits_total")
        asyncio.run(wave([(prefix, 3 + i) for i in range(3) for prefix in prefixes]))
        server.wait_idle()
        hits = engine_samples(server, "vllm:prefix_cache_hits_total")
        assert sum(hits.values()) - sum(before.values()) == 6 * 3 * 64
    finally:
        server.stop()


@pytest.mark.slow
def test_a_dead_engine_ends_its_requests_and_the_other_serves_on(model_dir: str) -> None:
    server = RemoteServer(model_dir, *SERVER_ARGS)
    try:
        first, second = engine_pids(server)

        async def ask(max_tokens: int) -> str:
            client = server.async_client(timeout=60)  # one per event loop (asyncio.run)
            try:
                await client.completions.create(model="tiny", prompt="Hello", max_tokens=max_tokens,
                                                extra_body=NO_EOS)
                return "ok"
            except openai.InternalServerError as error:
                assert error.status_code == 500 and "engine stopped" in str(error)
                return "ended"

        async def load_then_kill() -> list[str]:
            requests = [asyncio.ensure_future(ask(MAX_MODEL_LEN - 8)) for _ in range(8)]
            while (await asyncio.to_thread(server.metrics))["vllm:num_requests_running"] < 8:
                await asyncio.sleep(0.02)
            os.kill(first, signal.SIGKILL)
            return await asyncio.gather(*requests)

        results = asyncio.run(load_then_kill())
        assert results.count("ended") == 4, results  # the dead engine's half
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and len(health.json()["engines_down"]) == 1
        replicas = httpx.get(f"{server.url}/dashboard/snapshot", timeout=30).json()["replicas"]
        assert sorted(replica["up"] for replica in replicas) == [False, True]

        async def ask_more() -> list[str]:
            return await asyncio.gather(*(ask(4) for _ in range(6)))

        assert asyncio.run(ask_more()) == ["ok"] * 6  # all to the live engine
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503 and sorted(health.json()["engines_down"]) == [0, 1]
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
        assert response.status_code == 500 and "Every engine has stopped" in json.loads(response.text)["error"][
            "message"]
    finally:
        server.stop()


def test_replicas_take_consecutive_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7,9")
    config = SimpleNamespace(device="cuda", tensor_parallel_size=2, distributed_executor_backend="mp")
    assert replica_cuda_devices(config, 2) == ["2,3", "5,7"]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 needs 6 GPUs, but 5"):
        replica_cuda_devices(config, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        replica_cuda_devices(config, 0)  # type: ignore[arg-type]
    assert replica_cuda_devices(SimpleNamespace(device="cpu"), 2) == [None, None]  # type: ignore[arg-type]


@pytest.mark.slow
def test_offline_replicas_return_one_engines_outputs_in_order(model_dir: str) -> None:
    prompts: list = [*PROMPTS, [5, 6, 7, 8], {"prompt": "Hello there"}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    expected = one.generate(prompts, greedy, use_tqdm=False)
    one.shutdown()
    llm = LLM(model_dir, data_parallel_size=2, dtype="float32", max_model_len=MAX_MODEL_LEN)
    try:
        replica_pid = llm._replicas[0].process.pid
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outputs] == \
            [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in expected]
        with pytest.raises(ValueError, match=r"^Prompt 7: "):  # the index in the whole list; nothing runs
            llm.generate([*prompts[:7], [10**9]], greedy, use_tqdm=False)
        assert llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].text == expected[0].outputs[0].text
        assert llm.reset_prefix_cache()
    finally:
        llm.shutdown()
    assert not alive(replica_pid)
