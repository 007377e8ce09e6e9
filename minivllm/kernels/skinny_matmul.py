"""y = x @ W^T (+ bias) for a few rows of x: the linear layers of small decode batches.

At batch 1 to 16 a linear layer only has to stream its weight matrix once, so its floor is
the weight bytes over the memory bandwidth. cuBLAS's kernels for these shapes read Qwen3-0.6B's
weights at ~0.8-1.6 TB/s on the H200 (benchmarks/step_profile.py at batch 1: 12.6 us for the
12.6 MB gate_up projection, 5.3 us for the 4.2 MB o projection), a quarter of the bandwidth;
the GEMMs were 0.85 ms of a 1.54 ms decode step. This kernel gives each program a strip of
BLOCK_N weight rows, streamed along K in BLOCK_K tiles through a deep software pipeline,
against all (up to 16) rows of x at once on the tensor cores (tl.dot's smallest M is 16).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from minivllm.kernels import dot_precision

# Largest batch this kernel serves (tl.dot's smallest M is 16).
MAX_ROWS = 16
# Largest batch the linear layers send here, for weights where beats_cublas(). On the H200
# (benchmarks/skinny_matmul.py, weights from HBM) cuBLAS's heuristics pick a poor kernel for
# Qwen3-0.6B's o projection below 8 rows (12.7 us, against this kernel's 6.1) and a good one
# from 8 rows on (5.8 us); for the other shapes cuBLAS is as fast or faster at every size.
ROUTED_ROWS = 4


@triton.jit(do_not_specialize=["num_rows"])  # one compilation for every batch size
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    num_rows, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features of this program
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # int64: N * K may pass 2**31
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def skinny_matmul_config(dtype: torch.dtype) -> dict:
    """Tiles: 16 weight rows per program (Qwen3-0.6B's o projection, N = 1,024, then still
    spans 64 programs), 256 columns of K per step, 4 tiles in flight (32 KB of bf16 weights
    per program). First guesses, to be swept on the GPU (benchmarks/skinny_matmul.py)."""
    block_k = 256 if dtype.itemsize == 2 else 128
    return dict(BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=4)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K] with M <= MAX_ROWS: a new [M, N] tensor.

    weight [N, K] and x share a float dtype, both with a contiguous last dimension (x's
    row stride is free); fp32 accumulation; fp32 inputs multiply at about fp32 precision
    (dot_precision: three TF32 products, not one). `config` overrides skinny_matmul_config()
    (BLOCK_N, BLOCK_K, num_warps, num_stages).
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS, f"skinny_matmul serves at most {MAX_ROWS} rows, got {num_rows}"
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight need a contiguous last dimension"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be a contiguous [N]"
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    cfg = skinny_matmul_config(x.dtype) if config is None else config
    _skinny_matmul_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out,
        num_rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


_beats_cublas: dict[tuple, bool] = {}


def beats_cublas(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether skinny_matmul multiplies one row by this weight (and adds this bias) at least
    5 % faster than cuBLAS on this GPU: timed once per shape and dtype, each in a CUDA graph.
    Timing compiles the kernel variant too, so that no step has to."""
    key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None)
    if key not in _beats_cublas:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        ours, cublas = (triton.testing.do_bench_cudagraph(lambda fn=fn: fn(x, weight, bias), rep=5)
                        for fn in (skinny_matmul, F.linear))
        _beats_cublas[key] = ours < 0.95 * cublas
    return _beats_cublas[key]
