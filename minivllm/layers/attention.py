"""Attention layer: stores this step's K/V in the paged cache, then attends through a backend."""

from typing import Protocol

import torch
from torch import nn

from minivllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
        assert self.backend is not None, "KV cache not bound: ModelRunner allocates it"
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already stored."""
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)
