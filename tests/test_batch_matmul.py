"""The decode-batch linear kernel (batch_matmul) against F.linear in float64.

Without CUDA the kernel runs in Triton's interpreter (small shapes, fp32/fp16, no PDL and so
no weight prefetch); the `gpu`-marked test uses Qwen3-0.6B's projection shapes in bf16.
"""

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels import batch_matmul as batch_module
from minivllm.kernels import fused_ops
from minivllm.kernels.batch_matmul import MAX_ROWS, MIN_ROWS, PARTIAL_SUMS_MAX_ROWS, batch_matmul, batch_matmul_config
from minivllm.kernels.split_k import SplitKPartials
from minivllm.layers.linear import GateUpParallelLinear, linear
from tests.conftest import DEVICE, gate_up_silu_and_mul_float64

# fp32 accumulation in another order than float64; 16-bit outputs: one rounding of the result.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def operands(num_rows: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(num_rows * 7 + n + k)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b, F.linear(x.double(), weight.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,n,k,bias,config", [
    (MIN_ROWS, 128, 128, False, None),  # one program
    (MAX_ROWS, 200, 100, True, None),  # ragged N and K, bias
    (33, 64, 96, False, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=1, num_warps=4, num_stages=2)),
])
def test_batch_matmul_matches_linear(dtype, num_rows, n, k, bias, config):
    x, weight, b, want = operands(num_rows, n, k, dtype, bias)
    out = batch_matmul(x, weight, b, config=config)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_partial_sums_add_up_in_the_add_rms_norm(dtype):
    """Split-K partials (the last split ending in a ragged K tile) summed by the add-RMSNorm
    that follows the row-parallel projections: as if the product had been stored first."""
    num_rows, n, k = 20, 64, 120  # 3 splits of 48, 48 and 24 columns
    x, weight, _, want = operands(num_rows, n, k, dtype, False)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=3, num_warps=4, num_stages=2)
    out = batch_matmul(x, weight, partial_sums=True, config=config)
    assert isinstance(out, SplitKPartials) and out.parts.shape == (3, num_rows, n)
    torch.testing.assert_close(out.parts.double().sum(0), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    residual, norm_weight = torch.randn(num_rows, n).to(DEVICE, dtype), torch.rand(n).to(DEVICE, dtype)
    normed, summed = fused_ops.add_rms_norm(out, residual.clone(), norm_weight, 1e-6)
    want_normed, want_summed = fused_ops.add_rms_norm(out.parts.sum(0).to(dtype), residual.clone(), norm_weight, 1e-6)
    torch.testing.assert_close(summed, want_summed, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, want_normed, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,inter,k,config", [
    (MIN_ROWS, 64, 128, None),  # one program: 32 features' gate and up rows
    (MAX_ROWS, 100, 100, None),  # ragged I (masked features) and K
    (33, 40, 96, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=1, num_warps=4, num_stages=2)),  # row tiles
])
def test_silu_and_mul_epilogue_gives_the_separate_kernels_output(dtype, num_rows, inter, k, config):
    """One launch for the packed gate_up projection and SiluAndMul gives what the projection and
    fused_ops.silu_and_mul give one after the other (both agree with float64): bit for bit in
    fp16. In fp32 the interpreter's dots are numpy matmuls, whose summation order follows the
    operand shapes and the CPU's BLAS kernels, so the fused launch's separate gate and up dots
    may differ from the packed one's in the last bits."""
    x, weight, _, _ = operands(num_rows, 2 * inter, k, dtype, False)
    out = batch_module.batch_matmul_silu_and_mul(x, weight, config=config)
    assert out.shape == (num_rows, inter) and out.dtype == dtype
    separate = fused_ops.silu_and_mul(batch_matmul(x, weight, config=config))
    if dtype == torch.float32:
        torch.testing.assert_close(out, separate, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(out, separate)
    torch.testing.assert_close(out.double(), gate_up_silu_and_mul_float64(x, weight), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kernel", ["skinny_matmul", "batch_matmul"])
def test_gate_up_layer_takes_the_fused_kernel_only_for_routed_batches(monkeypatch, kernel):
    # Routed batches of a chosen weight: one launch (the stand-in answers what no projection
    # would); the rest: the projection, then the activation (written here in float64).
    from minivllm.kernels import skinny_matmul as skinny_module

    if kernel == "skinny_matmul":
        module, flag, first, last = skinny_module, "use_skinny", 1, skinny_module.ROUTED_ROWS
    else:
        module, flag, first, last = batch_module, "use_batch_matmul", MIN_ROWS, MAX_ROWS
    monkeypatch.setattr(module, f"{kernel}_silu_and_mul",
                        lambda x, w: torch.full((x.shape[0], w.shape[0] // 2), 1234.0))
    layer = GateUpParallelLinear(16, 8)
    layer.weight.data.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
    for rows, chosen in [(first - 1, True), (first, True), (last, True), (last + 1, True), (first, False)]:
        setattr(layer, flag, chosen)
        x = torch.randn(rows, 16)
        got = layer(x)
        if chosen and first <= rows <= last:
            assert torch.equal(got, torch.full((rows, 8), 1234.0)), (rows, chosen)
        else:
            torch.testing.assert_close(got.double(), gate_up_silu_and_mul_float64(x, layer.weight),
                                       atol=1e-5, rtol=1e-5)


def test_config_splits_k_evenly_to_fill_the_gpu():
    """Partial sums with too few output tiles split K (into equal whole tiles); other outputs never."""
    cpu = torch.device("cpu")  # sm_count 4
    assert batch_matmul_config(torch.float16, 128, 2048, cpu, partial_sums=False)["SPLIT_K"] == 1
    assert batch_matmul_config(torch.float16, 32, 2048, cpu, partial_sums=True)["SPLIT_K"] == 4
    assert batch_matmul_config(torch.float16, 128, 2048, cpu, partial_sums=True)["SPLIT_K"] == 1  # 4 tiles
    for k in (256, 384, 2048, 3072, 200):
        split = batch_matmul_config(torch.float16, 32, k, cpu, partial_sums=True)["SPLIT_K"]
        tiles = -(-k // 128)
        assert 1 <= split <= min(4, max(1, tiles // 2)) and tiles % split == 0
    # Past MAX_ROWS rows (partial sums only): 64 features a program and two splits where K has two tiles.
    wide = batch_matmul_config(torch.float16, 1024, 2048, cpu, partial_sums=True, num_rows=MAX_ROWS + 1)
    assert (wide["BLOCK_N"], wide["SPLIT_K"]) == (64, 2)
    assert batch_matmul_config(torch.float16, 1024, 100, cpu, partial_sums=True, num_rows=192)["SPLIT_K"] == 1
    assert batch_matmul_config(torch.float16, 1024, 2048, cpu, partial_sums=True, num_rows=MAX_ROWS)["BLOCK_N"] == 32


@pytest.mark.parametrize("num_rows,n,k", [(MAX_ROWS + 1, 96, 256), (PARTIAL_SUMS_MAX_ROWS, 64, 384), (100, 100, 200)])
def test_partial_sums_past_one_row_tile(num_rows, n, k):
    """With partial sums batch_matmul serves up to PARTIAL_SUMS_MAX_ROWS rows in tiles of 64
    (the last one partly rows past the batch), each split K leaving its own partial sums."""
    g = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, k, generator=g).to(DEVICE)
    weight = (torch.randn(n, k, generator=g) / 16).to(DEVICE)
    out = batch_matmul(x, weight, partial_sums=True)
    got = out.parts.sum(0)[:num_rows] if isinstance(out, SplitKPartials) else out
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
    with pytest.raises(AssertionError, match="at most"):
        batch_matmul(torch.randn(num_rows, k, device=DEVICE), weight)  # without partial sums: 64 rows at most


def test_linear_layers_route_decode_batches_of_chosen_weights(monkeypatch):
    rows_seen: list[int] = []

    def stand_in(x, w, b, partial_sums):
        rows_seen.append(x.shape[0])
        return torch.full((x.shape[0], w.shape[0]), 1234.0)

    monkeypatch.setattr(batch_module, "batch_matmul", stand_in)
    weight = torch.randn(8, 16)
    cases = [(MIN_ROWS - 1, True, False), (MIN_ROWS, True, False), (MAX_ROWS, True, False), (MAX_ROWS + 1, True, False),
             (64, False, False),  # chosen=False: cuBLAS serves this weight
             (MAX_ROWS + 1, True, True), (PARTIAL_SUMS_MAX_ROWS, True, True), (PARTIAL_SUMS_MAX_ROWS + 1, True, True)]
    for rows, chosen, partial_sums in cases:
        x = torch.randn(rows, 16)
        got = linear(x, weight, None, use_skinny=False, use_batch_matmul=chosen, partial_sums=partial_sums)
        if chosen and MIN_ROWS <= rows <= (PARTIAL_SUMS_MAX_ROWS if partial_sums else MAX_ROWS):
            assert torch.equal(got, torch.full((rows, 8), 1234.0))
        else:
            torch.testing.assert_close(got, x @ weight.T)
    assert rows_seen == [MIN_ROWS, MAX_ROWS, MAX_ROWS + 1, PARTIAL_SUMS_MAX_ROWS]


@pytest.mark.parametrize("partial_sums", [False, True])
def test_choosing_checks_the_kernel_at_the_fewest_and_most_rows(monkeypatch, partial_sums):
    """Only with PDL (its gain is the weight prefetch that PDL overlaps with the kernel before);
    deciding runs the kernel (compiling it before any step) and checks it against F.linear."""
    weight = torch.randn(256, 256, dtype=torch.float16, device=DEVICE) / 16
    assert not batch_module.chosen(weight, partial_sums=partial_sums)  # the interpreter: no PDL
    monkeypatch.setattr(batch_module, "_chosen", {})
    monkeypatch.setattr(batch_module, "pdl_enabled", lambda device: True)  # the launches still run without
    rows_launched = []
    real = batch_module.batch_matmul

    def spy(x, w, b=None, partial=False):
        rows_launched.append(x.shape[0])
        return real(x, w, b, partial)

    monkeypatch.setattr(batch_module, "batch_matmul", spy)
    assert batch_module.chosen(weight, partial_sums=partial_sums)
    assert rows_launched == [MIN_ROWS, MAX_ROWS] + ([PARTIAL_SUMS_MAX_ROWS] if partial_sums else [])


@pytest.mark.parametrize("wrong", [False, True])
@pytest.mark.parametrize("kernel", ["skinny_matmul", "batch_matmul"])
def test_choosing_checks_the_silu_and_mul_epilogue(monkeypatch, caplog, kernel, wrong):
    # For a packed [gate; up] weight the start-up choice checks the fused kernel the layer calls.
    from minivllm.kernels import skinny_matmul as skinny_module

    module, choose, decisions = ((skinny_module, skinny_module.beats_cublas, "_beats_cublas")
                                 if kernel == "skinny_matmul" else (batch_module, batch_module.chosen, "_chosen"))
    monkeypatch.setattr(module, decisions, {})
    monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    if wrong:  # the projection without the activation
        monkeypatch.setattr(module, f"{kernel}_silu_and_mul", lambda x, w: F.linear(x, w)[:, :w.shape[0] // 2])
    weight = torch.randn(128, 128, dtype=torch.float16, device=DEVICE) / 12
    assert choose(weight, fuse_silu_and_mul=True) is not wrong
    assert ("disagrees" in caplog.text) is wrong


def test_a_kernel_that_disagrees_is_not_chosen(monkeypatch, caplog):
    monkeypatch.setattr(batch_module, "_chosen", {})
    monkeypatch.setattr(batch_module, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(batch_module, "batch_matmul", lambda x, w, b=None, partial=False: torch.zeros(
        x.shape[0], w.shape[0], dtype=x.dtype, device=x.device))
    assert not batch_module.chosen(torch.randn(64, 64, dtype=torch.float16, device=DEVICE))
    assert "disagrees with F.linear" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [5, 33, 64])
@pytest.mark.parametrize("n,k,partial_sums", [(4096, 1024, False), (1024, 2048, True), (6144, 1024, False),
                                               (1024, 3072, True)])
def test_gpu_qwen3_projections(num_rows, n, k, partial_sums):
    """Qwen3-0.6B's qkv, o, gate_up and down at decode batch sizes, bf16, with PDL and the
    weight prefetch as the engine launches them."""
    x, weight, _, want = operands(num_rows, n, k, torch.bfloat16, False)
    out = batch_matmul(x, weight, partial_sums=partial_sums)
    got = out.parts.sum(0) if isinstance(out, SplitKPartials) else out
    torch.testing.assert_close(got.double(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert batch_module.chosen(weight, partial_sums=partial_sums)
    if n == 6144:  # gate_up, ending with SiLU-and-mul: bit for bit the separate kernels' output
        fused = batch_module.batch_matmul_silu_and_mul(x, weight)
        assert torch.equal(fused, fused_ops.silu_and_mul(out))
        torch.testing.assert_close(fused.double(), gate_up_silu_and_mul_float64(x, weight), atol=TOL[torch.bfloat16],
                                   rtol=TOL[torch.bfloat16])
        assert batch_module.chosen(weight, fuse_silu_and_mul=True)
