"""SamplingParams.bad_words as vLLM: each word's token sequences (as it starts a text, and
after a space), and a token masked where it would complete one; greedy generation checked
against Hugging Face with the same rule applied."""

import itertools

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from tests.hf_oracle import hf_greedy, load_hf_model

PROMPT = "The quick brown fox"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=64, block_size=8)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@torch.no_grad()
def hf_greedy_without(model_dir: str, prompt: list[int], words: list[list[int]]) -> list[int]:
    """Hugging Face's greedy tokens, each step masking every word's last token where the
    outputs so far end with the word's other tokens (the prompt does not count)."""
    model = load_hf_model(model_dir)
    outputs: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = model(torch.tensor([prompt + outputs])).logits[0, -1]
        for word in words:
            if len(word) - 1 <= len(outputs) and outputs[len(outputs) - len(word) + 1:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        outputs.append(int(logits.argmax()))
    return outputs


def test_spellings(tokenizer) -> None:
    """A word as it starts a text and, where that is another sequence of as many tokens, as
    it follows a space (vLLM's rule: " fox" is one token of the demo tokenizer, "fox" three,
    so only "fox" is banned); leading whitespace of the word itself is dropped."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert len(encode("the")) == len(encode(" the")) == 1 and encode("the") != encode(" the")
    assert len(encode("fox")) == 3 and len(encode(" fox")) == 1
    assert len(encode("the lazy dog")) == len(encode(" the lazy dog")) > 1
    params = SamplingParams(bad_words=["the", "fox", "  the lazy dog"])
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids == [encode("the"), encode(" the"), encode("fox"), encode("the lazy dog"),
                                          encode(" the lazy dog")]
    assert params.has_bad_word_prefixes and params.needs_token_history
    single = SamplingParams(bad_words=["the"])
    single.update_from_tokenizer(tokenizer)
    assert not single.has_bad_word_prefixes and not single.needs_token_history


def test_sampler_masks_completing_tokens() -> None:
    """Single-token words always; longer ones only after their other tokens, as outputs (not
    the prompt); nothing else changes."""
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[7], [3, 4, 5], [9, 2]]
    rows = [SamplingRow(params, [3, 4], []), SamplingRow(params, [], [1, 3, 4]), SamplingRow(params, [], [9]),
            SamplingRow(SamplingParams(temperature=0.0), [], [3, 4])]
    meta = SamplingMetadata.build(rows, 10, "cpu")
    assert meta.reads_outputs and meta.edits_logits
    logits = torch.zeros(4, 10)
    masked = Sampler().penalised_logits(logits, meta).isinf()
    assert masked.nonzero().tolist() == [[0, 7], [1, 5], [1, 7], [2, 2], [2, 7]]
    static = SamplingParams(temperature=0.0)
    static.bad_words_token_ids = [[7]]
    assert not SamplingMetadata.build([SamplingRow(static, (), ())], 10, "cpu").reads_outputs


def test_generation_matches_hf_with_the_rule(llm: LLM, model_dir: str) -> None:
    """A word of one token and one of two, both taken from the unconstrained output (each
    spelt there as the word alone is): the output changes, and equals Hugging Face's under
    vLLM's rule."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    free = hf_greedy(model_dir, prompt, MAX_TOKENS)[0]

    def spelt_alone(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return text == text.lstrip() and bool(text) and tokenizer.encode(text) == tokens

    single = tokenizer.decode([next(t for t in reversed(free) if spelt_alone([t]))])
    pair = tokenizer.decode(next([a, b] for a, b in itertools.pairwise(free) if spelt_alone([a, b])))
    for words in ([single], [pair], [single, pair]):
        params = greedy(bad_words=words)
        output = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert list(output.token_ids) != free, words
        assert list(output.token_ids) == hf_greedy_without(model_dir, prompt, params.bad_words_token_ids), words
        assert params.has_bad_word_prefixes == (pair in words)


def test_bad_words_refused(model_dir: str) -> None:
    for bad in ("fox", [""], ["  "], [5]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]
    without_tokenizer = LLM(model_dir, dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words need the tokenizer"):
        without_tokenizer.generate([1, 2, 3], greedy(bad_words=["fox"]), use_tqdm=False)
    assert not without_tokenizer.llm_engine.has_unfinished_requests()
