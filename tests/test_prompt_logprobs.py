"""SamplingParams.prompt_logprobs against Hugging Face (fp32, CPU): every position's logprob,
rank and top candidates, through chunked prefill (a prompt over several steps, its logits in
several slices), a prefix cached by another request, preemption, n > 1 and requests that
don't ask; each position computed exactly once."""

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.executor.model_runner import ModelRunner
from minivllm.executor.persistent_batch import PromptLogprobRows
from minivllm.outputs import Logprob
from tests.hf_oracle import hf_greedy, hf_prompt_logprobs

BLOCK_SIZE = 8
TOL = 1e-4  # fp32


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


def make_llm(model_dir: str, **kwargs: object) -> LLM:
    # max_num_seqs 4: a long prompt's logits come in slices of 4 positions.
    return LLM(model_dir, **{"dtype": "float32", "max_model_len": 128, "block_size": BLOCK_SIZE,
                             "max_num_seqs": 4, **kwargs})


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def greedy(max_tokens: int = 4, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture
def computed_positions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Grows by each prompt position whose logprobs a step computes (its sequence's id)."""
    seq_ids: list[int] = []
    original = ModelRunner._prompt_logprobs

    def spy(self: ModelRunner, hidden: torch.Tensor, rows: PromptLogprobRows) -> object:
        for seq_id, count in zip(rows.seq_ids, rows.num_positions):
            seq_ids.extend([seq_id] * count)
        return original(self, hidden, rows)

    monkeypatch.setattr(ModelRunner, "_prompt_logprobs", spy)
    return seq_ids


def assert_matches_hf(prompt_logprobs: list[dict[int, Logprob] | None] | None, prompt: list[int], model_dir: str,
                      k: int, llm: LLM) -> None:
    """Position 0 None; at every other position the prompt token's logprob and rank (ties
    within TOL either way), and the top k candidates, as Hugging Face's log-softmax has them;
    each token decoded."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    reference = hf_prompt_logprobs(model_dir, tuple(prompt))
    tokenizer = llm.get_tokenizer()
    for position, row, token in zip(prompt_logprobs[1:], reference, prompt[1:]):
        assert position is not None
        value = float(row[token])
        assert position[token].logprob == pytest.approx(value, abs=TOL)
        assert int((row > value + TOL).sum()) + 1 <= position[token].rank <= int((row >= value - TOL).sum())
        top = {t: p for t, p in position.items() if p.rank is not None and p.rank <= k}
        assert sorted(p.rank for p in top.values()) == list(range(1, k + 1))
        assert set(position) <= set(top) | {token}
        kth_largest = float(row.topk(k).values[-1]) if k else float("inf")
        for candidate, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(row[candidate]), abs=TOL)
            assert logprob.decoded_token == tokenizer.decode([candidate])
            if candidate in top:
                assert logprob.logprob >= kth_largest - TOL


def test_chunked_sliced_mixed_with_other_requests_and_n(model_dir: str, computed_positions: list[int]) -> None:
    """Prompts of 1 to 50 tokens, some asking (k of 0, 1 and 5, one with n = 3), some not, in
    one batch under a 13-token budget: each asking prompt's logprobs are Hugging Face's,
    computed once per request (n = 3 included); outputs are unchanged."""
    llm = make_llm(model_dir, max_num_batched_tokens=13)
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 50, 23, 31, 17)]
    params = [greedy(prompt_logprobs=1), greedy(prompt_logprobs=5), greedy(prompt_logprobs=0), greedy(),
              SamplingParams(n=3, seed=3, max_tokens=4, prompt_logprobs=2), greedy(logprobs=2)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, param, output in zip(prompts, params, outputs):
        if param.prompt_logprobs is None:
            assert output.prompt_logprobs is None
        else:
            assert_matches_hf(output.prompt_logprobs, prompt, model_dir, param.prompt_logprobs, llm)
        if param.temperature == 0:
            assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 4)[0]
    # Once per request: the positions of the four asking prompts, n = 3 or not.
    assert len(computed_positions) == sum(len(p) - 1 for p, q in zip(prompts, params) if q.prompt_logprobs is not None)
    assert len(set(computed_positions)) == 3  # (the 1-token prompt has no position to compute)


def test_cached_prefix_is_computed_and_cached_for_others(model_dir: str) -> None:
    """A prompt whose prefix another request cached still gets every position (the request
    takes no cache hits); the blocks it computes serve later requests."""
    llm = make_llm(model_dir)
    prompt = random_prompt(40, seed=11)
    assert llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0].num_cached_tokens == 0
    asking = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=3), use_tqdm=False)[0]
    assert asking.num_cached_tokens == 0
    assert_matches_hf(asking.prompt_logprobs, prompt, model_dir, 3, llm)
    fresh = make_llm(model_dir)
    first = fresh.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=3), use_tqdm=False)[0]
    assert first.prompt_logprobs == asking.prompt_logprobs
    after = fresh.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
    assert after.num_cached_tokens == 32  # the four full blocks before the last token's
    assert fresh.llm_engine.stats()["prefix_cache_queries"] == len(prompt)  # the asking request did not look


def test_preemption_computes_each_position_once(model_dir: str, computed_positions: list[int]) -> None:
    """Sequences preempted during and after their prefill, recomputed: the same prompt
    logprobs as Hugging Face, each position computed once; outputs unchanged."""
    llm = make_llm(model_dir, max_model_len=80, num_gpu_blocks_override=14, max_num_batched_tokens=24,
                   enable_prefix_caching=False)
    prompts = [random_prompt(n, seed=20 + n) for n in (50, 41, 33, 26)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24, prompt_logprobs=2), use_tqdm=False)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        assert_matches_hf(output.prompt_logprobs, prompt, model_dir, 2, llm)
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 24)[0]
    assert len(computed_positions) == sum(len(p) - 1 for p in prompts)


def test_whole_vocabulary_and_streaming(model_dir: str) -> None:
    """-1 gives every token of the vocabulary at every position; a stream's first output
    carries the prompt logprobs, later ones none."""
    llm = make_llm(model_dir)
    prompt = random_prompt(6, seed=5)
    whole = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=-1), use_tqdm=False)[0]
    vocab_size = llm.llm_engine.config.hf_config.vocab_size
    assert whole.prompt_logprobs is not None
    assert all(position is not None and len(position) == vocab_size for position in whole.prompt_logprobs[1:])
    assert_matches_hf(whole.prompt_logprobs, prompt, model_dir, vocab_size, llm)
    engine = llm.llm_engine
    engine.add_request("stream", {"prompt_token_ids": prompt}, greedy(5, prompt_logprobs=-1), stream=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].prompt_logprobs == whole.prompt_logprobs
    assert len(outputs) > 1 and all(output.prompt_logprobs is None for output in outputs[1:])


def test_bad_prompt_logprobs(model_dir: str) -> None:
    for bad in (-2, "3", True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match=r"prompt_logprobs \(1000000\) exceeds the vocabulary"):
        llm.generate([1, 2, 3], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([1, 2, 3], greedy(prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs is not None
