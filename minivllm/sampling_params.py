"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults);
StructuredOutputsParams: the format the output must follow (vLLM's structured outputs)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Below this temperature sampling is treated as greedy, as in vLLM.
GREEDY_EPSILON = 1e-5

# logit_bias values are clamped to OpenAI's documented range, as vLLM does.
MAX_ABS_LOGIT_BIAS = 100.0


# StructuredOutputsParams' constraints, of which a request sets exactly one.
STRUCTURED_OUTPUT_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """The output must follow exactly one of: a JSON schema (`json`, a dict or its JSON text),
    a regular expression, one of a list of strings (`choice`), a grammar (`grammar`: EBNF as
    xgrammar and llama.cpp write it, or Lark when it has no `::=` rule), any JSON object
    (`json_object=True`) or an xgrammar structural tag (its JSON text). Checked on
    construction; whether the schema, regex or grammar itself is valid is checked where the
    request is added (engine/grammar_spec.py), with xgrammar's own message."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON only: no whitespace between tokens (vLLM's option; any whitespace by default).
    disable_any_whitespace: bool = False
    # Accepted for vLLM's clients: xgrammar's strict mode already refuses properties a schema
    # does not name unless it allows them (additionalProperties), which is what this asks.
    disable_additional_properties: bool = False
    # vLLM's outlines-only option; xgrammar has no equivalent, so it is refused when set.
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        def fail(message: str) -> NoReturn:
            raise ValueError(f"StructuredOutputsParams: {message}")

        given = [name for name in STRUCTURED_OUTPUT_CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            fail(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_CONSTRAINTS)}; got "
                 f"{', '.join(given) if given else 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            fail(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                fail(f"{name} must be a non-empty string, got {value!r}.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) for c in self.choice)):
                fail(f"choice must be a non-empty list of strings, got {self.choice!r}.")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            fail(f"json_object must be True when given, got {self.json_object!r}.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        if self.whitespace_pattern is not None:
            fail("whitespace_pattern is not supported (xgrammar has no such option): leave it out, or set "
                 "disable_any_whitespace=True for JSON without whitespace.")

    @property
    def constraint(self) -> str:
        """The name of the constraint given (one of STRUCTURED_OUTPUT_CONSTRAINTS)."""
        return next(name for name in STRUCTURED_OUTPUT_CONSTRAINTS if getattr(self, name) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each under the model given the tokens before it), with
    # this many most likely candidates per position; -1: the whole vocabulary.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to a token's logit (clamped to [-100, 100]) before penalties and temperature.
    logit_bias: dict[int, float] | None = None
    # Every other token is masked out (-inf) before anything else edits the logits.
    allowed_token_ids: list[int] | None = None
    # Words never to generate: a token that would complete one (as the tokenizer writes it,
    # with or without a leading space) is masked out (-inf), after allowed_token_ids.
    bad_words: list[str] | None = None
    # The format the output must follow (JSON schema, regex, choice, grammar...); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine from the tokenizer / generation config: EOS and friends.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by update_from_tokenizer: the token ids of each bad word's spellings.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop = _listed([self.stop] if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = _listed(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> NoReturn:
            raise ValueError(f"SamplingParams: {message}")

        # Types first: a float count or a string number would misbehave further in.
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                fail(f"{name} must be an integer, got {value!r}.")
            if value is not None:
                setattr(self, name, int(value))  # numpy and similar integers become plain ints
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}.")
        if not isinstance(self.stop_token_ids, list) or any(isinstance(t, bool) or not isinstance(t, Integral)
                                                            for t in self.stop_token_ids):
            fail(f"stop_token_ids must be a list of token ids (integers), got {self.stop_token_ids!r}.")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not isinstance(self.stop, list) or any(not isinstance(s, str) for s in self.stop):
            fail(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            fail(f"seed must be in [-2**63, 2**63), got {self.seed}.")
        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            fail(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            fail(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be > 0 (1 means none), got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and self.logprobs < 0:
            fail(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            fail(f"prompt_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.prompt_logprobs}.")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(not isinstance(w, str) for w in self.bad_words):
                fail(f"bad_words must be a list of strings, got {self.bad_words!r}.")
            if any(not w.strip() for w in self.bad_words):
                fail("bad_words must not hold empty (or blank) strings.")
            self.bad_words = list(self.bad_words)
        if any(not s for s in self.stop):
            fail("stop strings must not be empty.")
        self._validate_logit_bias(fail)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, Integral)
                                                         for t in ids):
                fail(f"allowed_token_ids must be a list of token ids (integers), got {ids!r}.")
            if not ids:
                fail("allowed_token_ids must not be empty: give at least one token id, or leave it out.")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}.")

    def _validate_logit_bias(self, fail: Callable[[str], NoReturn]) -> None:
        """Keys to ints (vLLM also takes integer strings, as JSON gives them), values finite and
        clamped to [-100, 100]."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            fail(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_id(key)
            if token is None:
                fail(f"logit_bias keys must be token ids (integers), got {key!r}.")
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                fail(f"logit_bias values must be finite numbers, got {value!r} for token {token}.")
            bias[token] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, float(value)))
        self.logit_bias = bias

    def update_from_tokenizer(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        """bad_words_token_ids from bad_words, as vLLM spells them: each word (leading
        whitespace stripped) as it starts a text, and with a leading space, as it follows another
        word, where that is another token sequence of the same length."""
        self.bad_words_token_ids = []
        for word in self.bad_words or ():
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            self.bad_words_token_ids.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                self.bad_words_token_ids.append(spaced)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the first field with a token id outside [0, vocab_size): only the
        engine knows the vocabulary, so this runs where requests are added."""
        for label, ids in (("stop_token_ids", self.stop_token_ids or ()),
                           ("logit_bias keys", self.logit_bias or ()),
                           ("allowed_token_ids", self.allowed_token_ids or ()),
                           ("bad_words token ids", [t for word in self.bad_words_token_ids for t in word])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"SamplingParams: {label} {bad[:5]} are outside the vocabulary [0, {vocab_size}).")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def has_bad_word_prefixes(self) -> bool:
        """Some bad word spans several tokens: whether its last token is masked depends on the
        tokens generated before it."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def needs_token_history(self) -> bool:
        """Sampling reads the sequence's tokens so far (penalties, min_tokens, bad words of
        several tokens)."""
        return self.has_penalties or self.min_tokens > 0 or self.has_bad_word_prefixes


def _token_id(key: object) -> int | None:
    """A logit_bias key as a token id: an integer, or a string holding one; None otherwise."""
    if isinstance(key, bool):
        return None
    if isinstance(key, Integral):
        return int(key)
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


def _listed(value: object) -> Any:
    """None as [], a list or tuple as a list (a copy); anything else as it is, for _validate to refuse
    (so Any: what comes back is known only after _validate)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else value
