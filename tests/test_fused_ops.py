"""Triton RMSNorm / attention-input (q/k norm + RoPE + KV store) / SiluAndMul kernels against
the torch layers they replace.

The references are minivllm/layers' own RMSNorm, RotaryEmbedding and SiluAndMul, and the
kernels promise the same rounding, so results are compared in ulps of the output dtype,
not with a loose tolerance. On a machine without CUDA the kernels run under Triton's
interpreter (small shapes, fp32/fp16: the interpreter mishandles bf16); with CUDA they run
compiled, and the `gpu`-marked tests add realistic shapes, bf16 and CUDA-graph capture.
"""

import pytest
import torch
from transformers import PretrainedConfig

from minivllm.kernels import fused_ops
from minivllm.kernels.split_k import SplitKPartials
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from tests.conftest import DEVICE
from tests.test_skinny_matmul import ordered_sum

CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------
def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int, min_exact: float = 0.0) -> None:
    """|actual - expected| <= max_ulps ulps of expected (in its dtype), element-wise, and at
    least a fraction min_exact of the elements bit-identical."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    mag = expected.abs()
    ulp = (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).double()
    err = (actual.double() - expected.double()).abs()
    worst = (err / ulp).max().item() if err.numel() else 0.0
    assert worst <= max_ulps, f"max error {worst:.2f} ulps > {max_ulps}"
    if err.numel():
        exact = (err == 0).double().mean().item()
        assert exact >= min_exact, f"only {exact:.4f} of the elements bit-identical (< {min_exact})"


def norm_tolerance(dtype: torch.dtype) -> dict:
    """Summation order differs from torch's, so the float32 rstd may be an ulp or two off,
    which moves every element of the row by a few ulps. Rounding to 16 bits hides nearly
    all of it; where the normed value does flip by one ulp, `weight *` can make that up to
    two or three ulps of the output."""
    if dtype == torch.float32:
        return dict(max_ulps=8)
    return dict(max_ulps=3, min_exact=0.95)


def make_norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, EPS).to(DEVICE, dtype)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))  # non-trivial scale
    return norm


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def make_rope(head_dim: int, max_pos: int, random_table: bool = False) -> torch.Tensor:
    """A cos_sin table: the layer's own (Qwen3's theta), or random with unequal halves to
    check that the kernel reads the table rather than assuming its structure."""
    if random_table:
        return randn(max_pos, 2, head_dim, dtype=torch.float32, seed=7)
    return RotaryEmbedding(PretrainedConfig(rope_theta=1e6), head_dim, max_pos).cos_sin.to(DEVICE)


def reference_rope(positions, q, k, cos_sin):
    rope = RotaryEmbedding(PretrainedConfig(rope_theta=1e6), q.shape[-1], 1)
    rope.cos_sin = cos_sin  # the layer's forward applied to this table
    return rope(positions, q, k)


# ----------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 8), (5, 48), (3, 256), (0, 64)])
def test_rms_norm(dtype, num_tokens, hidden):
    norm = make_norm(hidden, dtype)
    x = randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    x_before = x.clone()
    out = fused_ops.rms_norm(x, norm.weight, EPS)
    assert torch.equal(x, x_before)
    assert_ulps(out, norm(x), **norm_tolerance(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 8), (6, 40), (0, 32)])
def test_add_rms_norm_updates_residual_in_place(dtype, num_tokens, hidden):
    norm = make_norm(hidden, dtype)
    x = randn(num_tokens, hidden, dtype=dtype, seed=2)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=3, scale=4.0)
    ref_out, ref_residual = norm(x, residual.clone())
    x_before = x.clone()
    out, new_residual = fused_ops.add_rms_norm(x, residual, norm.weight, EPS)
    assert new_residual is residual  # documented: the sum is written into `residual`
    assert torch.equal(residual, ref_residual)  # one rounding of an exact sum: bit-identical
    assert torch.equal(x, x_before)
    assert_ulps(out, ref_out, **norm_tolerance(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_parts,num_rows", [(4, 1), (3, 5)])
def test_add_rms_norm_sums_split_k_partials_first(dtype, num_parts, num_rows):
    """A row-parallel projection's SplitKPartials in place of x: the kernel adds the parts in
    order in fp32 and rounds once (the output skinny_matmul would have stored), then runs
    the add-norm on it: bit for bit what add_rms_norm gives on that output. Rows past
    num_rows in the workspace are not read."""
    hidden = 40
    parts = randn(num_parts, 8, hidden, dtype=torch.float32, seed=6)
    parts[:, num_rows:] = float("nan")
    partials = SplitKPartials(parts, num_rows, dtype)
    norm = make_norm(hidden, dtype)
    residual = randn(num_rows, hidden, dtype=dtype, seed=7, scale=4.0)
    want_out, want_residual = fused_ops.add_rms_norm(ordered_sum(partials), residual.clone(), norm.weight, EPS)
    out, new_residual = fused_ops.add_rms_norm(partials, residual, norm.weight, EPS)
    assert new_residual is residual and out.shape == (num_rows, hidden) and out.dtype == dtype
    assert torch.equal(residual, want_residual) and torch.equal(out, want_out)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_strided_views(dtype):
    """Per-head norm on the q slice of a packed qkv tensor (3D, row stride != Hq * D), and a
    2D input with a row stride, as the model hands them over without copying."""
    num_tokens, hq, hkv, head_dim = 3, 4, 2, 16
    qkv = randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=4)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    norm = make_norm(head_dim, dtype)
    out = fused_ops.rms_norm(q, norm.weight, EPS)
    assert out.shape == q.shape and out.is_contiguous()
    assert_ulps(out, norm(q), **norm_tolerance(dtype))

    wide = randn(5, 64, dtype=dtype, seed=5)
    x, residual = wide[:, :24], wide[:, 32:56]  # row stride 64, not 24
    norm = make_norm(24, dtype)
    ref_out, ref_residual = norm(x, residual.clone())
    out, _ = fused_ops.add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(residual, ref_residual)
    assert torch.equal(wide[:, 24:32], randn(5, 64, dtype=dtype, seed=5)[:, 24:32])  # gap untouched
    assert_ulps(out, ref_out, **norm_tolerance(dtype))


# ----------------------------------------------------------------------------------------
# Rotary embedding
# ----------------------------------------------------------------------------------------
class AttentionInputs:
    """A step's q/k/v as views of a packed qkv tensor, a paged cache, slots (some < 0) and
    positions, with the torch layers' results: per-head RMSNorm (optional), RoPE, stored."""

    def __init__(self, num_tokens: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype,
                 qk_norm: bool, random_table: bool = False, block_size: int = 4, max_pos: int = 64,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.qkv = randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=seed + 1)
        q, k, v = self.qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        self.q = q.view(num_tokens, hq, head_dim)
        self.k, self.v = k.view(num_tokens, hkv, head_dim), v.view(num_tokens, hkv, head_dim)
        self.cos_sin = make_rope(head_dim, max_pos, random_table)
        self.positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
        num_blocks = num_tokens // block_size + 2
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::3] = -1  # every third token is not stored (cached already, or padding)
        self.slot_mapping = slots.to(DEVICE)
        self.k_cache = randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, seed=seed + 2)
        self.v_cache = randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, seed=seed + 3)
        self.norms = (make_norm(head_dim, dtype, seed=4), make_norm(head_dim, dtype, seed=5)) if qk_norm else None

        # The reference: the torch layers, then the cache written row by row.
        q, k = self.q.clone(), self.k.clone()
        if self.norms:
            q, k = self.norms[0](q), self.norms[1](k)
        self.ref_q, ref_k = reference_rope(self.positions, q, k, self.cos_sin)
        self.ref_k_cache, self.ref_v_cache = self.k_cache.clone(), self.v_cache.clone()
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                self.ref_k_cache[slot // block_size, slot % block_size] = ref_k[i]
                self.ref_v_cache[slot // block_size, slot % block_size] = self.v[i]

    def run(self) -> torch.Tensor:
        norms = (self.norms[0].weight, self.norms[1].weight, EPS) if self.norms else ()
        return fused_ops.qk_norm_rope_store(self.positions, self.q, self.k, self.v, self.cos_sin,
                                            self.k_cache, self.v_cache, self.slot_mapping, *norms)

    def check(self) -> None:
        k_before, v_before = self.k.clone(), self.v.clone()
        assert self.run() is self.q  # documented: q rotated in place
        assert torch.equal(self.k, k_before) and torch.equal(self.v, v_before)
        assert torch.equal(self.v_cache, self.ref_v_cache)  # untouched slots included
        if self.norms is None:  # RoPE alone: same roundings as eager torch, no FMA: bit-identical
            assert torch.equal(self.q, self.ref_q) and torch.equal(self.k_cache, self.ref_k_cache)
            return
        # The norm sums squares in another order (see norm_tolerance) and RoPE then mixes two
        # elements, which can cancel: allow two ulps of the operands (|x| < 8 here) absolutely,
        # four relatively, and require most 16-bit results to be bit-identical.
        eps = torch.finfo(self.q.dtype).eps
        for got, want in ((self.q, self.ref_q), (self.k_cache, self.ref_k_cache)):
            if not got.numel():
                continue
            identical = (got == want).double().mean().item()
            msg = (f"max |diff| {(got.float() - want.float()).abs().max().item():.3g}, "
                   f"{identical:.4%} bit-identical")
            torch.testing.assert_close(got, want, atol=16 * eps, rtol=4 * eps, msg=lambda _, msg=msg: msg)
            if self.q.dtype != torch.float32:
                assert identical >= 0.95, msg


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim,random_table", [
    (1, 2, 1, 8, False),
    (7, 6, 2, 16, False),  # non-power-of-two head counts
    (5, 3, 3, 12, True),  # half = 6: masked lanes; unequal table halves
    (0, 2, 1, 8, False),
])
def test_qk_norm_rope_store(dtype, qk_norm, num_tokens, hq, hkv, head_dim, random_table):
    AttentionInputs(num_tokens, hq, hkv, head_dim, dtype, qk_norm, random_table).check()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_store_several_tokens_a_program(monkeypatch, qk_norm):
    """Prompt-sized launches give each program several tokens, the last program fewer."""
    monkeypatch.setattr(fused_ops, "QK_ONE_TOKEN_MAX_TOKENS", 2)
    assert fused_ops.qk_tokens_per_program(7) == fused_ops.QK_TOKENS_PER_PROGRAM == 4
    AttentionInputs(7, 6, 2, 16, torch.float32, qk_norm).check()


