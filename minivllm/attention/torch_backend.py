"""The reference attention backend: gathers each sequence's pages and runs SDPA.

Plain torch, so it runs on CPU and GPU alike; the Triton kernels are tested against it.
"""

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: an FP8 (e4m3) cache saturates at +-448 (e4m3 has no
    infinity; a plain cast would give NaN), then rounds."""
    if cache_dtype == torch.float8_e4m3fn:
        limit = torch.finfo(cache_dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(cache_dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's K and V [N, Hkv, D] into their cache slots (slot < 0: not stored). With
    Triton, fused_ops.qk_norm_rope_store does this inside its kernel."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_slots, *k_cache.shape[2:])[slots] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache.view(num_slots, *v_cache.shape[2:])[slots] = to_cache_dtype(value[keep], v_cache.dtype)


class TorchAttentionBackend:
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert meta.seq_lens_cpu is not None and meta.query_start_loc_cpu is not None, \
            "the torch backend needs host lengths (it cannot run inside CUDA graphs)"
        block_size = k_cache.shape[1]
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for b, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[b], starts[b + 1]
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[b, :num_blocks]
            # [seq_len, Hkv, D] -> [Hkv, seq_len, D], in q's dtype (an FP8 cache's values widened)
            k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
            v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
            query = q[q_start:q_end].transpose(0, 1)
            out[q_start:q_end] = _causal_attention(query, k, v, scale).transpose(0, 1)
        return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, Lq, D] holds the last Lq of the Lk positions in k/v [Hkv, Lk, D]."""
    num_q, num_k = q.shape[1], k.shape[1]
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    # Query i sits at position num_k - num_q + i and sees keys up to it.
    q_pos = torch.arange(num_k - num_q, num_k, device=q.device)[:, None]
    mask = torch.arange(num_k, device=q.device)[None, :] <= q_pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
