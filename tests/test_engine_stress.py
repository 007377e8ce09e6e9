"""Random workloads through the engine: whatever the batching, chunking, preemption, prefix
hits and aborts, greedy outputs equal an unconstrained run and no block leaks."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # randomised workloads (hypothesis)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
SEED_WITH_EVERYTHING = 33  # a workload that preempts, hits the prefix cache and aborts


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def reference(model_dir: str) -> LLM:
    """Plenty of memory and budget, no prefix cache: every request runs undisturbed."""
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               enable_prefix_caching=False, max_num_batched_tokens=4096)


def make_workload(rng: random.Random) -> list[tuple[list[int], int]]:
    stems = [[rng.randrange(3, 700) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    workload = []
    for _ in range(rng.randrange(4, 12)):
        prompt = rng.choice(stems) + [rng.randrange(3, 700) for _ in range(rng.randrange(0, 20))]
        if not prompt:
            prompt = [5]
        workload.append((prompt, rng.randrange(1, min(30, MAX_MODEL_LEN - len(prompt)) + 1)))
    return workload


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_workloads(seed: int, model_dir: str, reference: LLM) -> None:
    run_workload(seed, model_dir, reference)


def test_a_workload_with_preemption_hits_and_aborts(model_dir: str, reference: LLM) -> None:
    stats = run_workload(SEED_WITH_EVERYTHING, model_dir, reference)
    print("stress workload stats:", stats)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["aborted"] > 0


def run_workload(seed: int, model_dir: str, reference: LLM) -> dict[str, int]:
    rng = random.Random(seed)
    workload = make_workload(rng)
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              enable_prefix_caching=rng.random() < 0.8, max_num_seqs=rng.randrange(1, 9),
              max_num_batched_tokens=rng.randrange(1, 64),
              num_gpu_blocks_override=rng.randrange(MAX_MODEL_LEN // BLOCK_SIZE, 80))
    engine: LLMEngine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _, max_tokens in workload]
    want = [list(o.outputs[0].token_ids) for o in reference.generate(
        [{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)]

    pending = list(range(len(workload)))
    aborted: set[str] = set()
    got: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:  # requests arrive while others run
            i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": workload[i][0]}, params[i])
        if engine.requests and rng.random() < 0.05:
            victim = rng.choice(list(engine.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for output in engine.step():
            got[output.request_id] = list(output.outputs[0].token_ids)
    for i in range(len(workload)):
        if str(i) not in aborted:
            assert got[str(i)] == want[i], f"request {i} diverged"
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return engine.stats() | {"aborted": len(aborted)}
