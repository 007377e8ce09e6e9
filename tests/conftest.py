"""Shared fixtures: the demo tokenizer and tiny random checkpoints, built once per session."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter; this must be set before
# anything (transformers, via torch._dynamo) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from minivllm.demo import build_tiny_model, build_tokenizer  # noqa: E402

TinyModelFactory = Callable[..., str]

# Test models are tiny: a second intra-op thread buys nothing, and on a busy CI machine
# OpenMP's spin-waiting threads make each tiny matmul ~50x slower (measured: a 2-layer
# forward 250 ms instead of 4 ms). OMP_NUM_THREADS, when set, still wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """The demo byte-level BPE tokenizer (the one every tiny model ships with)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`factory(architecture="Qwen3ForCausalLM", **kwargs) -> model dir`.

    kwargs are build_tiny_model's (dtype, tie_word_embeddings, max_shard_size, seed) and
    config overrides. Each distinct set of arguments is built once per test session.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, str] = {}

    def factory(architecture: str = "Qwen3ForCausalLM", **kwargs: Any) -> str:
        # default=str turns torch dtypes into "torch.float32"; sort_keys makes the key
        # independent of argument order.
        key = json.dumps([architecture, kwargs], sort_keys=True, default=str)
        if key not in built:
            name = f"{architecture}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            built[key] = build_tiny_model(str(root / name), architecture, **kwargs)
        return built[key]

    return factory


@pytest.fixture
def cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Cascade attention enabled for small test batches (2+ sequences sharing 16+ tokens);
    the returned list grows by one on every cascade kernel call."""
    import minivllm.attention.triton_backend as triton_backend
    from minivllm.executor import model_runner

    monkeypatch.setattr(model_runner, "CASCADE_MIN_PREFIX_TOKENS", 16)
    monkeypatch.setattr(model_runner, "CASCADE_MIN_SEQS", 2)
    calls: list[int] = []
    original = triton_backend.paged_attention_decode_shared_prefix

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_attention_decode_shared_prefix", spy)
    return calls
