"""`--tool-call-parser llama3_json`: Llama 3.1 and later's JSON tool calls. The reply is the
call, `{"name": ..., "parameters": {...}}` ("arguments" is taken too), perhaps after
`<|python_tag|>`; several calls are separated by ';'. A reply that starts otherwise is content."""

import json

from minivllm.tool_parsers.base import JsonCallDeltas, StreamDelta, ToolCall, ToolParser
from minivllm.tool_parsers.partial_json import skip_whitespace

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.calls_start: int | None = None  # where the first call's object opens, once known
        self.is_content = False  # decided: the reply is not calls
        self.calls = JsonCallDeltas(("arguments", "parameters"))

    @staticmethod
    def _calls_start(text: str) -> int | None:
        """Where the first call opens, if the reply is calls; None otherwise."""
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        return i if text.startswith("{", i) else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = self._calls_start(text)
        if i is None:
            return text or None, []
        decoder = json.JSONDecoder()
        calls = []
        try:
            while i < len(text):
                call, i = decoder.raw_decode(text, i)
                if not isinstance(call["name"], str):
                    raise TypeError("the name is not a string")
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
                calls.append(ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
                i = skip_whitespace(text, i)
                if i < len(text):
                    if text[i] != SEPARATOR:
                        raise ValueError("text after a call")
                    i = skip_whitespace(text, i + 1)
        except (ValueError, KeyError, TypeError):  # not calls after all: all of it is content (as vLLM)
            return text or None, []
        return None, calls

    def _decided(self) -> bool:
        """Whether the text so far tells calls from content (it does once it is more than
        whitespace and the start of the python tag)."""
        if self.calls_start is not None or self.is_content:
            return True
        i = skip_whitespace(self.text, 0)
        if self.text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(self.text, i + len(PYTHON_TAG))
            if i == len(self.text):
                return False
        elif PYTHON_TAG.startswith(self.text[i:]):
            return False
        self.calls_start = self._calls_start(self.text)
        self.is_content = self.calls_start is None
        return True

    def stream(self, text: str) -> StreamDelta:
        self.text += text
        if not self._decided():
            return "", []
        if self.is_content:
            return self._rest(), []
        assert self.calls_start is not None, "decided: calls or content"
        return "", self.calls.update_sequence(self.text, self.calls_start, SEPARATOR)

    def finish(self) -> StreamDelta:
        # Undecided, or calls that never named a function: what was held back is content, as in a
        # whole output.
        return ("", []) if self.calls.num_calls else (self._rest(), [])

    def _rest(self) -> str:
        rest = self.text[self.content_sent:]
        self.content_sent = len(self.text)
        return rest
