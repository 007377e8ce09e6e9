"""Tool calls and reasoning without a server: the tool-call parsers and reasoning parsers on
text fed to them (whole, and streamed in pieces cut at awkward places), the requests'
validation, the JSON schemas forced tool choices constrain the output to, and the chat
responses and stream chunks the server builds from an engine's deltas."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from minivllm.entrypoints.openai.chat_message import MessageParsing
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.serving import _ChatResponse, _Choice, message_parsing
from minivllm.outputs import CompletionOutput
from minivllm.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser, reasoning_parser_class
from minivllm.tool_parsers import TOOL_PARSERS, tool_parser_class
from minivllm.tool_parsers.base import ToolCall, ToolParser
from minivllm.tool_parsers.forced import NamedFunctionCall, RequiredFunctionCalls, required_calls_schema
from minivllm.tool_parsers.hermes import HermesToolParser
from minivllm.tool_parsers.llama3_json import Llama3JsonToolParser
from minivllm.tool_parsers.partial_json import ObjectScanner
from tests.tool_models import TIME_TOOL, WEATHER_TOOL, tool_tokenizer

TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def cut_ways(text: str) -> list[list[str]]:
    """text in pieces: one character at a time, a few sizes, and cut inside every marker and
    JSON string (the awkward places)."""
    ways = [[text], list(text)] + [pieces(text, list(range(size, len(text), size))) for size in (2, 3, 5, 8)]
    awkward = [m.start() + k for m in re.finditer(r"<[^>]*>|\"[^\"]*\"", text) for k in (1, 3)]
    return [*ways, pieces(text, [c for c in awkward if 0 < c < len(text)])]


def streamed(parser: ToolParser, parts: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The content and calls (id, name, arguments) a stream of parts adds up to; checks the
    deltas' shape: a call's first delta has its id and name, the later ones arguments only."""
    content = ""
    calls: list[dict[str, Any]] = []
    for piece, last in [(part, False) for part in parts] + [("", True)]:
        more, deltas = parser.finish() if last else parser.stream(piece)
        content += more
        for delta in deltas:
            if delta.index == len(calls):
                assert delta.name is not None and TOOL_CALL_ID.fullmatch(delta.id or ""), delta
                calls.append({"id": delta.id, "name": delta.name, "arguments": delta.arguments})
            else:
                assert delta.name is None and delta.id is None and delta.arguments, delta
                calls[delta.index]["arguments"] += delta.arguments
    return content, calls


def call_list(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def streamed_list(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(call["name"], json.loads(call["arguments"])) for call in calls]


# --- tool-call parsers ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    '{"name": "f", "arguments": {"s": "a \\"}\\\\", "n": [1, {"x": null}], "t": true, "e": -1.5e3}}',
    '  {"a": "\\u00e9\\n", "b": [], "c": {}, "d": false}',
    "{}",
])
def test_object_scanner_read_piece_by_piece_is_read_whole(text: str) -> None:
    """A scan that goes on where the last stopped finds what one scan of the whole finds:
    every top-level value's span, complete values decoding as JSON's."""
    whole = ObjectScanner(0).scan(text)
    assert whole.end == len(text) and not whole.malformed
    assert {key: whole.complete_value(text, key) for key in whole.fields} == json.loads(text)
    scanner = ObjectScanner(0)
    for end in range(len(text) + 1):
        scan = scanner.scan(text[:end])
        assert all(value_end is None or value_end <= end for _, value_end in scan.fields.values())
    assert scan == whole


@pytest.mark.parametrize("text", ['["a"]', '{"a" 1}', '{"a": 1 "b": 2}', "{'a': 1}", '{"a": 1,}'])
def test_object_scanner_stops_at_what_is_not_an_object(text: str) -> None:
    scanner = ObjectScanner(0)
    scans = [scanner.scan(text[:end]) for end in range(len(text) + 1)]
    assert scans[-1].malformed and scans[-1].end is None



HERMES_CASES = [
    # (output, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome \\"Caput\\" {mundi}"}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": 'Rome "Caput" {mundi}'}), ("get_time", {"zone": "CET"})]),
    # Cut short after a complete call: still a call.
    ('<tool_call>{"name": "f", "arguments": {"a": [1, {"b": null}]}}', None, [("f", {"a": [1, {"b": None}]})]),
    ("No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.", []),
]


