"""Attention layer: stores this step's K/V in the paged cache and attends over it, through a
backend (torch or Triton) that also applies the layer's q/k prologue (norms, RoPE)."""

from typing import Protocol

import torch
from torch import nn

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.qk_prologue import QKPrologue


class AttentionBackend(Protocol):
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, prologue: QKPrologue, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]: the prologue applied to q and k, k and v
        stored at meta.slot_mapping, q attended over the cache. May overwrite q."""
        ...


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 prologue: QKPrologue) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.prologue = prologue
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] as projected (before the prologue) -> [N, Hq, D]. May
        overwrite q."""
        assert self.backend is not None, "KV cache not bound: ModelRunner allocates it"
        return self.backend.forward(positions, q, k, v, self.k_cache, self.v_cache, self.prologue, meta,
                                    self.scale)
