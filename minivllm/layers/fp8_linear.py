"""FP8 linear layers: float8 e4m3 weights with float32 scales, and their matmul.

The scheme (quantization.py's Fp8Config) is chosen once, for the whole model, when it is
built (`with fp8_linear_layers(config): build_model(...)`); each linear layer built inside
holds an Fp8LinearMethod, which registers the layer's FP8 parameters under the
checkpoints' names (`weight`, `weight_scale` or `weight_scale_inv`, `input_scale`), loads
this rank's slice of them and computes the layer's matmul:

- weight scales per output channel (a per-tensor scale is spread over its channels), on
  CUDA in bfloat16: torch._scaled_mm, FP8 tensor cores with per-token (or static) activation
  scales;
- 128x128 block scales with the Triton kernels: kernels/fp8_matmul.py, the weight read as float8
  and dequantised tile by tile in the kernel;
- weight-only schemes, and everything else: the reference below, which quantises the
  activations exactly as the GPU paths do, dequantises the weight whole and multiplies in the
  activation dtype (the same function; CI tests it on CPU).
"""

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import tp_rank, tp_size
from minivllm.layers.custom_op import triton_kernels_enabled
from minivllm.quantization import Fp8Config

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row (or group) quantises to zeros rather than dividing by 0.
MIN_SCALE = 1e-12

_BUILDING: ContextVar[Fp8Config | None] = ContextVar("minivllm_fp8_linear_layers", default=None)


@contextmanager
def fp8_linear_layers(config: Fp8Config | None) -> Iterator[None]:
    """Linear layers built inside hold FP8 weights of config's scheme (None: the model dtype)."""
    token = _BUILDING.set(config)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_fp8(checkpoint_names: Sequence[str] = ()) -> Fp8Config | None:
    """The FP8 scheme of the layer being built now (fp8_linear_layers), whose checkpoint modules
    (a packed layer's parts) are checkpoint_names; None: unquantised, without a scheme or where
    the checkpoint leaves the modules so (Fp8Config.ignores). Raises ValueError where it leaves
    some of a packed layer's modules so but not all."""
    config = _BUILDING.get()
    if config is None or not checkpoint_names:
        return config
    ignored = [name for name in checkpoint_names if config.ignores(name)]
    if not ignored:
        return config
    if len(ignored) < len(checkpoint_names):
        quantized = [name for name in checkpoint_names if name not in ignored]
        raise ValueError(f"The checkpoint's quantization_config leaves {ignored[0]} unquantised but not "
                         f"{quantized[0]}, which minivllm packs into one layer with it: that layer is in FP8 "
                         "or not as a whole.")
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer of the layer, typed as the tensor it is."""
    tensor = getattr(layer, name)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantisation: weight [N, K] -> (float8 weight, float32 scale [N]), one scale per row
    (its largest magnitude maps to FP8_MAX)."""
    quantized, scale = quantize_activations(weight, None, None)
    return quantized, scale.squeeze(1)


