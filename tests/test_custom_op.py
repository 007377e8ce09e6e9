"""Ops whose implementation is chosen once, at build (layers/custom_op.py): each op, the
attention backends with their q/k prologue, and a whole model built both ways give matching
outputs. The Triton side runs in Triton's interpreter on CPU (tests/conftest.py), in fp32 and
fp16 only (the interpreter mishandles bf16)."""

import gc
import weakref
from collections.abc import Callable
from itertools import accumulate
from typing import TypeVar

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.qk_prologue import QKPrologue
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.attention.triton_backend import TritonAttentionBackend
from minivllm.executor.kv_cache import allocate_kv_cache
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import AttentionBackend
from minivllm.layers.custom_op import CustomOp, triton_kernels_enabled, use_triton_kernels
from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.linear import RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.loader import load_weights
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.registry import build_model
from tests.conftest import DEVICE, TinyModelFactory
from tests.test_triton_kernels import make_batch, make_meta

OpT = TypeVar("OpT", bound=torch.nn.Module)

DTYPES = [torch.float32, torch.float16]
# Kernel against torch: fp32 sums in another order; 16-bit outputs may round one ulp apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def build_both(make_op: Callable[[], OpT]) -> tuple[OpT, OpT]:
    """make_op() built outside use_triton_kernels and inside it."""
    native = make_op()
    with use_triton_kernels(True):
        triton = make_op()
    return native, triton


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.fixture
def split_k_in_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_matmul splits K in two wherever partial sums are wanted (tiny weights would not
    be split), and keeps other outputs whole."""
    from minivllm.kernels import batch_matmul

    real_config = batch_matmul.batch_matmul_config

    def config(dtype: torch.dtype, n: int, k: int, device: torch.device, partial_sums: bool, *rest: int) -> dict:
        return {**real_config(dtype, n, k, device, partial_sums, *rest), "BLOCK_K": 16,
                "SPLIT_K": 2 if partial_sums else 1}

    monkeypatch.setattr(batch_matmul, "batch_matmul_config", config)


def test_forward_is_bound_once_by_the_build_context() -> None:
    assert not triton_kernels_enabled()
    norm = RMSNorm(8, 1e-6)
    with use_triton_kernels(True):
        assert triton_kernels_enabled()
        fused = RMSNorm(8, 1e-6)
        with use_triton_kernels(False):
            inner = RMSNorm(8, 1e-6)
        assert triton_kernels_enabled()  # the outer choice is back
    assert not triton_kernels_enabled()
    # Leaving the context changes nothing for the ops built inside it.
    assert norm._forward_method is RMSNorm.forward_native and not norm.uses_triton
    assert fused._forward_method is RMSNorm.forward_triton and fused.uses_triton
    assert inner._forward_method is RMSNorm.forward_native and not inner.uses_triton


def test_a_dropped_model_is_freed_without_the_garbage_collector(tiny_model_factory: TinyModelFactory) -> None:
    """No reference cycles: a model's weights go as soon as the model does, even while the
    collector is off (an engine freezes its start-up objects)."""
    config = AutoConfig.from_pretrained(tiny_model_factory("Qwen3MoeForCausalLM"))
    gc.disable()
    try:
        for use_triton in (False, True):
            with use_triton_kernels(use_triton):
                model = build_model(config, 64)
            weights = weakref.ref(model.model.layers[0].mlp.experts.w13)
            del model
            assert weights() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    native, triton = build_both(lambda: RMSNorm(96, 1e-6).to(DEVICE, dtype))
    native.weight.copy_(1 + 0.5 * randn(96, dtype=dtype, seed=0))
    triton.load_state_dict(native.state_dict())
    x, residual = randn(7, 96, dtype=dtype, seed=1), randn(7, 96, dtype=dtype, seed=2)
    torch.testing.assert_close(triton(x), native(x), **TOL[dtype])
    # The fused kernel writes the sum into residual: each side gets its own copy.
    for got, want in zip(triton(x, residual.clone()), native(x, residual.clone())):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    native, triton = build_both(SiluAndMul)
    x = randn(5, 2 * 48, dtype=dtype, seed=3)
    torch.testing.assert_close(triton(x), native(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(dtype: torch.dtype) -> None:
    num_experts, hidden, inter, tokens, top_k = 4, 32, 16, 9, 2
    native, triton = build_both(lambda: FusedMoE(num_experts, hidden, inter).to(DEVICE, dtype))
    native.w13.copy_(randn(num_experts, 2 * inter, hidden, dtype=dtype, seed=4) / hidden ** 0.5)
    native.w2.copy_(randn(num_experts, hidden, inter, dtype=dtype, seed=5) / inter ** 0.5)
    triton.load_state_dict(native.state_dict())
    gen = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    x = randn(tokens, hidden, dtype=dtype, seed=7)
    torch.testing.assert_close(triton(x, weights, ids), native(x, weights, ids), **TOL[dtype])


def test_row_parallel_partial_sums_are_chosen_at_build() -> None:
    """Only a layer that feeds an add-RMSNorm, built with the Triton kernels, without a bias
    (on one rank), may leave split-K partial sums."""
    with use_triton_kernels(True):
        assert RowParallelLinear(16, 8, feeds_add_norm=True).partial_sums
        assert not RowParallelLinear(16, 8).partial_sums
        assert not RowParallelLinear(16, 8, bias=True, feeds_add_norm=True).partial_sums
    assert not RowParallelLinear(16, 8, feeds_add_norm=True).partial_sums


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_parallel_partial_sums_into_the_add_norm(dtype: torch.dtype, split_k_in_two: None) -> None:
    """A projection's LinearOutput through the add-RMSNorm after it: with Triton, batch_matmul's
    partial sums (K split in two) added up by the fused kernel; in torch, F.linear and torch ops."""
    from minivllm.kernels import batch_matmul
    from minivllm.kernels.split_k import SplitKPartials

    hidden, inter, rows = 32, 64, batch_matmul.MIN_ROWS + 2

    def make_pair() -> torch.nn.ModuleList:
        return torch.nn.ModuleList([RowParallelLinear(inter, hidden, feeds_add_norm=True),
                                    RMSNorm(hidden, 1e-6)]).to(DEVICE, dtype)

    native, triton = build_both(make_pair)
    native[0].weight.copy_(randn(hidden, inter, dtype=dtype, seed=8) / inter ** 0.5)
    triton.load_state_dict(native.state_dict())
    triton[0].use_batch_matmul = True  # as choose_small_batch_kernels may route it on a GPU
    x, residual = randn(rows, inter, dtype=dtype, seed=9), randn(rows, hidden, dtype=dtype, seed=10)
    partials = triton[0](x)
    assert isinstance(partials, SplitKPartials) and partials.parts.shape[0] == 2
    for got, want in zip(triton[1](partials, residual.clone()), native[1](native[0](x), residual.clone())):
        torch.testing.assert_close(got, want, **TOL[dtype])


def step_meta(q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
              ) -> AttentionMetadata:
    """A step of sequences whose last q_lens tokens are new, their K/V stored where
    block_tables says."""
    qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    tables = block_tables.cpu()
    slots = [int(tables[b, pos // block_size]) * block_size + pos % block_size
             for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)) for pos in range(seq_len - q_len, seq_len)]
    return make_meta(qsl, lens, block_tables, torch.tensor(slots, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_backends_apply_the_prologue_and_store(dtype: torch.dtype, qk_norm: bool) -> None:
    """The torch backend (norms and RoPE in torch, store_kv, SDPA) and the Triton backend (the
    fused norm + RoPE + store kernel, then its attention kernels) from the same q, k, v: the same
    outputs and the same cache."""
    num_q_heads, num_kv_heads, head_dim, block_size, eps = 4, 2, 32, 16, 1e-6
    q_lens, seq_lens = [1, 1, 9, 20], [40, 7, 30, 20]  # decodes first, then prompt chunks
    _, _, block_tables, num_blocks = make_batch(q_lens, seq_lens, block_size)
    meta = step_meta(q_lens, seq_lens, block_tables, block_size)
    rotary = RotaryEmbedding(PretrainedConfig(rope_theta=1e6), head_dim, 64)
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim, eps).to(DEVICE, dtype), RMSNorm(head_dim, eps).to(DEVICE, dtype))
        for i, norm in enumerate(norms):
            norm.weight.copy_(1 + 0.5 * randn(head_dim, dtype=dtype, seed=11 + i))
    prologue = QKPrologue(rotary, norms)
    tokens = sum(q_lens)
    q, k, v = (randn(tokens, heads, head_dim, dtype=dtype, seed=13 + i)
               for i, heads in enumerate((num_q_heads, num_kv_heads, num_kv_heads)))
    cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=16)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens)]).to(DEVICE)

    def run(backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = cache.clone().unbind()
        out = backend.forward(positions, q.clone(), k, v, k_cache, v_cache, prologue, meta, head_dim ** -0.5)
        return out, torch.stack([k_cache, v_cache])

    (out, kv), (want_out, want_kv) = run(TritonAttentionBackend()), run(TorchAttentionBackend())
    torch.testing.assert_close(kv, want_kv, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])


def build_loaded(model_dir: str, use_triton: bool, max_position: int) -> LlamaForCausalLM:
    with torch.device(DEVICE), use_triton_kernels(use_triton):
        model = build_model(AutoConfig.from_pretrained(model_dir), max_position)
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("routed", [False, True])
def test_models_built_both_ways_match(tiny_model_factory: TinyModelFactory, architecture: str, routed: bool,
                                      split_k_in_two: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt step and one decode step of a tiny model built with torch ops and with Triton
    ops (each with its attention backend): the same hidden states. routed: every linear layer
    takes batch_matmul, so the o and down projections hand partial sums to the add-RMSNorms."""
    from minivllm.kernels import fused_ops
    from minivllm.kernels.split_k import SplitKPartials

    partial_sums_normed: list[bool] = []
    add_rms_norm = fused_ops.add_rms_norm

    def spy(x, *args):
        partial_sums_normed.append(isinstance(x, SplitKPartials))
        return add_rms_norm(x, *args)

    monkeypatch.setattr(fused_ops, "add_rms_norm", spy)
    model_dir = tiny_model_factory(architecture)
    block_size, max_position = 16, 64
    models = {use_triton: build_loaded(model_dir, use_triton, max_position) for use_triton in (False, True)}
    ops = [module for module in models[True].modules() if isinstance(module, CustomOp)]
    assert ops and all(op.uses_triton for op in ops)
    assert not any(isinstance(module, CustomOp) and module.uses_triton for module in models[False].modules())
    if routed:
        for module in models[True].modules():
            if hasattr(module, "use_batch_matmul"):
                module.use_batch_matmul = True
    # Two sequences: a prompt step, then a decode step (one token more each).
    _, _, block_tables, num_blocks = make_batch([6, 9], [7, 10], block_size)
    prompt_meta = step_meta([6, 9], [6, 9], block_tables, block_size)
    decode_meta = step_meta([1, 1], [7, 10], block_tables, block_size)
    token_ids = torch.randint(3, 700, (17,), generator=torch.Generator().manual_seed(17)).to(DEVICE)
    steps = [(token_ids[:15], torch.cat([torch.arange(6), torch.arange(9)]), prompt_meta),
             (token_ids[15:], torch.tensor([6, 9]), decode_meta)]
    hidden: dict[bool, list[torch.Tensor]] = {}
    for use_triton, model in models.items():
        backend = TritonAttentionBackend() if use_triton else TorchAttentionBackend()
        allocate_kv_cache(model.attention_layers(), backend, num_blocks, block_size, torch.float32,
                          torch.device(DEVICE))
        with torch.inference_mode():
            hidden[use_triton] = [model(ids, positions.to(DEVICE), meta) for ids, positions, meta in steps]
    for got, want in zip(hidden[True], hidden[False]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert any(partial_sums_normed) == routed
