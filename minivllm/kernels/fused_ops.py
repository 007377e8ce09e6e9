"""Triton kernels for the small per-token ops of a decoder layer: RMSNorm (optionally fused
with the residual add before it); the attention inputs (Qwen3's per-head q/k RMSNorm,
neox-style rotary embedding and the KV-cache store, in one kernel); and SiluAndMul.

Each kernel reproduces the rounding of the torch code in minivllm/layers (norm.py,
rotary.py, activation.py), so swapping one for the other changes no token:

* RMSNorm: residual add in the model dtype; sum of squares, mean and reciprocal square
  root in float32; the normalised row rounded to the model dtype, then multiplied by the
  weight and rounded again (Hugging Face's order). The summation order (and torch's
  CUDA rsqrt) differ, so float32 results agree to a few ulps; in 16 bits nearly every
  element is bit-identical and the rest are an ulp or two off.
* Rotary: cos/sin rounded to the model dtype first, then x*cos and rotate_half(x)*sin
  each rounded to the model dtype and added, as eager torch's three separate ops do:
  bit-identical in every dtype (FMA contraction is disabled for it).
* SiluAndMul: silu(gate) rounded to the model dtype, then times up, rounded again; exp
  is CUDA's expf (libdevice), as torch's, so results should be bit-identical on GPU.

All are memory-bound: they read and write each element once and keep whole rows in
registers. None synchronises with the host, so all can be captured in a CUDA graph
(the first call for a new shape compiles, so warm up before capturing). Inputs must have
their last dimension contiguous; row (and head) strides are free, so views such as the
q/k slices of a packed qkv tensor need no copy. Activations and weights share one dtype
(float32, float16 or bfloat16).
"""

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import cdiv, next_power_of_2, silu_times_up
from minivllm.kernels.pdl import pdl_options, wait_for_previous_kernel
from minivllm.kernels.split_k import SplitKPartials

FP8_E4M3_MAX = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)  # 448


# ----------------------------------------------------------------------------------------
# RMSNorm (+ residual add)
# ----------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    num_rows,
    stride_xn, stride_xh,  # x viewed as [N, INNER, HIDDEN]: row r is (r // INNER, r % INNER)
    stride_rn, stride_rh,  # the same for residual (unused without one)
    stride_xp,  # x as partial sums: the stride from one part to the next
    eps,
    INNER: tl.constexpr,  # 1 for [N, H] inputs, the number of heads for [N, heads, D]
    HIDDEN: tl.constexpr,  # constexpr: a norm has one or two sizes, and masks then fold away
    HAS_RESIDUAL: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # > 0: x is the sum of this many fp32 parts (SplitKPartials), in order
    BLOCK_M: tl.constexpr,  # rows per program (several when rows are short, e.g. per-head norms)
    BLOCK_H: tl.constexpr,  # HIDDEN rounded up to a power of two
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: N * stride may pass 2**31
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < HIDDEN
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    n, h = rows // INNER, rows % INNER
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
    wait_for_previous_kernel(PDL)

    x_offs = (n * stride_xn + h * stride_xh)[:, None] + cols[None, :]
    if NUM_PARTS == 0:
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    else:  # the matmul's output as skinny_matmul would have stored it: fp32 sum in part order, rounded
        x_sum = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for part in tl.static_range(NUM_PARTS):
            x_sum += tl.load(x_ptr + part * stride_xp + x_offs, mask=mask, other=0.0)
        x = x_sum.to(dtype)
    if HAS_RESIDUAL:
        r_offs = (n * stride_rn + h * stride_rh)[:, None] + cols[None, :]
        r = tl.load(residual_ptr + r_offs, mask=mask, other=0.0)
        # torch's `x + residual`: exact in float32, one rounding to the model dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + r_offs, x, mask=mask)  # the new residual, in place

    x32 = x.to(tl.float32)
    # Correctly rounded division and square root, as torch's mean and (CPU) rsqrt; the
    # approximate defaults would cost an ulp or two for nothing in a memory-bound kernel.
    mean_sq = tl.math.div_rn(tl.sum(x32 * x32, axis=1), tl.full([BLOCK_M], HIDDEN, tl.float32))
    rstd = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
    normed = (x32 * rstd[:, None]).to(dtype)  # Hugging Face rounds before scaling by the weight
    out = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out, mask=mask)


