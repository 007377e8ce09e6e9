"""Hugging Face architecture name -> model class and flags."""

from collections.abc import Callable

from transformers import PretrainedConfig

from minivllm.models.llama import ArchitectureFlags, LlamaForCausalLM
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM


def _llama_flags(config: PretrainedConfig) -> ArchitectureFlags:
    return ArchitectureFlags(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=False)


def _qwen3_flags(config: PretrainedConfig) -> ArchitectureFlags:
    return ArchitectureFlags(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)


_ARCHITECTURES: dict[str, tuple[type[LlamaForCausalLM], Callable[[PretrainedConfig], ArchitectureFlags]]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, _llama_flags),
    "MistralForCausalLM": (LlamaForCausalLM, _llama_flags),
    "Qwen2ForCausalLM": (LlamaForCausalLM, lambda config: ArchitectureFlags(qkv_bias=True, qk_norm=False)),
    "Qwen3ForCausalLM": (LlamaForCausalLM, _qwen3_flags),
    "Qwen3MoeForCausalLM": (Qwen3MoeForCausalLM, _qwen3_flags),
}

SUPPORTED_ARCHITECTURES = sorted(_ARCHITECTURES)


def build_model(config: PretrainedConfig, max_position: int) -> LlamaForCausalLM:
    """An empty (uninitialised) model for config's architecture, on the default device. Its ops
    take the Triton kernels when built under layers/custom_op.py's use_triton_kernels (then
    with the Triton attention backend), torch's otherwise."""
    architectures = getattr(config, "architectures", None) or []
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and max_position > window:
        raise ValueError(f"This model uses sliding-window attention (window {window}), which minivllm "
                         f"does not implement: set max_model_len <= {window}.")
    for name in architectures:
        if name in _ARCHITECTURES:
            model_class, flags = _ARCHITECTURES[name]
            return model_class(config, flags(config), max_position)
    raise ValueError(f"Model architecture {architectures or '(none in config.json)'} is not supported. "
                     f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.")
