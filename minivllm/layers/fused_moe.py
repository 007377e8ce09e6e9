"""Mixture-of-experts feed-forward: every expert's projections packed into two tensors per
layer, each token's output the routing-weighted sum of its top-k experts' SwiGLU MLPs.

Tensor parallelism splits each expert's intermediate dimension across ranks (as the dense
MLP's column/row-parallel pair does), so every rank holds a slice of every expert and the
output is all-reduced.

Built under fp8_linear_layers, the experts' weights are float8 with scales (layers/fp8_linear.py:
one Fp8LinearMethod per projection, which loads them and quantises each projection's input as the
scheme says): the Triton kernel reads them as float8 and applies the scales in the kernel; the
torch loop multiplies by each expert's dequantised weights.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import all_reduce, tp_rank, tp_size
from minivllm.layers.custom_op import CustomOp
from minivllm.layers.fp8_linear import Fp8LinearMethod, building_fp8

if TYPE_CHECKING:  # a type only: the torch path imports nothing from kernels/
    from minivllm.kernels.fused_moe import Fp8Experts

# Where a checkpoint tensor goes in the packed weights: (expert, shard). expert is None
# when the tensor holds every expert (a leading expert dimension, as transformers' packed
# format). For w13, shard 0 is the gate projection, 1 the up projection, None both (a packed
# [gate; up] tensor); for w2 it is None.
ExpertPart = tuple[int | None, int | None]


class FusedMoE(CustomOp):
    """forward(hidden [T, H], topk_weights (float32) and topk_ids [T, k]) -> [T, H], summed over
    ranks: kernels/fused_moe.py's grouped GEMMs with Triton, a loop over the experts in torch."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str | None = None
                 ) -> None:
        """prefix: the checkpoint's experts module (model.layers.0.mlp.experts), whose experts an FP8
        checkpoint may leave unquantised (all of them, or none)."""
        super().__init__()
        assert intermediate_size % tp_size() == 0, "moe_intermediate_size not divisible by tp size"
        self.local_intermediate = intermediate_size // tp_size()
        # w13[e]: expert e's gate rows then up rows; w2[e]: its down projection. This rank's
        # slice of the intermediate dimension only.
        fp8_config = building_fp8(() if prefix is None else [f"{prefix}.{expert}.{projection}_proj"
                                                               for expert in range(num_experts)
                                                               for projection in ("gate", "up", "down")])
        if fp8_config is None:
            self.fp8 = None
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_intermediate, hidden_size),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_intermediate),
                                   requires_grad=False)
        else:
            block = fp8_config.weight_block
            if self.uses_triton and block is not None and block[1] % 16:
                raise ValueError(f"The checkpoint's {block[0]}x{block[1]} weight blocks are not a multiple of 16 "
                                 "columns wide, which the Triton mixture-of-experts kernel needs: pass "
                                 "kernels='torch'.")
            size = self.local_intermediate
            self.fp8 = (Fp8LinearMethod(fp8_config, [size, size], hidden_size, 0, num_experts, "w13"),
                        Fp8LinearMethod(fp8_config, [hidden_size], size, 1, num_experts, "w2"))
            for method in self.fp8:
                method.create_weights(self)
            if not self.uses_triton:
                self._forward_method = type(self).forward_fp8

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: ExpertPart) -> None:
        """Copy this rank's slice of a checkpoint tensor into param (w13 or w2, or an FP8 scale),
        where part says."""
        expert, shard = part
        if self.fp8 is not None:
            self._load_fp8(param, loaded, expert, shard)
            return
        dest = param.data if expert is None else param.data[expert]
        size = self.local_intermediate
        start = tp_rank() * size
        if param is self.w2:
            dest.copy_(loaded.narrow(-1, start, size))
            return
        halves = enumerate(loaded.chunk(2, dim=-2)) if shard is None else [(shard, loaded)]
        for index, half in halves:
            dest.narrow(-2, index * size, size).copy_(half.narrow(-2, start, size))

    def _load_fp8(self, param: nn.Parameter, loaded: torch.Tensor, expert: int | None, shard: int | None) -> None:
        """An FP8 projection's tensor: one expert's (or, with expert None, every expert's along the first
        dimension); for w13, shard says gate (0) or up (1), None: both, stacked."""
        assert self.fp8 is not None
        method = next(m for m in self.fp8 if m.owns(self, param))
        if param.dim() == 0:  # an input scale: one for every part and expert
            method.load(self, param, loaded, 0)
            return
        if expert is None:
            for index, tensor in enumerate(loaded):
                self._load_fp8(param, tensor, index, shard)
            return
        if method is self.fp8[1]:
            method.load(self, param, loaded, 0, expert)
            return
        halves = enumerate(loaded.chunk(2, dim=-2)) if shard is None else [(shard, loaded)]
        for part, half in halves:
            method.load(self, param, half, part, expert)

    def forward_fp8(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                    ) -> torch.Tensor:
        """forward_native's loop with FP8 weights: each expert's projections by its Fp8LinearMethods."""
        assert self.fp8 is not None
        w13, w2 = self.fp8
        out = torch.zeros_like(hidden)
        for expert in topk_ids.unique().tolist():
            tokens, slots = torch.where(topk_ids == expert)
            gate, up = w13.apply(self, hidden[tokens], None, expert).chunk(2, dim=-1)
            y = w2.apply(self, F.silu(gate) * up, None, expert)
            out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(y.dtype))
        return all_reduce(out)

    def forward_triton(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                       ) -> torch.Tensor:
        from minivllm.kernels.fused_moe import fused_moe  # imported only where Triton is used
        return all_reduce(fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids, fp8=self.fp8_experts()))

    def fp8_experts(self) -> "Fp8Experts | None":
        """The kernel's view of the FP8 experts' scales and input quantisation (None: not FP8)."""
        from minivllm.kernels.fused_moe import Fp8Experts  # imported only where Triton is used
        if self.fp8 is None:
            return None
        w13, w2 = self.fp8
        quantize = None if w13.config.activation_scheme == "none" else self._quantize_input
        return Fp8Experts(w13.weight_and_scale(self)[1], w2.weight_and_scale(self)[1], w13.config.weight_block,
                          quantize)

    def _quantize_input(self, x: torch.Tensor, projection: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input of projection 0 (w13) or 1 (w2), quantised as its FP8 scheme says."""
        assert self.fp8 is not None
        quantized = self.fp8[projection].quantize_input(self, x)
        assert quantized is not None
        return quantized

    def forward_native(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                       ) -> torch.Tensor:
        """The reference: one matmul pair per expert that has tokens, in expert order (as
        transformers sums them)."""
        out = torch.zeros_like(hidden)
        for expert in topk_ids.unique().tolist():
            tokens, slots = torch.where(topk_ids == expert)
            gate, up = F.linear(hidden[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            # Weights rounded to the model dtype before the product, as transformers does.
            out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(y.dtype))
        return all_reduce(out)
