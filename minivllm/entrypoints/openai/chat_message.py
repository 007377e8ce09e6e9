"""A chat choice's output as its assistant message: the reasoning split off (a reasoning
parser), then tool calls read from the rest (a tool parser), as vLLM shapes them.

A response parses each choice's whole text; a stream feeds each choice's text through a
MessageStream as it arrives and sends what each piece adds.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.reasoning import ReasoningParser
from minivllm.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser

Json = dict[str, Any]


@dataclass
class MessageDelta:
    """What a piece of output adds to the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def as_json(self) -> Json:
        """The chunk's `delta`: only what it has."""
        delta: Json = {}
        if self.reasoning:
            # Also under the name vLLM used before `reasoning` (DeepSeek's API, older clients).
            delta["reasoning"] = delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.as_json() for call in self.tool_calls]
        return delta


@dataclass
class Message:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]

    def as_json(self) -> Json:
        message: Json = {"role": "assistant", "content": self.content, "reasoning": self.reasoning,
                         "reasoning_content": self.reasoning}  # vLLM's earlier name, as in MessageDelta
        if self.tool_calls:
            message["tool_calls"] = [call.as_json() for call in self.tool_calls]
        return message


def finish_reason(engine_reason: str | None, called: bool, named: bool) -> str | None:
    """"tool_calls" once calls were made, as OpenAI and vLLM say it, except for a function that
    tool_choice named (then the engine's reason stands)."""
    return "tool_calls" if called and not named else engine_reason


@dataclass
class MessageParsing:
    """How a request's outputs become messages (the same for each of its choices)."""

    prompt_token_ids: list[int]
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True  # vLLM's request field: False drops the reasoning
    tool_parser: Callable[[], ToolParser] | None = None  # a new parser for each choice
    named: bool = False  # the tool parser reads the function tool_choice named
    parallel_tool_calls: bool = True  # False: only the first call is kept

    def parse(self, text: str, engine_reason: str | None) -> tuple[Message, str | None]:
        """A whole output's message and finish reason."""
        reasoning, content = (self.reasoning.extract_reasoning(text, self.prompt_token_ids) if self.reasoning
                              else (None, text))
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser().extract(content or "")
        if not self.parallel_tool_calls:
            calls = calls[:1]
        message = Message(reasoning if self.include_reasoning else None, content, calls)
        return message, finish_reason(engine_reason, bool(calls), self.named)

    def stream(self) -> "MessageStream":
        return MessageStream(self)


class MessageStream:
    """One choice's output, piece by piece."""

    def __init__(self, parsing: MessageParsing) -> None:
        self.parsing = parsing
        self.reasoning = parsing.reasoning.stream(parsing.prompt_token_ids) if parsing.reasoning else None
        self.tool_parser = parsing.tool_parser() if parsing.tool_parser else None
        self.called = False

    def feed(self, text: str) -> MessageDelta:
        """What the output's next piece adds."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._delta(reasoning, content, finishing=False)

    def finish(self, text: str, engine_reason: str | None) -> tuple[MessageDelta, str | None]:
        """What the output's last piece adds, with all that was held back, and the finish reason."""
        reasoning, content = "", text
        if self.reasoning:
            reasoning, content = self.reasoning.feed(text)
            held_reasoning, held_content = self.reasoning.finish()
            reasoning, content = reasoning + held_reasoning, content + held_content
        delta = self._delta(reasoning, content, finishing=True)
        return delta, finish_reason(engine_reason, self.called, self.parsing.named)

    def _delta(self, reasoning: str, content: str, finishing: bool) -> MessageDelta:
        delta = MessageDelta(reasoning if self.parsing.include_reasoning else "", content)
        if self.tool_parser is not None:
            delta.content, delta.tool_calls = self.tool_parser.stream(content)
            if finishing:
                more_content, more_calls = self.tool_parser.finish()
                delta.content += more_content
                delta.tool_calls += more_calls
            if not self.parsing.parallel_tool_calls:
                delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
            self.called = self.called or bool(delta.tool_calls)
        return delta
