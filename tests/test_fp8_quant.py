"""The one-launch activation quantiser (kernels/fp8_quant.py) against quantize_activations, the
torch reference (layers/fp8_linear.py): the same float8 bits and the same scales, per row, per
group of columns and with a static scale."""

import pytest
import torch

from minivllm.kernels.fp8_quant import MAX_BLOCK, quantize_activations_triton
from minivllm.layers.fp8_linear import FP8_MAX, MIN_SCALE, quantize_activations
from tests.conftest import DEVICE

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows over many magnitudes: a row of zeros, values that quantise to FP8's subnormals
    and to exact ties, and outliers that set their span's scale."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 2, rows)[:, None]
    if rows > 3:
        x[0] = 0.0
        x[1, : cols // 2] *= 1e-4  # beside an outlier: subnormals after scaling
        x[1, -1] = 300.0
        x[2] = torch.arange(cols) % 17 * 0.0625  # exact ties between FP8 values once scaled
    return x.to(dtype).to(DEVICE)


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == want[0].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].expand_as(want[1]), want[1]) and got[1].shape == want[1].shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [48, 300, MAX_BLOCK + 136])  # one block, odd, several blocks a row
def test_per_row_scales_match_the_reference(dtype: torch.dtype, cols: int) -> None:
    x = activations(6, cols, dtype, seed=cols)
    assert_same(quantize_activations_triton(x, None, None, MIN_SCALE), quantize_activations(x, None, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols, group", [(256, 128), (320, 128), (96, 32)])  # whole groups, a partial last one
def test_group_scales_match_the_reference(dtype: torch.dtype, cols: int, group: int) -> None:
    x = activations(5, cols, dtype, seed=cols + group)
    assert_same(quantize_activations_triton(x, group, None, MIN_SCALE), quantize_activations(x, group, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_static_scale_clamps_as_the_reference(dtype: torch.dtype) -> None:
    x = activations(4, 200, dtype, seed=3)
    scale = torch.tensor(0.05, device=DEVICE)  # the larger rows saturate at +-448
    got = quantize_activations_triton(x, None, scale, MIN_SCALE)
    assert_same(got, quantize_activations(x, None, scale))
    assert got[0].float().abs().max() == FP8_MAX


def test_strided_rows_and_an_empty_batch() -> None:
    wide = activations(3, 160, torch.float32, seed=4)
    x = wide[:, 16:144]  # rows with a stride wider than their length
    assert_same(quantize_activations_triton(x, 64, None, MIN_SCALE), quantize_activations(x, 64, None))
    empty = wide[:0]
    quantized, scale = quantize_activations_triton(empty, None, None, MIN_SCALE)
    assert quantized.shape == (0, 160) and scale.shape == (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("cols, group", [(4096, None), (12288, None), (4096, 128), (12288, 128)])
def test_qwen3_8b_shapes_in_bfloat16(rows: int, cols: int, group: int | None) -> None:
    """Qwen3-8B's projection inputs (hidden 4096, intermediate 12288) in bfloat16, per token and
    per 128-column block, under PDL where the GPU has it."""
    x = activations(rows, cols, torch.bfloat16, seed=rows + cols)
    assert_same(quantize_activations_triton(x, group, None, MIN_SCALE), quantize_activations(x, group, None))
