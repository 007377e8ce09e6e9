"""y = x @ W^T (+ bias) for a few rows of x: the linear layers of small decode batches.

At batch 1 to 16 a linear layer only has to stream its weight matrix once, so its floor is
the weight bytes over the memory bandwidth. cuBLAS's kernels for these shapes read Qwen3-0.6B's
weights at about a quarter of the H200's bandwidth (benchmarks/kernels/step_profile.py at
batch 1). This kernel gives each program a strip of BLOCK_N weight rows, streamed along K in
BLOCK_K tiles through a deep software pipeline, against all (up to 16) rows of x at once on
the tensor cores (tl.dot's smallest M is 16).

Split-K: a weight with few strips (N = 1,024: 64 programs of 16 rows) would leave most SMs
idle, each program streaming a long K alone. Then SPLIT_K programs share a strip's K; each
writes its fp32 partial sums to its own slot of a workspace and counts itself done on the
strip's counter, and the strip's last program adds the partials up in split order (so the
result does not depend on which program finished first), adds the bias, stores the output
and zeroes the counter for the next launch: one launch, no reduction kernel.

skinny_matmul_silu_and_mul multiplies by a packed [gate; up] weight and applies SiluAndMul in
the epilogue: each program streams BLOCK_N / 2 gate rows and the same features' up rows, so its
tile holds both halves of its features. The MLP's activation then costs no launch of its own.

skinny_matmul_partials leaves the partials unreduced for a consumer that adds them up as it
loads its input (fused_ops.add_rms_norm, after the row-parallel o and down projections): the
matmul then ends with its stores. At batch 1 the last program's count, reload and store are
a few dependent round trips through L2 on the layer's critical path, longer than the
streaming before them.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from minivllm.kernels.common import (
    agrees_with_linear,
    cdiv,
    check_matmul_operands,
    dot_precision,
    matmul_k_range,
    sm_count,
    split_count,
    split_k_range,
    store_output,
    weight_rows,
)
from minivllm.kernels.fused_ops import silu_and_mul
from minivllm.kernels.pdl import pdl_enabled, pdl_options, wait_for_previous_kernel
from minivllm.kernels.split_k import SplitKPartials

# Largest batch this kernel serves (tl.dot's smallest M is 16).
MAX_ROWS = 16
# Largest batch the linear layers send here, for weights where beats_cublas() (timed at one
# row). Tuned on Qwen3-0.6B's projections and W1's steps on an H200
# (benchmarks/kernels/skinny_matmul.py): the kernel also beats cuBLAS on o and down up to 16
# rows, but W1 has few steps of 5-16 sequences, so routing them too gains next to nothing.
ROUTED_ROWS = 4


@triton.jit(do_not_specialize=["num_rows"])  # one compilation for every batch size
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    part_ptr,  # [SPLIT_K, BLOCK_M, N] fp32 workspace (SPLIT_K > 1; 2N columns with SILU_AND_MUL)
    count_ptr,  # [strips] int32, zero between launches: splits of each strip done (SPLIT_K > 1)
    num_rows, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,  # w is [gate; up] (2N rows): out = silu(x @ gate^T) * (x @ up^T), [M, N]
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    SPLIT_K: tl.constexpr,
    REDUCE: tl.constexpr,  # SPLIT_K > 1: the strip's last program sums the partials (else the consumer does)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    strip = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    w_rows, col_mask = weight_rows(strip, N, BLOCK_N, SILU_AND_MUL)
    k_begin, k_end = split_k_range(K, split, SPLIT_K, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    # int64: N * K may pass 2**31.
    w_ptrs = w_ptr + w_rows[:, None].to(tl.int64) * stride_wn + (k_begin + offs_k)[None, :]
    wait_for_previous_kernel(PDL)
    acc = matmul_k_range(x_ptrs, w_ptrs, row_mask, col_mask, k_begin, k_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                         DOT_PRECISION)
    if SPLIT_K == 1:
        store_output(acc, bias_ptr, out_ptr, strip, rows, row_mask, N, stride_om, HAS_BIAS, SILU_AND_MUL, BLOCK_N)
    else:
        # Partials by weight row, [SPLIT_K, BLOCK_M, the weight's rows]: split s's s * part_stride further.
        weight_rows_total = 2 * N if SILU_AND_MUL else N
        part_stride = BLOCK_M * weight_rows_total
        part_ptrs = part_ptr + rows[:, None] * weight_rows_total + w_rows[None, :]
        part_mask = row_mask[:, None] & col_mask[None, :]
        tl.store(part_ptrs + split * part_stride, acc, mask=part_mask)
        if REDUCE:
            # Every thread's partials are stored before the count (one thread's atomic) says so:
            # the barrier orders them before it, acq_rel publishes them and shows the last program
            # everyone's (the pattern of CUTLASS's split-K semaphore).
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + strip, 1, sem="acq_rel") == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT_K):  # in split order: the same sum whoever came last
                    total += tl.load(part_ptrs + s * part_stride, mask=part_mask, other=0.0, cache_modifier=".cg")
                store_output(total, bias_ptr, out_ptr, strip, rows, row_mask, N, stride_om, HAS_BIAS, SILU_AND_MUL,
                             BLOCK_N)
                tl.store(count_ptr + strip, 0)  # ready for the next launch


# Split-K launch heuristic: enough programs for this many per SM, but no split shorter than
# MIN_K_PER_SPLIT columns of K (each split adds a partial-sum write and a share of the
# reduction). On an H200 they give Qwen3-0.6B's o and down projections 4 and 6 splits.
PROGRAMS_PER_SM = 4
MIN_K_PER_SPLIT = 512
MAX_SPLIT_K = 8


@functools.cache  # called by every eager skinny_matmul: the split heuristic once per shape
def skinny_matmul_config(dtype: torch.dtype, n: int, k: int, device: torch.device) -> dict:
    """Tiles: 16 weight rows per program, 256 columns of K per step (128 in fp32), 4 tiles in
    flight (32 KB of weights per program), 2 warps; SPLIT_K programs per strip where the
    strips alone would not fill the GPU (N = 1,024 has 64 strips). The warps and the split
    count were chosen on W2's whole step (benchmarks/latency.py), where each projection
    follows another kernel under PDL, not on the kernel timed alone
    (benchmarks/kernels/skinny_matmul.py --sweep, which times other tiles and split counts).
    The returned dict is shared: read it, don't change it."""
    block_n, block_k = 16, 256 if dtype.itemsize == 2 else 128
    strips = cdiv(n, block_n)
    # Where the strips alone give every SM a program (Qwen3-0.6B's qkv: 256), splitting K
    # only adds the reduction's round trips to the kernel's end.
    split_k = 1 if strips >= sm_count(device) else split_count(
        PROGRAMS_PER_SM * sm_count(device), strips, k, max(MIN_K_PER_SPLIT, block_k), MAX_SPLIT_K)
    # Whole tiles per split: drop splits that rounding would leave empty.
    k_tiles = cdiv(k, block_k)
    split_k = cdiv(k_tiles, cdiv(k_tiles, split_k))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=2, num_stages=4)


