"""`--tool-call-parser hermes`: Hermes 2 Pro and later, Qwen2.5 and Qwen3, whose calls are
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per pair of tags, after any
text. The content is the text before the first call."""

import json

from minivllm.tool_parsers.base import JsonCallDeltas, StreamDelta, ToolCall, ToolParser, partial_marker_length

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    needs_special_tokens = True  # the tags are special tokens in some vocabularies

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0  # how much of text went out as content
        self.first_call: int | None = None  # where the first start tag is, once written
        self.calls = JsonCallDeltas(("arguments",))

    @staticmethod
    def _bodies(text: str, start: int, streaming: bool) -> list[tuple[int, int]]:
        """Where each call's text is, from the start tag at `start` on: from a start tag to its
        end tag, or to the end of the text (less what could be the start of an end tag, while
        streaming)."""
        bodies = []
        while start != -1:
            body = start + len(START)
            end = text.find(END, body)
            if end == -1:
                tail = partial_marker_length(text, END) if streaming else 0
                bodies.append((body, len(text) - tail))
                break
            bodies.append((body, end))
            start = text.find(START, end + len(END))
        return bodies

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(START)
        if first == -1:
            return text or None, []
        calls = []
        for start, end in self._bodies(text, first, streaming=False):
            try:
                call = json.loads(text[start:end])
                if not isinstance(call["name"], str):
                    raise TypeError("the name is not a string")
                calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):  # not a call after all: all of it is content (as vLLM)
                return text or None, []
        return text[:first] or None, calls

    def stream(self, text: str) -> StreamDelta:
        self.text += text
        content = ""
        if self.first_call is None:  # content so far: a start tag can only begin after what was sent
            found = self.text.find(START, self.content_sent)
            sendable = found if found != -1 else len(self.text) - partial_marker_length(self.text, START)
            content = self.text[self.content_sent:sendable]
            self.content_sent = sendable
            if found == -1:
                return content, []
            self.first_call = found
        deltas = []
        for index, (start, end) in enumerate(self._bodies(self.text, self.first_call, streaming=True)):
            _, delta = self.calls.update(index, self.text[:end], start)
            if delta is not None:
                deltas.append(delta)
            if index == self.calls.num_calls:  # this call has no name yet: later ones wait
                break
        return content, deltas

    def finish(self) -> StreamDelta:
        if self.calls.num_calls:
            return "", []
        # No call after all: what was held back is content, as in a whole output.
        rest = self.text[self.content_sent:]
        self.content_sent = len(self.text)
        return rest, []
