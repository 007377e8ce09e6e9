"""Load weights into a model: checkpoint tensors (name, tensor) from a source, each copied
into the parameter that owns it (or random weights, for speed tests)."""

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from minivllm.config import is_gguf
from minivllm.models.llama import LlamaForCausalLM

NamedTensors = Iterator[tuple[str, torch.Tensor]]


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, part: object = 0) -> None:
    param.data.copy_(loaded)


def _safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir!r}: minivllm loads safetensors checkpoints "
                         "(or use load_format='dummy' for random weights).")
    return files


def safetensors_tensors(model_dir: str) -> NamedTensors:
    """Every tensor of a Hugging Face model directory's safetensors files."""
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has keys() but no __iter__)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"Could not read {path!r} ({error}): the file is missing, truncated or corrupt; "
                             "download the checkpoint again.") from error


def load_weights(model: LlamaForCausalLM, path: str) -> None:
    """Weights from a Hugging Face model directory or a .gguf file."""
    if is_gguf(path):
        from minivllm.gguf_loader import gguf_tensors  # the gguf package only for GGUF models
        tensors = gguf_tensors(path)
    else:
        tensors = safetensors_tensors(path)
    load_named_tensors(model, tensors, path)


def load_named_tensors(model: LlamaForCausalLM, tensors: NamedTensors, source: str) -> None:
    """Copy checkpoint tensors, named as in Hugging Face checkpoints, into the model (its
    checkpoint_target says which parameter, and which part of it, each one fills); every
    parameter must get one. source names the checkpoint in errors."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded_names: set[str] = set()
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tied:
            continue  # tied: the embedding's weight is the head's
        target, part = model.checkpoint_target(name)
        if target not in params:
            raise ValueError(f"Checkpoint tensor {name!r} has no place in the model: "
                             "is config.json's architecture right for these weights?")
        param = params[target]
        # Sharded and packed layers know where their slice of a tensor goes.
        owner = model.get_submodule(target.rsplit(".", 1)[0])
        loader = getattr(owner, "weight_loader", _default_weight_loader)
        loader(param, tensor, part)  # each loader converts (an FP8 layer's reads float8 and scales)
        loaded_names.add(target)
    missing = set(params) - loaded_names
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"The checkpoint in {source!r} lacks weights for: {', '.join(sorted(missing))}.")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random weights, as vLLM's load_format='dummy': for speed tests, not for text."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(("scale", "scale_inv")):  # FP8 layers' scales: 1
            param.data.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            if param.dtype == torch.float8_e4m3fn:  # no float8 random numbers: drawn in float32
                values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                param.data.copy_(values.uniform_(-1e-3, 1e-3, generator=generator))
            else:
                param.data.uniform_(-1e-3, 1e-3, generator=generator)
            seed += 1
