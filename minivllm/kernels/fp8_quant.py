"""Activations to float8 e4m3 in one launch: layers/fp8_linear.py's quantize_activations (the
reference), as a kernel.

In torch the dynamic per-token quantisation is a chain of small kernels (cast, abs, amax, clamp,
divide, divide, clamp, cast) before every FP8 matmul; at decode batch sizes each costs a launch
and a few microseconds, several times over per layer. Here one program scales one span of a row
(the whole row, or one group of columns): a pass for its largest magnitude, a pass that writes
the float8 values, and its scale. Results equal the reference's bit for bit.
"""

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import pdl_options, wait_for_previous_kernel

FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
MAX_BLOCK = 2048  # columns a program loads at a time


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still as
    float32: adding and taking away 2^(e + 20) rounds |v| in [2^e, 2^(e+1)) to the 3-bit mantissa's
    step 2^(e - 3) (e >= -6: below, the subnormals' fixed step 2^-9). The float8 cast of the
    result is then exact; Triton's interpreter rounds some values wrongly when it casts."""
    magnitude = tl.abs(v)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    magic = ((tl.maximum(exponent, -6) + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    sign = v.to(tl.int32, bitcast=True) & -0x80000000  # (kept on zeros too: -0.0 as the reference)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, K, stride_x, stride_out, num_spans,
                     SPAN: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr, MIN_SCALE: tl.constexpr,
                     PDL: tl.constexpr):
    row = tl.program_id(0)
    span = tl.program_id(1)
    wait_for_previous_kernel(PDL)
    start = span * SPAN
    end = tl.minimum(start + SPAN, K)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_SCALE), FP8_MAX)
        tl.store(scale_ptr + row * num_spans + span, scale)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        v = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * stride_out + cols, _round_to_e4m3(v).to(tl.float8e4nv), mask=cols < end)


def quantize_activations_triton(x: torch.Tensor, group: int | None, static_scale: torch.Tensor | None,
                                min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations in one launch: x [M, K] -> (float8 x, float32 scales): static_scale's
    (a scalar) when given, expanded to [M, 1]; else one scale per row ([M, 1]), or per row and
    group of `group` columns ([M, ceil(K / group)]), each mapping its span's largest magnitude
    (at least min_scale * 448) to 448."""
    rows, cols = x.shape
    span = cols if group is None else group
    num_spans = triton.cdiv(cols, span)
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = (static_scale.reshape(1, 1).expand(rows, 1) if static_scale is not None
             else torch.empty(rows, num_spans, dtype=torch.float32, device=x.device))
    if rows and cols:
        x = x if x.stride(1) == 1 else x.contiguous()
        _quantize_kernel[(rows, num_spans)](
            x, out, scale, scale if static_scale is None else static_scale, cols, x.stride(0), out.stride(0),
            num_spans, SPAN=span, BLOCK=min(triton.next_power_of_2(span), MAX_BLOCK),
            STATIC=static_scale is not None, MIN_SCALE=min_scale, **pdl_options(x.device))
    return out, scale
