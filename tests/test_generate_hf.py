"""Greedy generation equals Hugging Face transformers token for token (fp32, CPU), in every
scheduling regime: plain, prefix-cache hits, chunked prefill and forced preemption."""

import random

import pytest

from minivllm import LLM, SamplingParams
from tests.hf_oracle import hf_greedy

ARCHITECTURES = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-tied-sharded": ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "max_shard_size": "100KB"}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope-scaling": ("LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),  # every layer sparse: top-2 of 8 experts
}
MAX_TOKENS = 12
BLOCK_SIZE = 8


def mixed_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Ten prompts from 1 token to several blocks, two sharing a long prefix."""
    rng = random.Random(seed)
    lengths = [1, 3, 7, 8, 9, 16, 23, 40, 57]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    prompts.append(prompts[-1][:33] + [rng.randrange(vocab_size) for _ in range(5)])
    return prompts


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def expected(model_dir: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [hf_greedy(model_dir, p, max_tokens)[0] for p in prompts]


def make_llm(model_dir: str, **kwargs: object) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": BLOCK_SIZE, **kwargs}
    return LLM(model_dir, **kwargs)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model_dir(request: pytest.FixtureRequest, tiny_model_factory) -> str:
    architecture, overrides = ARCHITECTURES[request.param]
    return tiny_model_factory(architecture, **overrides)


def vocab(model_dir: str) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir).vocab_size


def test_plain(model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir))
    assert run(make_llm(model_dir, enable_prefix_caching=False), prompts) == expected(model_dir, prompts)


def test_prefix_cache_hits(model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir), seed=1)
    llm = make_llm(model_dir)
    want = expected(model_dir, prompts)
    assert run(llm, prompts) == want
    first_hits = llm.llm_engine.stats()["prefix_cache_hits"]
    assert run(llm, prompts) == want  # the same batch again: mostly cache hits
    stats = llm.llm_engine.stats()
    print("prefix cache hits (tokens): first run", first_hits, "after second run", stats["prefix_cache_hits"])
    assert first_hits >= 32  # the shared 33-token prefix: four 8-token blocks
    assert stats["prefix_cache_hits"] - first_hits >= sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)


def test_chunked_prefill(model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir), seed=2)
    llm = make_llm(model_dir, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert run(llm, prompts) == expected(model_dir, prompts)


def test_preemption(model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir), seed=3)
    # 18 blocks: one full-length sequence, far less than the batch needs.
    llm = make_llm(model_dir, num_gpu_blocks_override=18, enable_prefix_caching=False)
    assert run(llm, prompts, max_tokens=24) == expected(model_dir, prompts, max_tokens=24)
    preemptions = llm.llm_engine.stats()["num_preemptions"]
    print("preemptions:", preemptions)
    assert preemptions > 0
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks


def test_cache_hits_chunks_and_preemption_together(model_dir: str) -> None:
    prompts = mixed_prompts(vocab(model_dir), seed=4)
    llm = make_llm(model_dir, num_gpu_blocks_override=20, max_num_batched_tokens=13)
    want = expected(model_dir, prompts, max_tokens=20)
    assert run(llm, prompts, max_tokens=20) == want
    assert run(llm, prompts, max_tokens=20) == want
    stats = llm.llm_engine.stats()
    print("all regimes:", stats)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
