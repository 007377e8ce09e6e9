"""What a decoder layer applies to q and k between its projection and attention: optionally
RMSNorm of every q and k head (Qwen3's q_norm/k_norm), then neox-style RoPE.

The attention backend applies it as it stores K/V and attends: the torch backend with the
layers' own torch ops, the Triton backend in the one kernel that also stores K/V
(fused_ops.qk_norm_rope_store). The prologue holds the modules that own the weights and
the cos/sin table, not the tensors, since moving a module (.to()) replaces its buffers.
"""

from dataclasses import dataclass
from typing import Protocol

import torch


class Rotary(Protocol):
    """Neox-style RoPE with a cos/sin table (layers/rotary.py's RotaryEmbedding)."""

    @property
    def cos_sin(self) -> torch.Tensor:
        """[max_position, 2, head_dim] float32: cos and sin per position."""
        ...

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D] and k [N, Hkv, D] rotated, in torch."""
        ...


class HeadNorm(Protocol):
    """An RMSNorm over the last dimension (layers/norm.py's RMSNorm, built for head_dim)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x normed in torch."""
        ...


@dataclass(frozen=True)
class QKPrologue:
    rotary: Rotary
    norms: tuple[HeadNorm, HeadNorm] | None = None  # q's and k's, or none

    def __post_init__(self) -> None:
        if self.norms is not None:
            q_norm, k_norm = self.norms
            assert q_norm.eps == k_norm.eps, "q and k norms must share eps (the fused kernel takes one)"

    def apply_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D] and k [N, Hkv, D] normed and rotated by torch ops (new tensors)."""
        if self.norms is not None:
            q_norm, k_norm = self.norms
            q, k = q_norm.norm(q), k_norm.norm(k)
        return self.rotary(positions, q, k)

    def norm_args(self) -> tuple[torch.Tensor, torch.Tensor, float] | tuple[()]:
        """fused_ops.qk_norm_rope_store's optional arguments: the q and k norm weights and
        their eps, or none."""
        if self.norms is None:
            return ()
        q_norm, k_norm = self.norms
        return q_norm.weight, k_norm.weight, q_norm.eps