@pytest.mark.parametrize("output, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed(output: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got_calls = HermesToolParser().extract(output)
    assert (got_content, call_list(got_calls)) == (content, calls)
    assert all(TOOL_CALL_ID.fullmatch(call.id) for call in got_calls)
    for parts in cut_ways(output):
        streamed_content, streamed_calls = streamed(HermesToolParser(), parts)
        assert (streamed_content or None, streamed_list(streamed_calls)) == (content, calls), parts


@pytest.mark.parametrize("output, named", [
    ("Sure. <tool_call>\nget_weather(city='Paris')\n</tool_call>", False),  # not JSON
    ('<tool_call>\n{"function": "get_weather"}\n</tool_call>', False),  # no name
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', True),  # malformed JSON
    ('<tool_call>\n{"name": "get_weather"}\n</tool_call>', True),  # no arguments
])
def test_hermes_malformed_calls_are_content(output: str, named: bool) -> None:
    """As vLLM: an output whose calls do not parse is all content, with no calls. A stream
    that never names a function sends it all as content too; one that did has sent the call."""
    assert HermesToolParser().extract(output) == (output, [])
    for parts in cut_ways(output):
        content, calls = streamed(HermesToolParser(), parts)
        if named:
            assert content.strip() == output[:output.find("<tool_call>")].strip()
            assert [call["name"] for call in calls] == ["get_weather"]
        else:
            assert (content, calls) == (output, [])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "arguments": {"x": "a;b}"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": "a;b}"}), ("g", {})]),
    ("  \n{\"name\": \"f\", \"parameters\": {\"n\": 12}}\n", None, [("f", {"n": 12})]),
    ("The answer is {42}.", "The answer is {42}.", []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ('{"name": "f", "parameters": {"a": 1}} and then some text', '{"name": "f", "parameters": {"a": 1}} and then '
     "some text", []),
]


@pytest.mark.parametrize("output, content, calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(output: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got_calls = Llama3JsonToolParser().extract(output)
    assert (got_content, call_list(got_calls)) == (content, calls)
    for parts in cut_ways(output):
        streamed_content, streamed_calls = streamed(Llama3JsonToolParser(), parts)
        if calls or not streamed_calls:  # text after a streamed call cannot be taken back
            assert (streamed_content or None, streamed_list(streamed_calls)) == (content, calls), parts


def test_streamed_arguments_are_the_models_text_piece_by_piece() -> None:
    """Arguments stream as the model writes them (each piece extends the last): the name goes
    first, even when the model writes the arguments before it."""
    output = '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>'
    parser = HermesToolParser()
    deltas = [delta for piece in output for delta in parser.stream(piece)[1]]
    assert len(deltas) == 1 and deltas[0].name == "get_weather" and deltas[0].arguments == '{"city": "Paris"}'
    parser = HermesToolParser()
    deltas = [delta for piece in '<tool_call>{"name": "f", "arguments": {"a": "xyz"}}' for delta in
              parser.stream(piece)[1]]
    assert [delta.arguments for delta in deltas] == ["", "{", '"', "a", '"', ":", " ", '"', "x", "y", "z", '"', "}"]


def test_required_and_named_calls_are_read_as_json() -> None:
    output = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, got = RequiredFunctionCalls().extract(output)
    assert content == "" and call_list(got) == calls
    for parts in cut_ways(output):
        assert streamed_list(streamed(RequiredFunctionCalls(), parts)[1]) == calls
    # Output that is not an array of calls (constrained decoding cut short) has none.
    for bad in ('[{"name": "get_weather", "parameters": {"city"', "Paris", '[{"parameters": {}}]', "{}"):
        assert RequiredFunctionCalls().extract(bad) == ("", [])
    content, got = NamedFunctionCall("get_weather").extract('{"city": "Paris"}')
    assert content == "" and call_list(got) == [("get_weather", {"city": "Paris"})]
    for parts in cut_ways('{"city": "Paris"}'):
        assert streamed(NamedFunctionCall("get_weather"), parts)[1][0]["arguments"] == '{"city": "Paris"}'
    assert streamed(NamedFunctionCall("get_time"), [])[1][0]["arguments"] == ""  # no output: still the call


def test_forced_tool_choice_schemas() -> None:
    tools = [(t["function"]["name"], t["function"].get("parameters")) for t in (WEATHER_TOOL, TIME_TOOL)]
    schema = required_calls_schema([*tools, ("ping", None)])
    assert schema["type"] == "array" and schema["minItems"] == 1
    anyof = schema["items"]["anyOf"]
    assert [item["properties"]["name"] for item in anyof] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]},
        {"type": "string", "enum": ["ping"]}]
    assert anyof[0]["properties"]["parameters"] == WEATHER_TOOL["function"]["parameters"]
    assert anyof[2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(item["required"] == ["name", "parameters"] for item in anyof)
    # $defs move to the top, where the references point; the tools' own schemas stay as they were.
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": {"type": "array"}}}
    schema = required_calls_schema([("go", point)])
    assert schema["$defs"] == {"Point": {"type": "array"}} and "$defs" not in schema["items"]["anyOf"][0]
    assert "$defs" in point
    other = {**point, "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(ValueError, match="'Point'"):
        required_calls_schema([("go", point), ("stay", other)])


def test_the_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert tool_parser_class("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser_class("mistral")


# --- reasoning parsers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tool_tokenizer()


def split_streamed(parser: ReasoningParser, prompt: list[int], parts: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream(prompt)
    pairs = [stream.feed(part) for part in parts] + [stream.finish()]
    return "".join(r for r, _ in pairs) or None, "".join(c for _, c in pairs) or None


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("output, reasoning, content", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("The user greets me.</think>Hello!", "The user greets me.", "Hello!"),  # <think> was in the prompt
    ("<think>Cut short, still thinking", "Cut short, still thinking", None),
    ("<think>Let me call it.\n<tool_call>\n{}</tool_call>", "Let me call it.\n", "<tool_call>\n{}</tool_call>"),
    ("  <think>a < b, and a </thin is no end</think>", "a < b, and a </thin is no end", None),
])
def test_qwen3_reasoning_whole_and_streamed(tokenizer: Any, output: str, reasoning: str | None,
                                            content: str | None) -> None:
    parser = Qwen3ReasoningParser(tokenizer)
    prompt = ids(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert parser.extract_reasoning(output, prompt) == (reasoning, content)
    for parts in cut_ways(output):
        assert split_streamed(parser, prompt, parts) == (reasoning, content), parts


def test_qwen3_without_thinking_answers_at_once(tokenizer: Any) -> None:
    """enable_thinking false: the template closes an empty reasoning in the prompt, and the
    output is all answer (even a </think> or <tool_call> in it)."""
    off = {"enable_thinking": False}
    prompt = ids(tokenizer, tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                          add_generation_prompt=True, **off))
    for parser in (Qwen3ReasoningParser(tokenizer, off), Qwen3ReasoningParser(tokenizer)):
        for output in ("Hello!", "a </think> b", "<tool_call>{}</tool_call>"):
            assert parser.extract_reasoning(output, prompt) == (None, output)
            assert split_streamed(parser, prompt, list(output)) == (None, output)
    # Without the template's markers, the switch alone says it.
    assert Qwen3ReasoningParser(tokenizer, off).extract_reasoning("Hello!", []) == (None, "Hello!")


def test_deepseek_r1_output_starts_inside_the_reasoning(tokenizer: Any) -> None:
    parser = DeepSeekR1ReasoningParser(tokenizer)
    prompt = ids(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    for output, expected in [("Greeting.\n</think>\n\nHello!", ("Greeting.\n", "\n\nHello!")),
                             ("<think>Greeting.</think>Hello!", ("Greeting.", "Hello!")),
                             ("Still thinking", ("Still thinking", None)),
                             ("</think>", (None, None))]:
        assert parser.extract_reasoning(output, prompt) == expected
        for parts in cut_ways(output):
            assert split_streamed(parser, prompt, parts) == expected
    # <tool_call> does not end DeepSeek-R1's reasoning.
    assert parser.extract_reasoning("a<tool_call>b", prompt) == ("a<tool_call>b", None)


def test_is_reasoning_end_reads_token_ids(tokenizer: Any) -> None:
    qwen3, r1 = Qwen3ReasoningParser(tokenizer), DeepSeekR1ReasoningParser(tokenizer)
    for parser in (qwen3, r1):
        assert not parser.is_reasoning_end([])
        assert not parser.is_reasoning_end(ids(tokenizer, "Hi <think> let me see"))
        assert parser.is_reasoning_end(ids(tokenizer, "<think> hm </think> answer"))
        assert not parser.is_reasoning_end(ids(tokenizer, "<think>a</think> b <think> c"))
    # Qwen3: an open <tool_call> ends the reasoning; a closed one (the template's example) does not.
    assert qwen3.is_reasoning_end(ids(tokenizer, "<think> I will call <tool_call>{"))
    assert not qwen3.is_reasoning_end(ids(tokenizer, "<tool_call>x</tool_call> <think> I will"))
    assert not r1.is_reasoning_end(ids(tokenizer, "<think> I will call <tool_call>{"))


def test_reasoning_parsers_need_their_markers_in_the_vocabulary() -> None:
    from minivllm.local_models import build_tokenizer

    with pytest.raises(ValueError, match="<think> and </think> as tokens"):
        Qwen3ReasoningParser(build_tokenizer())
    assert reasoning_parser_class("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser_class("granite")


def test_engine_config_checks_the_reasoning_parser(tiny_model_factory: Any) -> None:
    from minivllm.config import EngineConfig

    model = tiny_model_factory("Qwen3ForCausalLM")
    assert EngineConfig(model, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="Unknown reasoning parser 'qwen4'"):
        EngineConfig(model, reasoning_parser="qwen4")


# --- requests ------------------------------------------------------------------------------------

def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}))


def error_at(fields: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        chat_request(**fields)
    error = info.value.errors()[0]
    return ".".join(str(part) for part in error["loc"]), error["msg"]


def test_tool_choice_defaults_and_checks() -> None:
    assert chat_request().tool_choice == "none"
    assert chat_request(tools=[WEATHER_TOOL]).tool_choice == "auto"
    assert chat_request(tools=[WEATHER_TOOL], tool_choice=None).tool_choice == "auto"
    assert chat_request(tool_choice="none").tool_choice == "none"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert chat_request(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named).tool_choice.function.name == "get_time"
    loc, msg = error_at({"tools": [WEATHER_TOOL], "tool_choice": named})
    assert loc == "tool_choice" and "'get_time', which is not one of tools (get_weather)" in msg
    loc, msg = error_at({"tool_choice": "required"})
    assert loc == "tool_choice" and "needs tools" in msg
    assert error_at({"tools": []})[0] == "tools"
    assert error_at({"tools": [WEATHER_TOOL], "tool_choice": "always"})[0].startswith("tool_choice")
    assert error_at({"tools": [{"type": "function", "function": {"description": "no name"}}]})[0] == (
        "tools.0.function.name")


def test_tool_messages_render_as_vllm_passes_them() -> None:
    """An assistant message's calls reach the template with their arguments parsed ({} when
    empty), a tool message with its call's id, reasoning also as reasoning_content; tools
    are among the template's arguments."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Call it.", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
    ]
    request = chat_request(messages=messages, tools=[WEATHER_TOOL], tool_choice="none")
    rendered = [message.as_template_input() for message in request.messages]
    assert rendered[1] == {"role": "assistant", "content": "", "reasoning": "Call it.", "reasoning_content": "Call it.",
                           "tool_calls": [
                               {"id": "call-1", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                               {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}
    assert rendered[3] == {"role": "assistant", "content": "Sunny."}
    assert request.template_kwargs()["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_TOOL["function"][
            "parameters"]}}]
    bad = [messages[0], {**messages[1], "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{city: Paris}"}}]}]
    loc, msg = error_at({"messages": bad})
    assert loc == "messages.1.tool_calls.0.function.arguments" and "must be JSON text" in msg


def test_forced_tool_choices_set_the_schema_in_sampling_params() -> None:
    """Named: the function's parameters; required: an array of calls; auto and none: no constraint
    (and no parsing for none). Special tokens stay in the text where the server asks it (a
    parser such as hermes reads its tags there, special in some vocabularies)."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(named, WEATHER_TOOL["function"]["parameters"]),
             ("required", required_calls_schema([("get_weather", WEATHER_TOOL["function"]["parameters"]),
                                                 ("get_time", TIME_TOOL["function"]["parameters"])])),
             ("auto", None), ("none", None)]
    assert HermesToolParser.needs_special_tokens and not Llama3JsonToolParser.needs_special_tokens
    for choice, schema in cases:
        request = chat_request(tools=tools, tool_choice=choice)
        params = request.sampling_params(None, None, None, {}, keep_special_tokens=request.may_call_tools)
        assert (params.structured_outputs.json if params.structured_outputs else None) == schema, choice
        assert params.skip_special_tokens == (choice == "none"), choice
        assert (message_parsing(request, [], HermesToolParser, None) is None) == (choice == "none")
    assert message_parsing(chat_request(tools=tools, tool_choice="required"), [], Llama3JsonToolParser,
                           None) is not None


# --- responses and stream chunks -----------------------------------------------------------------

def run_choice(parsing: MessageParsing | None, pieces_: list[str], finish_reason: str) -> tuple[dict, list[dict]]:
    """The non-streamed choice and the streamed chunk choices of one output (engine deltas of these pieces)."""
    response = _ChatResponse("chatcmpl-1", "tiny", None, 1, [], parsing)
    choice = _Choice()
    chunks = []
    for i, piece in enumerate(pieces_):
        last = i == len(pieces_) - 1
        delta = (0, piece, [i], None, None, finish_reason if last else None, None)
        choice.add(CompletionOutput(*delta))
        if (chunk := response.chunk_json(0, delta)) is not None:
            chunks.append(json.loads(chunk))
    return response.final_choice(0, choice), chunks


def test_chat_response_and_chunks_with_tool_calls() -> None:
    output = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsing = MessageParsing([], tool_parser=HermesToolParser)
    final, chunks = run_choice(parsing, list(output[:20]) + [output[20:40], output[40:]], "stop")
    assert final["finish_reason"] == "tool_calls"
    message = final["message"]
    assert message["content"] == "Checking." and message["reasoning"] is None
    [call] = message["tool_calls"]
    assert TOOL_CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Streamed: content first, then the call's first delta (index, id, type, name), then arguments.
    deltas = [chunk["delta"] for chunk in chunks]
    assert "".join(delta.get("content", "") for delta in deltas) == "Checking."
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0].keys() == {"index", "id", "type", "function"} and calls[0]["function"]["name"] == "get_weather"
    assert all(call.keys() == {"index", "function"} and call["function"].keys() == {"arguments"}
               for call in calls[1:])
    assert json.loads("".join(call["function"]["arguments"] for call in calls)) == {"city": "Paris"}
    assert [chunk["finish_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert all(chunk["delta"] for chunk in chunks[:-1])  # held-back pieces sent no empty chunks


def test_chat_response_with_reasoning_and_a_named_function() -> None:
    parsing = MessageParsing([], reasoning=None, tool_parser=lambda: NamedFunctionCall("get_weather"), named=True)
    final, chunks = run_choice(parsing, ['{"city"', ': "Rome"}'], "stop")
    assert final["finish_reason"] == "stop"  # a named function: the engine's reason (as OpenAI and vLLM)
    assert final["message"]["content"] == "" and final["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert chunks[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert chunks[1]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": ': "Rome"}'}}
    # Reasoning first, then what the tool parser reads; include_reasoning false drops the reasoning.
    tokenizer = tool_tokenizer()
    for include in (True, False):
        parsing = MessageParsing([], Qwen3ReasoningParser(tokenizer), include, tool_parser=HermesToolParser)
        output = '<think>Weather: a tool.</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        final, chunks = run_choice(parsing, list(output), "stop")
        assert final["message"]["reasoning"] == ("Weather: a tool." if include else None)
        assert final["message"]["content"] is None and final["finish_reason"] == "tool_calls"
        assert "".join(chunk["delta"].get("reasoning", "") for chunk in chunks) == (
            "Weather: a tool." if include else "")
        assert [call["function"].get("name") for chunk in chunks for call in chunk["delta"].get("tool_calls", [])
                if "id" in call] == ["get_weather"]


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    output = ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsing = MessageParsing([], tool_parser=HermesToolParser, parallel_tool_calls=False)
    final, chunks = run_choice(parsing, list(output), "stop")
    assert [call["function"]["name"] for call in final["message"]["tool_calls"]] == ["get_weather"]
    assert {call["index"] for chunk in chunks for call in chunk["delta"].get("tool_calls", [])} == {0}


def test_plain_chat_message_has_no_tool_calls() -> None:
    final, chunks = run_choice(None, ["Hello", " there"], "length")
    assert final["message"] == {"role": "assistant", "content": "Hello there", "reasoning": None,
                                "reasoning_content": None}
    assert [chunk["delta"] for chunk in chunks] == [{"content": "Hello"}, {"content": " there"}]


def test_serve_checks_its_tool_and_reasoning_flags_before_the_model_loads(tiny_model_factory: Any,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from minivllm.entrypoints.cli import main

    model = tiny_model_factory("Qwen3ForCausalLM")
    for flags, fragment in [(["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                            (["--tool-call-parser", "pythonic"], "Unknown tool call parser 'pythonic'"),
                            (["--reasoning-parser", "granite"], "Unknown reasoning parser 'granite'")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", model, "--host", "127.0.0.1", "--port", "0", *flags])
        assert exit_info.value.code == 2 and fragment in capsys.readouterr().err
