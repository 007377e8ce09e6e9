"""Reasoning parsers: a reasoning model writes its reasoning between two markers (<think>
and </think>) before its answer. A parser splits an output into the two (the server sends
the reasoning as `reasoning`, the answer as `content`) and says from token ids whether the
reasoning has ended (where constrained decoding may start).

The reasoning may open in the prompt (the chat template writes the start marker) or in the
output; a start marker the output opens with is dropped. Where the prompt shows that the
reasoning already ended (a template that turns thinking off writes both markers), the
output is all answer, unless it opens a reasoning of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm.tool_parsers.base import partial_marker_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of `token` if the vocabulary has it as one token, else None."""
    found = tokenizer.convert_tokens_to_ids(token)
    return found if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == token else None


class ReasoningParser:
    """Reasoning between `start_token` and `end_token` (both must be tokens of the vocabulary),
    before the answer. Subclasses name the markers."""

    name: str  # the --reasoning-parser name
    start_token: str
    end_token: str

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        """chat_template_kwargs: the request's (a template argument may turn thinking off).
        Raises ValueError if the vocabulary lacks a marker."""
        start_token_id = token_id(tokenizer, self.start_token)
        end_token_id = token_id(tokenizer, self.end_token)
        if start_token_id is None or end_token_id is None:
            raise ValueError(f"The {self.name} reasoning parser needs {self.start_token} and {self.end_token} as "
                             "tokens of the model's vocabulary, and this model's tokenizer lacks them: choose the "
                             "reasoning parser of this model's family, or none.")
        self.start_token_id: int = start_token_id
        self.end_token_id: int = end_token_id

    # Text that ends the reasoning, and whether it belongs to the answer.
    def end_markers(self) -> list[tuple[str, bool]]:
        return [(self.end_token, False)]

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether the reasoning has ended by the end of token_ids: the last marker in them is
        an end marker (False if there is none)."""
        for token in reversed(token_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False

    def answers_at_once(self, prompt_token_ids: list[int]) -> bool:
        """Whether an output after this prompt starts with the answer (the prompt ended the
        reasoning)."""
        return self.is_reasoning_end(prompt_token_ids)

    def stream(self, prompt_token_ids: list[int]) -> ReasoningStream:
        """A splitter for one output after this prompt."""
        return ReasoningStream(self.start_token, self.end_markers(), not self.answers_at_once(prompt_token_ids))

    def extract_reasoning(self, text: str, prompt_token_ids: list[int]) -> tuple[str | None, str | None]:
        """A whole output's reasoning and answer (each None if empty)."""
        stream = self.stream(prompt_token_ids)
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        return (reasoning + rest_reasoning) or None, (content + rest_content) or None


class ReasoningStream:
    """Splits one output into reasoning and answer as its text arrives, holding back text that
    could be the start of a marker."""

    def __init__(self, start_token: str, end_markers: list[tuple[str, bool]], reasoning: bool) -> None:
        self.start_token = start_token
        self.end_markers = end_markers
        self.reasoning = reasoning  # in the reasoning (else in the answer)
        self.opening = True  # before the output's first text: it may open with the start marker
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) text that `text` adds."""
        text, self.held = self.held + text, ""
        if self.opening:
            lead = text.lstrip()
            if self.start_token.startswith(lead):  # whitespace, or part of the start marker
                self.held = text
                return "", ""
            self.opening = False
            if lead.startswith(self.start_token):
                self.reasoning = True
                text = lead[len(self.start_token):]
        if not self.reasoning:
            return "", text
        found = [(text.find(marker), marker, kept) for marker, kept in self.end_markers if marker in text]
        if found:
            at, marker, kept = min(found)
            self.reasoning = False
            return text[:at], text[at if kept else at + len(marker):]
        hold = max(partial_marker_length(text, marker) for marker, _ in self.end_markers)
        self.held = text[len(text) - hold:]
        return text[:len(text) - hold], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        self.opening = False
        return (held, "") if self.reasoning else ("", held)
