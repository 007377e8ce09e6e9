"""The small-batch linear kernel against F.linear in float64.

Without CUDA the kernel runs in Triton's interpreter (small shapes, fp32/fp16); the
`gpu`-marked tests use Qwen3-0.6B / -8B projection shapes in every dtype.
"""

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels import skinny_matmul as skinny_module
from minivllm.kernels.skinny_matmul import MAX_ROWS, ROUTED_ROWS, skinny_matmul
from minivllm.kernels.split_k import SplitKPartials
from minivllm.layers.linear import linear
from tests.conftest import DEVICE, gate_up_silu_and_mul_float64

# fp32 accumulation in another order than float64; 16-bit outputs: one rounding of the result.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(num_rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0,
          row_stride: int | None = None, config: dict | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_rows, row_stride or k, generator=gen)
    x = wide[:, :k].to(DEVICE, dtype) if row_stride is None else wide.to(DEVICE, dtype)[:, :k]
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = skinny_matmul(x, weight, b, config=config)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (num_rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,n,k,bias", [
    (1, 16, 256, False),  # one program, K in whole tiles
    (5, 40, 300, True),  # ragged N (masked columns), ragged K, bias
    (MAX_ROWS, 48, 512, False),  # the largest batch
    (3, 16, 96, True),  # K shorter than one tile
])
def test_matches_linear(dtype, num_rows, n, k, bias):
    check(num_rows, n, k, dtype, bias)


@pytest.mark.parametrize("num_rows,n,k,split_k,bias", [
    (3, 40, 256, 2, True),  # K split evenly; ragged N; bias added once, by the last split
    (MAX_ROWS, 16, 300, 3, False),  # 5 tiles of 64 in 3 splits, the last one ragged
    (1, 32, 300, 4, True),  # 5 tiles in 4 splits: the 4th has none and adds zeros
])
def test_split_k_matches_linear(num_rows, n, k, split_k, bias):
    config = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=split_k, num_warps=4, num_stages=2)
    for seed in range(2):  # a second launch reuses the counters the first left at zero
        check(num_rows, n, k, torch.float32, bias, seed=seed, config=config)


def test_split_k_by_default_where_strips_are_few():
    # A short, wide output has many strips (no split); a narrow one with a long K splits.
    assert skinny_module.skinny_matmul_config(torch.float32, 4096, 1024, torch.device(DEVICE))["SPLIT_K"] == 1
    assert skinny_module.skinny_matmul_config(torch.float32, 16, 2048, torch.device(DEVICE))["SPLIT_K"] > 1
    check(2, 16, 2048, torch.float32, bias=True)


def ordered_sum(partials: SplitKPartials) -> torch.Tensor:
    """The output a SplitKPartials stands for, summed here: in part order, in fp32, rounded once."""
    total = torch.zeros_like(partials.parts[0, :partials.num_rows])
    for part in partials.parts[:, :partials.num_rows]:
        total += part
    return total.to(partials.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,n,k,split_k", [
    (3, 40, 256, 2),  # ragged N
    (1, 16, 300, 4),  # 5 tiles in 4 splits: a ragged last tile
])
def test_partials_are_the_split_k_sums_left_to_the_consumer(dtype, num_rows, n, k, split_k):
    # skinny_matmul_partials leaves exactly the sums skinny_matmul adds up itself: summed in
    # part order they give its output bit for bit (and both give F.linear's).
    config = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=split_k, num_warps=4, num_stages=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    partials = skinny_module.skinny_matmul_partials(x, weight, config=config)
    assert isinstance(partials, SplitKPartials)
    assert partials.parts.shape == (split_k, MAX_ROWS, n) and partials.num_rows == num_rows
    assert partials.dtype == dtype and partials.parts.dtype == torch.float32
    assert torch.equal(ordered_sum(partials), skinny_matmul(x, weight, config=config))
    torch.testing.assert_close(ordered_sum(partials).double(), F.linear(x.double(), weight.double()),
                               atol=TOL[dtype], rtol=TOL[dtype])
    # One split: nothing to leave, the plain output.
    one_split = {**config, "SPLIT_K": 1}
    single = skinny_module.skinny_matmul_partials(x, weight, config=one_split)
    assert isinstance(single, torch.Tensor) and torch.equal(single, skinny_matmul(x, weight, config=one_split))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,inter,k,split_k", [
    (1, 8, 256, 1),  # one program: 8 features' gate and up rows
    (3, 20, 300, 1),  # ragged I (masked features) and K
    (MAX_ROWS, 48, 128, 2),  # the largest batch; K split, the last program applies the activation
    (2, 24, 320, 4),  # 5 tiles in 4 splits: a ragged last one
])
def test_silu_and_mul_epilogue_gives_the_separate_kernels_output(dtype, num_rows, inter, k, split_k):
    # One launch for the packed gate_up projection and SiluAndMul gives bit for bit what the
    # projection and fused_ops.silu_and_mul give one after the other (both agree with float64).
    from minivllm.kernels import fused_ops

    config = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=split_k, num_warps=4, num_stages=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(2 * inter, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    for _ in range(2):  # a second launch reuses the split-K counters the first left at zero
        out = skinny_module.skinny_matmul_silu_and_mul(x, weight, config=config)
        assert out.shape == (num_rows, inter) and out.dtype == dtype
        assert torch.equal(out, fused_ops.silu_and_mul(skinny_matmul(x, weight, config=config)))
    torch.testing.assert_close(out.double(), gate_up_silu_and_mul_float64(x, weight), atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_rows_and_empty_batch():
    check(4, 32, 256, torch.float32, bias=False, row_stride=320)  # x a view with row stride 320
    empty = skinny_matmul(torch.empty(0, 64, device=DEVICE), torch.ones(8, 64, device=DEVICE))
    assert empty.shape == (0, 8)
    with pytest.raises(AssertionError, match="at most"):
        skinny_matmul(torch.ones(MAX_ROWS + 1, 64, device=DEVICE), torch.ones(8, 64, device=DEVICE))


def test_linear_layers_route_only_small_batches_of_chosen_weights(monkeypatch):
    # The stand-in kernel answers something no matmul would, so each result says which
    # path made it; the other path must give x @ W^T + b (float64, written here).
    rows_seen: list[int] = []

    def stand_in(x, w, b):
        rows_seen.append(x.shape[0])
        return torch.full((x.shape[0], w.shape[0]), 1234.0)

    monkeypatch.setattr(skinny_module, "skinny_matmul", stand_in)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    for rows, use_skinny in [(1, True), (ROUTED_ROWS, True), (ROUTED_ROWS + 1, True),
                             (1, False)]:  # use_skinny=False: a weight where cuBLAS was faster
        x = torch.randn(rows, 16, generator=gen)
        got = linear(x, weight, bias, use_skinny=use_skinny, use_batch_matmul=False)
        if use_skinny and rows <= ROUTED_ROWS:
            assert torch.equal(got, torch.full((rows, 8), 1234.0)), (rows, use_skinny)
        else:
            want = (x.double() @ weight.double().T + bias.double()).float()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert rows_seen == [1, ROUTED_ROWS]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # Qwen3-0.6B
                                 (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])  # Qwen3-8B
@pytest.mark.parametrize("num_rows", [1, 7, 16])
def test_gpu_projection_shapes(dtype, n, k, num_rows):
    check(num_rows, n, k, dtype, bias=n == 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(6144, 1024), (24576, 4096)])  # Qwen3-0.6B's and -8B's gate_up
