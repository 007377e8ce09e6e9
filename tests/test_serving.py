"""serving.py's event JSON without a server: the template written for the common event is
exactly what encoding its dict gives."""

import json

import pytest
from tokenizers import AddedToken

from minivllm.entrypoints.openai.protocol import CompletionRequest
from minivllm.entrypoints.openai.serving import _NOT_JSON, _ChatResponse, _CompletionResponse, _json_value
from minivllm.outputs import CompletionOutput

TEXTS = ["", " the", 'quote " and \\ backslash', "line\nbreak\ttab\r", "\x00\x1f control", "é ü ß", "日本語",
         "emoji 🙂", "\ud800 lone surrogate", "</script>"]


@pytest.mark.parametrize("text", TEXTS)
def test_chunk_templates_are_the_chunk_json(text: str) -> None:
    completion = _CompletionResponse("cmpl-1", "tiny", CompletionRequest(prompt=["w", "x", "y", "z"]), 1, [], [],
                                     str)
    chat = _ChatResponse("chatcmpl-1", "tiny", None, 1, [])
    running = (0, text, [5], None, None, None, None)  # CompletionOutput's fields
    for response in (completion, chat):
        template = response.chunk_json(3, running)
        assert template == json.dumps(response.chunk_choice(3, CompletionOutput(*running)))
        assert json.loads(template)["index"] == 3


def test_chunks_that_leave_the_template() -> None:
    """Finished choices, logprobs and echo are encoded from their dict."""
    finished = (0, "end", [5], None, None, "stop", "###")
    response = _CompletionResponse("cmpl-1", "tiny", CompletionRequest(prompt="x"), 1, [], [], str)
    assert json.loads(response.chunk_json(0, finished)) == {"index": 0, "text": "end", "logprobs": None,
                                                            "finish_reason": "stop", "stop_reason": "###"}
    echo = _CompletionResponse("cmpl-1", "tiny", CompletionRequest(prompt="x", echo=True), 1, [("Hi", [7])], [],
                               str)
    running = (0, " there", [5], None, None, None, None)
    assert json.loads(echo.chunk_json(0, running))["text"] == "Hi there"
    assert json.loads(echo.chunk_json(0, running))["text"] == " there"  # the prompt only once


def test_tokenizer_config_as_json() -> None:
    """/tokenizer_info's values: AddedTokens as their text, what JSON cannot carry left out."""
    config = {"eos_token": AddedToken("</s>", special=True), "ids": (1, 2.5, float("nan")),
              "added_tokens_decoder": {0: AddedToken("<unk>")}, "path": object(), "max": float("inf")}
    value = _json_value(config)
    assert value == {"eos_token": "</s>", "ids": [1, 2.5], "added_tokens_decoder": {"0": "<unk>"}}
    assert json.loads(json.dumps(value, allow_nan=False)) == value
    assert _json_value(object()) is _NOT_JSON
