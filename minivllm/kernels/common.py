"""Helpers shared by the Triton kernels: interpreter detection, launch heuristics, matmul tiles."""

import functools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minivllm.kernels.split_k import SplitKPartials

logger = logging.getLogger(__name__)

# Kernels run as Python under Triton's interpreter (the CPU tests): no inline PTX, no libdevice.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED = tl.constexpr(INTERPRET)  # the same, as a constexpr for use inside kernels

# Inline PTX (Triton's and Gluon's inline_asm_elementwise, constraints "=h,=h,=h,=h,r"): a
# 4-byte word of four e4m3 bytes widened to four fp16 values, byte 0 first, two per
# instruction (Hopper's cvt.rn.f16x2.e4m3x2).
E4M3_WORD_TO_FP16_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    .reg .b32 a, b;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 a, lo;
    cvt.rn.f16x2.e4m3x2 b, hi;
    mov.b32 {$0, $1}, a;
    mov.b32 {$2, $3}, b;
    }""")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for inputs of this dtype: fp32 inputs would otherwise go
    through TF32 (10-bit mantissa); fp32 is the "exact" option, so keep it (nearly) exact
    with three TF32 products. 16-bit inputs ignore this."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device, for launch heuristics; on CPU (Triton's
    interpreter) a small "GPU" of 4, so that tests see several splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers. (triton.cdiv and triton.next_power_of_2 are constexpr
    functions in Triton 3.6, slow to call from the host; eager steps call these helpers for
    every launch: benchmarks/RESULTS.md has the figures.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def split_count(target_programs: int, programs_per_split: int, length: int, min_split_len: int,
                max_splits: int | None = None) -> int:
    """How many pieces to split a length-`length` reduction into, so that a launch reaches
    target_programs programs (each split adds programs_per_split), with at most one piece
    per min_split_len of length (rounded up); at least 1, at most max_splits (None: no cap)."""
    want = -(-target_programs // max(1, programs_per_split))
    by_len = -(-max(1, length) // min_split_len)
    return max(1, min(want, by_len, by_len if max_splits is None else max_splits))


def check_matmul_operands(kernel_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          max_rows: int) -> None:
    """Assert what skinny_matmul and batch_matmul need of F.linear's operands: x [M <= max_rows, K]
    and weight [N, K] of one float dtype, each with a contiguous last dimension; bias None or a
    contiguous [N]."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= max_rows, f"{kernel_name} serves at most {max_rows} rows, got {num_rows}"
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight need a contiguous last dimension"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be a contiguous [N]"


def agrees_with_linear(kernel_name: str, out: torch.Tensor | SplitKPartials, x: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor | None, tolerance: float,
                       fuse_silu_and_mul: bool = False) -> bool:
    """Whether a matmul kernel's output for x is F.linear(x, weight, bias) within `tolerance`
    (relative error, in float64); with fuse_silu_and_mul, silu(gate) * up of that output (a packed
    [gate; up] weight). If not, logs an error: a kernel bug, and the caller keeps cuBLAS for
    this weight."""
    ours = (out.parts.sum(0) if isinstance(out, SplitKPartials) else out).double()
    want = F.linear(x, weight, bias).double()
    if fuse_silu_and_mul:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    error = float((ours - want).norm() / want.norm().clamp_min(1e-30))
    if error > tolerance:
        logger.error("%s disagrees with F.linear on a %s %s weight (relative error %.2e): a kernel bug; "
                     "using cuBLAS for it.", kernel_name, tuple(weight.shape), weight.dtype, error)
    return error <= tolerance


@triton.jit
def split_k_range(K, split, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split `split` of SPLIT_K's range of K, [k_begin, k_end), in whole BLOCK_K tiles; the last
    split's may end in a ragged one."""
    tiles_per_split = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K
    k_begin = split * tiles_per_split * BLOCK_K
    return k_begin, tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)


@triton.jit
def matmul_k_range(x_ptrs, w_ptrs, row_mask, col_mask, k_begin, k_end, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """x[rows, k_begin:k_end] @ w[cols, k_begin:k_end]^T, accumulated in fp32: x_ptrs
    [BLOCK_M, BLOCK_K] and w_ptrs [BLOCK_N, BLOCK_K] point at column k_begin of their rows.
    EVEN_K: the range is whole BLOCK_K tiles, no masks along K."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < k_end
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """torch's silu(gate) * up for fp32 tensors holding values of the model dtype: silu as
    x / (1 + exp(-x)) in float32, rounded to the model dtype before `* up`, the product rounded
    again. Compiled: libdevice's expf (CUDA's, as torch uses) over tl.exp's ex2.approx; the
    interpreter has no libdevice."""
    if INTERPRETED:
        exp_neg = tl.exp(-gate)
    else:
        exp_neg = libdevice.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def weight_rows(strip, N, BLOCK_N: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """The weight rows of output tile `strip`'s BLOCK_N columns, and which of them exist. With
    SILU_AND_MUL the weight is a packed [gate; up] of 2N rows for N output features: the tile
    takes BLOCK_N // 2 features' gate rows, then the same features' up rows."""
    if SILU_AND_MUL:
        tile_cols = tl.arange(0, BLOCK_N)
        features = strip * (BLOCK_N // 2) + tile_cols % (BLOCK_N // 2)
        return features + (tile_cols >= BLOCK_N // 2) * N, features < N
    else:
        cols = strip * BLOCK_N + tl.arange(0, BLOCK_N)
        return cols, cols < N


@triton.jit
def store_output(acc, bias_ptr, out_ptr, strip, rows, row_mask, N, stride_om, HAS_BIAS: tl.constexpr,
                  SILU_AND_MUL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the [rows, BLOCK_N] fp32 sums (+ bias, if HAS_BIAS) of output tile `strip` in the
    output's dtype; with SILU_AND_MUL (columns as weight_rows gives them; never with a bias,
    which the host wrappers refuse), its gate and up columns rounded to that dtype (as a
    separate gate_up output would be) and combined into silu(gate) * up for the tile's
    BLOCK_N // 2 features."""
    dtype = out_ptr.dtype.element_ty
    if SILU_AND_MUL:
        cols = strip * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        halves = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [acc.shape[0], 2, BLOCK_N // 2]), [0, 2, 1])
        gate, up = tl.split(halves)
        out = silu_times_up(gate, up, dtype)
    else:
        cols = strip * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_mask[:, None] & (cols < N)[None, :])


def patch_triton_interpreter() -> None:
    """Make Triton 3.6's interpreter work with NumPy >= 2.4.

    The interpreter holds every scalar as a 1-element array and converts it with
    int(array), which NumPy 2.4 turned into an error: any loop with a bound read at run
    time (`for t in range(0, n)`) then fails. Convert through the array's single element.
    Only interpreter runs are affected; compiled kernels never see this code. Idempotent.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter module: nothing to patch
        return
    original = interpreter._patch_lang_tensor
    if original.__module__ == __name__:  # already patched, by a previous import of this module
        return

    def patched(tensor: Any, scope: Any) -> None:  # Triton's interpreter types, untyped
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if INTERPRET:
    patch_triton_interpreter()
