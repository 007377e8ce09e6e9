import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a packed [gate | up] input."""

    def __init__(self, use_triton: bool = False) -> None:
        """use_triton: one fused Triton kernel instead of torch ops."""
        super().__init__()
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from minivllm.kernels import fused_ops  # imported only where Triton is used
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