def _norm_launch_config(hidden: int, num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps): about 1K+ elements per program, 8+ per thread.

    Rows shorter than 1024 are batched so that a program still moves a few KB (per-head
    norms have head_dim 128); wide rows get more warps so each thread keeps few registers.
    """
    block_h = next_power_of_2(hidden)
    block_m = min(max(1, 1024 // block_h), next_power_of_2(num_rows))
    elems = block_m * block_h
    num_warps = 4 if elems < 2048 else 8 if elems < 8192 else 16
    return block_m, block_h, num_warps


def _as_3d(t: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(N, inner, stride_n, stride_inner) of a [N, H] or [N, inner, H] tensor."""
    assert t.dim() in (2, 3), f"{name} must be [N, H] or [N, heads, H], got {tuple(t.shape)}"
    assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}'s last dimension must be contiguous"
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _rms_norm(x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    num_parts = stride_xp = 0
    shape: tuple[int, ...]
    if isinstance(x, SplitKPartials):
        num_parts, stride_xp = x.parts.shape[0], x.parts.stride(0)
        dtype, shape = x.dtype, (x.num_rows, x.parts.shape[2])
        x = x.parts[0, :x.num_rows]  # the launch's x: part 0, as an [N, H] input
    else:
        dtype, shape = x.dtype, x.shape
    hidden = shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous(), (
        f"weight must be a contiguous [{hidden}] tensor, got {tuple(weight.shape)}")
    assert weight.dtype == dtype, f"weight dtype {weight.dtype} differs from input dtype {dtype}"
    assert dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {dtype}"
    n, inner, sxn, sxh = _as_3d(x, "x")
    srn = srh = 0
    if residual is not None:
        assert residual.shape == shape and residual.dtype == dtype, (
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(shape)} {dtype}")
        _, _, srn, srh = _as_3d(residual, "residual")
    out = torch.empty(shape, dtype=dtype, device=x.device)  # contiguous whatever x's strides
    num_rows = n * inner
    if num_rows == 0:
        return out
    block_m, block_h, num_warps = _norm_launch_config(hidden, num_rows)
    _rms_norm_kernel[(cdiv(num_rows, block_m),)](
        x, residual if residual is not None else x, weight, out,
        num_rows, sxn, sxh, srn, srh, stride_xp, eps,
        INNER=inner, HIDDEN=hidden, HAS_RESIDUAL=residual is not None, NUM_PARTS=num_parts,
        BLOCK_M=block_m, BLOCK_H=block_h, **pdl_options(x.device),
        num_warps=num_warps,
        enable_fp_fusion=False,  # torch rounds x*x before summing; an FMA would not
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: `RMSNorm.forward_native(x)` of minivllm/layers/norm.py.

    x: [N, H] or [N, heads, H] (per-head norms such as Qwen3's q/k norm), last dimension
    contiguous, other strides free; weight: [H], x's dtype. Returns a new contiguous
    tensor shaped like x; x is not modified.
    """
    return _rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward_native(x, residual)`: s = x + residual; return (rms_norm(s), s).

    IN PLACE: s is written into `residual`, and the returned second element IS `residual`
    (no new allocation for the residual stream). x is not modified; the normed output is a
    new contiguous tensor. Shapes as rms_norm; residual has x's shape and dtype. x may be a
    row-parallel projection's unreduced SplitKPartials: the kernel adds its parts up first.
    """
    out = _rms_norm(x, residual, weight, eps)
    return out, residual


# ----------------------------------------------------------------------------------------
# Attention inputs: q/k per-head RMSNorm (Qwen3), rotary embedding (neox style: rotate_half
# pairs element d with d + D/2), and the KV-cache store, in one kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _first_halves(stride_h, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Offsets [BLOCK_HEADS, BLOCK_HALF] of one token's heads' first halves (the second
    halves are HALF further), and their mask."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    return heads * stride_h + d, (heads < NUM_HEADS) & (d < HALF)


@triton.jit
def _load_halves(ptr, stride_h, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's [NUM_HEADS, 2 * HALF] heads as their two halves (model dtype)."""
    offs, mask = _first_halves(stride_h, NUM_HEADS, HALF, BLOCK_HEADS, BLOCK_HALF)
    return tl.load(ptr + offs, mask=mask, other=0.0), tl.load(ptr + offs + HALF, mask=mask, other=0.0)


@triton.jit
def _store_halves(ptr, stride_h, x1, x2, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs, mask = _first_halves(stride_h, NUM_HEADS, HALF, BLOCK_HEADS, BLOCK_HALF)
    tl.store(ptr + offs, x1, mask=mask)
    tl.store(ptr + offs + HALF, x2, mask=mask)


@triton.jit
def _to_cache_dtype(x, cache_ptr, FP8_CACHE: tl.constexpr):
    """x in the cache's element type: for an FP8 (e4m3) cache saturated at its largest
    finite value, +-448, as torch's reference store does (e4m3 has no infinity)."""
    if FP8_CACHE:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _head_rms_norm(x1, x2, weight_ptr, eps, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """RMSNorm of each head (row) over both halves, rounded as _rms_norm_kernel rounds."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    sum_sq = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
    mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, 2 * HALF, tl.float32))
    rstd = tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))[:, None]
    d = tl.arange(0, BLOCK_HALF)
    w1 = tl.load(weight_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    out1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)
    out2 = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _rotate(x1, x2, cos1, cos2, sin1, sin2):
    """Neox RoPE of [heads, HALF] halves; cos*/sin* are float32 [1, HALF] (already rounded
    to the model dtype). torch computes x * cos + cat([-x2, x1]) * sin with each product
    and the sum rounded to the model dtype (separate eager ops); a product of two bf16/fp16
    values is exact in float32, so computing it there and rounding once matches bit for bit."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    out1 = (a * cos1).to(dtype).to(tl.float32) - (b * sin1).to(dtype).to(tl.float32)
    out2 = (b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _norm_rope_heads(ptr, stride_h, norm_weight_ptr, eps, cos1, cos2, sin1, sin2,
                     NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """One token's q or k heads, RMSNormed per head (if QK_NORM) and rotated, as two halves."""
    x1, x2 = _load_halves(ptr, stride_h, NUM_HEADS, HALF, BLOCK_HEADS, BLOCK_HALF)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, norm_weight_ptr, eps, HALF, BLOCK_HALF)
    return _rotate(x1, x2, cos1, cos2, sin1, sin2)


@triton.jit
def _qk_norm_rope_store_token(
    tok, positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cp, stride_cs,
    stride_cb, stride_co, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr, WAIT: tl.constexpr,
):
    """Token tok's share of the kernel: its q heads (program_id(1) == 0) or its k and v."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    row = cos_sin_ptr + pos * stride_cp
    # Both halves are read (not assumed equal) so any [max_pos, 2, D] table works; cos/sin
    # are rounded to the model dtype first, as `cos_sin.to(q.dtype)` does.
    dtype = q_ptr.dtype.element_ty
    cos1 = tl.load(row + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    cos2 = tl.load(row + HALF + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin1 = tl.load(row + stride_cs + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin2 = tl.load(row + stride_cs + HALF + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)  # int64: caches can pass 2**31 elements
    wait_for_previous_kernel(WAIT)  # positions, cos/sin and slots are the step's inputs; q, k, v are not

    if tl.program_id(1) == 0:
        q1, q2 = _norm_rope_heads(q_ptr + tok * stride_qn, stride_qh, q_weight_ptr, eps, cos1, cos2, sin1, sin2,
                                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, QK_NORM)
        _store_halves(q_ptr + tok * stride_qn, stride_qh, q1, q2, NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    elif slot >= 0:  # < 0: stored nowhere (a graph's padding tokens, warm-up steps)
        k1, k2 = _norm_rope_heads(k_ptr + tok * stride_kn, stride_kh, k_weight_ptr, eps, cos1, cos2, sin1, sin2,
                                  NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, QK_NORM)
        v1, v2 = _load_halves(v_ptr + tok * stride_vn, stride_vh, NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
        k1, k2 = _to_cache_dtype(k1, k_cache_ptr, FP8_CACHE), _to_cache_dtype(k2, k_cache_ptr, FP8_CACHE)
        v1, v2 = _to_cache_dtype(v1, v_cache_ptr, FP8_CACHE), _to_cache_dtype(v2, v_cache_ptr, FP8_CACHE)
        _store_halves(k_cache_ptr + dst, stride_ch, k1, k2, NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF)
        _store_halves(v_cache_ptr + dst, stride_ch, v1, v2, NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF)


@triton.jit(do_not_specialize=["num_tokens"])
def _qk_norm_rope_store_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    eps,
    num_tokens,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cp, stride_cs,  # cos_sin [max_pos, 2, D]: position, cos/sin
    stride_cb, stride_co, stride_ch,  # cache [blocks, block_size, Hkv, D]: block, offset, head
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    QK_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    # Two programs per TOKENS_PER_PROGRAM tokens: one for the q heads, one for k and v (a
    # decode step's latency is then two short chains side by side rather than one long one);
    # q, k and v are each read once and q written once, k and v go straight to the cache.
    # Several tokens a program spare a prompt step's tens of thousands of tiny programs
    # their launch costs.
    for i in tl.static_range(TOKENS_PER_PROGRAM):
        tok = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM + i  # int64: N * stride can pass 2**31
        if tok < num_tokens:
            _qk_norm_rope_store_token(
                tok, positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
                k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cp, stride_cs,
                stride_cb, stride_co, stride_ch,
                NUM_Q_HEADS, NUM_KV_HEADS, HALF, BLOCK_HALF, BLOCK_HQ, BLOCK_HKV, BLOCK_SIZE, QK_NORM,
                FP8_CACHE, PDL and i == 0)


# Launches of more tokens than this (prompt steps) give each program QK_TOKENS_PER_PROGRAM.
QK_ONE_TOKEN_MAX_TOKENS = 1024
QK_TOKENS_PER_PROGRAM = 4


def qk_tokens_per_program(num_tokens: int) -> int:
    """Tokens each program of qk_norm_rope_store takes: one for decode-sized launches (the
    shortest chain), several for prompt steps."""
    return 1 if num_tokens <= QK_ONE_TOKEN_MAX_TOKENS else QK_TOKENS_PER_PROGRAM


def _qk_num_warps(block_hq: int, head_dim: int) -> int:
    # Qwen3-0.6B: 16 q heads x 128 = 2K elements per token -> 4 warps, 16 B per thread-load.
    return 4 if block_hq * head_dim <= 4096 else 8


def qk_norm_rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """A decoder layer's attention inputs in one kernel, per token: optionally RMSNorm of
    every q and k head (Qwen3's q_norm/k_norm: pass both weights), neox-style RoPE on q and
    k (`RotaryEmbedding.forward` of minivllm/layers/rotary.py), and the new K and V into the
    paged cache (`store_kv` of minivllm/attention/torch_backend.py; slot < 0: not stored;
    an FP8 cache gets the values saturated to +-448, then rounded).

    positions [N] int64 (int32 accepted), each < max_pos (not checked: that would sync);
    q [N, Hq, D], k and v [N, Hkv, D], one dtype, last dimension contiguous (row and head
    strides free: views into a packed qkv tensor need no copy); cos_sin [max_pos, 2, D]
    float32; k_cache/v_cache [num_blocks, block_size, Hkv, D] with identical strides;
    slot_mapping [N] int64. IN PLACE: q is overwritten with its normed, rotated values and
    returned; k and v are left as they are (the rotated K lives in the cache only).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.dim() == 3 and k.shape == v.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"q, k and v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, (
        "q, k and v must have a contiguous last dimension")
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,), (
        f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be ({num_tokens},)")
    assert cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, head_dim) and cos_sin.stride(-1) == 1, (
        f"cos_sin must be [max_pos, 2, {head_dim}] with a contiguous last dimension, got {tuple(cos_sin.shape)}")
    assert cos_sin.dtype == torch.float32, f"cos_sin must be float32, got {cos_sin.dtype}"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        "k_cache and v_cache must have the same shape and strides")
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1, (
        f"cache {tuple(k_cache.shape)} does not match the key heads/dim {(num_kv_heads, head_dim)}")
    qk_norm = q_norm_weight is not None
    assert qk_norm == (k_norm_weight is not None), "pass both q and k norm weights, or neither"
    if q_norm_weight is not None and k_norm_weight is not None:  # qk_norm
        for w in (q_norm_weight, k_norm_weight):
            assert w.shape == (head_dim,) and w.is_contiguous() and w.dtype == q.dtype, (
                f"norm weights must be contiguous [{head_dim}] tensors of q's dtype")
    if num_tokens == 0:
        return q
    half = head_dim // 2
    block_hq = next_power_of_2(num_q_heads)
    tokens_per_program = qk_tokens_per_program(num_tokens)
    _qk_norm_rope_store_kernel[(cdiv(num_tokens, tokens_per_program), 2)](
        positions, q, k, v, cos_sin,
        q_norm_weight if qk_norm else q, k_norm_weight if qk_norm else q,  # (placeholders without norms)
        k_cache, v_cache, slot_mapping,
        eps,
        num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), cos_sin.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        HALF=half, BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=block_hq, BLOCK_HKV=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
        QK_NORM=qk_norm,
        FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn,
        TOKENS_PER_PROGRAM=tokens_per_program,
        **pdl_options(q.device),
        num_warps=_qk_num_warps(block_hq, head_dim),
        enable_fp_fusion=False,  # keeps torch's separately rounded products (RoPE, norm)
    )
    return q


# ----------------------------------------------------------------------------------------
# SiluAndMul
# ----------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xn, inter,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    # Grid (rows, column blocks): even one decode token spreads over several SMs.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    wait_for_previous_kernel(PDL)
    gate = tl.load(x_ptr + row * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xn + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, silu_times_up(gate, up, dtype), mask=mask)


def _silu_launch_config(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps): 1024 columns at 4 warps = 8 bf16 per thread, one 16-byte load per
    operand; I = 3072 then gives 3 programs per token, so even small batches fill the SMs."""
    return min(1024, next_power_of_2(inter)), 4


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [N, 2I] (last dimension contiguous) -> new [N, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [N, 2I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "x's last dimension must be contiguous"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter == 0:
        return out
    block, num_warps = _silu_launch_config(inter)
    _silu_and_mul_kernel[(num_tokens, cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block,
        **pdl_options(x.device), num_warps=num_warps)
    return out
