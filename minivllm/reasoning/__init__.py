"""Reasoning parsers by their `--reasoning-parser` names (vLLM's)."""

from minivllm.reasoning.base import ReasoningParser
from minivllm.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from minivllm.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser named `name`; ValueError naming the choices for any other name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {name!r}: choose one of {', '.join(sorted(REASONING_PARSERS))}.")
    return REASONING_PARSERS[name]
