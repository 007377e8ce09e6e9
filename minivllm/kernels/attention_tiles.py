"""What the paged-attention kernels share: reading K/V tiles from the paged cache (FP8 ones
widened on the way), the inner loop over them, and the host side's input checks and launch
options.

The mixed kernel (mixed_attention.py: prompt chunks and decodes) and the split-KV decode
kernel (decode_attention.py; also the prefix launch of cascade_attention.py's shared-prefix
decode) run one inner loop, `attend_kv_tiles`: for each tile of keys, the scores, an online
softmax update and the weighted sum of values, all accumulated in fp32. The cascade's own-keys
kernel runs the same steps over tiles of several KV heads, its FP8 value tiles loaded as here.

Layout (see minivllm/attention/metadata.py): k_cache, v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; token t of sequence b lives in block
block_tables[b, t // block_size] at offset t % block_size. K/V tiles are gathered token by
token (each token looks up its block id), which makes BLOCK_N independent of block_size.
The cache holds q's dtype, or float8 e4m3 (an FP8 KV cache, half the bytes to read): its
tiles are widened in registers right after the load, to the dtype the dots run in
(`dot_dtype`: fp16 under bf16 queries, see there).
"""

from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import E4M3_WORD_TO_FP16_PTX, INTERPRETED, dot_precision
from minivllm.kernels.pdl import pdl_options

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is the native instruction)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """The dtype of the kernels' tl.dot inputs (the query tile, the K/V tiles, the softmax
    weights); accumulation is always fp32. q's own dtype, except that an FP8 cache under
    bf16 queries runs in fp16: Hopper widens e4m3 to fp16 in one instruction per pair but
    to bf16 only through fp16 (three), enough to make the conversion, not memory, the
    decode kernel's limit. fp16 holds every e4m3 value exactly and has the finer mantissa;
    queries must stay below its 65,504 range, which normed attention queries do by far."""
    if cache_dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16:
        return tl.float16
    return _TL_DTYPES[q_dtype]


