"""Incremental detokenization and stop strings (vLLM v1's semantics).

Each step appends a few token ids; we turn only those into text with the `tokenizers`
DecodeStream (prefix/read offsets in Rust: it re-decodes a short window, never the whole
output) and hold text back while it ends in an incomplete UTF-8 character.

Streaming rule: while a request runs, the last (longest stop string - 1) characters are
held back from deltas, because they could be the start of a stop string that the next
token completes, and a stop string must never reach the client unless
include_stop_str_in_output is set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# How far back into the prompt we prime the decode stream: far enough that the first
# output token decodes with its real left context (leading spaces, merged bytes).
_PROMPT_CONTEXT_MIN = 4
_PROMPT_CONTEXT_MAX = 24
# tokenizers raises this when a decoder's output is not monotonic in its input (rare,
# e.g. some byte-fallback decoders on invalid UTF-8); vLLM recovers by restarting.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"


def _backend(tokenizer: PreTrainedTokenizerBase | Tokenizer) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError("IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer, "
                         f"got {type(tokenizer).__name__}.")
    return backend


def _prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The end of the prompt, from a point that decodes cleanly (no partial character), else
    one whose text at least does not end in U+FFFD; else nothing. A decode stream primed with
    text ending in U+FFFD (garbage bytes, or the character itself) holds it back as an
    incomplete character and would hand it out with the first output token."""
    if len(prompt_token_ids) <= _PROMPT_CONTEXT_MIN:
        return prompt_token_ids if not tokenizer.decode(
            prompt_token_ids, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR) else []
    fallback: list[int] = []
    for i in range(_PROMPT_CONTEXT_MIN, min(len(prompt_token_ids), _PROMPT_CONTEXT_MAX) + 1):
        suffix = prompt_token_ids[-i:]
        text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
        if REPLACEMENT_CHAR not in text:
            return suffix
        if not fallback and not text.endswith(REPLACEMENT_CHAR):
            fallback = suffix
    return fallback


def detokenize(tokenizer: PreTrainedTokenizerBase | Tokenizer, sequences: list[tuple[list[int], list[int]]],
               skip_special_tokens: bool) -> list[str]:
    """The whole output text of each (prompt token ids, output token ids): what
    IncrementalDetokenizer gives at the end without stop strings. For requests that neither
    stream nor look for stop strings, which finish many at a time: two batched decodes, which
    the tokenizer runs in parallel."""
    backend = _backend(tokenizer)
    contexts = [_prompt_context(backend, prompt, skip_special_tokens) for prompt, _ in sequences]
    prefixes = backend.decode_batch(contexts, skip_special_tokens=skip_special_tokens)
    texts = backend.decode_batch([context + output for context, (_, output) in zip(contexts, sequences)],
                                 skip_special_tokens=skip_special_tokens)
    # A merge across the prompt/output boundary changes the prefix: decode the output alone.
    return [text[len(prefix):] if text.startswith(prefix)
            else backend.decode(output, skip_special_tokens=skip_special_tokens)
            for prefix, text, (_, output) in zip(prefixes, texts, sequences)]


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, step by step, and finds stop
    strings in it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._tokenizer = _backend(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # Characters held back from streamed deltas; none when the stop string may be
        # shown anyway.
        self._stop_buffer_length = (max(map(len, self._stop)) - 1
                                    if self._stop and not self._include_stop else 0)

        self._text = ""
        self.num_output_tokens = 0
        self._last_output_offset = 0  # end of what get_next_output_text(delta=True) gave
        self._stopped = False  # a stop string truncated the text: nothing more to add
        self._flushed = False

        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        # Prime the stream with the end of the prompt, so output text is what it would be in context.
        # Output ids not yet turned into text (held back as an incomplete character); only
        # used to flush them at the end.
        self._pending: list[int] = []
        for token_id in _prompt_context(self._tokenizer, prompt_token_ids, self._skip_special_tokens):
            self._step(token_id)
        self._pending.clear()

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def output_text(self) -> str:
        """All text so far (truncated at a stop string once one is found). Unlike streamed
        deltas, this includes a stop string that may still be forming."""
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens; return the stop string that ended the sequence, if any.

        stop_terminated: the last new token is a stop token (EOS or stop_token_ids). As in
        vLLM, its text is left out of the output unless include_stop_str_in_output.
        """
        if not new_token_ids or self._stopped:
            return None
        if stop_terminated and not self._include_stop:
            decode_ids = new_token_ids[:-1]
        else:
            decode_ids = new_token_ids

        # Stop strings are searched only in text that is new since this offset (plus a
        # stop string's length of overlap), so each step's work stays proportional to the
        # new text. Text from the first min_tokens tokens is never searched (vLLM #22014).
        check_offset = len(self._text)
        for token_id in decode_ids:
            self._text += self._step(token_id)
            self.num_output_tokens += 1
            if self.num_output_tokens <= self._min_tokens:
                check_offset = len(self._text)
        self.num_output_tokens += len(new_token_ids) - len(decode_ids)

        if not self._stop or self.num_output_tokens <= self._min_tokens:
            return None
        return self._check_stop_strings(check_offset)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text (delta=False) or what is new since the last delta call.

        While not finished, the last (longest stop string - 1) characters are held back so
        no partial stop string is streamed. When finished, everything is released,
        including a trailing incomplete character (as U+FFFD, as tokenizer.decode gives),
        so the final text equals the decode of all output tokens.
        """
        if finished:
            self._flush()
        hold = 0 if finished else self._stop_buffer_length
        end = len(self._text) - hold
        if not delta:
            return self._text[:end] if hold else self._text
        if end <= self._last_output_offset:
            return ""
        start, self._last_output_offset = self._last_output_offset, end
        return self._text[start:end]

    # -- internals -----------------------------------------------------------------------

    def _step(self, token_id: int) -> str:
        """Feed one token to the decode stream; return the text it completes (maybe "")."""
        self._pending.append(token_id)
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception as e:  # tokenizers raises a plain Exception subclass here
            if _INVALID_PREFIX_ERR not in str(e):
                raise
            # Restart the stream: output text stays append-only, at the cost of losing
            # left context for this one token.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._pending = [token_id]
            text = self._stream.step(self._tokenizer, token_id)
        if text is None:
            return ""
        self._pending.clear()
        return text

    def _flush(self) -> None:
        """Release text the stream still holds (an incomplete character at the end)."""
        if self._flushed:
            return
        self._flushed = True
        if self._stopped or not self._pending:
            return
        # The held ids decode to a string that ends in U+FFFD; once the sequence is over
        # no later token can complete it. (Skipped special tokens decode to "".)
        self._text += self._tokenizer.decode(self._pending,
                                             skip_special_tokens=self._skip_special_tokens)
        self._pending = []

    def _check_stop_strings(self, check_offset: int) -> str | None:
        """Find the earliest stop string that ends in the text after check_offset;
        truncate the text there and return it."""
        new_chars = len(self._text) - check_offset
        if new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A match must end in the new text, so it starts at most len(stop)-1 before it.
            index = self._text.find(stop, max(0, check_offset - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index + len(stop) if self._include_stop else index]
        self._stopped = True
        return stop
