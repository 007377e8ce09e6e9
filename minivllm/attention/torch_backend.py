"""The reference attention backend: paged attention in plain torch (SDPA).

Plain torch, so it runs on CPU and GPU alike; the Triton kernels are tested against it. Per
layer, `forward` applies the q/k prologue with torch ops, stores K/V (`store_kv`) and attends. A
step's decodes (the one-token sequences that lead the batch) take one SDPA call together,
over their contexts gathered from the cache and padded to the longest. Each prompt chunk
takes a call of its own: its many queries amortise the call, and padding chunks of unequal
lengths to one another would waste work quadratically.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.qk_prologue import QKPrologue


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
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # index_copy_ rather than an indexed assignment (index_put_): the same rows written, at a
    # fraction of the CPU time.
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows = to_cache_dtype(new[keep], cache.dtype)
        if cache.element_size() == 1:  # index_copy_ has no FP8 kernel on CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


@dataclass(frozen=True)
class _Call:
    """One SDPA call: `num_seqs` sequences of `query_len` new tokens each (the decodes, or
    one prompt chunk), query rows q[start:end], contexts padded to `context_len` keys."""

    start: int
    end: int
    num_seqs: int
    query_len: int
    context_len: int
    kv_rows: torch.Tensor  # [num_seqs * Hkv * context_len] rows of the cache viewed as [slots * Hkv, D]
    mask: torch.Tensor  # [num_seqs, 1, query_len, context_len]: the keys each query sees


class TorchAttentionBackend:
    def __init__(self) -> None:
        # The calls of the step being run, planned by its first layer for all of them.
        self._step: tuple[AttentionMetadata, list[_Call]] | None = None
        # K and V gathered for a call, [2, rows, D] in the cache's dtype: one buffer for every
        # call, as fresh buffers of a few MB cost more in page faults than the gather itself.
        self._gathered = torch.empty(2, 0, 0)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, prologue: QKPrologue, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        q, k = prologue.apply_native(positions, q, k)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already stored."""
        assert meta.seq_lens_cpu is not None and meta.query_start_loc_cpu is not None, \
            "the torch backend needs host lengths (it cannot run inside CUDA graphs)"
        if self._step is None or self._step[0] is not meta:
            self._step = meta, _plan(meta, k_cache.shape[1], k_cache.shape[2])
        out = torch.empty_like(q)
        for call in self._step[1]:
            out[call.start:call.end] = self._attend(q, k_cache, v_cache, call, scale)
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, call: _Call,
                scale: float) -> torch.Tensor:
        """Rows q[call.start:call.end] [num_seqs * query_len, Hq, D] attended over their contexts."""
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[2]
        rows = call.kv_rows.numel()
        buffer = self._gathered
        if buffer.shape[1] < rows or (buffer.shape[2], buffer.dtype, buffer.device) != (
                head_dim, k_cache.dtype, k_cache.device):
            buffer = self._gathered = torch.empty(2, max(rows, 2 * buffer.shape[1]), head_dim, dtype=k_cache.dtype,
                                                  device=k_cache.device)
        # [num_seqs, Hkv, context_len, D], in q's dtype (an FP8 cache's values widened)
        k, v = (torch.index_select(cache.view(-1, head_dim), 0, call.kv_rows, out=buffer[i, :rows])
                .view(call.num_seqs, num_kv_heads, call.context_len, head_dim).to(q.dtype)
                for i, cache in enumerate((k_cache, v_cache)))
        queries = q[call.start:call.end]
        if call.query_len == 1:
            # Query head h uses KV head h // group: each KV head's group of query heads goes in
            # as that many query rows, so that the keys are read once per KV head.
            out = F.scaled_dot_product_attention(queries.view(call.num_seqs, num_kv_heads, -1, head_dim), k, v,
                                                 attn_mask=call.mask, scale=scale)
            return out.reshape(-1, num_heads, head_dim)  # (CUDA SDPA may return another layout)
        out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], k, v, attn_mask=call.mask,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def _plan(meta: AttentionMetadata, block_size: int, num_kv_heads: int) -> list[_Call]:
    """The step's SDPA calls: its leading decodes together, then each prompt chunk."""
    qsl = meta.query_start_loc_cpu
    assert qsl is not None, "the torch backend runs eagerly: steps have host copies"
    num_decodes = meta.num_leading_decodes
    spans = [(0, num_decodes)] if num_decodes else []
    spans += [(b, b + 1) for b in range(num_decodes, len(qsl) - 1) if qsl[b + 1] > qsl[b]]
    return [_call(meta, first, last, block_size, num_kv_heads) for first, last in spans]


def _call(meta: AttentionMetadata, first: int, last: int, block_size: int, num_kv_heads: int) -> _Call:
    """The call for sequences first..last-1, which all have the same number of new tokens."""
    qsl, seq_lens_cpu = meta.query_start_loc_cpu, meta.seq_lens_cpu
    assert qsl is not None and seq_lens_cpu is not None, "the torch backend runs eagerly: steps have host copies"
    device = meta.block_tables.device
    query_len = qsl[first + 1] - qsl[first]
    context_len = max(seq_lens_cpu[first:last])
    seq_lens = torch.tensor(seq_lens_cpu[first:last], device=device)[:, None]
    keys = torch.arange(context_len, device=device)
    # Padding keys repeat the sequence's last key: finite values that the mask hides, rather
    # than whatever the cache holds past the context (stale, or never written).
    positions = torch.minimum(keys, seq_lens - 1)
    slots = meta.block_tables[first:last].long().gather(1, positions // block_size) * block_size \
        + positions % block_size
    kv_rows = slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=device)[:, None]
    # A sequence's new tokens are its last: query i sits at position seq_len - query_len + i.
    query_positions = seq_lens - query_len + torch.arange(query_len, device=device)
    return _Call(start=qsl[first], end=qsl[last], num_seqs=last - first, query_len=query_len,
                 context_len=context_len, kv_rows=kv_rows.flatten(),
                 mask=(keys <= query_positions[:, :, None])[:, None])