def test_qk_norm_rope_store_int32_positions_and_one_sided_norm_rejected():
    inputs = AttentionInputs(3, 4, 2, 8, torch.float32, qk_norm=False)
    inputs.positions = inputs.positions.int()  # int32 accepted
    inputs.check()
    with pytest.raises(AssertionError, match="both"):
        fused_ops.qk_norm_rope_store(inputs.positions, inputs.q, inputs.k, inputs.v, inputs.cos_sin,
                                     inputs.k_cache, inputs.v_cache, inputs.slot_mapping,
                                     torch.ones(8, device=DEVICE))


# ----------------------------------------------------------------------------------------
# SiluAndMul
# ----------------------------------------------------------------------------------------
def silu_tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(max_ulps=4)
    return dict(max_ulps=3, min_exact=0.99)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 8), (3, 24), (2, 1500), (0, 16)])  # 1500: 2 masked blocks
def test_silu_and_mul(dtype, num_tokens, inter):
    x = randn(num_tokens, 2 * inter, dtype=dtype, seed=1, scale=4.0)
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    # exp is not correctly rounded and numpy's differs from torch's, so float32 may be a few
    # ulps off; rounding silu to fp16 absorbs nearly all of it, but when it does flip, `* up`
    # turns that one ulp of silu into up to two of the output.
    assert_ulps(out, SiluAndMul()(x), **silu_tolerance(dtype))


