"""minivllm: a compact, fast LLM inference engine with vLLM's user-facing API."""

from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
