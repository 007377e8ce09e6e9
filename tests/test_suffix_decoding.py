"""Suffix decoding: its drafts against the method's definition (brute force), drafts from the
outputs of earlier requests, and the engine's output unchanged by them (greedy = HF)."""

import math
import random
from collections import Counter

import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.engine.suffix_proposer import SEPARATOR, OutputCache, suffix_draft
from tests.hf_oracle import hf_greedy


def definition(haystack: list[int], ends: list[int], pattern: list[int], max_tokens: int, factor: float,
               min_prob: float) -> tuple[list[int], float]:
    """The draft, straight from the definition: the longest suffix of pattern ending at one of
    `ends`, then the most frequent next token (the smallest on a tie) while the path's
    probability holds."""
    matched, occurrences = 0, []
    for length in range(len(pattern), 0, -1):
        occurrences = [e for e in ends if e - length + 1 >= 0 and haystack[e - length + 1:e + 1] == pattern[-length:]]
        if occurrences:
            matched = length
            break
    draft: list[int] = []
    score, prob = 0.0, 1.0
    while len(draft) < min(max_tokens, math.ceil(matched * factor - 1e-9)) and occurrences:
        following = Counter(haystack[e + 1] for e in occurrences
                            if e + 1 < len(haystack) and haystack[e + 1] != SEPARATOR)
        if not following:
            break
        token = min(following, key=lambda t: (-following[t], t))
        prob *= following[token] / len(occurrences)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        occurrences = [e + 1 for e in occurrences if e + 1 < len(haystack) and haystack[e + 1] == token]
    return draft, score


def test_suffix_draft_is_the_definition() -> None:
    rng = np.random.default_rng(0)
    for _ in range(400):
        haystack = rng.integers(0, 3, int(rng.integers(1, 40))).tolist()
        for i in rng.integers(0, len(haystack), int(rng.integers(0, 3))):
            haystack[i] = SEPARATOR  # an output cache's boundaries
        pattern = rng.integers(0, 3, int(rng.integers(1, 8))).tolist()
        max_tokens, factor = int(rng.integers(1, 8)), float(rng.choice([0.5, 1.0, 2.0]))
        min_prob = float(rng.choice([0.0, 0.1, 0.4]))
        ends = [i for i, token in enumerate(haystack) if token == pattern[-1]]
        want = definition(haystack, ends, pattern, max_tokens, factor, min_prob)
        array = np.array(haystack)
        got = suffix_draft([(array, np.array(ends, dtype=np.int64))], np.array(pattern), max_tokens, factor, min_prob)
        assert (got.tokens, got.score) == (want[0], pytest.approx(want[1]))
        # Split over two arrays (an output cache's segments), the counts add up the same.
        cut = int(rng.integers(0, len(haystack) + 1))
        halves = [(array[:cut], np.array([e for e in ends if e < cut], dtype=np.int64)),
                  (array[cut:], np.array([e - cut for e in ends if e >= cut], dtype=np.int64))]
        if SEPARATOR in haystack[cut - 1:cut] or cut in (0, len(haystack)):  # (a split is a boundary)
            split = suffix_draft(halves, np.array(pattern), max_tokens, factor, min_prob)
            assert (split.tokens, split.score) == (got.tokens, pytest.approx(got.score))


def test_output_cache_keeps_the_last_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("minivllm.engine.suffix_proposer.SEGMENT_TOKENS", 8)
    cache = OutputCache(max_requests=3)
    for i in range(10):
        cache.add([100 + i, 7, 7])
    found = {int(tokens[end]) for tokens, ends in cache.occurrences(7) for end in ends - 1 if tokens[end] >= 100}
    assert {107, 108, 109} <= found <= set(range(100, 110)) and len(found) < 10  # old segments went
    assert all(len(ends) == 0 for _, ends in OutputCache(0).occurrences(7))


def test_output_cache_finds_every_occurrence_while_filling_and_sealed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each segment's occurrences of a token are exactly its positions, whether the segment is
    still filling (past its first buffer's size) or sealed and sorted."""
    monkeypatch.setattr("minivllm.engine.suffix_proposer.SEGMENT_TOKENS", 3000)
    rng = np.random.default_rng(0)
    cache = OutputCache(max_requests=1000)
    for _ in range(40):
        cache.add(rng.integers(0, 50, int(rng.integers(1, 300))).tolist())
        for token in (0, 7, 49, 50):
            for tokens, ends in cache.occurrences(token):
                assert np.array_equal(np.sort(ends), np.flatnonzero(tokens == token))
    assert len(cache.occurrences(7)) >= 2  # a sealed segment and an open one


def test_config_as_vllm_takes_it() -> None:
    config = SpeculativeConfig.from_dict({"method": "suffix"})
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24  # vLLM's defaults
    assert (config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (10000, 1.0, 0.1)
    for values, message in [({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "from 0 to 1"),
                            ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "above 0"),
                            ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "at least 0"),
                            ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "at least 1")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(values)


@pytest.mark.parametrize("cached_requests", [10000, 0])
def test_drafts_from_earlier_outputs_keep_greedy_output_hfs(tiny_model_factory, cached_requests: int) -> None:
    """A request whose answer an earlier request already wrote gets it as drafts (only from
    the output cache: this model's outputs barely repeat themselves); the output stays HF's."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    spec = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": cached_requests}
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=8, speculative_config=spec,
              enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = hf_greedy(model_dir, prompt, 32)[0]
    accepted = []
    for _ in range(2):
        before = llm.llm_engine.stats()["spec_decode_num_accepted_tokens"]
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert list(output.outputs[0].token_ids) == want
        accepted.append(llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] - before)
    if cached_requests:
        assert accepted[1] >= 24 and accepted[1] > 2 * accepted[0]  # the second wrote the first's answer
    else:
        assert accepted[1] == accepted[0]
