"""minivllm: a compact, fast LLM inference engine with vLLM's user-facing API."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.llm import LLM
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
    from minivllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

# Where each name lives. Imported on first use, so that a process that needs one submodule (the
# chat-template render process) does not load torch and the engine with the package.
_MODULES = {"LLM": "minivllm.llm", "SamplingParams": "minivllm.sampling_params",
            "StructuredOutputsParams": "minivllm.sampling_params", "RequestOutput": "minivllm.outputs",
            "CompletionOutput": "minivllm.outputs", "Logprob": "minivllm.outputs"}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
