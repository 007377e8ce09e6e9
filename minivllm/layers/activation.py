import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a packed [gate | up] input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from minivllm.kernels import fused_ops  # Triton: GPU only
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
