"""Tool calls in a model's output, in OpenAI's shape, and what finds them.

A ToolParser reads one choice's output: `extract` the whole of it (a response), or
`stream` and `finish` it piece by piece (a stream, in which a call's first delta carries
its id and name and the later ones the next pieces of its arguments' text).
"""

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from minivllm.tool_parsers.partial_json import ObjectScan, ObjectScanner, skip_whitespace

Json = dict[str, Any]


def make_tool_call_id() -> str:
    """A tool call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=make_tool_call_id)

    def as_json(self) -> Json:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """What a stream adds to the call at `index`: its first delta has its id and name."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def as_json(self) -> Json:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# What a piece of output adds: content, and deltas of tool calls.
StreamDelta = tuple[str, list[ToolCallDelta]]


class ToolParser(ABC):
    """Finds the tool calls in one choice's output (streaming keeps state: one per choice)."""

    # The markers are special tokens in some vocabularies: the output's text must keep them.
    needs_special_tokens = False

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output's content (None if empty) and calls. Output that does not parse as
        calls is all content, with no calls."""

    @abstractmethod
    def stream(self, text: str) -> StreamDelta:
        """What the output's next piece of text adds."""

    def finish(self) -> StreamDelta:
        """What the stream held back, at the end of the output."""
        return "", []


class JsonCallDeltas:
    """The deltas of calls written as JSON objects, {"name": ..., ARGUMENTS: {...}}: a call's
    first delta once its name is complete, then its arguments' text as it grows (the raw
    text, so every piece extends what was sent). Calls are announced in order."""

    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self.argument_keys = argument_keys
        self.sent: list[str] = []  # per announced call: the arguments' text sent so far
        self._scanners: list[ObjectScanner] = []  # per call seen

    @property
    def num_calls(self) -> int:
        return len(self.sent)

    def update(self, index: int, text: str, start: int) -> tuple[ObjectScan, ToolCallDelta | None]:
        """Call `index` (at most num_calls), whose object opens at `start` (after whitespace) of
        the grown text: its scan, and its delta (None if nothing new)."""
        if index == len(self._scanners):
            self._scanners.append(ObjectScanner(start))
        scan = self._scanners[index].scan(text)
        arguments = next((value for key in self.argument_keys
                          if (value := scan.raw_value(text, key)) is not None), "")
        if index == len(self.sent):
            name = scan.complete_value(text, "name")
            if not isinstance(name, str):
                return scan, None
            self.sent.append(arguments)
            return scan, ToolCallDelta(index, arguments, name, make_tool_call_id())
        new = arguments[len(self.sent[index]):]
        if not new:
            return scan, None
        self.sent[index] = arguments
        return scan, ToolCallDelta(index, new)

    def update_sequence(self, text: str, start: int, separator: str) -> list[ToolCallDelta]:
        """The deltas of calls written one after the other from text[start], separated by
        `separator` (and whitespace)."""
        deltas = []
        index, i = 0, start
        while index <= self.num_calls:  # the next unannounced call waits for its name
            scan, delta = self.update(index, text, i)
            if delta is not None:
                deltas.append(delta)
            if scan.malformed or scan.end is None:
                break
            i = skip_whitespace(text, scan.end)
            if not text.startswith(separator, i):
                break
            i += len(separator)
            index += 1
        return deltas


def partial_marker_length(text: str, marker: str) -> int:
    """How much of text's end could be the start of `marker` (held back while streaming)."""
    tail = text[len(text) - len(marker) + 1:] if len(text) >= len(marker) else text
    start = tail.find(marker[0])  # the earliest candidate is the longest
    while start != -1:
        if marker.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(marker[0], start + 1)
    return 0
