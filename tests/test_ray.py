"""distributed_executor_backend="ray" on CPU, over Ray's simulation of a two-node cluster
(ray.cluster_utils.Cluster: processes of this host, one CPU a node, so that a placement group
of two bundles takes both nodes): a TP=2 group across the nodes equals TP=1 and Hugging Face,
served and offline; DP=2 (a replica a node) answers a burst in full; a replica's actor killed
mid-load ends its own requests with EngineDeadError while the other serves on, and /health
names the dead one; too few CPUs, or none free, is a clear error.

Each engine core and rank is an actor that imports torch (seconds, ~300 MB): the module builds
one engine of each kind, one at a time, on one cluster."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.data_parallel import DataParallelAsyncLLM
from minivllm.entrypoints.cli import main
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.serving import OpenAIServing
from tests.server_utils import serving
from tests.test_generate_hf import BLOCK_SIZE, expected, make_llm, mixed_prompts, run, vocab

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 (after the skip)
from ray.util import placement_group_table  # noqa: E402

from minivllm.executor import ray_utils  # noqa: E402 (imports ray)

pytestmark = pytest.mark.slow  # Ray's processes and actors

MAX_MODEL_LEN = 1024  # the tiny model's longest
NO_EOS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


def ray_config(model_dir: str, **kwargs: object) -> EngineConfig:
    return EngineConfig(model_dir, dtype="float32", distributed_executor_backend="ray", **kwargs)  # type: ignore[arg-type]


def nodes_of(engine: AsyncLLM) -> list[str]:
    """The nodes of the engine's placement group's bundles, in bundle order."""
    bundles = placement_group_table(engine.core.placement_group)["bundles_to_node_id"]  # type: ignore[attr-defined]
    return [bundles[index] for index in sorted(bundles)]


def test_too_few_cpus_for_the_ranks_is_a_clear_error(cluster: Cluster, model_dir: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", model_dir, "--host", "127.0.0.1", "--port", "0", "-tp", "2", "-dp", "2",
              "--distributed-executor-backend", "ray"])
    assert exit_info.value.code == 2
    assert ("tensor_parallel_size=2 x data_parallel_size=2 needs 4 CPUs in the Ray cluster, but it has 2 "
            "(2 nodes with [1, 1])") in capsys.readouterr().err


def test_tp2_across_two_nodes_matches_tp1_and_hf(cluster: Cluster, model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir), seed=7)
    want = expected(model_dir, prompts)
    tp1 = make_llm(model_dir)
    tp1_outputs = run(tp1, prompts)
    tp1.shutdown()
    engine = AsyncLLM(ray_config(model_dir, max_model_len=128, block_size=BLOCK_SIZE, tensor_parallel_size=2),
                      log_stats_interval_s=None)
    try:
        first, second = nodes_of(engine)
        assert first != second

        async def generate(prompt: list[int]) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=12)
            return [token for output in [o async for o in engine.generate(prompt, params)]
                    for token in output.outputs[0].token_ids]

        async def generate_all() -> list[list[int]]:
            return await asyncio.gather(*(generate(prompt) for prompt in prompts))

        outputs = asyncio.run(generate_all())
    finally:
        engine.shutdown()
    assert outputs == tp1_outputs == want


def test_offline_llm_ranks_and_replicas_are_actors(cluster: Cluster, model_dir: str) -> None:
    """LLM(...): its own tensor-parallel ranks after this process's, and its other replicas."""
    prompts = mixed_prompts(vocab(model_dir), seed=3)
    tp1 = make_llm(model_dir)
    want = run(tp1, prompts)
    tp1.shutdown()
    for sizes in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        llm = make_llm(model_dir, distributed_executor_backend="ray", **sizes)
        try:
            assert run(llm, prompts) == want, sizes
            assert ray.available_resources().get("CPU", 0) == (0 if "tensor_parallel_size" in sizes else 1)
        finally:
            llm.shutdown()
    deadline = time.monotonic() + 10  # Ray frees a removed placement group's bundles soon after
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2  # every bundle given back


