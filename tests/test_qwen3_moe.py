"""Qwen3-MoE (models/qwen3_moe.py, layers/fused_moe.py): greedy generation equals Hugging Face
transformers' Qwen3MoeForCausalLM token for token (fp32, CPU) with both router weightings and
with dense layers among the sparse ones, under prefix-cache hits, chunked prefill and
preemption; checkpoints with per-expert or packed expert tensors; the expert layer against a
per-token float64 reference, and how its weight loader splits experts across ranks.

The demo's default Qwen3-MoE (every layer sparse) also runs through test_generate_hf.py's
regimes, and test_tensor_parallel.py runs a variant below at tensor_parallel_size=2.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from minivllm.config import EngineConfig
from minivllm.layers import fused_moe
from minivllm.layers.fused_moe import FusedMoE
from tests.hf_oracle import load_hf_model
from tests.test_generate_hf import expected, make_llm, mixed_prompts, run, vocab

VARIANTS = {
    # A dense layer (mlp_only_layers) before two sparse ones; top-k weights renormalised.
    "dense-layer-0-renormalised": {"num_hidden_layers": 3, "mlp_only_layers": [0], "norm_topk_prob": True},
    # Every second layer sparse (decoder_sparse_step); the top-k softmax weights as they are.
    "sparse-step-2-raw-weights": {"num_hidden_layers": 4, "decoder_sparse_step": 2, "norm_topk_prob": False},
}
MAX_TOKENS = 16


def sparse_layers(layers: torch.nn.ModuleList) -> list[bool]:
    return [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in layers]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_hf_plain_and_under_cache_hits_chunks_and_preemption(name: str, tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM", **VARIANTS[name])
    prompts = mixed_prompts(vocab(model_dir), seed=5)
    want = expected(model_dir, prompts, MAX_TOKENS)
    plain = make_llm(model_dir, enable_prefix_caching=False)
    ours = sparse_layers(plain.llm_engine.model_runner.model.model.layers)
    assert ours == sparse_layers(load_hf_model(model_dir).model.layers) and any(ours) and not all(ours)
    assert run(plain, prompts, MAX_TOKENS) == want
    llm = make_llm(model_dir, num_gpu_blocks_override=20, max_num_batched_tokens=13)
    assert run(llm, prompts, MAX_TOKENS) == want
    assert run(llm, prompts, MAX_TOKENS) == want  # the second run hits the prefix cache
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_packed_expert_checkpoint(tiny_model_factory, tmp_path: Path) -> None:
    """transformers' save_pretrained(save_original_format=False) writes each layer's experts
    as two packed tensors instead of three per expert: the same model."""
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM")
    packed_dir = tmp_path / "packed"
    shutil.copytree(model_dir, packed_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    load_hf_model(model_dir).save_pretrained(packed_dir, save_original_format=False)
    with safe_open(str(packed_dir / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()  # noqa: SIM118 (safe_open: no __contains__)
    prompts = mixed_prompts(vocab(model_dir), seed=6)[:4]
    assert run(make_llm(str(packed_dir)), prompts) == expected(model_dir, prompts)


def test_fused_moe_torch_path_matches_per_token_reference() -> None:
    num_experts, hidden, inter, tokens, top_k = 6, 16, 12, 10, 2
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(num_experts, hidden, inter)
    layer.w13.data = torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    layer.w2.data = torch.randn(num_experts, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    # Distinct experts per token (as top-k picks them); the last expert gets no token.
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    out = layer(x, weights, ids)
    w13, w2 = layer.w13.double(), layer.w2.double()
    for t in range(tokens):
        want = torch.zeros(hidden, dtype=torch.float64)
        for weight, expert in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = w13[expert, :inter] @ x[t].double(), w13[expert, inter:] @ x[t].double()
            want += weight * (w2[expert] @ (F.silu(gate) * up))
        torch.testing.assert_close(out[t].double(), want, atol=1e-4, rtol=1e-5)


def test_weight_loader_splits_each_expert_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 holds the second half of every expert's intermediate dimension, from
    per-expert and from packed checkpoint tensors alike."""
    monkeypatch.setattr(fused_moe, "tp_size", lambda: 2)
    monkeypatch.setattr(fused_moe, "tp_rank", lambda: 1)
    num_experts, hidden, inter = 3, 4, 6
    gate, up = torch.randn(2, num_experts, inter, hidden).unbind()
    down = torch.randn(num_experts, hidden, inter)
    per_expert = FusedMoE(num_experts, hidden, inter)
    for e in range(num_experts):
        per_expert.weight_loader(per_expert.w13, gate[e], (e, 0))
        per_expert.weight_loader(per_expert.w13, up[e], (e, 1))
        per_expert.weight_loader(per_expert.w2, down[e], (e, None))
    packed = FusedMoE(num_experts, hidden, inter)
    packed.weight_loader(packed.w13, torch.cat([gate, up], dim=1), (None, None))
    packed.weight_loader(packed.w2, down, (None, None))
    for layer in (per_expert, packed):
        assert torch.equal(layer.w13, torch.cat([gate[:, 3:], up[:, 3:]], dim=1))
        assert torch.equal(layer.w2, down[:, :, 3:])


def test_tensor_parallel_size_must_divide_the_experts(tiny_model_factory, tmp_path: Path) -> None:
    config = json.loads(Path(tiny_model_factory("Qwen3MoeForCausalLM"), "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 33}))
    with pytest.raises(ValueError, match=r"divide the experts' moe_intermediate_size \(33\)"):
        EngineConfig(str(tmp_path), tensor_parallel_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs this path natively (test_gpu_engine.py)")
def test_triton_path_matches_hf(tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """With kernels='triton' the experts run in the fused Triton kernel (on CPU
    through Triton's interpreter: a short run)."""
    from minivllm.kernels import fused_moe as kernel

    calls: list[int] = []
    original = kernel.fused_moe

    def spy(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "fused_moe", spy)
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = mixed_prompts(vocab(model_dir), seed=7)[1:3]
    llm = make_llm(model_dir, kernels="triton")
    assert run(llm, prompts, 3) == expected(model_dir, prompts, 3)
    assert calls
