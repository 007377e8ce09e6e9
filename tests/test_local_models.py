"""minivllm.local_models: the tokenizer, tiny random checkpoints that transformers loads and that
generate varied text, the demo model cache, and the real-size config presets."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from benchmarks import presets
from minivllm import local_models

TinyModelFactory = Callable[..., str]  # the tiny_model_factory fixture (conftest.py)

ARCHITECTURES = ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                 "Qwen3MoeForCausalLM"]
PROMPTS = ["Hello, my name is", "The capital of France is", "日本語 café 🎉"]
NEW_TOKENS = 24


def tensor_names(model_dir: str) -> dict[str, torch.dtype]:
    names: dict[str, torch.dtype] = {}
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys() but no __iter__)
                names[name] = f.get_slice(name).get_dtype()
    return names


# -- tokenizer --------------------------------------------------------------------------

def test_tokenizer_is_deterministic_and_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.backend_tokenizer.to_str() == local_models.build_tokenizer().backend_tokenizer.to_str()
    assert len(tokenizer) == local_models.TOKENIZER_VOCAB_SIZE
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert set(tokenizer.all_special_tokens) == set(local_models.SPECIAL_TOKENS)
    text = "Hi café 日本語 🎉 “quotes”\n\tdef f(x): return x"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # real merges, not bytes
    # Some tokens hold part of a multi-byte character (what detokenization must handle).
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_tokenizer_chat_template_and_save(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    local_models.build_tokenizer(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert loaded.decode(loaded.encode(text), skip_special_tokens=True) == "system\nBe brief.\nuser\nHi\nassistant\n"
    assert loaded.chat_template == tokenizer.chat_template


# -- tiny models ------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tiny_model_generates_varied_text(architecture: str, tied: bool, tiny_model_factory: TinyModelFactory,
                                          tokenizer: PreTrainedTokenizerFast) -> None:
    model_dir = tiny_model_factory(architecture, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == architecture
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[:, batch.input_ids.shape[1]:]
    eos_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for row in generated.tolist():
        assert not eos_ids & set(row), "a random model should not stop this early"
        assert len(set(row)) >= NEW_TOKENS // 2, f"repetitive output {row}"
    assert len({tuple(r) for r in generated.tolist()}) == len(PROMPTS)
    # Greedy comparisons against transformers need clear winners: no near-ties.
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4


def test_architecture_specific_weights(tiny_model_factory: TinyModelFactory) -> None:
    qwen2 = tensor_names(tiny_model_factory("Qwen2ForCausalLM"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    qwen3 = tensor_names(tiny_model_factory("Qwen3ForCausalLM"))
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    assert "model.layers.0.self_attn.q_proj.bias" not in qwen3
    assert "lm_head.weight" in qwen3
    tied = tensor_names(tiny_model_factory("Qwen3ForCausalLM", tie_word_embeddings=True))
    assert "lm_head.weight" not in tied
    assert all(dtype == "F32" for dtype in qwen3.values())


def test_config_generation_config_and_overrides(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    config = AutoConfig.from_pretrained(model_dir)
    shape = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert shape == (64, 4, 2, 16)
    assert config.vocab_size == 768 and config.architectures == ["Qwen3ForCausalLM"]
    gen = json.loads(Path(model_dir, "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]  # <|endoftext|> and <|im_end|>, as Qwen ships it

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model_dir = tiny_model_factory("LlamaForCausalLM", num_key_value_heads=4, rope_scaling=scaling,
                                   dtype=torch.bfloat16, eos_token_id=5)
    config = AutoConfig.from_pretrained(model_dir)
    assert config.num_key_value_heads == 4
    # transformers 5 stores rope_theta and rope_scaling together as rope_parameters.
    assert config.rope_parameters == {**scaling, "rope_theta": 10000.0}
    assert set(tensor_names(model_dir).values()) == {"BF16"}
    assert json.loads(Path(model_dir, "generation_config.json").read_text())["eos_token_id"] == 5
    AutoModelForCausalLM.from_pretrained(model_dir)  # loads as the real class does

    mistral = AutoConfig.from_pretrained(tiny_model_factory("MistralForCausalLM"))
    assert mistral.sliding_window is None


def test_weights_follow_the_seed(tiny_model_factory: TinyModelFactory, tmp_path: Path) -> None:
    def embedding(model_dir: str) -> torch.Tensor:
        with safe_open(str(Path(model_dir, "model.safetensors")), "pt") as f:
            return f.get_tensor("model.embed_tokens.weight")

    a = embedding(tiny_model_factory("LlamaForCausalLM"))
    assert torch.equal(a, embedding(local_models.build_tiny_model(str(tmp_path), "LlamaForCausalLM")))
    assert not torch.equal(a, embedding(tiny_model_factory("LlamaForCausalLM", seed=1)))


def test_sharded_save_has_an_index(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM", max_shard_size="100KB")
    index = json.loads(Path(model_dir, "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all(Path(model_dir, s).is_file() for s in shards)
    assert set(index["weight_map"]) == set(tensor_names(model_dir))
    # Same weights as the unsharded build.
    sharded = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_factory("Qwen3ForCausalLM")).state_dict()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_unknown_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        local_models.build_tiny_model(str(tmp_path), "GPT2LMHeadModel")


def test_demo_model_dir_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = local_models.demo_model_dir()
    assert path.startswith(str(tmp_path / "minivllm" / "demo-qwen3-"))
    assert AutoConfig.from_pretrained(path).architectures == ["Qwen3ForCausalLM"]
    mtime = os.path.getmtime(Path(path, "model.safetensors"))
    assert local_models.demo_model_dir() == path
    assert os.path.getmtime(Path(path, "model.safetensors")) == mtime
    assert os.listdir(tmp_path / "minivllm") == [os.path.basename(path)]  # no temp dirs left


# -- presets ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_write_loadable_configs(name: str, tmp_path: Path) -> None:
    path = presets.write_preset(name, str(tmp_path))
    config = AutoConfig.from_pretrained(path)
    preset = presets.PRESETS[name]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "rms_norm_eps"):
        assert getattr(config, key) == preset[key], key
    assert config.architectures == preset["architectures"]
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.dtype == torch.bfloat16
    assert len(AutoTokenizer.from_pretrained(path)) == local_models.TOKENIZER_VOCAB_SIZE
    assert not list(tmp_path.glob("*.safetensors"))
    # The architecture is real enough for transformers to build it (on the meta device).
    with torch.device("meta"):
        model = getattr(transformers, preset["architectures"][0])(config)
    expected = {"qwen3-0.6b": 0.6e9, "qwen3-8b": 8.2e9, "qwen3-30b-a3b": 30.5e9, "qwen3-30b-a3b-fp8": 30.5e9}[name]
    assert abs(sum(p.numel() for p in model.parameters()) - expected) / expected < 0.05


def test_presets_are_the_public_shapes() -> None:
    small, big = presets.PRESETS["qwen3-0.6b"], presets.PRESETS["qwen3-8b"]
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"]) == (1024, 28, 16)
    assert small["tie_word_embeddings"] and not big["tie_word_embeddings"]
    assert (big["hidden_size"], big["intermediate_size"], big["num_hidden_layers"]) == (4096, 12288, 36)
    moe = presets.PRESETS["qwen3-30b-a3b"]
    assert (moe["hidden_size"], moe["num_hidden_layers"], moe["num_key_value_heads"]) == (2048, 48, 4)
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (128, 8, 768)


def test_unknown_preset_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"qwen3-0\.6b.*qwen3-8b"):
        presets.write_preset("llama-70b", str(tmp_path))
