"""A tiny model that speaks Qwen's tool and reasoning formats: the demo tokenizer with Qwen3's
<think>, </think>, <tool_call> and </tool_call> as tokens of its own (not special, as in
Qwen3), and a chat template that uses tools, tool calls, tool results and reasoning the way
Qwen3's does (simplified)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast

from minivllm.local_models import build_tiny_model, build_tokenizer

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# The model's vocabulary: the demo tokenizer's 768 tokens, the markers and reserved tokens up
# to a multiple of 64, so that every id the model can sample decodes.
VOCAB_SIZE = 832

# Arguments must reach the template as a mapping (vLLM parses the JSON text OpenAI sends):
# anything else fails the render.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function.arguments is not mapping %}"
    "{{- raise_exception('tool call arguments must be a mapping') }}"
    "{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response id=\"' + message.tool_call_id + '\">\\n' + message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def tool_tokenizer() -> PreTrainedTokenizerFast:
    """The demo tokenizer with the markers (and reserved tokens up to VOCAB_SIZE) and TOOL_CHAT_TEMPLATE."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(MARKERS)
    tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(tokenizer))])
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def build_tool_model(model_dir: str) -> str:
    """A tiny random Qwen3 in model_dir with tool_tokenizer()."""
    build_tiny_model(model_dir, "Qwen3ForCausalLM", vocab_size=VOCAB_SIZE)
    tool_tokenizer().save_pretrained(model_dir)
    return model_dir
