"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3, told apart by flags.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are
packed into qkv_proj and gate_up_proj (see PACKED_MODULES). use_triton, fixed when the model
is built, picks the Triton kernels for the small ops (fused norms, activation, and q/k norm +
RoPE + KV store as one kernel) over the torch reference ops.
"""

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.attention.metadata import AttentionMetadata
from minivllm.executor.distributed import tp_size
from minivllm.kernels.split_k import SplitKPartials
from minivllm.layers.attention import Attention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding

# checkpoint name fragment -> (packed parameter fragment, part index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class ArchitectureFlags:
    qkv_bias: bool  # Qwen2: biases on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on each query and key head before RoPE


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int,
                 use_triton: bool) -> None:
        super().__init__()
        self.use_triton = use_triton
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        self.num_heads = num_heads // tp_size()
        self.num_kv_heads = num_kv_heads // tp_size()
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=flags.qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, partial_sums=use_triton)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_position)
        if flags.qk_norm:
            # Their weights only, with Triton: the fused kernel applies them.
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | SplitKPartials:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_triton:
            from minivllm.kernels import fused_ops  # imported only where Triton is used
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            fused_ops.qk_norm_rope_store(positions, q, k, v, self.rotary_emb.cos_sin, self.attn.k_cache,
                                         self.attn.v_cache, meta.slot_mapping, *norms)
            out = self.attn.attend(q, meta)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, use_triton: bool) -> None:
        super().__init__()
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported.")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
        inter = config.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, inter, use_triton)  # and the SiLU-and-mul
        self.down_proj = RowParallelLinear(inter, config.hidden_size, partial_sums=use_triton)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        return self.down_proj(self.gate_up_proj(x))  # gate_up_proj ends with the SiLU-and-mul


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int,
                 use_triton: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, flags, max_position, use_triton)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | SplitKPartials, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor | SplitKPartials, torch.Tensor]:
        """hidden: the previous layer's MLP output (or the embeddings, residual None); the
        projections' outputs may be SplitKPartials, which only the add-RMSNorms read."""
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
                 use_triton: bool, mlps: list[nn.Module]) -> None:
        """mlps: each layer's feed-forward block."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, flags, max_position, use_triton, mlp)
                                     for mlp in mlps])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchitectureFlags, max_position: int,
                 use_triton: bool = False) -> None:
        super().__init__()
        self.config = config
        mlps = [self.make_mlp(i, use_triton) for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, flags, max_position, use_triton, mlps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer_idx: int, use_triton: bool) -> nn.Module:
        """Layer layer_idx's feed-forward block (a mixture-of-experts model overrides this)."""
        return LlamaMLP(self.config, use_triton)

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
