"""IncrementalDetokenizer: streamed text equals a one-shot decode, multi-byte characters are
never split, stop strings truncate the text and never leak into a stream."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from minivllm.engine.detokenizer import IncrementalDetokenizer, detokenize
from minivllm.local_models import IM_END, IM_START, build_tokenizer
from minivllm.sampling_params import SamplingParams

FFFD = "\ufffd"
# Built at import (10 ms) because hypothesis tests cannot take function-scoped fixtures
# and this is the same tokenizer as the session fixture.
TOKENIZER = build_tokenizer()
PROMPT = TOKENIZER.encode("Once upon a time")


def stream(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int],
           params: SamplingParams, chunks: list[int] | None = None,
           stop_terminated: bool = False) -> tuple[list[str], str, str | None, IncrementalDetokenizer]:
    """Feed output ids in chunks (default: one at a time) as the engine would, stopping at a
    stop string. Returns (deltas, final text, stop string, detokenizer); the last delta is
    the one taken with finished=True. Whatever the case, the deltas join to the final text."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    sizes = list(chunks or [1] * len(output))
    deltas: list[str] = []
    stop: str | None = None
    pos = 0
    while pos < len(output) and stop is None:
        size = sizes.pop(0) if sizes else 1
        new = output[pos:pos + size]
        pos += size
        last = pos >= len(output)
        stop = detok.update(new, stop_terminated=stop_terminated and last)
        if stop is None and not last:
            deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    final = detok.get_next_output_text(finished=True, delta=False)
    assert "".join(deltas) == final
    return deltas, final, stop, detok


def test_deltas_join_to_decode_of_all_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    text = " The café serves 日本語 food 🎉🚀 and crème brûlée, naïvely."
    output = tokenizer.encode(text)
    deltas, final, stop, _ = stream(tokenizer, PROMPT, output, SamplingParams())
    assert stop is None
    assert "".join(deltas) == final == tokenizer.decode(output) == text


def test_never_streams_a_broken_multibyte_character(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("日本語 🎉 café Ελληνικά")
    # The test means something only if some tokens hold part of a character.
    assert any(FFFD in tokenizer.decode([t]) for t in output)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams())
    for token in output:
        detok.update([token])
        assert FFFD not in detok.output_text
        assert FFFD not in detok.get_next_output_text(finished=False, delta=True)
    assert detok.output_text == "日本語 🎉 café Ελληνικά"


def test_trailing_partial_character_is_released_only_at_the_end(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("ab 日本語")
    # Drop tokens until the sequence ends inside a character.
    while ids and not tokenizer.decode(ids).endswith(FFFD):
        ids = ids[:-1]
    assert ids, "the tokenizer should split 日本語 into byte pieces"
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams())
    detok.update(ids)
    assert FFFD not in detok.get_next_output_text(finished=False, delta=False)
    tail = detok.get_next_output_text(finished=True, delta=True)
    assert tail.endswith(FFFD)
    assert detok.output_text == tokenizer.decode(ids)


def test_whole_text_mode(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode(" Hello world")
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(stop=["xyz"]))
    detok.update(output)
    # Not finished: a possible stop-string start (2 chars) is held back.
    assert detok.get_next_output_text(finished=False, delta=False) == " Hello wor"
    assert detok.get_next_output_text(finished=True, delta=False) == " Hello world"


def test_prompt_context_and_empty_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode(" is Paris.")
    prompt = tokenizer.encode("The capital of France")
    assert stream(tokenizer, prompt, output, SamplingParams())[1] == " is Paris."
    assert stream(tokenizer, [], output, SamplingParams())[1] == " is Paris."


