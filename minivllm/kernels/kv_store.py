"""Write the new tokens' K and V into the paged KV cache.

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim];
slot = block_id * block_size + offset. A slot < 0 means "do not store" (padding rows,
tokens whose KV is already cached).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kn, stride_kh,  # key [N, Hkv, D], last dim contiguous
    stride_vn, stride_vh,  # value [N, Hkv, D], last dim contiguous
    stride_cb, stride_cs, stride_ch,  # cache: block, offset in block, head (same for K and V)
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    # One program per token: it moves Hkv * D contiguous-ish elements for K and for V.
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)  # int64 offsets: caches can exceed 2**31 elements
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    tok64 = tok.to(tl.int64)  # N * stride can exceed 2**31 for large batches of wide heads
    k = tl.load(key_ptr + tok64 * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vn + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    # tl.store casts to the cache's element type, so a cache dtype other than the
    # activations' (e.g. fp16 activations into an fp32 cache in tests) works.
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache[slot // bs, slot % bs] = key/value[i] for each i with slot_mapping[i] >= 0.

    key, value: [N, Hkv, D] (any row/head strides, last dim contiguous);
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] with identical strides;
    slot_mapping: [N] int64 (int32 accepted). No host synchronisation (graph-capturable).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        "k_cache and v_cache must have the same shape and strides")
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} does not match key heads/dim {(num_kv_heads, head_dim)}")
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1, (
        "the head_dim axis must be contiguous")
    assert slot_mapping.shape == (num_tokens,), (
        f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
