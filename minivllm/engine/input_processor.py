"""InputProcessor: a prompt in any accepted form, checked and turned into token ids.

Both LLMEngine (offline) and AsyncLLM's front (serving, in the API process) use it, so a
bad prompt is refused with the same ValueError wherever it comes in, before any engine
state changes.
"""

import os
from numbers import Integral

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minivllm.config import EngineConfig, is_gguf
from minivllm.engine.grammar_spec import check_structured_outputs
from minivllm.sampling_params import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# A prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dicts.
PromptType = str | list[int] | dict


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase | None:
    """The model directory's (or GGUF file's) tokenizer (None with skip_tokenizer_init).
    Raises ValueError when the model has none."""
    if config.skip_tokenizer_init:
        return None
    if is_gguf(config.model):
        from minivllm.gguf_loader import gguf_tokenizer  # the gguf package only for GGUF models
        return gguf_tokenizer(config.model)
    advice = ("A Hugging Face model directory needs its tokenizer files (tokenizer.json and "
              "tokenizer_config.json); or pass skip_tokenizer_init=True and prompts as token ids.")
    # Without any of these, transformers may build an empty tokenizer rather than fail.
    if not any(os.path.isfile(os.path.join(config.model, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"{config.model!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}). {advice}")
    try:
        return AutoTokenizer.from_pretrained(config.model)
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"Could not load a tokenizer from {config.model!r} "
                         f"({type(error).__name__}: {str(error)[:200]}). {advice}") from error


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size: int = config.hf_config.vocab_size

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids). Raises ValueError on bad input."""
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._validate(prompt_token_ids)
        self.check_params(params)
        return prompt_text, prompt_token_ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: pass prompts as {'prompt_token_ids': [...]}.")
            return prompt, self.tokenizer.encode(prompt)
        if is_token_ids(prompt):
            return None, _token_ids(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: pass a string, a list of "
                         "token ids, or {'prompt_token_ids': [...]}.")

    def _validate(self, prompt_token_ids: list[int]) -> None:
        max_len = self.config.max_model_len
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"The prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_len}, which must "
                "also leave room for at least one generated token: shorten the prompt or raise max_model_len.")
        vocab_size = self.vocab_size
        if not _all_in_range(prompt_token_ids, vocab_size):
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
            raise ValueError(f"Prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}).")

    def check_params(self, params: SamplingParams) -> None:
        """What only the model and tokenizer can tell of params (token ids, bad words); fills
        params.bad_words_token_ids. Raises ValueError, its message starting with the field."""
        vocab_size = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} ({value}) exceeds the vocabulary size {vocab_size}.")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need the tokenizer, which skip_tokenizer_init=True leaves out.")
            params.update_from_tokenizer(self.tokenizer)
        params.check_vocab(vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer, which skip_tokenizer_init=True leaves out: "
                             "use stop_token_ids instead.")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs}).")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the tokenizer, which skip_tokenizer_init=True leaves out.")
            check_structured_outputs(params.structured_outputs)


def is_token_ids(prompt: object) -> bool:
    """Whether prompt is one prompt given as token ids: a list or tuple of integers (numpy's
    and torch's included), or a 1-D numpy array or tensor."""
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # numpy arrays, torch tensors
        return prompt.ndim == 1
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and _is_token_id(prompt[0])


def _is_token_id(value: object) -> bool:
    if hasattr(value, "ndim") and hasattr(value, "item"):  # a numpy or torch scalar
        return value.ndim == 0 and isinstance(value.item(), Integral) and not isinstance(value.item(), bool)
    return isinstance(value, Integral) and not isinstance(value, bool)


def _token_ids(values: object) -> list[int]:
    """A prompt's token ids as a list of plain ints (a list of them is taken as it is, not
    copied: the engine never changes it); anything else is the caller's mistake."""
    if hasattr(values, "ndim") and hasattr(values, "tolist"):
        values = values.tolist()
    # The common case, plain ints, checked at C speed (the server runs this on its event loop).
    if isinstance(values, (list, tuple)) and set(map(type, values)) <= {int}:
        return values if isinstance(values, list) else list(values)
    if not isinstance(values, (list, tuple)) or not all(_is_token_id(t) for t in values):
        raise ValueError("prompt_token_ids must be a list of integers.")
    return [int(t) for t in values]


def _all_in_range(token_ids: list[int], vocab_size: int) -> bool:
    """Whether every id (a plain int) lies in [0, vocab_size): one pass at C speed into an
    int64 array, whose min and max numpy finds faster than Python's min() and max()."""
    try:
        ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    except OverflowError:  # beyond int64, so beyond any vocabulary
        return False
    return bool(ids.min() >= 0 and ids.max() < vocab_size)