def test_stop_string_ending_inside_a_token(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world, the quick brown fox")
    assert tokenizer.decode(output[2:4]) == " world"  # " wor" + "ld": the stop ends mid-token
    deltas, final, stop, _ = stream(tokenizer, PROMPT, output, SamplingParams(stop=["wo"]))
    assert (stop, final, "".join(deltas)) == ("wo", "Hello ", "Hello ")
    deltas, final, stop, _ = stream(tokenizer, PROMPT, output,
                                    SamplingParams(stop=["wo"], include_stop_str_in_output=True))
    assert (stop, final, "".join(deltas)) == ("wo", "Hello wo", "Hello wo")


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world, the quick brown fox")
    params = SamplingParams(stop=["llo wo", "never"])
    deltas, final, stop, detok = stream(tokenizer, PROMPT, output, params)
    assert (stop, final, "".join(deltas)) == ("llo wo", "He", "He")
    assert detok.num_output_tokens == 3  # stopped at the token that completed it


def test_earliest_stop_string_wins_within_a_step(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world, the quick brown fox")
    _, final, stop, _ = stream(tokenizer, PROMPT, output, SamplingParams(stop=["quick", "the"]),
                               chunks=[len(output)])
    assert (stop, final) == ("the", "Hello world, ")


def test_streamed_deltas_never_contain_a_partial_stop_string(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world, the quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(stop=[", the slow"]))
    streamed = ""
    for token in output:
        assert detok.update([token]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        # 9 characters (longest stop - 1) stay back while running.
        assert streamed == detok.output_text[:max(0, len(detok.output_text) - 9)]
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == "Hello world, the quick brown fox"


def test_min_tokens_delays_stop_strings(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world, Hello world, the end")
    # Without min_tokens the first "world" stops it.
    assert stream(tokenizer, PROMPT, output, SamplingParams(stop=["world"]))[1] == "Hello "
    # "world" is complete after 4 tokens; with min_tokens=4 that one is not checked.
    deltas, final, stop, _ = stream(tokenizer, PROMPT, output, SamplingParams(stop=["world"], min_tokens=4))
    assert (stop, final, "".join(deltas)) == ("world", "Hello world, Hello ", "Hello world, Hello ")
    # min_tokens=3: the 4th token ("ld") completes "world" and is past min_tokens.
    assert stream(tokenizer, PROMPT, output, SamplingParams(stop=["world"], min_tokens=3))[1] == "Hello "


def test_skip_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    im_start, im_end = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    output = [im_start] + tokenizer.encode("assistant\nHi there") + [im_end, tokenizer.eos_token_id]
    for skip in (True, False):
        deltas, final, _, _ = stream(tokenizer, PROMPT, output, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == final == tokenizer.decode(output, skip_special_tokens=skip)
    assert final == "<|im_start|>assistant\nHi there<|im_end|><|endoftext|>"


def test_stop_terminated_token_text_is_left_out(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("Hello world")  # the last token, "ld", acts as a stop token id
    params = SamplingParams()
    assert stream(tokenizer, PROMPT, output, params, stop_terminated=True)[1] == "Hello wor"
    params = SamplingParams(include_stop_str_in_output=True)
    _, final, _, detok = stream(tokenizer, PROMPT, output, params, stop_terminated=True)
    assert final == "Hello world"
    assert detok.num_output_tokens == len(output)


def test_accepts_a_raw_tokenizers_backend(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode(" café 🎉")
    assert stream(tokenizer.backend_tokenizer, PROMPT, output, SamplingParams())[1] == " café 🎉"


# -- property tests ---------------------------------------------------------------------

_token_ids = st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=40)
_chunks = st.lists(st.integers(1, 4), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_token_ids, output=_token_ids, chunks=_chunks, skip=st.booleans())
def test_random_token_ids_stream_to_their_decode(prompt: list[int], output: list[int],
                                                 chunks: list[int], skip: bool) -> None:
    """Any ids (special tokens, lone UTF-8 continuation bytes, ...), any chunking: the
    deltas join to the decode of all output ids."""
    # Start the prompt at a clean character boundary, as real prompts (text) do; with
    # garbage bytes at the end of a prompt, the first output character legitimately
    # merges with them.
    prompt = TOKENIZER.encode("Hi") + prompt + TOKENIZER.encode(" ok")
    deltas, final, stop, _ = stream(TOKENIZER, prompt, output, SamplingParams(skip_special_tokens=skip), chunks)
    assert stop is None
    assert "".join(deltas) == final == TOKENIZER.decode(output, skip_special_tokens=skip)
    for delta in deltas[:-1]:  # while running: no replacement char at the end of a delta
        assert not delta.endswith(FFFD)


def _reference_stop(output: list[int], stops: list[str], include: bool) -> tuple[str, str | None]:
    """Re-decode everything after each token (slow and obviously right): the first stop
    string to complete wins; among those completed by the same token, the earliest; of
    those starting at the same place, the first in the list. Text counts once no incomplete
    character ends it: a token that completes one character and starts the next releases
    both with the token after it (as the decode stream, and vLLM's detokenizer, release them)."""
    for k in range(1, len(output) + 1):
        text = TOKENIZER.decode(output[:k])
        if text.endswith(FFFD):
            continue
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            index, stop = min(found, key=lambda match: match[0])  # min keeps the first of equals
            return text[:index + len(stop) if include else index], stop
    return TOKENIZER.decode(output), None


_text = st.text(alphabet=list("ab cdé日本🎉\n.,"), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_text, stops=st.lists(st.text(alphabet=list("ab cé日🎉."), min_size=1, max_size=4),
                                  min_size=1, max_size=3),
       include=st.booleans())
@example(text="a日日", stops=["日", "a日日"], include=False)  # one token ends a 日 and starts the next
def test_stop_strings_match_a_full_redecode(text: str, stops: list[str], include: bool) -> None:
    output = TOKENIZER.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, params)
    streamed, stop = "", None
    for token in output:
        stop = detok.update([token])
        if stop is not None:
            break
        streamed += detok.get_next_output_text(finished=False, delta=True)
        if not include:  # nothing streamed before the end may contain a stop string
            assert not any(s in streamed for s in stops)
    streamed += detok.get_next_output_text(finished=True, delta=True)
    want_text, want_stop = _reference_stop(output, stops, include)
    assert (streamed, detok.output_text, stop) == (want_text, want_text, want_stop)


@given(st.lists(st.tuples(st.sampled_from(["", "The capital of France", "日本", "a b c d e f"]),
                          st.text(alphabet="ab 日本語🎉é,.!\n", max_size=30)), min_size=1, max_size=6),
       st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_batched_final_texts_are_the_incremental_ones(cases: list[tuple[str, str]], skip: bool) -> None:
    """detokenize(), the engine's one batched decode of sequences that finish together, gives
    each the text that its own IncrementalDetokenizer would end with (partial characters,
    prompt context and special tokens included)."""
    sequences = [(TOKENIZER.encode(prompt), TOKENIZER.encode(text)) for prompt, text in cases]
    sequences.append((PROMPT, [TOKENIZER.convert_tokens_to_ids(IM_START), *TOKENIZER.encode(" hi")]))
    expected = [stream(TOKENIZER, prompt, output, SamplingParams(skip_special_tokens=skip))[1]
                for prompt, output in sequences]
    assert detokenize(TOKENIZER, sequences, skip) == expected


def test_a_prompt_ending_in_undecodable_text_stays_out_of_the_output(tokenizer: PreTrainedTokenizerFast) -> None:
    """A prompt whose end decodes to U+FFFD (lone UTF-8 bytes, or the character itself, as
    random-token prompts have): none of it reaches the output text, streamed or not."""
    lone_bytes = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == FFFD][:30]
    assert len(lone_bytes) >= 8  # the test means something only with such tokens
    output = tokenizer.encode('{"a": 1}')
    for tail in (lone_bytes, tokenizer.encode(FFFD * 30), lone_bytes[:3], tokenizer.encode(" x" + FFFD)):
        prompt = tokenizer.encode("Hi there") + tail
        _, final, _, _ = stream(tokenizer, prompt, output, SamplingParams())
        assert final == tokenizer.decode(output) == detokenize(tokenizer, [(prompt, output)], True)[0]
