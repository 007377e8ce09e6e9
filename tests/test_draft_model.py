"""Speculative decoding with a draft model: greedy output is the model's own (HF's), whatever
the draft proposes; seeded samples are those without speculation; both KV caches are freed.

The model is test_speculative_decoding's 16-token-vocabulary one; the draft is its first layer
alone (its embeddings, first layer, norm and LM head), which agrees with it often, not always."""

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.draft_model_proposer import DraftModelProposer
from tests.hf_oracle import hf_greedy
from tests.test_speculative_decoding import VOCAB_SIZE, random_prompt


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM", vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def draft_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """model_dir without its second layer."""
    draft = str(tmp_path_factory.mktemp("draft") / "first-layer")
    shutil.copytree(model_dir, draft)
    weights_path = os.path.join(draft, "model.safetensors")
    weights = load_file(weights_path)
    save_file({name: tensor for name, tensor in weights.items() if not name.startswith("model.layers.1.")},
              weights_path, metadata={"format": "pt"})
    config_path = os.path.join(draft, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, layer_types=config["layer_types"][:1])
    with open(config_path, "w") as f:
        json.dump(config, f)
    return draft


def draft_spec(draft: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def spec_llm(model_dir: str, draft_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, block_size=8, speculative_config=draft_spec(draft_dir))


def draft_proposer(llm: LLM) -> DraftModelProposer:
    proposer = llm.llm_engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def assert_every_block_free(llm: LLM) -> None:
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    draft_cache = draft_proposer(llm).kv_cache_manager
    assert draft_cache.num_free_blocks == draft_cache.num_blocks == stats["num_blocks"]


def test_config_errors(model_dir: str, tiny_model_factory) -> None:
    other_vocab = tiny_model_factory("Qwen3ForCausalLM", vocab_size=32)
    for spec, message in [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": model_dir}, "needs model"),
        (draft_spec(other_vocab), "vocabulary of 32 tokens, the model 16"),
        (draft_spec(model_dir + "-missing"), "draft model .*does not exist"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model_dir, speculative_config=spec)
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        EngineConfig(model_dir, tensor_parallel_size=2, speculative_config=draft_spec(model_dir))


def test_the_model_as_its_own_draft_is_always_right(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=8,
              speculative_config=draft_spec(model_dir, k=4))
    prompts = [random_prompt(12, seed=s) for s in range(3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 30)[0]
    stats = llm.llm_engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 50
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_every_block_free(llm)


def test_greedy_is_hf_with_cache_hits_chunked_prefill_and_preemption(model_dir: str, draft_dir: str) -> None:
    """Prompt chunks beside verify steps, shared prompt blocks (the target's prefix cache; the
    draft cache has none), n > 1, and a cache so small that sequences are preempted."""
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=40, max_num_seqs=6, speculative_config=draft_spec(draft_dir))
    shared = random_prompt(12, seed=1)
    prompts = [shared + random_prompt(9, seed=2), random_prompt(23, seed=4), shared + random_prompt(9, seed=2),
               random_prompt(30, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        want = hf_greedy(model_dir, prompt, 40)[0]
        assert [list(completion.token_ids) for completion in output.outputs] == [want, want]
    stats = llm.llm_engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_every_block_free(llm)


def test_stop_strings_and_max_tokens(spec_llm: LLM, model_dir: str) -> None:
    prompts = [random_prompt(10, seed=s) for s in range(3)]
    plain = LLM(model_dir, dtype="float32", max_model_len=128, block_size=8)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    text = plain.generate({"prompt_token_ids": prompts[0]}, base, use_tqdm=False)[0].outputs[0].text
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[12:14]]),
                   SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)):
        got = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for got_output, want_output in zip(got, want):
            got_completion, want_completion = got_output.outputs[0], want_output.outputs[0]
            assert (got_completion.token_ids, got_completion.text, got_completion.finish_reason) == (
                want_completion.token_ids, want_completion.text, want_completion.finish_reason)
    assert_every_block_free(spec_llm)


def test_seeded_samples_are_the_ones_without_speculation(spec_llm: LLM, model_dir: str) -> None:
    plain = LLM(model_dir, dtype="float32", max_model_len=128, block_size=8)
    prompts = [{"prompt_token_ids": random_prompt(6, seed=s) * 3} for s in range(3)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True, n=1 + s % 2) for s in range(3)]
    accepted_before = spec_llm.llm_engine.stats()["spec_decode_num_accepted_tokens"]
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert spec_llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > accepted_before
    for got_output, want_output in zip(got, want):
        assert [c.token_ids for c in got_output.outputs] == [c.token_ids for c in want_output.outputs]


def test_abort_frees_every_block_of_both_caches(spec_llm: LLM, model_dir: str) -> None:
    engine = spec_llm.llm_engine
    prompts = [random_prompt(14, seed=s) for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(6):
        engine.step()
    assert draft_proposer(spec_llm).kv_cache_manager.num_free_blocks < engine.stats()["num_blocks"]
    engine.abort_request("abort-1")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {output.request_id: output for output in engine.step() if output.finished}
    assert sorted(outputs) == ["abort-0", "abort-2"]
    for i in (0, 2):
        assert list(outputs[f"abort-{i}"].outputs[0].token_ids) == hf_greedy(model_dir, prompts[i], 40)[0]
    assert_every_block_free(spec_llm)


@pytest.mark.gpu
def test_on_the_gpu_outputs_are_the_ones_without_speculation(model_dir: str, draft_dir: str) -> None:
    """Triton kernels and CUDA graphs in both runners (the draft's decode steps replay its own
    graphs): greedy and seeded outputs with a draft model are those without, and both caches
    are freed."""
    kwargs: dict = dict(dtype="float32", max_model_len=128, block_size=8, gpu_memory_utilization=0.3, max_num_seqs=16)
    spec, plain = LLM(model_dir, speculative_config=draft_spec(draft_dir), **kwargs), LLM(model_dir, **kwargs)
    prompts = [{"prompt_token_ids": random_prompt(6, seed=s) * 3} for s in range(4)]
    prompts += [{"prompt_token_ids": random_prompt(12, seed=s)} for s in range(4, 8)]
    for params in (SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=48, ignore_eos=True)):
        got = spec.generate(prompts, params, use_tqdm=False)
        want = plain.generate(prompts, params, use_tqdm=False)
        for got_output, want_output in zip(got, want):
            assert [c.token_ids for c in got_output.outputs] == [c.token_ids for c in want_output.outputs]
    stats = spec.llm_engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert draft_proposer(spec).runner.graphs is not None
    assert_every_block_free(spec)
