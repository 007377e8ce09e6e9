"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's sampling extras).

Unknown fields are accepted and logged, as vLLM does, so clients written for other
servers keep working. Responses are built as plain dicts in serving.py: one streamed
event per generated token makes their construction part of the hot path.
"""

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError"}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "_Request":
        if self.model_extra:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Request):
    """The fields completions and chat share: sampling and stopping."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: the model's generation_config default, else 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (other than best_of = n): remove it")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams for this request; fields it leaves out take `defaults` (the model's
        generation config), then SamplingParams' own. Raises ValueError on bad values."""
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by minivllm: remove it from the request.")
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                        "repetition_penalty")
                 if getattr(self, name) is not None}
        return SamplingParams(**{**defaults, **given}, n=self.n, seed=self.seed, max_tokens=max_tokens,
                              min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logprobs=logprobs,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's default max_logprobs
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template takes it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless empty: minivllm has no tool calling or structured output.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionRequest":
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools and tool_choice are not supported by minivllm: remove them")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format other than {'type': 'text'} (structured output) is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """Extra arguments for the chat template."""
        extra = {"continue_final_message": True} if self.continue_final_message else {}
        return {**(self.chat_template_kwargs or {}), **extra}


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