def test_bad_inputs_are_rejected():
    x = randn(4, 16, dtype=torch.float32, seed=0)
    with pytest.raises(AssertionError):
        fused_ops.rms_norm(x.t(), torch.ones(4, device=DEVICE), EPS)  # last dim not contiguous
    with pytest.raises(AssertionError):
        fused_ops.rms_norm(x, torch.ones(16, device=DEVICE, dtype=torch.float16), EPS)  # dtype mismatch
    with pytest.raises(AssertionError):
        fused_ops.silu_and_mul(randn(2, 7, dtype=torch.float32, seed=0))  # odd width


# ----------------------------------------------------------------------------------------
# GPU: realistic shapes, bf16, CUDA graphs
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
@pytest.mark.parametrize("num_tokens", [1, 257, 8192])
def test_gpu_norms_realistic(dtype, hidden, num_tokens):
    norm = make_norm(hidden, dtype)
    x = randn(num_tokens, hidden, dtype=dtype, seed=1)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=2, scale=8.0)
    assert_ulps(fused_ops.rms_norm(x, norm.weight, EPS), norm(x), **norm_tolerance(dtype))
    ref_out, ref_residual = norm(x, residual.clone())
    out, _ = fused_ops.add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(residual, ref_residual)
    assert_ulps(out, ref_out, **norm_tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8)])
