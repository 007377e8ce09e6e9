"""GGUF checkpoints (llama.cpp's one-file format): the config and tokenizer from the file's
metadata, and its tensors dequantised and renamed as in Hugging Face checkpoints, so that
loader.load_named_tensors places them as it places safetensors."""

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, Keys
from gguf.quants import dequantize
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from minivllm.kept_dirs import kept_dir

# general.architecture -> the Hugging Face architecture minivllm runs it as. llama.cpp
# writes Mistral models as "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# What llama.cpp's usual quantisations (F16, Q8_0, Q4_K_M, ...) write, all of which the
# gguf package's numpy code dequantises; the rest are refused by name.
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

# Bump when what _write_hf_dir writes changes, so stale caches are not reused.
_HF_DIR_VERSION = 1

# GGUF metadata keys ("{arch}" filled in) -> Hugging Face config fields.
_CONFIG_KEYS = {
    Keys.LLM.CONTEXT_LENGTH: "max_position_embeddings",
    Keys.LLM.EMBEDDING_LENGTH: "hidden_size",
    Keys.LLM.FEED_FORWARD_LENGTH: "intermediate_size",
    Keys.LLM.BLOCK_COUNT: "num_hidden_layers",
    Keys.LLM.VOCAB_SIZE: "vocab_size",
    Keys.Attention.HEAD_COUNT: "num_attention_heads",
    Keys.Attention.HEAD_COUNT_KV: "num_key_value_heads",
    Keys.Attention.KEY_LENGTH: "head_dim",
    Keys.Attention.LAYERNORM_RMS_EPS: "rms_norm_eps",
    Keys.Rope.FREQ_BASE: "rope_theta",
    Keys.Tokenizer.BOS_ID: "bos_token_id",
    Keys.Tokenizer.EOS_ID: "eos_token_id",
    Keys.Tokenizer.PAD_ID: "pad_token_id",
}

# GGUF tensor names (without ".weight"/".bias") -> Hugging Face module names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _reader(path: str) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"Could not read GGUF file {path!r} ({error}): it is missing, truncated or not "
                         "a GGUF file; download it again.") from error


def _field(reader: GGUFReader, key: str) -> Any:
    """The metadata value at key (None if absent): an int, float, string or list, by the key."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = _field(reader, Keys.General.ARCHITECTURE)
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} (in {path!r}) is not supported. "
                         f"Supported GGUF architectures: {', '.join(ARCHITECTURES)}.")
    return arch


def gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config that the GGUF file's metadata describes. Raises ValueError
    for an architecture or rope scaling minivllm does not run."""
    return AutoConfig.from_pretrained(gguf_hf_dir(path))


def gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) in the GGUF file's metadata."""
    return AutoTokenizer.from_pretrained(gguf_hf_dir(path))


def gguf_hf_dir(path: str) -> str:
    """A Hugging Face directory (config.json, tokenizer files) made from the GGUF file's
    metadata once, then cached: reading the metadata (the whole vocabulary) takes seconds,
    and each process that needs the config or tokenizer (API server, engine) would pay it."""
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return kept_dir(f"gguf-v{_HF_DIR_VERSION}/{key}", lambda directory: _write_hf_dir(path, directory))


def _write_hf_dir(path: str, directory: str) -> None:
    _config_from_metadata(path).save_pretrained(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"Could not build a tokenizer from {path!r} ({type(error).__name__}: "
                         f"{str(error)[:200]}); or pass skip_tokenizer_init=True and prompts as token ids.") from error
    tokenizer.save_pretrained(directory)


def _config_from_metadata(path: str) -> PretrainedConfig:
    reader = _reader(path)
    arch = _architecture(reader, path)
    kwargs: dict[str, object] = {}
    for key, name in _CONFIG_KEYS.items():
        value = _field(reader, key.format(arch=arch))
        if value is not None:
            kwargs[name] = value
    scaling = _field(reader, Keys.Rope.SCALING_TYPE.format(arch=arch))
    tensor_names = {tensor.name for tensor in reader.tensors}
    # Llama 3.1+ files carry their rope scaling as per-frequency factors (rope_freqs), not
    # as the parameters minivllm's rotary embedding takes.
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path!r} uses rope scaling ({scaling or 'rope_freqs'}), which minivllm does not "
                         "read from GGUF files: load the model's Hugging Face directory instead.")
    if "vocab_size" not in kwargs:  # most files leave it to the token list's length
        tokens = reader.get_field(Keys.Tokenizer.LIST)
        if tokens is None:
            raise ValueError(f"{path!r} has neither {arch}.vocab_size nor a token list: it is not a complete "
                             "GGUF model file.")
        kwargs["vocab_size"] = len(tokens.data)
    return AutoConfig.for_model(
        arch, architectures=[ARCHITECTURES[arch]], **kwargs,
        # The weights are dequantised to float32, so dtype="auto" treats them as a float32
        # checkpoint's (float32 on CPU, bfloat16 on GPUs).
        dtype=torch.float32,
        # No output.weight: the head shares the embedding, as llama.cpp writes tied models.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp gives Llama's q/k projections (its rope pairs adjacent
    dimensions, transformers' pairs the two halves of each head)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str | None:
    module, _, suffix = gguf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{suffix}"
    prefix, _, layer_module = module.rpartition(".")
    if prefix.startswith("blk.") and layer_module in _LAYER_NAMES:
        return f"model.layers.{prefix[4:]}.{_LAYER_NAMES[layer_module]}.{suffix}"
    return None


def gguf_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file, dequantised to float32 and named as in Hugging Face
    checkpoints. Raises ValueError (before yielding any) for a quantisation type that
    minivllm does not dequantise or a tensor it has no place for."""
    reader = _reader(path)
    arch = _architecture(reader, path)
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {path!r} has quantisation type "
                             f"{tensor.tensor_type.name}, which minivllm does not dequantise. Supported: "
                             f"{', '.join(t.name for t in SUPPORTED_TYPES)}: use a file quantised as one of "
                             "these (e.g. Q4_K_M or Q8_0).")
        if _hf_name(tensor.name) is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {path!r} has no place in a "
                             f"{ARCHITECTURES[arch]}: is general.architecture right?")
    num_heads = _field(reader, Keys.Attention.HEAD_COUNT.format(arch=arch))
    num_kv_heads = _field(reader, Keys.Attention.HEAD_COUNT_KV.format(arch=arch)) or num_heads
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type)
        module = tensor.name.rsplit(".", 2)[-2]
        if arch == "llama" and module in ("attn_q", "attn_k"):
            weight = _unpermute(weight, num_heads if module == "attn_q" else num_kv_heads)
        name = _hf_name(tensor.name)
        assert name is not None, "every tensor's name was checked above"
        # A copy: the file is mapped read-only.
        yield name, torch.from_numpy(np.array(weight, dtype=np.float32))
