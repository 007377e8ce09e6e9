"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
from torch import nn

from minivllm.kernels.split_k import SplitKPartials


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        """use_triton: one fused Triton kernel (with the residual add) instead of torch ops."""
        super().__init__()
        self.eps = eps
        self.use_triton = use_triton
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As Hugging Face: normalise in float32, scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With a residual: (norm(x + residual), x + residual). With Triton one fused kernel,
        which writes the sum into `residual` (and takes x as a projection's SplitKPartials)."""
        if self.use_triton:
            from minivllm.kernels import fused_ops  # imported only where Triton is used
            if residual is not None:
                return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
            assert isinstance(x, torch.Tensor), "SplitKPartials come with a residual"
            return fused_ops.rms_norm(x, self.weight, self.eps)
        assert isinstance(x, torch.Tensor), "only the Triton matmuls give SplitKPartials"
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
