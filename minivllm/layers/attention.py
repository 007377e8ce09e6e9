"""Attention layer: attends over the paged KV cache through a backend (torch or Triton)."""

from typing import Protocol

import torch
from torch import nn

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import store_kv


class AttentionBackend(Protocol):
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
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]: stores k and v in the cache (the
        torch way), then attends."""
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already stored."""
        assert self.backend is not None, "KV cache not bound: ModelRunner allocates it"
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)
