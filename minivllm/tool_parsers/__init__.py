"""Tool-call parsers by their `--tool-call-parser` names (vLLM's): each reads a model's own
format for tool calls out of its output (tool_choice "auto")."""

from minivllm.tool_parsers.base import ToolParser
from minivllm.tool_parsers.hermes import HermesToolParser
from minivllm.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser named `name`; ValueError naming the choices for any other name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}: choose one of {', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name]
