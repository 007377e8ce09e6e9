"""y = x @ W^T (+ bias) for 5 to 64 rows (to 192 with partial sums): the linear layers of mid-sized
decode steps (and short prompt steps).

At these sizes a projection is a few microseconds of weight reads, and cuBLAS's kernels add a
launch, the first weight tiles' trip from HBM, and too few output tiles to fill the GPU (N = 1,024:
8 of 128 features). Past 64 rows cuBLAS's pipelines win back what this saves, except for the
row-parallel projections whose partial sums the next add-RMSNorm adds up (o and down: N = 1,024),
which keep split K and gain up to PARTIAL_SUMS_MAX_ROWS. This kernel is
launched with programmatic dependent launch (kernels/pdl.py), and each program first asks L2 to
prefetch its slice of the weight (one cp.async.bulk.prefetch.L2 per weight row) before it waits for
the kernel before it, whose output is x: the weight read overlaps that kernel's tail instead of
following it.

Split-K: a weight with few output tiles (N = 1,024) shares each tile's K among SPLIT_K programs.
Their fp32 partial sums are left for the consumer to add up as it loads them (SplitKPartials,
summed by fused_ops.add_rms_norm after the row-parallel o and down projections), as
skinny_matmul_partials does; callers that need the output itself get one split.

batch_matmul_silu_and_mul ends the MLP's packed gate_up projection with SiLU-and-mul, as
skinny_matmul_silu_and_mul does for smaller batches (kernels/common.py's weight_rows and
store_output: each tile holds its features' gate and up columns).
"""

import functools

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import (
    agrees_with_linear,
    cdiv,
    check_matmul_operands,
    dot_precision,
    matmul_k_range,
    sm_count,
    split_k_range,
    store_output,
    weight_rows,
)
from minivllm.kernels.pdl import pdl_enabled, pdl_options, wait_for_previous_kernel
from minivllm.kernels.split_k import SplitKPartials

# Rows this kernel serves: one tile of BLOCK_M rows (with partial sums, up to three); fewer go to
# skinny_matmul, more to cuBLAS.
MIN_ROWS, MAX_ROWS = 5, 64
PARTIAL_SUMS_MAX_ROWS = 192
MAX_SPLIT_K = 8
# Columns of K a program asks L2 to prefetch per weight row before it waits (2 KB of bf16).
PREFETCH_K = 1024


