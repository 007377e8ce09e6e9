"""Tool calling and reasoning through a real `minivllm serve --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3` on a tiny random model that speaks Qwen's
formats (tests/tool_models.py), driven by the official `openai` client. A random model calls
no tools of its own: these tests follow the messages through the template, the reasoning
split, and the calls that tool_choice forces, against the raw text of the same sampling from
/v1/completions. The full call -> result -> answer loop on a real model is in
test_smollm2.py."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.server_utils import RemoteServer, openai_error, serving
from tests.tool_models import TIME_TOOL, WEATHER_TOOL, build_tool_model

pytestmark = pytest.mark.slow  # a server subprocess

TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
NO_THINKING = {"enable_thinking": False}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tool_model(str(tmp_path_factory.mktemp("tool_model")))


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[RemoteServer]:
    with serving(model_dir, "--max-model-len", "512", "--kv-cache-memory-bytes", str(24 << 20),
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                 stop_signal=signal.SIGINT) as server:
        yield server


def extra(model: Any, name: str) -> Any:
    """A field the openai client does not declare (vLLM's `reasoning`), None where absent."""
    return (model.model_extra or {}).get(name)


def raw_text(server: RemoteServer, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
             template_kwargs: dict[str, Any], **sampling: Any) -> str:
    """What the model writes after the chat prompt, as /v1/completions gives it (no parsing)."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           **template_kwargs)
    body = {"model": "tiny", "prompt": prompt, **sampling}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_tool_messages_render_through_the_template(server: RemoteServer, tokenizer: PreTrainedTokenizerBase) -> None:
    """An assistant's tool calls (arguments as OpenAI's JSON text) and a tool's result reach the
    template as vLLM passes them: the template, which refuses arguments that are not a mapping,
    renders exactly what transformers renders from the parsed conversation."""
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Sunny, 24 C."}]
    parsed = [*messages[:1], {**messages[1], "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              messages[2]]
    expected = tokenizer.apply_chat_template(parsed, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    client = server.client()
    response = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=2)
    assert response.usage.prompt_tokens == len(expected)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == len(expected)


def test_reasoning_goes_to_its_own_field(server: RemoteServer, tokenizer: PreTrainedTokenizerBase) -> None:
    """What the model writes before </think> is the message's `reasoning`, the rest its content,
    whole and streamed; with enable_thinking false it is all content."""
    allowed = [tokenizer.convert_tokens_to_ids("</think>"), *tokenizer.encode(" the fox.", add_special_tokens=False)]
    sampling = {"max_tokens": 16, "temperature": 1.0, "seed": 5, "allowed_token_ids": allowed, "ignore_eos": True}
    raw = raw_text(server, tokenizer, QUESTION, {}, **sampling)
    reasoning, end, content = raw.partition("</think>")
    assert end and reasoning and content, raw  # the seed gives both parts
    client = server.client()
    extra_body = {k: sampling.pop(k) for k in ("allowed_token_ids", "ignore_eos")}
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, extra_body=extra_body, **sampling)
    message = whole.choices[0].message
    assert (extra(message, "reasoning"), message.content, message.tool_calls) == (reasoning, content, None)
    assert extra(message, "reasoning_content") == reasoning
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, extra_body=extra_body, stream=True,
                                                 **sampling))
    assert "".join(extra(c.choices[0].delta, "reasoning") or "" for c in chunks) == reasoning
    assert "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == "length"

    raw = raw_text(server, tokenizer, QUESTION, NO_THINKING, **sampling, **extra_body)
    off = client.chat.completions.create(model="tiny", messages=QUESTION,
                                         extra_body={**extra_body, "chat_template_kwargs": NO_THINKING}, **sampling)
    assert (extra(off.choices[0].message, "reasoning"), off.choices[0].message.content) == (None, raw)


def test_auto_without_a_call_is_content(server: RemoteServer, tokenizer: PreTrainedTokenizerBase) -> None:
    sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    raw = raw_text(server, tokenizer, QUESTION, {"tools": [WEATHER_TOOL], **NO_THINKING}, **sampling)
    response = server.client().chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINKING})
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (raw, None, "length")


def test_a_named_function_is_called_with_the_output_as_arguments(server: RemoteServer,
                                                                 tokenizer: PreTrainedTokenizerBase) -> None:
    """tool_choice naming a function: the call is that function's, its arguments the output
    constrained to the function's parameters schema (the same text /v1/completions writes under
    that schema); the finish reason stays the engine's, as OpenAI and vLLM have it."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    schema = TIME_TOOL["function"]["parameters"]
    raw = raw_text(server, tokenizer, QUESTION, {"tools": tools, **NO_THINKING}, max_tokens=8, temperature=0,
                   ignore_eos=True, skip_special_tokens=False, structured_outputs={"json": schema})
    assert raw.startswith("{")
    kwargs: dict[str, Any] = {"model": "tiny", "messages": QUESTION, "tools": tools, "max_tokens": 8, "temperature": 0,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                              "extra_body": {"ignore_eos": True, "chat_template_kwargs": NO_THINKING}}
    client = server.client()
    choice = client.chat.completions.create(**kwargs).choices[0]
    [call] = choice.message.tool_calls
    assert TOOL_CALL_ID.fullmatch(call.id) and call.type == "function"
    assert (call.function.name, call.function.arguments, choice.finish_reason) == ("get_time", raw, "length")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert TOOL_CALL_ID.fullmatch(deltas[0].id) and deltas[0].type == "function"
    assert deltas[0].function.name == "get_time" and all(d.id is None and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == raw
    assert chunks[-1].choices[0].finish_reason == "length"


def test_bad_tool_requests_get_400_and_the_server_keeps_serving(server: RemoteServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    chat = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, "tools": [WEATHER_TOOL]}
    bad_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "not one of tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": []}, "tools", "empty"),
        ({"messages": [*QUESTION, bad_call]}, "messages.1.tool_calls.0.function.arguments", "must be JSON text"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools' field"),
    ]
    for change, param, fragment in cases:
        response = httpx.post(url, json={**chat, **change})
        assert fragment in openai_error(response, 400), (change, response.text)
        assert response.json()["error"]["param"] == param
        assert httpx.post(url, json=chat).status_code == 200