# Split-K partials and counters, one pair per (device, N, SPLIT_K, strips), shared by every call of
# that shape: calls run one after another on one stream, and each leaves the counters at
# zero. Never reallocated, so CUDA graphs can keep pointing at them; made on the first call,
# which start-up's beats_cublas() makes for every weight before any graph is captured.
_workspaces: dict[tuple[torch.device, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_k_workspace(device: torch.device, n: int, split_k: int, strips: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, n, split_k, strips)
    if key not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"skinny_matmul's split-K workspace for N={n} must exist before CUDA-graph "
                               "capture: call skinny_matmul (or beats_cublas) on the weight first.")
        _workspaces[key] = (torch.empty(split_k * MAX_ROWS * n, dtype=torch.float32, device=device),
                            torch.zeros(strips, dtype=torch.int32, device=device))
    return _workspaces[key]


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K] with M <= MAX_ROWS: a new [M, N] tensor.

    weight [N, K] and x share a float dtype, both with a contiguous last dimension (x's
    row stride is free); fp32 accumulation; fp32 inputs multiply at about fp32 precision
    (dot_precision: three TF32 products, not one). `config` overrides skinny_matmul_config()
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
    """
    out = _launch(x, weight, bias, config, reduce=True)
    assert isinstance(out, torch.Tensor)
    return out


def skinny_matmul_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """`fused_ops.silu_and_mul(skinny_matmul(x, weight))` for a packed weight [2I, K] = [gate; up]
    (the MLP's gate_up projection, no bias) in one launch: a new [M, I] tensor, bit for bit the
    same. `config` as skinny_matmul's, for the packed weight."""
    out = _launch(x, weight, None, config, reduce=True, fuse_silu_and_mul=True)
    assert isinstance(out, torch.Tensor)
    return out


def skinny_matmul_partials(x: torch.Tensor, weight: torch.Tensor,
                           config: dict | None = None) -> torch.Tensor | SplitKPartials:
    """skinny_matmul(x, weight), but a split-K launch leaves its partial sums for the
    consumer to add up (SplitKPartials; the output a plain tensor where the weight takes one
    split). The partials live in the shape's shared workspace: consume them before the next
    launch of a weight of this shape."""
    return _launch(x, weight, None, config, reduce=False)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict | None,
            reduce: bool, fuse_silu_and_mul: bool = False) -> torch.Tensor | SplitKPartials:
    num_rows, k = x.shape
    n = weight.shape[0]
    assert not fuse_silu_and_mul or (n % 2 == 0 and bias is None and reduce), (
        "fuse_silu_and_mul: a [gate; up] weight, no bias")
    check_matmul_operands("skinny_matmul", x, weight, bias, MAX_ROWS)
    out_features = n // 2 if fuse_silu_and_mul else n
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    cfg = skinny_matmul_config(x.dtype, n, k, x.device) if config is None else config
    strips = cdiv(out_features, cfg["BLOCK_N"] // 2 if fuse_silu_and_mul else cfg["BLOCK_N"])
    split_k = cfg["SPLIT_K"]
    part = count = out  # placeholders when SPLIT_K == 1 (never touched)
    if split_k > 1:
        part, count = _split_k_workspace(x.device, n, split_k, strips)
    _skinny_matmul_kernel[(strips, split_k)](
        x, weight, bias if bias is not None else weight, out, part, count,
        num_rows, out_features, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=fuse_silu_and_mul,
        EVEN_K=k % cfg["BLOCK_K"] == 0,
        SPLIT_K=split_k,
        REDUCE=reduce,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION=dot_precision(x.dtype),
        **pdl_options(x.device),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split_k > 1 and not reduce:
        return SplitKPartials(part.view(split_k, MAX_ROWS, n), num_rows, x.dtype)
    return out


_beats_cublas: dict[tuple, bool] = {}


def beats_cublas(weight: torch.Tensor, bias: torch.Tensor | None = None, fuse_silu_and_mul: bool = False) -> bool:
    """Whether skinny_matmul (skinny_matmul_silu_and_mul with fuse_silu_and_mul: the weight is
    a packed [gate; up], checked and timed as such, against cuBLAS and the SiluAndMul kernel)
    should multiply one row by this weight (and add this bias) instead of cuBLAS on this GPU;
    decided once per shape and dtype.

    Where our kernels launch with programmatic dependent launch: always. In a step's chain
    of PDL kernels each launch overlaps the kernel before it, which a cuBLAS kernel's cannot
    (and the kernel after cuBLAS waits for it to end), so timing each kernel alone does not
    tell which serves the step better, and timings of a few microseconds are too noisy to
    choose by (W2 on an H200 with each choice: benchmarks/RESULTS.md).
    Without PDL: when it is at least 5 % faster than cuBLAS, each timed in a CUDA graph.
    Either way the kernel variant is compiled here, so that no step has to. A kernel that
    disagrees with cuBLAS on the weight is never chosen: cuBLAS it is, and an error is
    logged (a kernel bug; tests/test_skinny_matmul.py's GPU tests should show it)."""
    key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None, fuse_silu_and_mul)
    if key not in _beats_cublas:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        tolerance = 1e-5 if weight.dtype == torch.float32 else 1e-2
        def ours() -> torch.Tensor:
            return skinny_matmul_silu_and_mul(x, weight) if fuse_silu_and_mul else skinny_matmul(x, weight, bias)

        def cublas() -> torch.Tensor:  # and the engine's SiluAndMul kernel after it
            y = F.linear(x, weight, bias)
            return silu_and_mul(y) if fuse_silu_and_mul else y

        if not agrees_with_linear("skinny_matmul", ours(), x, weight, bias, tolerance, fuse_silu_and_mul):
            _beats_cublas[key] = False
        elif pdl_enabled(weight.device):
            _beats_cublas[key] = True
        else:
            ours_ms, cublas_ms = (triton.testing.do_bench_cudagraph(fn, rep=5) for fn in (ours, cublas))
            _beats_cublas[key] = ours_ms < 0.95 * cublas_ms
    return _beats_cublas[key]
