"""Mixture-of-experts MLP in Triton: each token through its top-k experts, weighted and summed.

Three launches and a sum, all on the device with no host synchronisation, and with launch
grids that depend only on tensor shapes, so that decode steps can be captured in CUDA graphs:

1. `moe_align` (one program per expert) groups the T * k (token, slot) pairs by expert:
   `sorted_slots` lists each expert's slots (slot = t * k + j), its group padded with the
   sentinel T * k to a multiple of BLOCK_M; `expert_ids` gives each BLOCK_M-row block its
   expert; `num_padded` (one element) is where the groups end. The buffers are sized for
   the worst case, T * k + min(T * k, E) * (BLOCK_M - 1) rows (at most that many experts
   get a padded group), so their size never depends on routing, and a decode step's grid
   has few row blocks beyond those in use.
2. Grouped GEMM 1 (`_grouped_gemm_kernel`, GATED): one program per (row block, BLOCK_N
   columns of the intermediate): gathers its tokens' rows of `hidden`, multiplies them by
   the expert's gate rows and the matching up rows at once (two accumulators), and stores
   silu(gate) * up per slot: an intermediate [T * k, I].
3. Grouped GEMM 2 (the same kernel, ROUTED): intermediate rows @ down^T, times the routing
   weight (fp32), stored per slot: [T * k, H].
4. The k slots of each token are summed ([T, k, H] -> [T, H]).

Blocks past `num_padded` return at once; an expert no token picked costs nothing. Products
accumulate in fp32; the intermediate and the per-slot outputs are rounded to the activation
dtype once each (as vLLM does; HF rounds after every matmul).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import cdiv, dot_precision, next_power_of_2

# Tiles by batch size: the first entry whose bound is >= T (the number of tokens), for
# Qwen3-30B-A3B on an H200 (E=128, H=2048, I=768, k=8, bf16); `python -m
# benchmarks.kernels.fused_moe --sweep` times candidates at each T and prints the fastest.
# Each expert gets about T * k / E rows, so small batches use 16-row blocks (tl.dot's
# smallest) and stream each hit expert's weights once, larger ones taller blocks that reuse
# each weight tile over more rows. GROUP_M: row blocks that walk the columns together, so
# their expert's weight tiles are read from L2. At the T values the sweep timed (1, 16, 64,
# 256, 1,024, 4,096, 8,192) each entry is the fastest tile or within 1 % of it, except at
# T = 1,024: its entry takes 64-row blocks (a little slower there than 128 rows, figures in
# benchmarks/RESULTS.md) so that the smaller batches it also serves are padded less. The
# bounds between those T values are a choice; the benchmark also times T = 128 and 512 to
# check them.
CONFIGS: dict[int, dict[str, int]] = {
    32: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    128: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4),
    256: dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    1024: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    1 << 62: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
}


def fused_moe_config(num_tokens: int, dtype: torch.dtype) -> dict[str, int]:
    """The CONFIGS entry for a batch of num_tokens tokens (tile_config)."""
    return tile_config(CONFIGS, num_tokens, dtype)


def tile_config(table: dict[int, dict[str, int]], rows: int, dtype: torch.dtype) -> dict[str, int]:
    """The entry of table (bounds -> tiles) for rows: the first whose bound is >= rows; for
    4-byte inputs with half the BLOCK_K, so that the pipeline's buffers keep their size in
    shared memory."""
    cfg = next(cfg for bound, cfg in table.items() if rows <= bound)
    return cfg if dtype.itemsize == 2 else {**cfg, "BLOCK_K": cfg["BLOCK_K"] // 2}


@triton.jit(do_not_specialize=["num_slots"])  # one compilation for every batch size
def _moe_align_kernel(
    ids_ptr,  # [num_slots] expert id of each (token, slot), flattened
    sorted_ptr,  # out: slots grouped by expert, each group padded to a multiple of BLOCK_M
    expert_ids_ptr,  # [blocks] out: expert of each BLOCK_M block (blocks < num_padded / BLOCK_M)
    num_padded_ptr,  # [1] out: rows of sorted_ptr in use (a multiple of BLOCK_M)
    num_slots,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two >= the number of experts
    CHUNK: tl.constexpr,  # slots read per step
):
    expert = tl.program_id(0)
    # Every program counts every expert (a histogram of all ids): where this expert's group
    # starts depends on all lower experts' padded counts; redoing it saves a second launch.
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for begin in range(0, num_slots, CHUNK):
        offs = begin + tl.arange(0, CHUNK)
        valid = offs < num_slots
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    bins = tl.arange(0, NUM_BINS)
    start = tl.sum(tl.where(bins < expert, padded, 0))
    count = tl.sum(tl.where(bins == expert, counts, 0))
    group_len = tl.sum(tl.where(bins == expert, padded, 0))
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded))
    # This expert's slots, in slot order: a running count ranks them.
    placed = 0
    for begin in range(0, num_slots, CHUNK):
        offs = begin + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        mine = (ids == expert).to(tl.int32)
        rank = placed + tl.cumsum(mine, 0) - 1
        tl.store(sorted_ptr + start + rank, offs, mask=mine != 0)
        placed += tl.sum(mine)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + pad, num_slots, mask=pad < group_len)
    for block in range(start // BLOCK_M, (start + group_len) // BLOCK_M):
        tl.store(expert_ids_ptr + block, expert)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group topk_ids' T * k (token, slot) pairs by expert, in padded BLOCK_M-row blocks.

    Returns int32 device tensors: `sorted_slots` [blocks * block_m] (each expert's slots
    t * k + j in increasing order, its group padded with T * k to a multiple of block_m,
    groups in expert order), `expert_ids` [blocks] (expert of each block) and `num_padded`
    [1] (rows in use), where blocks = cdiv(T * k + min(T * k, E) * (block_m - 1), block_m).
    Entries past num_padded are left unwritten. No host synchronisation: capturable in a
    CUDA graph.
    """
    num_slots = topk_ids.numel()
    blocks = cdiv(num_slots + min(num_slots, num_experts) * (block_m - 1), block_m)
    device = topk_ids.device
    sorted_slots = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    # Big chunks for prefill (fewer loop steps), small ones for decode (less masked work).
    chunk = min(1024, max(128, next_power_of_2(num_slots)))
    _moe_align_kernel[(num_experts,)](
        topk_ids.reshape(-1), sorted_slots, expert_ids, num_padded, num_slots,
        BLOCK_M=block_m,
        # tl.histogram wants at least one bin per lane of a warp.
        NUM_BINS=max(32, next_power_of_2(num_experts)),
        CHUNK=chunk,
        num_warps=8 if chunk >= 1024 else 4,
    )
    return sorted_slots, expert_ids, num_padded