@pytest.mark.parametrize("num_rows", [1, 4, 16])
def test_gpu_silu_and_mul_gate_up_shapes(dtype, n, k, num_rows):
    from minivllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    out = skinny_module.skinny_matmul_silu_and_mul(x, weight)
    assert torch.equal(out, fused_ops.silu_and_mul(skinny_matmul(x, weight)))
    torch.testing.assert_close(out.double(), gate_up_silu_and_mul_float64(x, weight), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072)])  # Qwen3-0.6B's o and down
@pytest.mark.parametrize("num_rows", [1, 4])
def test_gpu_partials_into_add_rms_norm(n, k, num_rows):
    # The engine's small-batch path after o and down, bf16: partials summed by the norm give
    # bit for bit what the norm gives on skinny_matmul's own output.
    from minivllm.kernels import fused_ops

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, torch.bfloat16)
    norm_weight = torch.rand(n, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(num_rows, n, generator=gen).to(DEVICE, torch.bfloat16)
    partials = skinny_module.skinny_matmul_partials(x, weight)
    assert isinstance(partials, SplitKPartials)
    got = fused_ops.add_rms_norm(partials, residual.clone(), norm_weight, 1e-6)
    want = fused_ops.add_rms_norm(skinny_matmul(x, weight), residual.clone(), norm_weight, 1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("pdl", [False, True])
def test_start_up_choice_takes_a_correct_kernel_under_pdl_without_timing(monkeypatch, pdl):
    import triton.testing

    monkeypatch.setattr(skinny_module, "_beats_cublas", {})
    monkeypatch.setattr(skinny_module, "pdl_enabled", lambda device: pdl)
    timings = iter([1.0, 2.0])  # ours, then cuBLAS: ours twice as fast
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: next(timings))
    assert skinny_module.beats_cublas(torch.randn(24, 40, device=DEVICE)) is True
    assert next(timings, None) == (1.0 if pdl else None)  # timed only without PDL
    monkeypatch.setattr(skinny_module, "_beats_cublas", {})
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: 1.0)  # a tie: cuBLAS
    assert skinny_module.beats_cublas(torch.randn(24, 40, device=DEVICE)) is pdl


def test_start_up_choice_refuses_a_kernel_that_disagrees(monkeypatch, caplog):
    # A fast but wrong kernel is never chosen (the check runs before any timing), and says so.
    monkeypatch.setattr(skinny_module, "skinny_matmul", lambda x, w, b: F.linear(x, w, b) * 1.1)
    monkeypatch.setattr(skinny_module, "_beats_cublas", {})
    assert skinny_module.beats_cublas(torch.randn(24, 40, device=DEVICE), None) is False
    assert "disagrees" in caplog.text


@pytest.mark.gpu
def test_gpu_beats_cublas_times_each_shape_once(monkeypatch):
    import triton.testing

    monkeypatch.setattr(skinny_module, "pdl_enabled", lambda device: False)  # with PDL nothing is timed
    timed = []
    real_bench = triton.testing.do_bench_cudagraph
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: timed.append(1) or real_bench(fn, **kw))
    weights = [torch.randn(1000, 2000, device="cuda", dtype=torch.bfloat16) for _ in range(2)]  # a fresh shape
    choice = skinny_module.beats_cublas(weights[0])
    assert isinstance(choice, bool) and len(timed) == 2  # ours and cuBLAS
    assert skinny_module.beats_cublas(weights[1]) is choice and len(timed) == 2  # same shape: not timed again
    skinny_module.beats_cublas(weights[0], torch.zeros(1000, device="cuda", dtype=torch.bfloat16))
    assert len(timed) == 4  # with a bias: another kernel variant, timed (and compiled) apart
