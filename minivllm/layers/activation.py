import torch
import torch.nn.functional as F

from minivllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(gate) * up, for a packed [gate | up] input."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from minivllm.kernels import fused_ops  # imported only where Triton is used
        return fused_ops.silu_and_mul(x)