@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: slot s reads row s // TOP_K (SORTED; else row s)
    w_ptr,  # [E, N, K], GATED: [E, 2 * N, K] (gate rows, then up rows)
    out_ptr,  # [num_slots, N]
    route_ptr,  # [num_slots] fp32 routing weights (ROUTED)
    a_scale_ptr,  # A_SCALED: a is float8, a[r, k] * a_scale[r, k // SCALE_K] (SCALE_K 0: a_scale[r])
    w_scale_ptr,  # W_SCALED: w is float8, w[e, n, k] * w_scale[e, n // SCALE_N, k // SCALE_K]
    sorted_ptr, expert_ids_ptr, num_padded_ptr,  # from moe_align (SORTED)
    num_slots, num_blocks_m, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    stride_as, stride_wse, stride_wsn,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,  # out = silu(a @ gate^T) * (a @ up^T)
    ROUTED: tl.constexpr,  # out = route weight * (a @ w^T)
    SORTED: tl.constexpr,  # rows grouped by expert (moe_align); else rows in order, all of expert 0
    A_SCALED: tl.constexpr,
    W_SCALED: tl.constexpr,
    SCALE_N: tl.constexpr,  # weight rows under one scale (1: per channel)
    SCALE_K: tl.constexpr,  # columns under one scale (weight and a), a multiple of BLOCK_K, or 0: all of K
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # GROUP_M consecutive row blocks take each column block in turn, so that (mostly one
    # expert's) weight tiles are shared through L2 while they are hot.
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * blocks_n)
    block_m = first_m + in_group % group_rows
    block_n = in_group // group_rows
    if SORTED:
        if block_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        slots = tl.load(sorted_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(expert_ids_ptr + block_m).to(tl.int64)  # int64: E * N * K may pass 2**31
    else:
        slots = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        expert = 0
    valid = slots < num_slots  # padding rows: not read, not written
    rows = (slots // TOP_K).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    # Weight tiles as [BLOCK_K, BLOCK_N] (transposed in the addressing).
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if W_SCALED:  # each column's scales (a row of K blocks); the up rows' after the gate rows' blocks
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_N) * stride_wsn
        up_scales = tl.cdiv(N, SCALE_N) * stride_wsn
    if A_SCALED:
        a_scale_ptrs = a_scale_ptr + rows * stride_as
    dot_dtype = out_ptr.dtype.element_ty  # float8 operands widen to it exactly
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # unused unless GATED
    for k in range(0, K, BLOCK_K):
        a_mask = valid[:, None]
        w_mask = n_mask[None, :]
        if not EVEN_K:
            a_mask = a_mask & (k + offs_k < K)[None, :]
            w_mask = w_mask & (k + offs_k < K)[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(dot_dtype)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(dot_dtype)
        if SCALE_K == 0:  # one scale for all of K: applied once, after the loop
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(dot_dtype)
                up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
        else:  # a scale per block of SCALE_K columns: each block's product scaled as it is added
            block_k = k // SCALE_K
            a_scale = 1.0
            if A_SCALED:
                a_scale = tl.load(a_scale_ptrs + block_k, mask=valid, other=0.0)[:, None]
            w_scale = tl.load(w_scale_ptrs + block_k, mask=n_mask, other=0.0)[None, :]
            acc += tl.dot(a, w, input_precision=DOT_PRECISION) * (w_scale * a_scale)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(dot_dtype)
                w_scale = tl.load(w_scale_ptrs + up_scales + block_k, mask=n_mask, other=0.0)[None, :]
                up += tl.dot(a, w_up, input_precision=DOT_PRECISION) * (w_scale * a_scale)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE_K == 0:
        if W_SCALED:
            acc = acc * tl.load(w_scale_ptrs, mask=n_mask, other=0.0)[None, :]
            up = up * tl.load(w_scale_ptrs + up_scales, mask=n_mask, other=0.0)[None, :]
        if A_SCALED:
            a_scale = tl.load(a_scale_ptrs, mask=valid, other=0.0)[:, None]
            acc = acc * a_scale
            up = up * a_scale
    if GATED:
        acc = acc * tl.sigmoid(acc) * up
    if ROUTED:
        acc = acc * tl.load(route_ptr + slots, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Fp8Operands:
    """float8_e4m3fn operands of a grouped GEMM and their float32 scales.

    weight_scale: [E, N] (one per output channel; GATED: the gate rows', then the up rows'), or
    [E, blocks of N, blocks of K] per block (block rows x columns: GATED, the gate rows' blocks,
    then the up rows', each part's last block maybe partial). a_scale (None: the activations are
    not quantised, in the output's dtype): [rows, 1], one per row, or with a block, [rows, blocks
    of K], one per row and block of columns (stride 0 along rows: one scale for every row).
    """

    weight_scale: torch.Tensor
    block: tuple[int, int] | None = None
    a_scale: torch.Tensor | None = None


def block_k_tile(block_k: int, largest: int) -> int:
    """The K tile under block scales block_k columns wide (block_k a multiple of 16, tl.dot's
    least K): the largest power of two up to `largest` that divides block_k, so that a tile
    is under one scale."""
    assert block_k % 16 == 0, f"block scales {block_k} columns wide: not a multiple of 16"
    tile = largest
    while block_k % tile:
        tile //= 2
    return tile


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, route: torch.Tensor | None,
                 align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, top_k: int, gated: bool,
                 cfg: dict[str, int], fp8: Fp8Operands | None = None) -> None:
    """out[s] = (silu(a @ gate^T) * (a @ up^T) if gated else a @ w^T) for each slot s of align's
    grouping (row s // top_k of a, its expert's weight), times route[s] unless route is None.
    align None: one expert (w [1, N, K]), slot s is row s. fp8: w (and a, with a_scale) are
    float8 with those scales, widened to out's dtype tile by tile in the kernel."""
    n, k = out.shape[1], a.shape[1]
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    scale_n, scale_k = 1, 0
    if fp8 is not None and fp8.block is not None:
        scale_n, scale_k = fp8.block
        block_k = block_k_tile(scale_k, block_k)
        # Each K block's product is a third fp32 tile beside the gated pair: the largest tiles
        # (prefill's) take half the columns, as their registers would spill (sm_90).
        if gated and cfg["BLOCK_M"] * block_n > 64 * 128:
            block_n //= 2
    a_scale = None if fp8 is None else fp8.a_scale
    w_scale = None if fp8 is None else fp8.weight_scale
    if align is None:
        sorted_slots = expert_ids = num_padded = None
        num_blocks_m = cdiv(out.shape[0], cfg["BLOCK_M"])
    else:
        sorted_slots, expert_ids, num_padded = align
        num_blocks_m = expert_ids.numel()
    grid = (num_blocks_m * cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, route, a_scale, w_scale, sorted_slots, expert_ids, num_padded,
        out.shape[0], num_blocks_m, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        0 if a_scale is None else a_scale.stride(0),
        0 if w_scale is None else w_scale.stride(0),
        0 if w_scale is None else w_scale.stride(1),
        TOP_K=top_k,
        GATED=gated,
        ROUTED=route is not None,
        SORTED=align is not None,
        A_SCALED=a_scale is not None,
        W_SCALED=w_scale is not None,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        EVEN_K=k % block_k == 0,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"],
        DOT_PRECISION=dot_precision(out.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


@dataclass(frozen=True)
class Fp8Experts:
    """The scales of float8_e4m3fn experts (fused_moe's w13 and w2), as Fp8Operands.weight_scale
    has them, and how the scheme quantises their inputs."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None
    # (input, projection: 0 for w13's, 1 for w2's) -> (float8 input, float32 scales as
    # Fp8Operands.a_scale); None: inputs stay in their dtype (weight-only FP8).
    quantize: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict[str, int] | None = None, fp8: Fp8Experts | None = None
              ) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j]: [T, H].

    hidden [T, H] (contiguous last dimension), w13 [E, 2 * I, H] (each expert's gate rows,
    then its up rows) and w2 [E, H, I], contiguous, share a float dtype, which the result
    has, unless fp8 is given: then w13 and w2 are float8_e4m3fn with fp8's scales (and the
    inputs of both projections are quantised as fp8.quantize says). topk_weights [T, k]
    float32, topk_ids [T, k] int32/int64 (distinct per token or not). fp32 accumulation;
    fp32 inputs multiply at about fp32 precision (dot_precision). `config` overrides
    fused_moe_config(T, dtype) (BLOCK_M/N/K, GROUP_M, num_warps, num_stages).
    No host synchronisation: capturable in a CUDA graph (after a first call has compiled).
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, two_i, hidden_size) and two_i % 2 == 0, f"w13 {tuple(w13.shape)}"
    assert w2.shape == (num_experts, hidden_size, two_i // 2), f"w2 {tuple(w2.shape)} does not match w13"
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k), "topk_ids/weights must be [T, k]"
    assert topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}"
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}"
    weight_dtype = hidden.dtype if fp8 is None else torch.float8_e4m3fn
    assert w13.dtype == w2.dtype == weight_dtype, f"w13 and w2 must be {weight_dtype}"
    assert hidden.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous(), "contiguous layouts"
    if num_tokens == 0:
        return torch.empty_like(hidden)
    cfg = fused_moe_config(num_tokens, hidden.dtype) if config is None else config
    align = moe_align(topk_ids, num_experts, cfg["BLOCK_M"])
    num_slots = num_tokens * top_k
    intermediate = torch.empty(num_slots, two_i // 2, dtype=hidden.dtype, device=hidden.device)
    per_slot = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)

    def gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, projection: int) -> None:
        operands = None
        if fp8 is not None:
            scale = (fp8.w13_scale, fp8.w2_scale)[projection]
            a_scale = None
            if fp8.quantize is not None:
                a, a_scale = fp8.quantize(a, projection)
            operands = Fp8Operands(scale, fp8.block, a_scale)
        gated = projection == 0
        grouped_gemm(a, w, out, None if gated else topk_weights.reshape(-1), align, top_k if gated else 1,
                     gated, cfg, operands)

    gemm(hidden, w13, intermediate, 0)
    gemm(intermediate, w2, per_slot, 1)
    if top_k == 1:
        return per_slot
    return per_slot.view(num_tokens, top_k, hidden_size).sum(dim=1)  # 16-bit: summed in fp32
