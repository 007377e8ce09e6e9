"""Tensor parallelism: with tensor_parallel_size=2 (gloo on CPU, NCCL on GPUs) greedy
generation equals tensor_parallel_size=1 and Hugging Face token for token in fp32, through
chunked prefill, preemption and prefix-cache hits; shutdown leaves no processes behind.

Each TP=2 engine spawns a worker that imports torch (seconds), so each test builds one.
A TP=1 engine cannot run in a process while a TP=2 one does (one process group per
process): references are computed first.
"""

import multiprocessing as mp

import pytest
import torch

from minivllm import SamplingParams, StructuredOutputsParams
from minivllm.outputs import RequestOutput
from tests.hf_oracle import hf_greedy, hf_prompt_logprobs
from tests.test_generate_hf import expected, make_llm, mixed_prompts, run, vocab
from tests.test_qwen3_moe import VARIANTS

pytestmark = pytest.mark.slow  # tensor-parallel worker processes

MODELS = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {}),
    # An odd vocabulary: the last rank's embedding and LM-head shards are padded.
    "qwen3-tied-sharded-odd-vocab": ("Qwen3ForCausalLM", {"tie_word_embeddings": True,
                                                          "max_shard_size": "100KB", "vocab_size": 771}),
    # Each expert's intermediate dimension split across the ranks, and a dense layer.
    "qwen3-moe": ("Qwen3MoeForCausalLM", VARIANTS["dense-layer-0-renormalised"]),
}
MAX_TOKENS = 20


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_prefill_and_preemption_match_tp1_and_hf(name: str, tiny_model_factory) -> None:
    architecture, overrides = MODELS[name]
    model_dir = tiny_model_factory(architecture, **overrides)
    prompts = mixed_prompts(vocab(model_dir), seed=7)
    want = expected(model_dir, prompts, MAX_TOKENS)
    # 20 blocks on every rank (a TP=2 rank's blocks hold half the KV heads): one
    # full-length sequence, far less than the batch needs, so sequences get preempted.
    kwargs = {"max_num_batched_tokens": 13}
    tp1 = make_llm(model_dir, num_gpu_blocks_override=20, **kwargs)
    tp1_outputs = [run(tp1, prompts, MAX_TOKENS) for _ in range(2)]  # the second run hits the prefix cache
    tp1_stats = tp1.llm_engine.stats()
    tp2 = make_llm(model_dir, num_gpu_blocks_override=20, tensor_parallel_size=2, **kwargs)
    try:
        tp2_outputs = [run(tp2, prompts, MAX_TOKENS) for _ in range(2)]
        stats = tp2.llm_engine.stats()
    finally:
        tp2.shutdown()
    print(name, stats)
    assert tp2_outputs == tp1_outputs == [want, want]
    assert stats == tp1_stats  # the same blocks, so the same schedule
    assert stats["num_blocks"] == 20 and stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert not mp.active_children()


def test_plain_logprobs_and_shutdown(tiny_model_factory) -> None:
    """Also prompt logprobs: chunked, their logits in slices of 4 positions (max_num_seqs),
    each slice gathered from both ranks."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    prompts = mixed_prompts(vocab(model_dir), seed=8)
    want = expected(model_dir, prompts)
    prompt = prompts[5]
    want_tokens, want_logprobs = hf_greedy(model_dir, prompt, 6)
    # Structured outputs: rank 0 masks and samples; the workers only run the forward passes.
    guided = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{2,4}-[0-9]{1,2}"))
    guided_want = tokens_of(make_llm(model_dir).generate(prompts[:3], guided, use_tqdm=False))
    llm = make_llm(model_dir, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=13)
    try:
        assert run(llm, prompts) == want
        assert tokens_of(llm.generate(prompts[:3], guided, use_tqdm=False)) == guided_want
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == want_tokens
        for position, ref in zip(out.logprobs, want_logprobs):
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(ref[token_id])) < 1e-4  # fp32 tolerance
        long_prompt = prompts[8]
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
        scored = llm.generate({"prompt_token_ids": long_prompt}, params, use_tqdm=False)[0].prompt_logprobs
        assert scored is not None and len(scored) == len(long_prompt)
        for position, ref, token in zip(scored[1:], hf_prompt_logprobs(model_dir, tuple(long_prompt)), long_prompt[1:]):
            assert position is not None and token in position and len(position) >= 2
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(ref[token_id])) < 1e-4
        with pytest.raises(ValueError, match="shut it down"):
            make_llm(model_dir)  # its layers would join the running engine's collectives
        assert len(mp.active_children()) == 1
    finally:
        llm.shutdown()
    assert not mp.active_children()
    llm.shutdown()  # a second call is harmless


def test_bad_tensor_parallel_size(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="must divide"):
        make_llm(model_dir, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="at least 1"):
        make_llm(model_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="GPUs"):
        make_llm(model_dir, device="cuda", tensor_parallel_size=2 * max(1, torch.cuda.device_count()))
    assert not mp.active_children()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_tp2_matches_tp1(name: str, tiny_model_factory) -> None:
    architecture, overrides = MODELS[name]
    model_dir = tiny_model_factory(architecture, **overrides)
    prompts = mixed_prompts(vocab(model_dir), seed=9)
    kwargs = {"gpu_memory_utilization": 0.3, "max_num_seqs": 16}
    for regime in ({}, {"enforce_eager": True}, {"max_num_batched_tokens": 13}):
        print(f"{name} {regime}: TP 1, then TP 2", flush=True)  # progress, for a run that hangs
        tp1 = make_llm(model_dir, **kwargs, **regime)
        want = run(tp1, prompts, MAX_TOKENS)
        tp2 = make_llm(model_dir, tensor_parallel_size=2, **kwargs, **regime)  # CUDA graphs unless eager
        try:
            assert run(tp2, prompts, MAX_TOKENS) == want, regime
        finally:
            tp2.shutdown()


def test_deleting_an_llm_frees_its_workers(tiny_model_factory) -> None:
    """As vLLM: `del llm` stops a tensor-parallel engine, so the next one can start."""
    import gc

    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    llm = make_llm(model_dir, tensor_parallel_size=2)
    first = run(llm, [[5, 6, 7]], 4)
    del llm
    gc.collect()
    assert not mp.active_children()
    again = make_llm(model_dir, tensor_parallel_size=2)
    try:
        assert run(again, [[5, 6, 7]], 4) == first
    finally:
        again.shutdown()
