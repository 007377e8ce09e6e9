"""`--reasoning-parser deepseek_r1`: DeepSeek-R1 and its distillations (and QwQ). The chat
template opens <think> in the prompt, so the output starts inside the reasoning and goes on
to the answer after </think>; an output without </think> is all reasoning (cut short)."""

from minivllm.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    start_token = "<think>"
    end_token = "</think>"
