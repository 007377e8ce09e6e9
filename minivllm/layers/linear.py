"""Linear layers, sharded for tensor parallelism, that load Hugging Face weights.

Column-parallel layers split the output features across ranks; row-parallel layers
split the input features and all-reduce. Packed layers (qkv, gate_up) load several
checkpoint tensors into one weight, each into its own slice. Built under fp8_linear_layers
(layers/fp8_linear.py), a layer holds FP8 weights and scales instead, which its
Fp8LinearMethod (`fp8`) loads and multiplies by.
"""

from types import ModuleType
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import all_reduce, tp_rank, tp_size
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.custom_op import triton_kernels_enabled
from minivllm.layers.fp8_linear import Fp8LinearMethod, building_fp8

if TYPE_CHECKING:  # a type only: the torch path imports nothing from kernels/
    from minivllm.kernels.split_k import SplitKPartials

# A linear layer's output as the next layer sees it: a tensor, or, from a RowParallelLinear built
# with feeds_add_norm and the Triton kernels on one rank, a split-K matmul's unreduced partial
# sums (kernels' SplitKPartials), which only the RMSNorm's residual add after it reads (adding the
# parts up as it loads them). Code between the two passes it on without looking inside.
LinearOutput: TypeAlias = "torch.Tensor | SplitKPartials"


def small_batch_kernel(x: torch.Tensor, use_skinny: bool, use_batch_matmul: bool,
                       partial_sums: bool = False) -> ModuleType | None:
    """The kernel module that serves x's batch where one was chosen for the weight: skinny_matmul
    for a small decode batch, batch_matmul for a mid-sized one (up to 64 rows, 192 where its
    partial sums are wanted); None: cuBLAS."""
    if not (use_skinny or use_batch_matmul) or x.dim() != 2:
        return None
    from minivllm.kernels import batch_matmul, skinny_matmul  # imported only where Triton is used
    rows = x.shape[0]
    if use_skinny and 0 < rows <= skinny_matmul.ROUTED_ROWS:
        return skinny_matmul
    if use_batch_matmul and batch_matmul.MIN_ROWS <= rows <= batch_matmul.max_rows(partial_sums):
        return batch_matmul
    return None


@overload
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_skinny: bool,
           use_batch_matmul: bool, partial_sums: Literal[False] = False) -> torch.Tensor: ...


