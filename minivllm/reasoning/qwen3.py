"""`--reasoning-parser qwen3`: Qwen3 (which writes <think> itself) and Qwen3.5 (whose template
opens it in the prompt). `enable_thinking: false` in chat_template_kwargs turns the reasoning
off: the template then writes an empty <think></think> and the output is all answer. A
<tool_call> written before </think> ends the reasoning too (Qwen3.5 does that) and starts
the answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm.reasoning.base import ReasoningParser, token_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.thinking = bool((chat_template_kwargs or {}).get("enable_thinking", True))
        self.tool_call_id = token_id(tokenizer, TOOL_CALL)
        self.tool_call_end_id = token_id(tokenizer, TOOL_CALL_END)

    def end_markers(self) -> list[tuple[str, bool]]:
        return [*super().end_markers(), (TOOL_CALL, True)]

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """As the base's, and a <tool_call> after the last marker ends the reasoning too, unless a
        </tool_call> follows it (a closed call is an earlier turn's, or the template's example)."""
        closed = False
        for token in reversed(token_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
            if token == self.tool_call_end_id:
                closed = True
            elif token == self.tool_call_id and not closed:
                return True
        return False

    def answers_at_once(self, prompt_token_ids: list[int]) -> bool:
        return not self.thinking or super().answers_at_once(prompt_token_ids)
