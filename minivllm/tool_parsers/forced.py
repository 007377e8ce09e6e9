"""Forced tool calls: `tool_choice` naming a function, or "required". Constrained decoding
makes the output a JSON schema's (built here, as vLLM builds it), so the output is read as
JSON directly rather than through a model's tool-call format: the arguments of the named
function, or an array of {"name": ..., "parameters": {...}} calls. The message's content
is empty."""

import json
from typing import Any

from minivllm.tool_parsers.base import (
    JsonCallDeltas,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
)
from minivllm.tool_parsers.partial_json import skip_whitespace

Schema = dict[str, Any]


def named_function_schema(parameters: Schema | None) -> Schema:
    """What the output must be when tool_choice names a function: its parameters' schema (an
    object, as vLLM assumes, for a function that declares none)."""
    return {"type": "object", "properties": {}} if parameters is None else parameters


def required_calls_schema(functions: list[tuple[str, Schema | None]]) -> Schema:
    """What the output must be for tool_choice "required": an array of one or more calls of
    the (name, parameters schema) functions. The functions' `$defs` move to the top, where
    their `#/$defs/...` references then point; raises ValueError if two define one name
    differently."""
    defs: Schema = {}
    calls = []
    for name, parameters in functions:
        parameters = dict(named_function_schema(parameters))
        for def_name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise ValueError(f"the tools define {def_name!r} in $defs differently: give each definition its "
                                 "own name")
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: Schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema


class NamedFunctionCall(ToolParser):
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return "", [ToolCall(self.name, text)]

    def stream(self, text: str) -> StreamDelta:
        return ("", [self._delta(text)]) if text else ("", [])

    def finish(self) -> StreamDelta:
        # An empty output still calls the function (as a whole output does).
        return ("", []) if self.started else ("", [self._delta("")])

    def _delta(self, arguments: str) -> ToolCallDelta:
        if self.started:
            return ToolCallDelta(0, arguments)
        self.started = True
        return ToolCallDelta(0, arguments, self.name, make_tool_call_id())


class RequiredFunctionCalls(ToolParser):
    """tool_choice "required": the output is a JSON array of calls. Output that is not (only
    possible where constrained decoding was cut short) has no calls."""

    def __init__(self) -> None:
        self.text = ""
        self.calls = JsonCallDeltas(("parameters",))

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            calls = json.loads(text)
        except ValueError:
            return "", []
        if not isinstance(calls, list) or not all(isinstance(call, dict) and isinstance(call.get("name"), str)
                                                  for call in calls):
            return "", []
        return "", [ToolCall(call["name"], json.dumps(call.get("parameters"), ensure_ascii=False)) for call in calls]

    def stream(self, text: str) -> StreamDelta:
        self.text += text
        i = skip_whitespace(self.text, 0)
        if not self.text.startswith("[", i):
            return "", []
        return "", self.calls.update_sequence(self.text, i + 1, ",")
