"""Qwen3-MoE: the Qwen3 decoder (models/llama.py) with a mixture-of-experts MLP in its
sparse layers.

Layer i is sparse when it is not listed in `mlp_only_layers` (those keep a dense MLP of
`intermediate_size`) and i + 1 is a multiple of `decoder_sparse_step`. Checkpoints store
the experts one by one (`mlp.experts.{e}.gate_proj.weight`, as the published Qwen3-MoE
checkpoints and transformers' save_pretrained write them) or packed
(`mlp.experts.gate_up_proj`, transformers' save_original_format=False); either is loaded
into FusedMoE's packed per-layer tensors.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from minivllm.layers.fused_moe import ExpertPart, FusedMoE
from minivllm.models.llama import LlamaForCausalLM, layer_prefix

# model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, or packed over the experts
# (no expert index): model.layers.{i}.mlp.experts.{gate_up,down}_proj; FP8 checkpoints add
# each projection's weight_scale (or weight_scale_inv) and input_scale.
_EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(?:(\d+)\.)?(gate|up|gate_up|down)_proj"
                            r"(?:\.(weight|weight_scale|weight_scale_inv|input_scale))?")
_W13_SHARDS = {"gate": 0, "up": 1}  # gate_up: both halves


class TopKRouter(nn.Module):
    """Which experts each token goes to, and with what weight (as transformers: softmax over
    every expert in float32, the top k, renormalised to sum to 1 when norm_topk_prob)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)  # replicated
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> weights (float32) and expert ids, both [T, top_k]."""
        probs = F.linear(hidden, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        """prefix: the block's checkpoint name (model.layers.0.mlp)."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
        self.gate = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                               config.norm_topk_prob)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                f"{prefix}.experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, *self.gate(hidden))


def _is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule."""
    return (layer_idx not in config.mlp_only_layers and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module:
        if _is_sparse_layer(self.config, layer_idx):
            return Qwen3MoeSparseMoeBlock(self.config, f"{layer_prefix(layer_idx)}.mlp")
        return super().make_mlp(layer_idx)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return super().checkpoint_target(name)
        experts, expert, projection, tensor = match.groups()
        param = "w2" if projection == "down" else "w13"
        if tensor not in (None, "weight"):  # FusedMoE's FP8 scales: w13_weight_scale, w2_input_scale...
            param = f"{param}_{tensor}"
        part: ExpertPart = (None if expert is None else int(expert), _W13_SHARDS.get(projection))
        return f"{experts}.{param}", part
