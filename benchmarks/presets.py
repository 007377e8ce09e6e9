"""Real model shapes (the public config.json files) for benchmarks with random weights
(load_format="dummy"): no machine here reaches a model hub."""

from __future__ import annotations

import shutil
from typing import Any

import transformers

from minivllm.local_models import EOS_TOKEN, build_tokenizer

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
    },
    # 128 experts of which 8 per token: ~30.5 B parameters, ~3.3 B active per token.
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_window_layers": 48,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    },
}
# Qwen3-30B-A3B-FP8's format: float8 weights with 128x128 block scales (the dense layers' and the
# experts'), activations quantised per token and 128 columns at run time; dummy weights, scales 1.
PRESETS["qwen3-30b-a3b-fp8"] = {
    **PRESETS["qwen3-30b-a3b"],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def write_preset(name: str, save_dir: str, tokenizer_dir: str | None = None) -> str:
    """Write a preset's config.json and a tokenizer (no weights: load it with
    load_format="dummy") to save_dir; return save_dir. The tokenizer is the demo one, or
    the one in tokenizer_dir."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}.")
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(save_dir)
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    else:  # its files as they are: a re-save could change them for another transformers' reading
        shutil.copytree(tokenizer_dir, save_dir, dirs_exist_ok=True)
        eos_id = transformers.AutoTokenizer.from_pretrained(save_dir).eos_token_id
    config = dict(PRESETS[name])
    model_type = config.pop("model_type")
    # Stop ids must mean something to the tokenizer that ships with the preset: its EOS (the
    # demo tokenizer's <|endoftext|>; ids past the tokenizer's vocabulary decode to nothing).
    config.update(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    transformers.AutoConfig.for_model(model_type, **config).save_pretrained(save_dir)
    return save_dir