def test_gpu_qk_norm_rope_store_realistic(dtype, qk_norm, hq, hkv):
    """Qwen3-0.6B / -8B attention inputs (head_dim 128), 3,001 tokens (several a program, the
    last program one), positions up to 40,960."""
    AttentionInputs(3001, hq, hkv, 128, dtype, qk_norm, block_size=16, max_pos=40960).check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("inter", [3072, 12288, 1000])
@pytest.mark.parametrize("num_tokens", [1, 4097])
def test_gpu_silu_and_mul_realistic(dtype, inter, num_tokens):
    x = randn(num_tokens, 2 * inter, dtype=dtype, seed=1, scale=4.0)
    assert_ulps(fused_ops.silu_and_mul(x), SiluAndMul()(x), **silu_tolerance(dtype))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """All four ops in one captured graph, replayed on new inputs, match eager calls."""
    dtype, n, hidden, inter, hq, hkv, d = torch.bfloat16, 64, 1024, 3072, 16, 8, 128
    norm = make_norm(hidden, dtype)
    cos_sin = make_rope(d, 4096)
    x, residual = randn(n, hidden, dtype=dtype, seed=1), randn(n, hidden, dtype=dtype, seed=2)
    q, k = randn(n, hq, d, dtype=dtype, seed=3), randn(n, hkv, d, dtype=dtype, seed=4)
    v = randn(n, hkv, d, dtype=dtype, seed=6)
    k_cache, v_cache = (torch.zeros(n // 16 + 1, 16, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    slots = torch.arange(n, device=DEVICE)
    head_norm = make_norm(d, dtype)
    gate_up = randn(n, 2 * inter, dtype=dtype, seed=5)
    positions = torch.arange(n, device=DEVICE)

    def step():
        a = fused_ops.rms_norm(x, norm.weight, EPS)
        b, _ = fused_ops.add_rms_norm(x, residual, norm.weight, EPS)
        fused_ops.qk_norm_rope_store(positions, q, k, v, cos_sin, k_cache, v_cache, slots,
                                     head_norm.weight, head_norm.weight, EPS)
        return a, b, fused_ops.silu_and_mul(gate_up), k_cache.clone(), v_cache.clone()

    inputs = (x, residual, q, k, v, gate_up)
    originals = [t.clone() for t in inputs]
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t, new in zip(inputs, [t + 1 for t in originals]):
        t.copy_(new)
    positions.add_(100)
    expected_inputs = [t.clone() for t in inputs]
    graph.replay()
    got = [o.clone() for o in outs] + [residual.clone(), q.clone()]
    for t, src in zip(inputs, expected_inputs):
        t.copy_(src)
    want = list(step()) + [residual, q]
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
