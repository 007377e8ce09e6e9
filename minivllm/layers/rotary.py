"""Rotary position embedding (neox style), with the scaling variants transformers knows."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# These depend on the sequence length at run time, which a fixed cos/sin table cannot express.
_UNSUPPORTED_ROPE_TYPES = {"dynamic", "longrope"}


def rope_parameters(config: PretrainedConfig) -> dict:
    """rope_type and rope_theta (+ scaling fields), for transformers 4.x and 5.x configs alike."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    cos_sin: torch.Tensor  # a buffer (register_buffer below), typed for readers of it

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type in _UNSUPPORTED_ROPE_TYPES or (rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS):
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, "
                             f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - _UNSUPPORTED_ROPE_TYPES))}.")
        # Computed on the CPU, as Hugging Face computes it, whatever the default device.
        cpu = torch.device("cpu")
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=cpu) / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu)
        freqs = torch.arange(max_position, dtype=torch.float, device=cpu)[:, None] * inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        # [max_position, 2, head_dim]: cos and sin per position, kept in float32.
        cos_sin = torch.stack([angles.cos() * scaling, angles.sin() * scaling], 1)
        self.register_buffer("cos_sin", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k [N, Hkv, D] -> rotated (same dtype). With Triton the attention
        layer fuses this into one kernel (fused_ops.qk_norm_rope_store)."""
        cos_sin = self.cos_sin[positions]
        cos, sin = cos_sin[:, 0, None, :].to(q.dtype), cos_sin[:, 1, None, :].to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