def test_served_from_the_command_line_joins_the_cluster(cluster: Cluster, model_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`minivllm serve -dp 2 --distributed-executor-backend ray`, a process of its own, joins the
    cluster that $RAY_ADDRESS names (as on a head node after `ray start --head`), a replica a
    node, and answers the OpenAI client; its replicas' bundles go back when it exits."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    prompt = mixed_prompts(vocab(model_dir), seed=4)[6]
    local = make_llm(model_dir)
    want = local.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0].outputs[0].text
    local.shutdown()
    with serving(model_dir, "-dp", "2", "--distributed-executor-backend", "ray", "--max-model-len",
                 str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), startup_timeout_s=180) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        for _ in range(4):  # over both replicas
            completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert completion.choices[0].text == want
        assert ray.available_resources().get("CPU", 0) == 0
        assert httpx.get(f"{server.url}/health").json() == {"data_parallel_size": 2, "engines_down": []}
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.fixture(scope="module")
def replicas(cluster: Cluster, model_dir: str) -> Iterator[DataParallelAsyncLLM]:
    engine = DataParallelAsyncLLM(ray_config(model_dir, max_model_len=MAX_MODEL_LEN), 2, "tiny",
                                  log_stats_interval_s=None)
    try:
        yield engine
    finally:
        engine.shutdown()


def served(engine: AsyncLLM) -> float:
    return sum(sample.value for metric in engine.metrics.registry.collect() for sample in metric.samples
               if sample.name == "vllm:request_success_total")


def test_a_replica_a_node_answers_a_burst_in_full(replicas: DataParallelAsyncLLM) -> None:
    assert nodes_of(replicas.replicas[0]) != nodes_of(replicas.replicas[1])

    async def ask(i: int) -> int:
        outputs = [output async for output in replicas.generate(f"Request {i} says", NO_EOS)]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    async def burst() -> list[int]:
        return await asyncio.gather(*(ask(i) for i in range(200)))

    assert asyncio.run(burst()) == [4] * 200
    counts = [served(replica) for replica in replicas.replicas]
    assert sum(counts) == 200 and min(counts) >= 50, counts


def test_a_replica_that_cannot_be_placed_says_what_it_needs(replicas: DataParallelAsyncLLM, model_dir: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster's two CPUs are the replicas': a third replica waits for one, then gives up."""
    monkeypatch.setattr(ray_utils, "PLACEMENT_GROUP_TIMEOUT_S", 0.4)
    monkeypatch.setattr(ray_utils, "_PLACEMENT_LOG_INTERVAL_S", 0.2)
    with pytest.raises(ValueError, match=r"Ray did not place a replica's placement group \(1 x \{'CPU': 1\}\) within "
                                         r"0.4 s: the cluster has 0 CPUs free of 2"):
        AsyncLLM(ray_config(model_dir), log_stats_interval_s=None)


def test_a_killed_replica_ends_its_requests_and_the_other_serves_on(replicas: DataParallelAsyncLLM) -> None:
    app = build_app(OpenAIServing(replicas, ["tiny"]))

    async def ask(max_tokens: int) -> str:
        try:
            async for _ in replicas.generate("Hello", SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                pass
            return "ok"
        except EngineDeadError:
            return "ended"

    async def load_then_kill() -> tuple[list[str], httpx.Response]:
        requests = [asyncio.ensure_future(ask(MAX_MODEL_LEN - 8)) for _ in range(8)]
        while any(replica.engine_stats().get("num_running", 0) < 4 for replica in replicas.replicas):
            await asyncio.sleep(0.02)
        ray.kill(replicas.replicas[0].core.actor)  # type: ignore[attr-defined]
        results = await asyncio.gather(*requests)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            health = await client.get("/health")
        return results, health

    results, health = asyncio.run(load_then_kill())
    assert sorted(results) == ["ended"] * 4 + ["ok"] * 4
    assert health.status_code == 200 and health.json() == {"data_parallel_size": 2, "engines_down": [0]}

    async def ask_more() -> list[str]:
        return await asyncio.gather(*(ask(4) for _ in range(6)))

    assert asyncio.run(ask_more()) == ["ok"] * 6  # all to the live replica


def test_minivllm_imports_no_ray() -> None:
    code = ("import sys, minivllm, minivllm.entrypoints.openai.api_server, minivllm.engine.data_parallel; "
            "assert 'ray' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