@triton.jit
def _prefetch_to_l2(ptrs, num_bytes):
    """Ask L2 to fetch num_bytes from each of ptrs (16-byte aligned, a multiple of 16 bytes)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, num_bytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["num_rows"])  # one compilation for every batch size
def _batch_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,  # out: [M, N], or [SPLIT_K, M, N] fp32 partials
    num_rows, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,  # w is [gate; up] (2N rows): out = silu(x @ gate^T) * (x @ up^T), [M, N]
    EVEN_K: tl.constexpr,  # K % (SPLIT_K * BLOCK_K) == 0: no masks along K
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ELEMENT_BYTES: tl.constexpr,
    PREFETCH_K: tl.constexpr,  # columns of its weight rows a program prefetches (a multiple of 8)
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py); prefetches its weights
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    w_row_ids, col_mask = weight_rows(tl.program_id(0), N, BLOCK_N, SILU_AND_MUL)
    k_begin, k_end = split_k_range(K, tl.program_id(2), SPLIT_K, BLOCK_K)
    w_rows = w_ptr + w_row_ids.to(tl.int64) * stride_wn + k_begin  # int64: N * K may pass 2**31
    if PDL:
        # The weights do not depend on the kernel before: fetch them while it finishes. Columns
        # past the weight's last row fetch that row again; the launch checks that rows are whole
        # 16-byte units. At most PREFETCH_K columns a row: enough to cover the wait, and no more
        # than L2 keeps for a big weight.
        last_row = (2 * N if SILU_AND_MUL else N) - 1
        prefetched = w_ptr + tl.minimum(w_row_ids, last_row).to(tl.int64) * stride_wn + k_begin
        num_bytes = tl.maximum(tl.minimum(k_end - k_begin, PREFETCH_K), 0) * ELEMENT_BYTES
        _prefetch_to_l2(prefetched, num_bytes + tl.zeros([BLOCK_N], tl.int32))
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    w_ptrs = w_rows[:, None] + offs_k[None, :]
    wait_for_previous_kernel(PDL)
    acc = matmul_k_range(x_ptrs, w_ptrs, row_mask, col_mask, k_begin, k_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                         DOT_PRECISION)
    if SPLIT_K == 1:
        store_output(acc, bias_ptr, out_ptr, tl.program_id(0), rows, row_mask, N, stride_om, HAS_BIAS, SILU_AND_MUL,
                     BLOCK_N)
    else:  # partial sums (never with SILU_AND_MUL: the launch checks)
        part_ptrs = out_ptr + (tl.program_id(2) * num_rows + rows[:, None]).to(tl.int64) * N + w_row_ids[None, :]
        tl.store(part_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def max_rows(partial_sums: bool) -> int:
    """The most rows batch_matmul serves: MAX_ROWS, or PARTIAL_SUMS_MAX_ROWS with partial sums."""
    return PARTIAL_SUMS_MAX_ROWS if partial_sums else MAX_ROWS


@functools.cache
def batch_matmul_config(dtype: torch.dtype, n: int, k: int, device: torch.device, partial_sums: bool,
                        num_rows: int = MAX_ROWS) -> dict:
    """Tiles of 64 rows x 128 of K (64 in fp32), 4 warps (one warpgroup: Hopper's wgmma), 4
    stages; 64 output features a program, or with partial_sums 32 and SPLIT_K programs per output
    tile where the tiles alone would leave SMs idle (at most MAX_SPLIT_K, a divisor of the K tiles,
    each split at least two). Past MAX_ROWS rows (partial sums only) 64 features and two splits:
    the row tiles already multiply the programs (the fastest tiles measured for Qwen3-0.6B's o and
    down at 96-192 rows on an H200; docs/perf-log.md has the figures). So one compilation serves
    every batch up to MAX_ROWS and one the rest. The returned dict is shared: read it, don't change it."""
    block_m, block_k = MAX_ROWS, 128 if dtype.itemsize == 2 else 64
    k_tiles = cdiv(k, block_k)
    if partial_sums and num_rows > MAX_ROWS:
        block_n, split_k = 64, min(2, k_tiles)
    else:
        block_n = 32 if partial_sums else 64
        split_k = max(1, min(MAX_SPLIT_K, sm_count(device) // cdiv(n, block_n), k_tiles // 2)) if partial_sums else 1
    while k_tiles % split_k:  # as many K tiles in every split: no empty or ragged split
        split_k -= 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=4)


def batch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 partial_sums: bool = False, config: dict | None = None) -> torch.Tensor | SplitKPartials:
    """`F.linear(x, weight, bias)` for x [M, K] with MIN_ROWS <= M <= max_rows(partial_sums): a new
    [M, N] tensor; with partial_sums (no bias) possibly SplitKPartials, to be consumed before the next
    call. weight [N, K] and x share a float dtype, both with a contiguous last dimension;
    fp32 accumulation. `config` overrides batch_matmul_config()."""
    return _launch(x, weight, bias, partial_sums, config, fuse_silu_and_mul=False)


def batch_matmul_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """`fused_ops.silu_and_mul(batch_matmul(x, weight))` for a packed weight [2I, K] = [gate; up]
    (the MLP's gate_up projection, no bias) in one launch: a new [M, I] tensor, bit for bit the
    same. `config` as batch_matmul's, for the packed weight."""
    out = _launch(x, weight, None, False, config, fuse_silu_and_mul=True)
    assert isinstance(out, torch.Tensor)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, partial_sums: bool,
            config: dict | None, fuse_silu_and_mul: bool) -> torch.Tensor | SplitKPartials:
    num_rows, k = x.shape
    n = weight.shape[0]
    check_matmul_operands("batch_matmul", x, weight, bias, max_rows(partial_sums))
    assert not (partial_sums and bias is not None), "a bias has no place in partial sums"
    cfg = batch_matmul_config(x.dtype, n, k, x.device, partial_sums, num_rows) if config is None else config
    split_k = cfg["SPLIT_K"]
    assert not fuse_silu_and_mul or (n % 2 == 0 and bias is None and split_k == 1), (
        "fuse_silu_and_mul: a [gate; up] weight, no bias, no split-K")
    out_features = n // 2 if fuse_silu_and_mul else n
    out = (torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device) if split_k == 1
           else torch.empty(split_k, num_rows, n, dtype=torch.float32, device=x.device))
    if num_rows == 0 or n == 0:
        return out
    options = pdl_options(x.device)
    assert not options["PDL"] or prefetchable(weight), "batch_matmul under PDL needs 16-byte weight rows"
    tile_features = cfg["BLOCK_N"] // 2 if fuse_silu_and_mul else cfg["BLOCK_N"]
    grid = (cdiv(out_features, tile_features), cdiv(num_rows, cfg["BLOCK_M"]), split_k)
    _batch_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        num_rows, out_features, k,
        x.stride(0), weight.stride(0), out_features,
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=fuse_silu_and_mul,
        EVEN_K=k % (split_k * cfg["BLOCK_K"]) == 0,
        SPLIT_K=split_k,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        ELEMENT_BYTES=x.element_size(),
        PREFETCH_K=PREFETCH_K,
        DOT_PRECISION=dot_precision(x.dtype),
        **options,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return SplitKPartials(out, num_rows, x.dtype) if split_k > 1 else out


