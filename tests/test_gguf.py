"""GGUF checkpoints: tiny random models written as llama.cpp writes them load to the same
weights, config, tokenizer and text as their safetensors originals; what minivllm cannot
load is a ValueError that names it."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoConfig, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.gguf_loader import gguf_tensors
from minivllm.loader import safetensors_tensors

GGUF_ARCHITECTURE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
PROMPTS = ["The quick brown fox", "Once upon a time there was", "A language model reads a prompt"]


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the q/k row order llama.cpp's rope wants."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(model_dir: str, path: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               arch: str | None = None, extra_tensors: dict[str, np.ndarray] | None = None) -> str:
    """Write a Hugging Face checkpoint as llama.cpp's converter would: metadata, tokenizer,
    tensors under gguf's own names (q/k permuted for llama), 2-D weights as qtype."""
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    arch = arch or GGUF_ARCHITECTURE[config.architectures[0]]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_token_list(tokens)
    special = set(tokenizer.all_special_ids)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch, gguf.MODEL_ARCH.LLAMA)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in safetensors_tensors(model_dir):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        weight = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            weight = _llama_cpp_permute(weight, heads)
        if weight.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
        else:  # llama.cpp keeps norms and biases in float32
            writer.add_tensor(name, weight)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    _write(writer)
    return path


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's GGUF files get their config and tokenizer cache (gguf_hf_dir) in its own
    directory, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("architecture,tied", [("LlamaForCausalLM", False), ("LlamaForCausalLM", True),
                                               ("Qwen2ForCausalLM", False), ("Qwen3ForCausalLM", True)])
def test_gguf_loads_as_its_safetensors_original(architecture: str, tied: bool, tiny_model_factory,
                                                tmp_path) -> None:
    model_dir = tiny_model_factory(architecture, tie_word_embeddings=tied)
    path = write_gguf(model_dir, str(tmp_path / "model.gguf"))
    original = dict(safetensors_tensors(model_dir))
    loaded = dict(gguf_tensors(path))
    if tied:
        original.pop("lm_head.weight", None)  # transformers may save the tied copy
    assert sorted(loaded) == sorted(original)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, original[name].float(), rtol=0, atol=0, msg=name)

    from_gguf = LLM(path, dtype="float32", max_model_len=256)
    from_dir = LLM(model_dir, dtype="float32", max_model_len=256)
    config = from_gguf.llm_engine.config.hf_config
    assert config.architectures == [architecture] and config.tie_word_embeddings == tied
    gguf_tokenizer, dir_tokenizer = from_gguf.get_tokenizer(), from_dir.get_tokenizer()
    for prompt in PROMPTS + ["naïve café 日本語 😀"]:
        assert gguf_tokenizer.encode(prompt) == dir_tokenizer.encode(prompt)
    assert gguf_tokenizer.chat_template == dir_tokenizer.chat_template
    assert _greedy(from_gguf) == _greedy(from_dir)


def test_quantised_gguf_dequantises_close_to_the_original(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("LlamaForCausalLM")
    path = write_gguf(model_dir, str(tmp_path / "q8.gguf"), GGMLQuantizationType.Q8_0)
    original = dict(safetensors_tensors(model_dir))
    for name, tensor in gguf_tensors(path):
        # Q8_0: 8-bit values with one scale per 32, so within half a step of the block's max.
        step = original[name].abs().max() / 127
        torch.testing.assert_close(tensor, original[name].float(), rtol=0, atol=float(step), msg=name)
    outputs = _greedy(LLM(path, dtype="float32", max_model_len=256))
    assert all(len(tokens) == 12 for tokens in outputs)


def test_unsupported_architecture_is_named(tmp_path) -> None:
    path = str(tmp_path / "gemma.gguf")
    writer = gguf.GGUFWriter(path, "gemma2")
    _write(writer)
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma2'.*not supported.*llama, qwen2, qwen3"):
        LLM(path)


def test_unsupported_quantisation_type_is_named(tmp_path) -> None:
    path = str(tmp_path / "iq4.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    # IQ4_NL packs 32 values in 18 bytes; any bytes do, they are refused before being read.
    iq4 = np.zeros((64, 128 // 32 * 18), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_down.weight", iq4, raw_dtype=GGMLQuantizationType.IQ4_NL)
    _write(writer)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight'.*IQ4_NL.*does not dequantise. Supported: F32"):
        list(gguf_tensors(path))


def test_rope_freqs_are_refused(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("LlamaForCausalLM")
    path = write_gguf(model_dir, str(tmp_path / "llama31.gguf"),
                      extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"rope scaling.*rope_freqs.*Hugging Face directory"):
        LLM(path)


def test_missing_and_corrupt_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"GGUF file '.*missing.gguf' does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="Could not read GGUF file"):
        LLM(str(corrupt))


def test_load_format_must_fit_the_path(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="load_format='gguf' does not fit"):
        EngineConfig(model_dir, load_format="gguf")
    path = write_gguf(model_dir, str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="load_format='safetensors' does not fit"):
        EngineConfig(path, load_format="safetensors")
    assert EngineConfig(path, load_format="gguf").hf_config.head_dim == 16