@overload
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_skinny: bool,
           use_batch_matmul: bool, partial_sums: bool) -> LinearOutput: ...


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_skinny: bool,
           use_batch_matmul: bool, partial_sums: bool = False) -> LinearOutput:
    """F.linear, or the small_batch_kernel for x's batch (with partial_sums and no bias, its
    output may be left as split-K partial sums)."""
    kernel = small_batch_kernel(x, use_skinny, use_batch_matmul, partial_sums)
    if kernel is None:
        return F.linear(x, weight, bias)
    from minivllm.kernels import batch_matmul
    if kernel is batch_matmul:
        return batch_matmul.batch_matmul(x, weight, bias, partial_sums)
    if partial_sums:
        assert bias is None, "a bias has no place in partial sums"
        return kernel.skinny_matmul_partials(x, weight)
    return kernel.skinny_matmul(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 checkpoint_names: list[str] | None = None) -> None:
        """checkpoint_names: the checkpoint's modules packed here (model.layers.0.self_attn.q_proj...),
        which an FP8 checkpoint may leave unquantised."""
        super().__init__()
        # choose_small_batch_kernels decides both, once the weight is loaded.
        self.use_skinny = self.use_batch_matmul = False
        tp = tp_size()
        assert all(size % tp == 0 for size in output_sizes), "output size not divisible by tp size"
        # Local (per-rank) size of each packed part, in checkpoint order.
        self.local_sizes = [size // tp for size in output_sizes]
        fp8_config = building_fp8(checkpoint_names or ())
        self.fp8 = None if fp8_config is None else Fp8LinearMethod(fp8_config, self.local_sizes, input_size, 0)
        if self.fp8 is None:
            self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), requires_grad=False)
        else:
            self.fp8.create_weights(self)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0) -> None:
        """Copy this rank's rows of checkpoint tensor number `part` into its slice."""
        if self.fp8 is not None and param is not self.bias:
            self.fp8.load(self, param, loaded, part)
            return
        size = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        shard = loaded.narrow(0, tp_rank() * size, size)
        param.data.narrow(0, offset, size).copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias, self.use_skinny, self.use_batch_matmul)


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections (checkpoint parts 0, 1, 2)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, prefix: str | None = None) -> None:
        """prefix: the checkpoint's attention module (model.layers.0.self_attn)."""
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         None if prefix is None else [f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")])


class GateUpParallelLinear(ColumnParallelLinear):
    """The MLP's packed gate and up projections (checkpoint parts 0, 1) and the SiluAndMul after
    them: returns silu(x @ W_gate^T) * (x @ W_up^T). Batches routed to skinny_matmul or
    batch_matmul take one launch for both and the activation (their *_silu_and_mul), bit for
    bit the same."""

    def __init__(self, input_size: int, intermediate_size: int, prefix: str | None = None) -> None:
        """prefix: the checkpoint's MLP module (model.layers.0.mlp)."""
        super().__init__(input_size, [intermediate_size, intermediate_size],  # no bias (LlamaMLP refuses one)
                         checkpoint_names=None if prefix is None else [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.act(self.fp8.apply(self, x, None))
        kernel = small_batch_kernel(x, self.use_skinny, self.use_batch_matmul)
        if kernel is None:
            return self.act(F.linear(x, self.weight))
        from minivllm.kernels import batch_matmul
        if kernel is batch_matmul:
            return batch_matmul.batch_matmul_silu_and_mul(x, self.weight)
        return kernel.skinny_matmul_silu_and_mul(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 feeds_add_norm: bool = False, checkpoint_name: str | None = None) -> None:
        """feeds_add_norm: the layer's output goes straight into an RMSNorm's residual add, so it
        is a LinearOutput. Built with the Triton kernels (use_triton_kernels), on one rank and
        without a bias, the layer then has partial_sums: its small and mid-sized batches return
        skinny_matmul's or batch_matmul's split-K partial sums, which the fused add-RMSNorm adds
        up itself. checkpoint_name: the checkpoint's module (model.layers.0.mlp.down_proj), which an
        FP8 checkpoint may leave unquantised."""
        super().__init__()
        # choose_small_batch_kernels decides both, once the weight is loaded.
        self.use_skinny = self.use_batch_matmul = False
        assert input_size % tp_size() == 0, "input size not divisible by tp size"
        self.local_input_size = input_size // tp_size()
        fp8_config = building_fp8([checkpoint_name] if checkpoint_name else ())
        self.fp8 = (None if fp8_config is None
                    else Fp8LinearMethod(fp8_config, [output_size], self.local_input_size, 1))
        self.partial_sums = (feeds_add_norm and triton_kernels_enabled() and tp_size() == 1 and not bias
                             and self.fp8 is None)
        if self.fp8 is None:
            self.weight = nn.Parameter(torch.empty(output_size, self.local_input_size), requires_grad=False)
        else:
            self.fp8.create_weights(self)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0) -> None:
        if self.fp8 is not None and param is not self.bias:
            self.fp8.load(self, param, loaded, part)
            return
        if param.dim() == 2:
            loaded = loaded.narrow(1, tp_rank() * self.local_input_size, self.local_input_size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        if self.partial_sums:  # one rank and no bias: nothing to reduce or add
            return linear(x, self.weight, None, self.use_skinny, self.use_batch_matmul, partial_sums=True)
        if self.fp8 is not None:
            y = self.fp8.apply(self, x, None)
        else:
            y = linear(x, self.weight, None, self.use_skinny, self.use_batch_matmul)
        # The bias is added once, after the reduction, not on every rank.
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y


def choose_small_batch_kernels(model: nn.Module) -> None:
    """Route each linear layer's small batches to skinny_matmul, and its decode batches of up
    to 64 rows (192 with partial sums) to batch_matmul, where each serves its loaded weight better than cuBLAS (a GPU
    only: skinny_matmul.beats_cublas, batch_matmul.chosen)."""
    from minivllm.kernels import batch_matmul, skinny_matmul  # needs a GPU
    for module in model.modules():
        # FP8 layers multiply with their own kernels (Fp8LinearMethod).
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.fp8 is None:
            # The bias the layer's matmul adds: a row-parallel layer adds its own after the
            # all-reduce instead.
            bias = None if isinstance(module, RowParallelLinear) else module.bias
            fuse_silu_and_mul = isinstance(module, GateUpParallelLinear)
            module.use_skinny = skinny_matmul.beats_cublas(module.weight, bias, fuse_silu_and_mul)
            partial_sums = isinstance(module, RowParallelLinear) and module.partial_sums
            module.use_batch_matmul = batch_matmul.chosen(module.weight, bias, partial_sums, fuse_silu_and_mul)
