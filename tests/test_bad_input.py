"""Bad input as a user meets it: each case raises a ValueError that names the field and value
(and says what to change), and the engine keeps serving with nothing leaked."""

import os
import re
import shutil
from collections.abc import Callable

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import main

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"n": 2.0}, "n must be an integer, got 2.0"),
    ({"n": "2"}, "n must be an integer, got '2'"),
    ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*63\)"),
    ({"stop_token_ids": ["</s>"]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids .integers., got 5"),
    ({"stop": [3]}, "stop must be a string or a list of strings"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias values must be finite numbers, got inf for token 3"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias values must be finite numbers, got nan"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids .integers., got 'x'"),
    ({"logit_bias": [3]}, "logit_bias must be a dict of token id -> bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids must be a list of token ids"),
])
def test_invalid_sampling_params_name_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_numpy_integers_are_plain_ints_in_params() -> None:
    params = SamplingParams(n=np.int64(2), max_tokens=np.int32(4), seed=np.int64(7))
    assert (params.n, params.max_tokens, params.seed) == (2, 4, 7)
    assert all(type(v) is int for v in (params.n, params.max_tokens, params.seed))


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a prompt or a list of prompts"),
    (5, "prompts must be a prompt or a list of prompts"),
    (["fine", ""], "Prompt 1: The prompt is empty"),
    (["fine", {"prompt_token_ids": [1, 10**9]}], r"Prompt 1: Prompt token ids \[1000000000\]"),
    (["fine", {"prompt_token_ids": [-3, 1]}], r"Prompt 1: Prompt token ids \[-3\]"),
    (["fine", {"prompt_token_ids": [1, 2**64]}], r"Prompt 1: Prompt token ids \[18446744073709551616\]"),
    ([{"prompt_token_ids": [1, 2]}, 7], "Prompt 1: Unsupported prompt type int"),
])
def test_bad_prompts_name_their_index(llm: LLM, prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_clean_and_serving(llm)


def test_stop_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"stop_token_ids \[99999\] are outside the vocabulary"):
        llm.generate("hello", SamplingParams(stop_token_ids=[99999]), use_tqdm=False)
    _assert_clean_and_serving(llm)


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {5: 1.0, 99999: 2.0}}, r"logit_bias keys \[99999\] are outside the vocabulary"),
    ({"logit_bias": {-1: 2.0}}, r"logit_bias keys \[-1\] are outside the vocabulary"),
    ({"allowed_token_ids": [4, 99999]}, r"allowed_token_ids \[99999\] are outside the vocabulary"),
])
def test_logit_bias_and_allowed_ids_outside_the_vocabulary(llm: LLM, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", SamplingParams(**kwargs), use_tqdm=False)
    _assert_clean_and_serving(llm)


def test_logit_bias_keys_become_ints_and_values_are_clamped() -> None:
    params = SamplingParams(logit_bias={"7": 500, np.int64(8): -1e9, 9: 0.5})
    assert params.logit_bias == {7: 100.0, 8: -100.0, 9: 0.5}
    assert all(type(k) is int for k in params.logit_bias)


def test_no_prompts_is_no_outputs(llm: LLM) -> None:
    assert llm.generate([], GREEDY, use_tqdm=False) == []


@pytest.mark.parametrize("sampling_params", [{"temperature": 0}, "greedy", [GREEDY, {"temperature": 0}]])
def test_sampling_params_of_the_wrong_type(llm: LLM, sampling_params: object) -> None:
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["hi", "there"], sampling_params, use_tqdm=False)
    _assert_clean_and_serving(llm)


def test_chat_without_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match=re.escape("chat() got no messages")):
        llm.chat([], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("make", [
    lambda ids: np.array(ids, dtype=np.int64),
    lambda ids: torch.tensor(ids),
    lambda ids: [np.int64(t) for t in ids],
    lambda ids: [torch.tensor(t) for t in ids],
    lambda ids: {"prompt_token_ids": np.array(ids, dtype=np.int32)},
])
def test_numpy_and_torch_token_ids_are_accepted(llm: LLM, make: Callable[[list[int]], object]) -> None:
    ids = [11, 42, 7, 99]
    want = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    output = llm.generate(make(ids), GREEDY, use_tqdm=False)
    assert len(output) == 1 and output[0].prompt_token_ids == ids
    assert output[0].outputs[0].token_ids == want


def test_corrupt_safetensors_names_the_file(tmp_path, model_dir: str, capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (weights,) = [name for name in os.listdir(broken) if name.endswith(".safetensors")]
    path = broken / weights
    path.write_bytes(path.read_bytes()[:100])  # truncated mid-header
    with pytest.raises(ValueError, match=f"Could not read '{path}'.*truncated or corrupt"):
        LLM(str(broken), dtype="float32")
    with pytest.raises(SystemExit) as exit_info:  # the CLI says so in one line, no traceback
        main(["generate", "--model", str(broken), "--dtype", "float32"])
    assert exit_info.value.code == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_missing_tokenizer_files(tmp_path, model_dir: str) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in os.listdir(bare):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            os.remove(bare / name)
    with pytest.raises(ValueError, match=r"has no tokenizer files.*skip_tokenizer_init=True"):
        LLM(str(bare), dtype="float32")
    # With skip_tokenizer_init it runs on token ids.
    output = LLM(str(bare), dtype="float32", skip_tokenizer_init=True).generate(
        {"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 3


def test_generate_help_documents_the_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "tokens to generate per prompt, at most (default: 64)" in help_text
    assert "0 is greedy (default: 0.0)" in help_text


def _assert_clean_and_serving(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3
