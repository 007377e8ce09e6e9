"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
from torch import nn

from minivllm.layers.custom_op import CustomOp
from minivllm.layers.linear import LinearOutput


class RMSNorm(CustomOp):
    """With a residual: (norm(x + residual), x + residual). With Triton one fused kernel, which
    writes the sum into `residual` and takes x as a projection's LinearOutput (the partial sums
    of a RowParallelLinear built with feeds_add_norm), adding its parts up as it loads them."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

    def forward_triton(self, x: LinearOutput, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from minivllm.kernels import fused_ops  # imported only where Triton is used
        if residual is None:
            assert isinstance(x, torch.Tensor), "split-K partial sums come with a residual"
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x normed in torch (no residual): the q/k head norms use it too."""
        # As Hugging Face: normalise in float32, scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
