"""serving.py without a server: the template written for the common event is exactly what
encoding its dict gives; an engine error ends a response; the request's output format."""

import json

import pytest
from tokenizers import AddedToken

from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from minivllm.entrypoints.openai.serving import _NOT_JSON, _ChatResponse, _CompletionResponse, _json_value
from minivllm.outputs import CompletionOutput
from minivllm.sampling_params import StructuredOutputsParams

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


def test_an_engine_error_is_a_500() -> None:
    """finish_reason "error" (vLLM's request-level internal error, a grammar that did not
    compile here) ends the response with a 500, as vLLM answers it."""
    response = _CompletionResponse("cmpl-1", "tiny", CompletionRequest(prompt="x"), 1, [], [], str)
    response.prompts = {"cmpl-1-0": (0, 1)}
    failed = ("cmpl-1-0", [(0, "", [], None, None, "error", None)], True, (None, None, None), 0, None)
    with pytest.raises(OpenAIError) as error:
        response.deltas([failed])
    assert error.value.status == 500


def test_response_format_and_structured_outputs_make_one_constraint() -> None:
    """response_format's constraint joins structured_outputs' options (vLLM's merge); text
    asks for none."""
    schema = {"type": "object"}
    request = CompletionRequest(prompt="x", structured_outputs={"disable_any_whitespace": True},
                                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert request.structured_outputs_params() == StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert request.structured_outputs_field == "response_format"
    assert CompletionRequest(prompt="x", response_format={"type": "text"}).structured_outputs_params() is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"})
    assert chat.structured_outputs_params() == StructuredOutputsParams(json_object=True)
    regex = CompletionRequest(prompt="x", structured_outputs={"regex": "a+"})
    assert regex.sampling_params(4, None, None, {}).structured_outputs == StructuredOutputsParams(regex="a+")
    assert regex.structured_outputs_field == "structured_outputs"
