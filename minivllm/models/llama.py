"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3, told apart by flags.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are
packed into qkv_proj and gate_up_proj (see PACKED_MODULES). Which kernels the ops run (torch
or Triton) is the build's choice (layers/custom_op.py's use_triton_kernels), made inside the
layers; the attention backend applies q/k norm and RoPE as it stores K/V.
"""

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.qk_prologue import QKPrologue
from minivllm.distributed import tp_size
from minivllm.layers.attention import Attention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import GateUpParallelLinear, LinearOutput, QKVParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding

# checkpoint name fragment -> (packed parameter fragment, part index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def layer_prefix(layer_idx: int) -> str:
    """Decoder layer layer_idx's checkpoint name, which its modules' names start with."""
    return f"model.layers.{layer_idx}"


@dataclass(frozen=True)
class ArchitectureFlags:
    qkv_bias: bool  # Qwen2: biases on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on each query and key head before RoPE


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int, prefix: str) -> None:
        """prefix: the module's checkpoint name (model.layers.0.self_attn)."""
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        self.num_heads = num_heads // tp_size()
        self.num_kv_heads = num_kv_heads // tp_size()
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=flags.qkv_bias,
                                          prefix=prefix)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, feeds_add_norm=True,
                                        checkpoint_name=f"{prefix}.o_proj")
        # Registered here, under the checkpoint's names; the attention backend applies them.
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_position)
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        prologue = QKPrologue(self.rotary_emb, (self.q_norm, self.k_norm) if flags.qk_norm else None)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, prologue)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> LinearOutput:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(positions, q, k, v, meta).flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        """prefix: the module's checkpoint name (model.layers.0.mlp)."""
        super().__init__()
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported.")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
        inter = config.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, inter, prefix)  # and the SiLU-and-mul
        self.down_proj = RowParallelLinear(inter, config.hidden_size, feeds_add_norm=True,
                                           checkpoint_name=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> LinearOutput:
        return self.down_proj(self.gate_up_proj(x))  # gate_up_proj ends with the SiLU-and-mul


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int,
                 mlp: nn.Module, prefix: str) -> None:
        """prefix: the layer's checkpoint name (model.layers.0)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, flags, max_position, f"{prefix}.self_attn")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: LinearOutput, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[LinearOutput, torch.Tensor]:
        """hidden: the previous layer's MLP output (or the embeddings, residual None); the
        projections' outputs are LinearOutputs, which only the add-RMSNorms read."""
        if residual is None:
            assert isinstance(hidden, torch.Tensor), "the embeddings"
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int,
                 mlps: list[nn.Module]) -> None:
        """mlps: each layer's feed-forward block."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, flags, max_position, mlp, layer_prefix(i))
                                     for i, mlp in enumerate(mlps)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int) -> None:
        super().__init__()
        self.config = config
        mlps = [self.make_mlp(i) for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, flags, max_position, mlps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """Layer layer_idx's feed-forward block (a mixture-of-experts model overrides this)."""
        return LlamaMLP(self.config, f"{layer_prefix(layer_idx)}.mlp")

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor goes into, and which part of it the tensor fills
        (told to the owning layer's weight_loader): q/k/v and gate/up are packed."""
        for fragment, (packed, index) in PACKED_MODULES.items():
            if f".{fragment}." in name:
                return name.replace(fragment, packed), index
        return name, 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [cast(LlamaDecoderLayer, layer).self_attn.attn for layer in self.model.layers]
