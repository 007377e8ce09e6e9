"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's sampling extras).

Unknown fields are accepted and logged, as vLLM does, so clients written for other
servers keep working. Known fields are validated strictly, as OpenAI's API does: `true`
is not a number and `"5"` is not an integer. Responses are built as plain dicts in
serving.py: one streamed event per generated token makes their construction part of the
hot path.
"""

import dataclasses
import inspect
import json
import logging
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.tool_parsers.forced import named_function_schema, required_calls_schema

logger = logging.getLogger(__name__)


# What chat_template_kwargs may not set: the template call's own arguments (`tokenize`, ...). A
# request template (`chat_template`) is the server's to allow or refuse.
_TEMPLATE_CALL_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) \
    - {"self", "kwargs", "chat_template"}

_STRUCTURED_OUTPUTS_KEYS = frozenset(field.name for field in dataclasses.fields(StructuredOutputsParams))

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


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
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "_Request":
        if self.model_extra:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaResponseFormat(BaseModel):
    """response_format's json_schema, as OpenAI's API has it (`strict` is accepted: xgrammar
    holds the output to the schema either way)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    # OpenAI's key is "schema", which pydantic's BaseModel uses itself.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
        return self


class _SamplingRequest(_Request):
    """The fields completions and chat share: sampling, stopping and the output's format."""

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
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's default max_logprobs
    # The output's format: OpenAI's response_format, or vLLM's structured_outputs (the keys of
    # StructuredOutputsParams); a response_format other than text overrides that constraint.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("is not supported (other than best_of = n): remove it")
        return best_of

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, Any], keep_special_tokens: bool = False) -> SamplingParams:
        """SamplingParams for this request; fields it leaves out take `defaults` (the model's
        generation config), then SamplingParams' own. Raises ValueError on bad values
        (OpenAIError for the output's format). keep_special_tokens: the text must show them
        whatever the request says (a tool parser reads its markers there)."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                        "repetition_penalty")
                 if getattr(self, name) is not None}
        return SamplingParams(**{**defaults, **given}, n=self.n, seed=self.seed, max_tokens=max_tokens,
                              min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs,
                              skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              # SamplingParams turns the string keys into ints (as vLLM does) and
                              # refuses any that are not integers.
                              logit_bias=cast("dict[int, float] | None", self.logit_bias),
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              structured_outputs=self.structured_outputs_params())

    @property
    def structured_outputs_field(self) -> str:
        """The field that sets the output's format (where its errors point)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """StructuredOutputsParams from structured_outputs and response_format (whose constraint
        replaces one of the same kind, as in vLLM; two kinds are an error). Raises OpenAIError
        naming the field."""
        fields = dict(self.structured_outputs or {})
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            fields["json_object"] = True
        elif response_format is not None and response_format.type == "json_schema":
            assert response_format.json_schema is not None  # ResponseFormat checks it
            fields["json"] = response_format.json_schema.json_schema
        if not fields and self.structured_outputs is None:
            return None
        param = self.structured_outputs_field
        unknown = sorted(set(fields) - _STRUCTURED_OUTPUTS_KEYS)
        if unknown:
            raise OpenAIError(f"structured_outputs has no key {unknown[0]!r}; its keys are "
                              f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KEYS))}.", param=param)
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as error:
            raise OpenAIError(str(error).removeprefix("StructuredOutputsParams: "), param=param) from error

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's default max_logprobs
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, prompt: Any) -> Any:
        """One clear message for a prompt of no accepted form (rather than one error per form)."""
        if not (isinstance(prompt, str) or _is_token_ids(prompt) or (isinstance(prompt, list) and (
                all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)))):
            raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                             "token-id lists")
        return prompt


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)  # not bool


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class FunctionCallParam(BaseModel):
    """A function call in an assistant message: its arguments as JSON text, as OpenAI sends them."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        if arguments:
            try:
                json.loads(arguments)
            except ValueError as error:
                raise ValueError(f"must be JSON text (the function's arguments): {error}") from None
        return arguments


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def as_template_input(self) -> dict[str, Any]:
        """The call as chat templates take it (vLLM's and transformers' convention): its
        arguments parsed ({} when empty)."""
        function = self.function
        arguments = json.loads(function.arguments) if function.arguments else {}
        return {**(self.model_extra or {}), "id": self.id, "type": self.type,
                "function": {**(function.model_extra or {}), "name": function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    reasoning: str | None = None  # an assistant's reasoning (for templates that show it again)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """One clear message for content that is not text (rather than one error per form it is not)."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of content parts ({'type': 'text', 'text': ...})")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: minivllm serves text-only models, so content "
                                 "parts must be {'type': 'text', 'text': ...}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} needs a 'text' string")
        return content

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template takes it (as vLLM passes it): content parts joined
        into one string, tool calls' arguments parsed, the reasoning also as
        `reasoning_content` (Qwen's templates' name)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.tool_calls:  # an empty list is left out: the template's plain assistant turn
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        return {"type": self.type, "function": self.function.model_dump()}


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the model must call."""

    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # the server refuses it unless it trusts request templates
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # Left out: "auto" with tools, else "none" (as vLLM).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(default=None,
                                                                                   validate_default=True)
    parallel_tool_calls: bool | None = True  # false (or null, as vLLM reads it): only the first call is kept
    include_reasoning: bool = True  # vLLM's: False leaves the reasoning out of the message

    @field_validator("tools")
    @classmethod
    def _some_tools(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        if tools == []:
            raise ValueError("must not be an empty array: give at least one tool, or leave tools out")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_fits_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools: list[ChatTool] | None = info.data.get("tools")
        if choice is None:
            return "auto" if tools else "none"
        if choice == "none":
            return choice
        if not tools:
            raise ValueError("needs tools: give the functions the model may call in tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {choice.function.name!r}, which is not one of tools "
                             f"({', '.join(t.function.name for t in tools)})")
        return choice

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return self

    @property
    def may_call_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """As the base's; but a tool choice that forces calls constrains the output to their JSON
        schema instead, as vLLM does: the named function's parameters, or for "required" an
        array of calls."""
        tools, choice = self.tools or [], self.tool_choice
        if isinstance(choice, NamedToolChoice):
            function = next(tool.function for tool in tools if tool.function.name == choice.function.name)
            return StructuredOutputsParams(json=named_function_schema(function.parameters))
        if choice == "required":
            try:
                schema = required_calls_schema([(tool.function.name, tool.function.parameters) for tool in tools])
            except ValueError as error:
                raise OpenAIError(f"Invalid request: tools: {error}", param="tools") from error
            return StructuredOutputsParams(json=schema)
        return super().structured_outputs_params()

    @property
    def structured_outputs_field(self) -> str:
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            return "tools"
        return super().structured_outputs_field

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_call_arguments(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in _TEMPLATE_CALL_ARGUMENTS:
                hint = f" (set the request's own '{key}' field)" if key in cls.model_fields else ""
                raise ValueError(f"may not set {key!r}, an argument of the template call itself{hint}")
        return kwargs

    def template_kwargs(self) -> dict[str, Any]:
        """Extra arguments for the chat template call: the tools (as vLLM passes them), and a template
        the request brings (in either place vLLM takes it) as `chat_template`, for the server to allow
        or refuse."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools is not None:  # with tool_choice "none" too (vLLM's default)
            kwargs["tools"] = [tool.as_template_input() for tool in self.tools]
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


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