def prefetchable(weight: torch.Tensor) -> bool:
    """Whether the L2 prefetch can take this weight's rows: 16-byte aligned, whole 16-byte units."""
    return (weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
            and weight.shape[1] * weight.element_size() % 16 == 0)


_chosen: dict[tuple, bool] = {}


def chosen(weight: torch.Tensor, bias: torch.Tensor | None = None, partial_sums: bool = False,
           fuse_silu_and_mul: bool = False) -> bool:
    """Whether batches of MIN_ROWS to max_rows(partial_sums) rows should multiply by this weight (and add this
    bias; leaving partial sums if asked; for a packed [gate; up] weight with fuse_silu_and_mul,
    through batch_matmul_silu_and_mul) here instead of in cuBLAS; decided once per shape and
    dtype. Only where kernels launch with PDL (kernels/pdl.py): the kernel's gain is the weight
    read that PDL lets it start before the kernel ahead of it ends, which timing it alone would
    not show. Deciding runs the kernel (compiling it now, not inside a step: a second's stall)
    at the fewest and most rows of each of its tilings; a kernel that disagrees with cuBLAS on the weight is never
    chosen (an error is logged: a kernel bug)."""
    key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None, partial_sums, fuse_silu_and_mul)
    if key not in _chosen:
        _chosen[key] = False
        if pdl_enabled(weight.device) and weight.dtype.itemsize == 2 and prefetchable(weight):
            xs = [torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                  for rows in sorted({MIN_ROWS, MAX_ROWS, max_rows(partial_sums)})]
            outs = [batch_matmul_silu_and_mul(x, weight) if fuse_silu_and_mul
                    else batch_matmul(x, weight, bias, partial_sums) for x in xs]
            _chosen[key] = all(agrees_with_linear("batch_matmul", out, x, weight, bias, 1e-2, fuse_silu_and_mul)
                               for out, x in zip(outs, xs))
    return _chosen[key]
