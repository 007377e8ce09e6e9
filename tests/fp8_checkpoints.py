"""FP8 checkpoints of tiny models, written as the published ones are, and their oracle.

`write_fp8_checkpoint` quantises a tiny model's decoder linear weights (q/k/v/o, gate/up/down,
and the experts') into float8_e4m3fn tensors with float32 scales, under the names and the
config.json quantization_config of the 'fp8' format (Qwen3-*-FP8) or llm-compressor's
'compressed-tensors'. It also writes the oracle: the same model with the dequantised weights in
float32, which Hugging Face transformers runs, and `hf_fp8_greedy` runs it with each
quantised layer's input quantised as the scheme says (written here independently of minivllm).
"""

import json
import os
import re
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The decoder's linear weights (dense and experts'); the LM head, embeddings, norms and router stay.
QUANTIZED = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")
# Layers that read the same input, and so share a static input scale (the largest of theirs).
SIBLINGS = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


@dataclass(frozen=True)
class Fp8Scheme:
    checkpoint_format: str  # "fp8" or "compressed-tensors"
    weights: str  # "tensor", "channel" or "block"
    activations: str  # "dynamic", "static" or "none"
    block: tuple[int, int] = (128, 128)


def quantization_config(scheme: Fp8Scheme, ignore: list[str]) -> dict:
    """config.json's quantization_config, as the published checkpoints write it; ignore: the
    modules left unquantised (names, or "re:" regular expressions) besides the LM head."""
    if scheme.checkpoint_format == "fp8":
        config: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": scheme.activations,
                        "modules_to_not_convert": ["lm_head", *ignore]}
        if scheme.weights == "block":
            config["weight_block_size"] = list(scheme.block)
        return config
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": scheme.weights,
               "block_structure": list(scheme.block) if scheme.weights == "block" else None, "observer": "minmax"}
    inputs: dict | None = None
    if scheme.activations == "dynamic":
        per_group = scheme.weights == "block"
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                  "strategy": "group" if per_group else "token", "group_size": scheme.block[1] if per_group else None}
    elif scheme.activations == "static":
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", *ignore], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}}}


def _block_scales(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N / rows), ceil(K / cols)]: each block's largest magnitude / FP8_MAX."""
    rows, cols = block
    n, k = weight.shape
    padded = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols)
    padded[:n, :k] = weight.abs()
    return padded.view(padded.shape[0] // rows, rows, -1, cols).amax(dim=(1, 3)) / FP8_MAX


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def quantize_weight(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, its scale as the checkpoint stores it, the dequantised weight in float32)."""
    weight = weight.float()
    if scheme.weights == "block":
        scale = _block_scales(weight, scheme.block)
        full = _expand(scale, weight.shape, scheme.block)
    elif scheme.weights == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1], as llm-compressor stores it
        full = scale
    else:
        scale = (weight.abs().amax() / FP8_MAX).reshape(1 if scheme.checkpoint_format == "compressed-tensors" else ())
        full = scale
    quantized = (weight / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale, quantized.float() * full


def write_fp8_checkpoint(model_dir: str, out_dir: str, scheme: Fp8Scheme, input_scales: dict[str, float] | None = None,
                         ignored: Collection[str] = (), ignore: list[str] | None = None) -> tuple[str, str]:
    """Write model_dir's FP8 checkpoint to out_dir/fp8 and its dequantised oracle to out_dir/oracle
    (returned). input_scales: static activation scales by projection name (q_proj...); ignored:
    modules left unquantised (model.layers.0.mlp.down_proj), which the config's ignore list names
    (as ignore says, when given)."""
    fp8_dir, oracle_dir = os.path.join(out_dir, "fp8"), os.path.join(out_dir, "oracle")
    for path in (fp8_dir, oracle_dir):
        shutil.copytree(model_dir, path)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    block_fp8 = scheme.checkpoint_format == "fp8" and scheme.weights == "block"
    scale_name = "weight_scale_inv" if block_fp8 else "weight_scale"
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not QUANTIZED.fullmatch(name) or prefix in ignored:
            quantized[name] = dequantized[name] = tensor
            continue
        quantized[name], quantized[f"{prefix}.{scale_name}"], dequantized[name] = quantize_weight(tensor, scheme)
        if scheme.activations == "static":
            assert input_scales is not None
            projection = prefix.rsplit(".", 1)[1]
            quantized[f"{prefix}.input_scale"] = torch.tensor(input_scales[projection], dtype=torch.float32)
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"))
    save_file(dequantized, os.path.join(oracle_dir, "model.safetensors"))
    config_path = os.path.join(fp8_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(scheme, list(ignored) if ignore is None else ignore)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return fp8_dir, oracle_dir


def fake_quantize(x: torch.Tensor, activations: str, group: int | None, static_scale: float | None) -> torch.Tensor:
    """x rounded as an FP8 layer's input: per token (per token and group of columns), or by a
    static scale."""
    if activations == "static":
        assert static_scale is not None
        return (x / static_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * static_scale
    width = x.shape[-1]
    group = group or width
    padded = torch.nn.functional.pad(x, (0, -(-width // group) * group - width))
    groups = padded.view(*x.shape[:-1], -1, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    rounded = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return rounded.view(*x.shape[:-1], -1)[..., :width]


def _experts_forward(experts: torch.nn.Module, quantize_input: Callable[[torch.Tensor], torch.Tensor],
                    quantize_hidden: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """transformers' Qwen3MoeExperts.forward with the projections' inputs rounded to FP8."""
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():  # in expert order, as transformers
            tokens, slots = torch.where(top_k_index == expert)
            gate, up = F.linear(quantize_input(hidden[tokens]), experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(quantize_hidden(experts.act_fn(gate) * up), experts.down_proj[expert])
            out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None])
        return out
    return forward


@torch.no_grad()
def hf_fp8_greedy(oracle_dir: str, scheme: Fp8Scheme, prompts: list[list[int]], max_tokens: int,
                  input_scales: dict[str, float] | None = None, ignored: Collection[str] = ()) -> list[list[int]]:
    """Greedy tokens of the dequantised model in transformers (float32), each quantised layer's
    input (not the ignored modules') rounded to FP8 as the scheme says."""
    model = AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()
    if scheme.activations != "none":
        group = scheme.block[1] if scheme.weights == "block" else None

        def quantizer(projection: str) -> Callable[[torch.Tensor], torch.Tensor]:
            shared = SIBLINGS.get(projection, projection)
            static = None if input_scales is None else max(
                scale for p, scale in input_scales.items() if SIBLINGS.get(p, p) == shared)
            return lambda x: fake_quantize(x, scheme.activations, group, static)

        for name, module in model.named_modules():
            if QUANTIZED.fullmatch(f"{name}.weight") and name not in ignored:
                quantize = quantizer(name.rsplit(".", 1)[1])
                module.register_forward_pre_hook(lambda _, args, quantize=quantize: (quantize(args[0]),))
            elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):  # transformers' packed experts
                module.forward = _experts_forward(module, quantizer("gate_proj"), quantizer("down_proj"))
    results = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        results.append(ids[len(prompt):])
    return results
