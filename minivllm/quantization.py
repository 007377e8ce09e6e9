"""FP8 weights: which scheme a model's linear layers run, read from a checkpoint's
`quantization_config` (config.json) or asked for with `quantization="fp8"` (as vLLM).

Two checkpoint formats:
- `quant_method: "fp8"` (Qwen3-*-FP8, DeepSeek): float8_e4m3fn weights with a float32
  `weight_scale_inv` per `weight_block_size` block (128 x 128) and activations quantised at
  run time per token and 128-column group; or, without `weight_block_size`, one `weight_scale`
  per tensor, with dynamic or static (`input_scale`) activations.
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (llm-compressor's FP8,
  FP8_DYNAMIC and FP8_BLOCK schemes): `weight_scale` per tensor, per output channel or per
  block; activations dynamic per token (per group with block weights), static per tensor
  (`input_scale`), or not quantised (weights only).
`quantization="fp8"` on a 16/32-bit checkpoint quantises each weight at load, one scale per
output channel (vLLM's default is one per tensor; a channel's own scale loses less), and
activations dynamically per token.

The LM head, embeddings, norms and the MoE router stay in the model's dtype, as in vLLM, and so
do the modules a checkpoint's ignore list names.
"""

import re
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PretrainedConfig

# The values of `quantization` (and of a checkpoint's quant_method) that minivllm runs.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")

ActivationScheme = Literal["dynamic", "static", "none"]


@dataclass(frozen=True)
class Fp8Config:
    """How the decoder's linear layers hold float8 e4m3 weights and scale their inputs."""

    # Where the FP8 weights come from: the checkpoint's quant_method ("fp8", "compressed-tensors"),
    # or None: a 16/32-bit checkpoint quantised at load.
    checkpoint_format: str | None
    # Rows x columns of the weight under one scale; None: one scale per output channel (a
    # checkpoint's per-tensor scale is spread over its channels at load).
    weight_block: tuple[int, int] | None
    # "dynamic": each token's activations (each token's group of weight_block[1] columns with block
    # weights) quantised with their own scale at every forward; "static": with the checkpoint's
    # per-tensor input_scale; "none": activations stay in the model dtype (weight-only FP8).
    activation_scheme: ActivationScheme
    # Modules the checkpoint leaves in 16/32 bits (compressed-tensors' ignore, the fp8 format's
    # ignored_layers or modules_to_not_convert): names, or "re:" and a regular expression.
    ignored: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint leaves the module (a checkpoint name: model.layers.0.mlp.down_proj) unquantised."""
        return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module
                   for entry in self.ignored)

    @property
    def weight_scale_name(self) -> str:
        """The checkpoint's name of the weight scales (a parameter of each quantised layer)."""
        return "weight_scale_inv" if self.checkpoint_format == "fp8" and self.weight_block else "weight_scale"


def resolve_fp8_config(hf_config: PretrainedConfig, quantization: str | None) -> Fp8Config | None:
    """The FP8 scheme of a model (None: unquantised). quantization: the user's `quantization`
    argument. Raises ValueError for any other method or scheme, naming it."""
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint is not None and not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported: minivllm runs "
                         f"{' and '.join(repr(m) for m in QUANTIZATION_METHODS)} (or None: the checkpoint's own).")
    if checkpoint is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(f"quantization={quantization!r} needs a checkpoint quantised that way, and this one "
                             "has no quantization_config: use quantization='fp8' to quantise it at load.")
        return Fp8Config(checkpoint_format=None, weight_block=None, activation_scheme="dynamic")
    method = checkpoint.get("quant_method")
    if quantization is not None and quantization != method:
        raise ValueError(f"The checkpoint's quantization_config has quant_method {method!r}, which does not match "
                         f"quantization={quantization!r}: leave quantization unset to run the checkpoint's own.")
    if method == "fp8":
        return _fp8_format(checkpoint)
    if method == "compressed-tensors":
        return _compressed_tensors_format(checkpoint)
    raise ValueError(f"This checkpoint is quantised with quant_method {method!r} (config.json's quantization_config), "
                     "which minivllm does not run: it loads FP8 checkpoints (quant_method 'fp8', or "
                     "'compressed-tensors' in the 'float-quantized' format) and 16/32-bit ones.")