def quantize_activations(x: torch.Tensor, group: int | None, static_scale: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 x, float32 scales): static_scale (a scalar) when given; else dynamic,
    one scale per row ([M, 1]), or per row and group of `group` columns ([M, ceil(K / group)])."""
    x = x.float()
    if static_scale is not None:
        return (x / static_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), static_scale.expand(x.shape[0], 1)
    if group is None:
        scale = x.abs().amax(dim=1, keepdim=True).clamp(min=MIN_SCALE) / FP8_MAX
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    rows, cols = x.shape
    groups = F.pad(x, (0, _cdiv(cols, group) * group - cols)).view(rows, -1, group)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=MIN_SCALE) / FP8_MAX
    quantized = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, -1)[:, :cols]
    return quantized, scale.squeeze(2)


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm's row-wise scaling multiplies x by weight^T: on CUDA, into bfloat16
    (its only output type with row-wise scales), both weight dimensions multiples of 16."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8LinearMethod:
    """The FP8 weights of one linear layer (this rank's shard, packed parts side by side), or of
    one projection of every expert of a mixture-of-experts layer, and its matmul. Holds no
    tensors: the layer does, as parameters named as in the checkpoint (`weight`,
    `weight_scale(_inv)`, `input_scale`) or, for the experts' projection `w13` (`w2`), `w13`,
    `w13_weight_scale(_inv)` and `w13_input_scale`."""

    def __init__(self, config: Fp8Config, output_sizes: list[int], input_size: int, shard_dim: int,
                 num_experts: int | None = None, prefix: str | None = None) -> None:
        """output_sizes: this rank's rows of each packed part; input_size: this rank's columns;
        shard_dim: the weight dimension tensor parallelism splits (0: column-, 1: row-parallel);
        num_experts: the weights' leading expert dimension (None: a plain layer), prefix: their
        names' (the experts' projection). Raises ValueError where a shard would split a weight block."""
        self.config = config
        self.output_sizes = output_sizes
        self.input_size = input_size
        self.shard_dim = shard_dim
        self.num_experts = num_experts
        self.weight_name = prefix or "weight"
        self.scale_name, self.input_scale_name, self.row_blocks_name, self.col_blocks_name = (
            name if prefix is None else f"{prefix}_{name}"
            for name in (config.weight_scale_name, "input_scale", "row_blocks", "col_blocks"))
        block = config.weight_block
        # Block weights multiply in Triton (kernels/fp8_matmul.py) where the kernels are Triton's and
        # the blocks a multiple of 16 columns wide (tl.dot's least K), as real checkpoints' 128 are.
        self.triton_blocks = triton_kernels_enabled() and block is not None and block[1] % 16 == 0
        # With the Triton kernels, activations quantise in one launch (kernels/fp8_quant.py).
        self.quantize_activations: Callable[[torch.Tensor, int | None, torch.Tensor | None],
                                            tuple[torch.Tensor, torch.Tensor]] = quantize_activations
        if triton_kernels_enabled():
            from minivllm.kernels.fp8_quant import quantize_activations_triton  # imported only where Triton is used
            self.quantize_activations = functools.partial(quantize_activations_triton, min_scale=MIN_SCALE)
        if block is not None and tp_size() > 1:
            sizes, block_size, what = ((output_sizes, block[0], "output rows") if shard_dim == 0
                                       else ([input_size], block[1], "input columns"))
            for size in sizes:
                if size % block_size:
                    raise ValueError(
                        f"tensor_parallel_size={tp_size()} splits a layer's {size * tp_size()} {what} into shards of "
                        f"{size}, which cut the checkpoint's {block[0]}x{block[1]} weight blocks: choose a "
                        "tensor_parallel_size that divides them into whole blocks.")

    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's FP8 weight and scales (float32). Scales a 16/32-bit checkpoint does
        not have (quantised at load) are buffers: the loader expects every parameter from it."""
        config = self.config
        rows = sum(self.output_sizes)
        experts = () if self.num_experts is None else (self.num_experts,)
        setattr(layer, self.weight_name,
                nn.Parameter(torch.empty(*experts, rows, self.input_size, dtype=FP8), requires_grad=False))
        # Ones until loaded (load_format="dummy" leaves buffers as they are).
        if config.weight_block is None:
            scale = torch.ones(*experts, rows, dtype=torch.float32)
        else:
            block_rows, block_cols = config.weight_block
            scale = torch.ones(*experts, sum(_cdiv(size, block_rows) for size in self.output_sizes),
                               _cdiv(self.input_size, block_cols), dtype=torch.float32)
            # Each weight row's and column's block, where a packed part's last block may be partial.
            row_blocks = torch.cat([torch.arange(size) // block_rows + sum(_cdiv(s, block_rows)
                                                                           for s in self.output_sizes[:part])
                                    for part, size in enumerate(self.output_sizes)])
            layer.register_buffer(self.row_blocks_name, row_blocks, persistent=False)
            layer.register_buffer(self.col_blocks_name, torch.arange(self.input_size) // block_cols,
                                  persistent=False)
        if config.checkpoint_format is None:
            layer.register_buffer(self.scale_name, scale)
        else:
            setattr(layer, self.scale_name, nn.Parameter(scale, requires_grad=False))
        if config.activation_scheme == "static":
            # The largest of the packed parts' (and experts') scales, which share one input scale
            # (as vLLM): loading takes the max.
            setattr(layer, self.input_scale_name,
                    nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False))

    # --- loading --------------------------------------------------------------------------

    def owns(self, layer: nn.Module, param: nn.Parameter) -> bool:
        """Whether param is one of this method's (an experts' layer has two methods)."""
        return any(param is getattr(layer, name, None) for name in (self.weight_name, self.scale_name,
                                                                      self.input_scale_name))

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, part: int,
             expert: int | None = None) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` (packed part `part`, of expert
        `expert` where the weights have an expert dimension) into param."""
        config = self.config
        dest = param.data if expert is None else param.data[expert]
        if param is getattr(layer, self.weight_name):
            if config.checkpoint_format is None:  # quantised here, from the whole rows
                quantized, scale = quantize_rows(loaded)
                self._copy_shard(dest, quantized, part, 1)
                scales = _tensor(layer, self.scale_name)
                self._copy_channel_scales(scales if expert is None else scales[expert], scale, part)
                return
            if loaded.dtype != FP8:
                raise ValueError(f"A checkpoint weight is {loaded.dtype}, not float8_e4m3fn, though the checkpoint's "
                                 "quantization_config does not leave its layer unquantised (ignore, ignored_layers "
                                 "or modules_to_not_convert): the weights do not match config.json.")
            self._copy_shard(dest, loaded, part, 1)
        elif param is getattr(layer, self.input_scale_name, None):
            param.data = torch.maximum(param.data, loaded.float().reshape(()))
        elif config.weight_block is None:
            scale = loaded.float().flatten()
            if scale.numel() == 1:  # per tensor: the same for each of the part's rows
                checkpoint_rows = self.output_sizes[part] * (tp_size() if self.shard_dim == 0 else 1)
                scale = scale.expand(checkpoint_rows)
            self._copy_channel_scales(dest, scale, part)
        else:
            block_rows, block_cols = config.weight_block
            self._copy_shard(dest, loaded.float(), part, block_rows if self.shard_dim == 0 else block_cols)

    def _copy_shard(self, dest: torch.Tensor, loaded: torch.Tensor, part: int, block: int) -> None:
        """Copy this rank's slice of a part's 2-D weight (block 1) or block scales (block: the
        weight rows or columns under one scale) into dest, along the sharded dimension."""
        if self.shard_dim == 1:
            dest.copy_(loaded.narrow(1, tp_rank() * self.input_size // block, dest.shape[1]))
            return
        size = self.output_sizes[part]
        offset = sum(_cdiv(s, block) for s in self.output_sizes[:part])
        rows = _cdiv(size, block)
        dest.narrow(0, offset, rows).copy_(loaded.narrow(0, tp_rank() * size // block, rows))

    def _copy_channel_scales(self, dest: torch.Tensor, scale: torch.Tensor, part: int) -> None:
        """Per-channel scales [the part's checkpoint rows]: a column-parallel rank keeps its rows'."""
        if self.shard_dim == 1:
            dest.copy_(scale)
        else:
            self._copy_shard(dest, scale, part, 1)

    # --- the matmul -----------------------------------------------------------------------

    def weight_and_scale(self, layer: nn.Module, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float8 weight and its float32 scales (expert `expert`'s, where there are experts):
        [rows] per output channel, or [row blocks, column blocks] (with experts, a leading
        expert dimension when expert is None)."""
        weight, scale = _tensor(layer, self.weight_name), _tensor(layer, self.scale_name)
        return (weight, scale) if expert is None else (weight[expert], scale[expert])

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """The weight as the matmul sees it, [rows, input_size] in dtype."""
        weight, scale = self.weight_and_scale(layer, expert)
        if self.config.weight_block is None:
            return (weight.float() * scale[:, None]).to(dtype)
        row_blocks, col_blocks = _tensor(layer, self.row_blocks_name), _tensor(layer, self.col_blocks_name)
        return (weight.float() * scale[row_blocks[:, None], col_blocks[None, :]]).to(dtype)

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [M, input_size] quantised as the scheme says: (float8 x, float32 scales [M, 1], or
        [M, column blocks] with block weights); None for weight-only schemes (x stays as it is)."""
        config = self.config
        if config.activation_scheme == "none":
            return None
        static_scale = _tensor(layer, self.input_scale_name) if config.activation_scheme == "static" else None
        return self.quantize_activations(x, None if config.weight_block is None else config.weight_block[1],
                                         static_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, expert: int | None = None
              ) -> torch.Tensor:
        """x [..., input_size] @ weight^T (+ bias), in x's dtype (expert `expert`'s weight, where
        there are experts)."""
        config = self.config
        x2d = x.reshape(-1, x.shape[-1])
        quantized = self.quantize_input(layer, x2d)
        weight, weight_scale = self.weight_and_scale(layer, expert)
        if self.triton_blocks:
            from minivllm.kernels.fp8_matmul import fp8_block_matmul  # imported only where Triton is used
            x_in, x_scale = (x2d, None) if quantized is None else quantized
            assert config.weight_block is not None
            y = fp8_block_matmul(x_in, weight, weight_scale, config.weight_block, x_scale, x.dtype)
            if bias is not None:
                y += bias
        elif quantized is None:
            y = F.linear(x2d, self.dequantized_weight(layer, x.dtype, expert), bias)
        elif config.weight_block is None and _scaled_mm_takes(x, weight):
            # FP8 tensor cores: row-wise scales, the activations' [M, 1] and the weight's [1, N].
            x_fp8, x_scale = quantized
            y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale[None, :],
                                 bias=bias, out_dtype=x.dtype)
        else:
            x_fp8, x_scale = quantized
            if config.weight_block is None:
                x_dequantized = x_fp8.float() * x_scale
            else:
                x_dequantized = x_fp8.float() * x_scale[:, _tensor(layer, self.col_blocks_name)]
            y = F.linear(x_dequantized.to(x.dtype), self.dequantized_weight(layer, x.dtype, expert), bias)
        return y.view(*x.shape[:-1], -1)