@triton.jit
def _e4m3_bits_to_f16(b):
    # An e4m3 byte (in an int32) as fp16: sign, exponent and mantissa moved into fp16's places
    # give the value / 256 (exponent biases 7 and 15; subnormals included), so scale back.
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def load_e4m3_value_tile(ptr, row_offs, row_valid, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    """A [ROWS, HEAD_DIM] tile of an FP8 (e4m3) cache, rows at element offsets row_offs,
    widened to fp16. For the value tile of P @ V: the dot reads V along its rows, and
    Hopper has no transposing shared-memory load for 8-bit data, so a plain fp8 load would
    be read back from shared memory a byte at a time. Loaded as 4-byte words and widened
    in registers, the fp16 tile goes through the transposing 16-bit load instead. Its columns
    come in value_column_order (the caller's P @ V then has its columns in that order too).
    Rows with row_valid False read zeros (if MASK)."""
    words_ptr = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    offs_w = tl.arange(0, HEAD_DIM // 4)
    ptrs = words_ptr + (row_offs // 4)[:, None] + offs_w[None, :]  # rows start 4-byte aligned (D >= 16)
    if MASK:
        w = tl.load(ptrs, mask=row_valid[:, None], other=0)
    else:
        w = tl.load(ptrs)
    if INTERPRETED:  # inline PTX does not run in Triton's interpreter
        b0 = _e4m3_bits_to_f16(w & 0xFF)
        b1 = _e4m3_bits_to_f16((w >> 8) & 0xFF)
        b2 = _e4m3_bits_to_f16((w >> 16) & 0xFF)
        b3 = _e4m3_bits_to_f16((w >> 24) & 0xFF)
    else:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm=E4M3_WORD_TO_FP16_PTX,
            constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    # join adds a last axis: [.., 2] of (b0, b2) then of that and (b1, b3) gives b0 b1 b2 b3.
    v = value_column_order(tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (ROWS, HEAD_DIM)), ROWS, HEAD_DIM)
    if INTERPRETED:
        return v
    # Triton picks a mma.sync dot's operand layout (the decode kernels') from what its inputs
    # were loaded as, and takes the joins above for a sub-16-bit load: the P @ V dot's kWidth
    # would be 4, whose transposing loads of this tile conflict in shared memory (two
    # wavefronts each instead of one). An impure identity hides the chain, and the
    # dot takes the plain fp16 layout (kWidth 2); ptxas drops the mov.
    return tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[v], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def value_column_order(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """x's columns reordered: d = 16 j + 8 h + e goes to (HEAD_DIM / 2) h + 8 j + e (HEAD_DIM // 16
    groups j of two halves h). A thread holds 16 consecutive columns of a widened FP8 tile;
    stored as they are, the first 16-byte stores of 8 neighbouring threads would meet only
    every other 16-byte bank group, each twice (2-way bank conflicts); reordered, they meet
    each once. dim_order undoes it."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, HEAD_DIM // 16, 2, 8)), (0, 2, 1, 3)), (ROWS, HEAD_DIM))


@triton.jit
def dim_order(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The inverse of value_column_order."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, 2, HEAD_DIM // 16, 8)), (0, 2, 1, 3)), (ROWS, HEAD_DIM))


@triton.jit
def attend_kv_tiles(
    acc, l_i, m_i,  # running output [M, D] (unnormalised), softmax denominator [M], row max [M]
    q,  # [M, D] query tile
    k_cache_ptr, v_cache_ptr,
    block_table_ptr,  # this sequence's row of block_tables
    kv_head_off,  # kv_head * stride of the head axis
    tile_begin, tile_end,  # key tiles [tile_begin, tile_end), BLOCK_N keys each
    kv_len,  # keys at positions >= kv_len are not attended (and not read)
    q_pos,  # [M] position of each query row (used when CAUSAL)
    scale_log2,  # softmax scale * log2(e)
    stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_KV: tl.constexpr,  # tiles may reach past kv_len: mask loads and scores
    CAUSAL: tl.constexpr,  # tiles may hold keys after some query row: causal mask
    DOT_PRECISION: tl.constexpr,
):
    # The whole loop is one helper (not one call per tile) because Triton's interpreter
    # pays a large fixed cost for every call of a jitted function; compiled, it is inlined.
    offs_d = tl.arange(0, HEAD_DIM)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:  # value tiles come in value_column_order
        acc = value_column_order(acc, acc.shape[0], HEAD_DIM)
    for t in range(tile_begin, tile_end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_valid = offs_n < kv_len
        # Each token looks up its page; tokens of one page repeat the same id (an L1 hit).
        if MASK_KV:
            block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=kv_valid, other=0)
        else:
            block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
        # int64: block_id * stride_cb can pass 2**31 elements in a large cache.
        kv_offs = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_off
        kv_ptrs = kv_offs[:, None] + offs_d[None, :]
        if MASK_KV:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_ptrs)
        k = k.to(q.dtype)  # an FP8 cache's tile (q is in the dots' dtype); a no-op otherwise

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N], base 2
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & kv_valid[None, :], s, float("-inf"))
        elif MASK_KV:
            s = tl.where(kv_valid[None, :], s, float("-inf"))

        # Online softmax. m_i starts at a finite -1e30 rather than -inf, so a row whose keys
        # are all masked so far keeps alpha = exp2(0) = 1 and p = 0 instead of NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
            v = load_e4m3_value_tile(v_cache_ptr, kv_offs, kv_valid, BLOCK_N, HEAD_DIM, MASK_KV).to(q.dtype)
        else:
            if MASK_KV:
                v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
            else:
                v = tl.load(v_cache_ptr + kv_ptrs)
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = dim_order(acc, acc.shape[0], HEAD_DIM)
    return acc, l_i, m_i


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor) -> tuple[int, int, int, int]:
    """Assert what every attention kernel needs of its operands. Returns (Hq, Hkv, D, block_size)."""
    assert q.dim() == 3, f"q must be [N, Hq, D], got shape {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides"
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two >= 16 (64, 128, 256...), got {head_dim}")
    assert block_size >= 8 and block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two >= 8, got {block_size}")
    assert num_q_heads % num_kv_heads == 0, (
        f"query heads {num_q_heads} must be a multiple of KV heads {num_kv_heads}")
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn), (
        f"the KV cache ({k_cache.dtype}, {v_cache.dtype}) must hold q's dtype ({q.dtype}) or float8_e4m3fn")
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "the head_dim axis must be contiguous"
    assert block_tables.dtype == torch.int32, "block_tables must be int32"
    return num_q_heads, num_kv_heads, head_dim, block_size


def launch_options(q: torch.Tensor, k_cache: torch.Tensor, num_warps: int, num_stages: int) -> dict[str, Any]:
    """The keyword arguments every attention launch ends with: the dots' dtype and precision,
    PDL, and the tiles' warps and stages."""
    return dict(DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype), DOT_PRECISION=dot_precision(q.dtype),
                **pdl_options(q.device), num_warps=num_warps, num_stages=num_stages)