def _fp8_format(checkpoint: dict[str, Any]) -> Fp8Config:
    activation = checkpoint.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise ValueError(f"quantization_config activation_scheme {activation!r} is not supported: "
                         "'dynamic' or 'static'.")
    if checkpoint.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config fmt {checkpoint['fmt']!r} is not supported: FP8 weights are e4m3.")
    block = checkpoint.get("weight_block_size")
    ignored = tuple(checkpoint.get("ignored_layers") or checkpoint.get("modules_to_not_convert") or ())
    if block is None:
        return Fp8Config("fp8", None, activation, ignored)
    if activation != "dynamic":
        raise ValueError("quantization_config weight_block_size needs activation_scheme 'dynamic' "
                         f"(got {activation!r}), as in vLLM.")
    return Fp8Config("fp8", _block_shape(block, "weight_block_size"), "dynamic", ignored)


def _block_shape(block: object, field: str) -> tuple[int, int]:
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ValueError(f"quantization_config {field} must be two positive integers [rows, columns], got {block!r}.")
    return block[0], block[1]


def _compressed_tensors_format(checkpoint: dict[str, Any]) -> Fp8Config:
    if checkpoint.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format {checkpoint.get('format')!r} is not supported: minivllm runs "
                         "'float-quantized' (FP8) checkpoints only.")
    if checkpoint.get("kv_cache_scheme") is not None:
        raise ValueError("compressed-tensors kv_cache_scheme is not supported: use a checkpoint without KV-cache "
                         "scales (kv_cache_dtype='fp8' quantises the cache without them).")
    groups = checkpoint.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups.")
    schemes = {_compressed_tensors_group(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors config_groups {', '.join(sorted(groups))} use different schemes: "
                         "minivllm runs one FP8 scheme for every linear layer.")
    scheme = schemes.pop()
    return Fp8Config(scheme.checkpoint_format, scheme.weight_block, scheme.activation_scheme,
                     tuple(checkpoint.get("ignore") or ()))


def _compressed_tensors_group(name: str, group: dict[str, Any]) -> Fp8Config:
    """One config group's scheme: FP8 weights on every Linear layer, FP8 or no activations."""
    where = f"compressed-tensors config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets {group.get('targets')!r} is not supported: ['Linear'].")
    weights = group.get("weights") or {}
    _require_fp8(weights, f"{where}.weights")
    if weights.get("dynamic", False):
        raise ValueError(f"{where}.weights.dynamic true is not supported: weights carry their scales.")
    strategy = weights.get("strategy")
    block: tuple[int, int] | None = None
    if strategy == "block":
        block = _block_shape(weights.get("block_structure"), f"{where}.weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported: 'tensor', 'channel' or 'block'.")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations is not supported.")
    inputs = group.get("input_activations")
    if inputs is None:
        return Fp8Config("compressed-tensors", block, "none")
    _require_fp8(inputs, f"{where}.input_activations")
    activation_strategy = inputs.get("strategy")
    if inputs.get("dynamic", False):
        per_group = (block is not None and activation_strategy == "group"
                     and inputs.get("group_size") == block[1])
        if activation_strategy == "token" or per_group:
            return Fp8Config("compressed-tensors", block, "dynamic")
    elif activation_strategy == "tensor" and block is None:
        return Fp8Config("compressed-tensors", block, "static")
    raise ValueError(f"{where}.input_activations (strategy {activation_strategy!r}, dynamic "
                     f"{inputs.get('dynamic', False)}) is not supported: dynamic per 'token' (per 'group' of the "
                     "weight block's columns with block weights), or static per 'tensor'.")


def _require_fp8(args: dict[str, Any], where: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8 or not args.get("symmetric", True):
        raise ValueError(f"{where} (type {args.get('type')!r}, num_bits {args.get('num_bits')!r}, symmetric "
                         f"{args.get('symmetric', True)}) is not supported: minivllm runs symmetric 8-bit float (FP8).")
