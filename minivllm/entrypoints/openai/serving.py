"""/v1/completions and /v1/chat/completions over AsyncLLM, shaped as vLLM answers them.

A request becomes one engine request per prompt (n samples each); their delta outputs are
merged into one sequence of per-choice deltas, which a streaming request sends as one SSE
event per generated token and a plain request gathers into one response. A stream's events
are the server's hot path (one per token, for every open stream): the common event is
written from a template, without building and encoding a dict.
"""

import asyncio
import itertools
import json
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from json.encoder import encode_basestring_ascii
from types import TracebackType
from typing import Any, cast

from starlette.types import Message, Send
from tokenizers import AddedToken

from minivllm.engine.async_llm import RequestStream, WireCompletion, WireOutput
from minivllm.engine.data_parallel import EngineClient
from minivllm.engine.grammar_spec import check_structured_outputs
from minivllm.entrypoints.chat_renderer import ChatRenderer
from minivllm.entrypoints.openai.chat_message import MessageParsing, MessageStream
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    OpenAIError,
    _SamplingRequest,
)
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs
from minivllm.reasoning import ReasoningParser, reasoning_parser_class
from minivllm.sampling_params import SamplingParams
from minivllm.tool_parsers.base import ToolParser
from minivllm.tool_parsers.forced import (
    NamedFunctionCall,
    RequiredFunctionCalls,
)

# The sampling fields a model's generation_config.json may set as defaults (vLLM applies them).
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# JSON has no -inf: a token with zero probability reports this (as vLLM does).
_MIN_LOGPROB = -9999.0

Json = dict[str, Any]
# Paths to the tokenizer's files on the server: of no use to a client (vLLM leaves them out too).
_TOKENIZER_FILE_FIELDS = ("vocab_file", "merges_file")
# Special tokens as the loaded tokenizer resolved them: tokenizer_config.json may name them only
# in special_tokens_map.json or not at all (a GGUF file's tokenizer), and lm-eval's remote
# tokenizer needs eos_token.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def generation_config_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults the model's generation_config.json sets (empty if none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {name: config[name] for name in _GENERATION_CONFIG_FIELDS if config.get(name) is not None}


# What one engine output adds to one choice: the choice's index (prompt index * n + sample
# index) and the engine's delta for it.
_Delta = tuple[int, WireCompletion]


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_json(self) -> Json:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class _Choice:
    """A choice gathered from its deltas (non-streaming responses)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class EventStream:
    """A streaming request's answer: `write(send)` sends its SSE events as ASGI
    http.response.body messages (the caller sends the response's start and its end)."""

    def __init__(self, write: Callable[[Send], Awaitable[None]]) -> None:
        self.write = write


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str],
                 trust_request_chat_template: bool = False, tool_parser: type[ToolParser] | None = None) -> None:
        """trust_request_chat_template: render chat templates that requests bring (`chat_template`),
        as vLLM's --trust-request-chat-template; refused otherwise. tool_parser: the format of the
        model's tool calls (--enable-auto-tool-choice with --tool-call-parser); None: no tool calls.
        The engine's reasoning_parser splits chat replies' reasoning off; raises ValueError if the
        vocabulary lacks its markers."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.sampling_defaults = generation_config_defaults(engine.config.model)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser
        name = engine.config.reasoning_parser
        self.reasoning_parser = reasoning_parser_class(name) if name is not None else None
        if self.reasoning_parser is not None and self.tokenizer is not None:
            self.reasoning_parser(self.tokenizer)  # a vocabulary without its markers fails now, not per request
        self.chat_renderer = ChatRenderer(self.tokenizer) if self.tokenizer is not None else None

    def close(self) -> None:
        if self.chat_renderer is not None:
            self.chat_renderer.close()

    # --- shared checks ----------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist: this server serves "
                              f"{', '.join(self.served_model_names)}.", 404, "model")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("This server has no tokenizer: send token ids instead of text.")
        return await self.engine.encode(text, add_special_tokens)

    def tokenizer_info(self) -> Json:
        """GET /tokenizer_info, as vLLM answers it: the tokenizer's configuration (what
        tokenizer_config.json gave it) with tokenizer_class and the chat template this server
        renders with. lm-eval's remote tokenizer reads eos_token, bos_token, pad_token and
        chat_template from it."""
        if self.tokenizer is None:
            raise OpenAIError("This server has no tokenizer.")
        config = {key: value for key, value in self.tokenizer.init_kwargs.items() if key not in _TOKENIZER_FILE_FIELDS}
        info = cast(Json, _json_value(config))
        for name in _SPECIAL_TOKENS:
            token = getattr(self.tokenizer, name)
            if token is not None:
                info[name] = str(token)
        info["tokenizer_class"] = type(self.tokenizer).__name__
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, str):
            info["chat_template"] = template
        return info

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt token ids of a conversation, rendered by the chat renderer (off the event
        loop, bounded in time and memory)."""
        template_kwargs = template_kwargs or {}
        if "chat_template" in template_kwargs and not self.trust_request_chat_template:
            raise OpenAIError("This server runs only its own chat template: remove chat_template from the "
                              "request, or start the server with --trust-request-chat-template.",
                              param="chat_template")
        if self.chat_renderer is None:
            raise OpenAIError("This server has no tokenizer: send a completion request with token ids.")
        return await self.chat_renderer.render([message.as_template_input() for message in messages],
                                               add_generation_prompt, template_kwargs)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, your request "
                              f"has {num_prompt_tokens} input tokens, which leaves no room for output. "
                              "Please reduce the length of the input.", param="prompt")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
                              f"is {limit} tokens and your request has {num_prompt_tokens} input tokens "
                              f"({max_tokens} > {limit} - {num_prompt_tokens}).", param="max_tokens")

    def _sampling_params(self, request: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, keep_special_tokens: bool = False) -> SamplingParams:
        if request.stream and request.prompt_logprobs:
            raise OpenAIError("prompt_logprobs are not available with stream=true (as with vLLM): send the "
                              "request without streaming.", param="prompt_logprobs")
        try:
            params = request.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults,
                                             keep_special_tokens)
            if params.structured_outputs is not None:
                try:  # xgrammar's parse of the schema, regex or grammar (check_params finds it cached)
                    check_structured_outputs(params.structured_outputs)
                except ValueError as error:
                    raise OpenAIError(str(error), param=request.structured_outputs_field) from error
            # Here rather than in the engine, so that the error names its field.
            self.engine.input_processor.check_params(params)
            return params
        except ValueError as error:  # "SamplingParams: top_p must be ...": name the field as param
            message = str(error).removeprefix("SamplingParams: ")
            raise OpenAIError(message, param=message.split()[0]) from error

    async def _start(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                     request_id: str) -> list[RequestStream]:
        """One engine request per prompt; all or none (every prompt is checked first)."""
        for _, token_ids in prompts:
            self._check_length(len(token_ids), params.max_tokens)
        return await self.engine.add_requests([{"prompt": text, "prompt_token_ids": token_ids}
                                               for text, token_ids in prompts], params,
                                              [f"{request_id}-{i}" for i in range(len(prompts))])

    # --- /v1/completions --------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest) -> Awaitable[Json] | EventStream:
        """Queue the request; return what makes the response body, or the SSE events of a
        streaming response. Raises OpenAIError or ValueError (both 400) before anything is
        queued."""
        self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported: remove it from the request.", param="suffix")
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs  # the echoed prompt's tokens get logprobs too
        # max_tokens 0 with echo (how lm-eval scores a text): the prompt alone. As vLLM, the
        # engine generates one token, which the reply leaves out.
        max_tokens = 1 if request.echo and request.max_tokens == 0 else request.max_tokens
        params = self._sampling_params(request, max_tokens, request.logprobs, prompt_logprobs)
        prompts = await self._completion_prompts(request.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(prompts, params, request_id)
        echoes = [(self._prompt_text(text, ids), ids) for text, ids in prompts] if request.echo else []
        response = _CompletionResponse(request_id, request.model or self.served_model_names[0], request,
                                       params.n, echoes, streams, self._decode_token)
        if request.stream:
            return EventStream(partial(response.stream, request.include_usage))
        return response.gather()

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                                  ) -> list[tuple[str | None, list[int]]]:
        # One prompt (text or token ids), or a list of them (CompletionRequest checked which).
        prompts = cast("list[str | list[int]]",
                       [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt)
        if not prompts:
            raise OpenAIError("prompt is empty: give a string, a list of strings, token ids or lists of them.",
                              param="prompt")
        return [(p, await self.tokenize(p)) if isinstance(p, str) else (None, p) for p in prompts]

    def _prompt_text(self, text: str | None, token_ids: list[int]) -> str:
        if text is not None:
            return text
        if self.tokenizer is None:
            return ""
        return cast(str, self.tokenizer.decode(token_ids))  # one sequence's ids: one string

    def _decode_token(self, token: int) -> str:
        return self._prompt_text(None, [token])

    # --- /v1/chat/completions ---------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Awaitable[Json] | EventStream:
        self.check_model(request.model)
        self._check_tool_choice(request.tool_choice)
        token_ids = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                           request.template_kwargs())
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        # A tool parser that reads special tokens (its markers) needs them in the text (as vLLM).
        keep_special_tokens = (request.may_call_tools and self.tool_parser is not None
                               and self.tool_parser.needs_special_tokens)
        params = self._sampling_params(request, max_tokens, num_logprobs, request.prompt_logprobs,
                                       keep_special_tokens)
        reasoning = self.reasoning_parser(self.tokenizer, request.chat_template_kwargs) \
            if self.reasoning_parser is not None and self.tokenizer is not None else None
        parsing = message_parsing(request, token_ids, self.tool_parser, reasoning)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start([(None, token_ids)], params, request_id)
        response = _ChatResponse(request_id, request.model or self.served_model_names[0], num_logprobs, params.n,
                                 streams, parsing)
        if request.stream:
            return EventStream(partial(response.stream, request.include_usage))
        return response.gather()

    def _check_tool_choice(self, tool_choice: str | NamedToolChoice | None) -> None:
        """A 400 for a tool choice that needs tool calling where the server has none (as vLLM)."""
        if tool_choice == "none" or self.tool_parser is not None:
            return
        if tool_choice == "auto":
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        else:
            label = '"required"' if tool_choice == "required" else "naming a function"
            message = f"tool_choice {label} requires --enable-auto-tool-choice and --tool-call-parser to be set"
        raise OpenAIError(f"{message} (on the server).", param="tool_choice")


def message_parsing(request: ChatCompletionRequest, prompt_token_ids: list[int], tool_parser: type[ToolParser] | None,
                    reasoning: ReasoningParser | None) -> MessageParsing | None:
    """How a chat request's replies become messages (None: their text is the content), with the
    server's tool parser (None: no tool calls; the request was checked for that) and the request's
    reasoning parser. A tool choice that forces calls reads the output as their JSON (the request
    constrained it to their schema: ChatCompletionRequest.structured_outputs_params)."""
    if not request.may_call_tools:
        return MessageParsing(prompt_token_ids, reasoning, request.include_reasoning) if reasoning else None
    assert tool_parser is not None, "tools are called only where the server can (_check_tool_choice)"
    choice = request.tool_choice
    parser: Callable[[], ToolParser] = tool_parser
    if isinstance(choice, NamedToolChoice):
        parser = partial(NamedFunctionCall, choice.function.name)
    elif choice == "required":
        parser = RequiredFunctionCalls
    return MessageParsing(prompt_token_ids, reasoning, request.include_reasoning, parser,
                          named=isinstance(choice, NamedToolChoice),
                          parallel_tool_calls=bool(request.parallel_tool_calls))


class _Response:
    """One response built from the merged deltas of its engine requests; subclasses shape
    the JSON of a choice, a chunk and the whole response."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, n: int, streams: list[RequestStream]) -> None:
        self.id = request_id
        self.model = model
        self.n = n
        self.streams = streams  # one engine request per prompt
        self.created = int(time.time())
        self.usage = _Usage()
        self.finished: set[int] = set()  # choices whose last delta was taken
        # Per engine request id: its first choice's index and its number of prompt tokens.
        self.prompts = {stream.request_id: (i * n, len(stream.prompt_token_ids)) for i, stream in enumerate(streams)}
        # Per prompt (its index) that asked for them: its prompt logprobs, once they came.
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}

    def deltas(self, outputs: list[WireOutput]) -> list[_Delta]:
        """What a batch of engine outputs adds to the choices; counts the usage and keeps the
        prompt logprobs (they come before any choice of theirs, in the request's first output)."""
        deltas = []
        for request_id, completions, finished, _, num_cached_tokens, prompt_logprobs in outputs:
            first_index, num_prompt_tokens = self.prompts[request_id]
            if prompt_logprobs is not None:
                self.prompt_logprobs[first_index // self.n] = prompt_logprobs
            if finished:  # a prompt's cached-token count is final once it finishes
                self.usage.prompt_tokens += num_prompt_tokens
                self.usage.cached_tokens += num_cached_tokens
            for completion in completions:
                sample, _, token_ids, _, _, finish_reason, _ = completion  # CompletionOutput's fields
                index = first_index + sample
                if index in self.finished or not (token_ids or finish_reason):
                    continue
                if finish_reason == "error":  # vLLM's request-level internal error: always a 500
                    raise OpenAIError("The engine could not complete this request (a grammar that did not "
                                      "compile, say); the server logged why.", 500)
                if finish_reason is not None:
                    self.finished.add(index)
                self.usage.completion_tokens += len(token_ids)
                deltas.append((index, completion))
        return deltas

    async def gather(self) -> Json:
        choices = [_Choice() for _ in range(len(self.streams) * self.n)]
        async with _Merged(self.streams) as merged:
            while outputs := await merged.next():
                for index, delta in self.deltas(outputs):
                    choices[index].add(CompletionOutput(*delta))
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [self.final_choice(i, choice) for i, choice in enumerate(choices)],
                "usage": self.usage.as_json(), **self.response_fields()}

    async def stream(self, include_usage: bool, send: Send) -> None:
        """Send the SSE events (see EventStream): one per generated token (those that arrived
        together in one message); an error after the start as an error event; then the usage
        chunk (if asked) and [DONE]."""
        # Every chunk is this prefix, its choice and this suffix: only the choice is encoded
        # per event.
        prefix = (f'data: {{"id": "{self.id}", "object": "{self.chunk_object_name}", '
                  f'"created": {self.created}, "model": {json.dumps(self.model)}, "choices": [')
        suffix = '], "usage": null}\n\n' if include_usage else "]}\n\n"
        between = suffix + prefix
        try:
            opening = self.opening_choices(len(self.streams) * self.n)
            if opening:
                await send(_body("".join(prefix + json.dumps(choice) + suffix for choice in opening)))
            async with _Merged(self.streams) as merged:
                next_batch, chunk_json = merged.next, self.chunk_json
                while outputs := await next_batch():
                    # A choice whose delta adds nothing yet (a parser holds its text back) is left out.
                    if choices := [choice for choice in itertools.starmap(chunk_json, self.deltas(outputs))
                                   if choice is not None]:
                        await send(_body(prefix + between.join(choices) + suffix))
            if include_usage:
                await send(_body(_sse({"id": self.id, "object": self.chunk_object_name, "created": self.created,
                                       "model": self.model, "choices": [], "usage": self.usage.as_json()})))
        except Exception as error:  # noqa: BLE001 (the status line is sent: report it in the stream)
            status = error.status if isinstance(error, OpenAIError) else 500
            await send(_body(_sse(OpenAIError(str(error), status).body())))
        await send(_body("data: [DONE]\n\n"))

    def opening_choices(self, num_choices: int) -> list[Json]:
        return []

    def response_fields(self) -> Json:
        """Fields of a whole (non-streamed) response past its usage."""
        return {}

    def chunk_json(self, index: int, delta: WireCompletion) -> str | None:
        """A chunk's choice as JSON text (subclasses write the common case from a template); None
        if the delta adds nothing to send."""
        choice = self.chunk_choice(index, CompletionOutput(*delta))
        return json.dumps(choice) if choice is not None else None

    def chunk_choice(self, index: int, delta: CompletionOutput) -> Json | None:
        raise NotImplementedError

    def final_choice(self, index: int, choice: _Choice) -> Json:
        raise NotImplementedError


class _CompletionResponse(_Response):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, request: CompletionRequest, n: int,
                 echoes: list[tuple[str, list[int]]], streams: list[RequestStream],
                 decode: Callable[[int], str]) -> None:
        """echoes: with echo, per prompt its text and token ids; decode: one token's text (where
        no logprob carries it: the prompt's first token)."""
        super().__init__(request_id, model, n, streams)
        self.num_logprobs = request.logprobs
        self.echo = request.echo
        self.echoes = echoes
        self.prompt_only = request.echo and request.max_tokens == 0  # the generated token left out
        self.decode = decode
        self.echoed: set[int] = set()
        self.text_offsets: dict[int, int] = {}  # per choice, for streamed logprobs
        self.plain = request.logprobs is None and not request.echo  # chunks from chunk_json's template

    def _shown(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]
               ) -> tuple[str, list[int], list[dict[int, Logprob] | None]]:
        """What a choice's delta (or whole output) shows of its text, tokens and logprobs: with
        echo, the prompt's before them in the choice's first (once); none of the generated
        token with max_tokens 0."""
        if self.prompt_only:
            text, token_ids, logprobs = "", [], []
        if not self.echo or index in self.echoed:
            return text, token_ids, logprobs
        self.echoed.add(index)
        prompt = index // self.n
        prompt_text, prompt_token_ids = self.echoes[prompt]
        return prompt_text + text, prompt_token_ids + token_ids, [*self.prompt_logprobs.get(prompt, []), *logprobs]

    def chunk_json(self, index: int, delta: WireCompletion) -> str | None:
        _, text, _, _, _, finish_reason, _ = delta
        if not self.plain or finish_reason is not None:
            return super().chunk_json(index, delta)
        # chunk_choice's JSON (a running choice has no stop reason).
        return (f'{{"index": {index}, "text": {encode_basestring_ascii(text)}, '
                '"logprobs": null, "finish_reason": null, "stop_reason": null}')

    def chunk_choice(self, index: int, delta: CompletionOutput) -> Json:
        text, token_ids, logprobs = self._shown(index, delta.text, delta.token_ids, list(delta.logprobs or []))
        logprobs_json = None
        if self.num_logprobs is not None:
            offset = self.text_offsets.get(index, 0)
            logprobs_json, self.text_offsets[index] = _completion_logprobs(
                token_ids, logprobs, self.num_logprobs, offset, self.decode)
        return {"index": index, "text": text, "logprobs": logprobs_json, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}

    def final_choice(self, index: int, choice: _Choice) -> Json:
        text, token_ids, logprobs = self._shown(index, "".join(choice.text), choice.token_ids, list(choice.logprobs))
        logprobs_json = None
        if self.num_logprobs is not None:
            logprobs_json, _ = _completion_logprobs(token_ids, logprobs, self.num_logprobs, 0, self.decode)
        return {"index": index, "text": text, "logprobs": logprobs_json, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "prompt_logprobs": _prompt_logprobs_json(self.prompt_logprobs.get(index // self.n))}


class _ChatResponse(_Response):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, num_logprobs: int | None, n: int,
                 streams: list[RequestStream], parsing: MessageParsing | None = None) -> None:
        """parsing: how outputs become messages (reasoning, tool calls); None: the text is the content."""
        super().__init__(request_id, model, n, streams)
        self.num_logprobs = num_logprobs
        self.parsing = parsing
        self.message_streams: dict[int, MessageStream] = {}  # per choice, while streaming with parsing

    def response_fields(self) -> Json:
        return {"prompt_logprobs": _prompt_logprobs_json(self.prompt_logprobs.get(0))}

    def opening_choices(self, num_choices: int) -> list[Json]:
        """The assistant role, in each choice's first delta (as OpenAI and vLLM send it)."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_json(self, index: int, delta: WireCompletion) -> str | None:
        _, text, _, _, _, finish_reason, _ = delta
        if self.num_logprobs is not None or finish_reason is not None or self.parsing is not None:
            return super().chunk_json(index, delta)
        # chunk_choice's JSON (a running choice has no stop reason).
        return (f'{{"index": {index}, "delta": {{"content": {encode_basestring_ascii(text)}}}, '
                '"logprobs": null, "finish_reason": null, "stop_reason": null}')

    def chunk_choice(self, index: int, delta: CompletionOutput) -> Json | None:
        message: Json = {"content": delta.text}
        finish_reason = delta.finish_reason
        if self.parsing is not None:
            stream = self.message_streams.get(index)
            if stream is None:
                stream = self.message_streams[index] = self.parsing.stream()
            if finish_reason is None:
                parsed = stream.feed(delta.text)
            else:
                parsed, finish_reason = stream.finish(delta.text, finish_reason)
            message = parsed.as_json()
            if not message and finish_reason is None and self.num_logprobs is None:
                return None
        return {"index": index, "delta": message, "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": finish_reason, "stop_reason": delta.stop_reason}

    def final_choice(self, index: int, choice: _Choice) -> Json:
        text = "".join(choice.text)
        if self.parsing is None:
            message: Json = {"role": "assistant", "content": text, "reasoning": None, "reasoning_content": None}
            finish_reason = choice.finish_reason
        else:
            parsed, finish_reason = self.parsing.parse(text, choice.finish_reason)
            message = parsed.as_json()
        return {"index": index, "message": message, "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> Json | None:
        if self.num_logprobs is None or logprobs is None:
            return None
        return {"content": [{**_chat_logprob(position[token]),
                             "top_logprobs": [_chat_logprob(p) for p in _top(position, self.num_logprobs)]}
                            for token, position in zip(token_ids, logprobs)]}


def _top(position: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely candidates at one position, most likely first."""
    return sorted((p for p in position.values() if p.rank is not None and p.rank <= k),
                  key=lambda p: cast(int, p.rank))  # not None: filtered


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _chat_logprob(logprob: Logprob) -> Json:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": _clamp(logprob.logprob), "bytes": list(token.encode())}


def _completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int,
                         offset: int, decode: Callable[[int], str]) -> tuple[Json, int]:
    """The legacy completions logprobs object, and the text offset after its tokens. A
    position without logprobs (an echoed prompt's first token) gets nulls, as in vLLM."""
    result: Json = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, position in zip(token_ids, logprobs):
        if position is None:
            text = decode(token)
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            chosen = position[token]
            text = chosen.decoded_token or ""
            result["token_logprobs"].append(_clamp(chosen.logprob))
            result["top_logprobs"].append({p.decoded_token: _clamp(p.logprob) for p in [chosen, *_top(position, k)]})
        result["text_offset"].append(offset)
        result["tokens"].append(text)
        offset += len(text)
    return result, offset


def _prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list[Json | None] | None:
    """vLLM's prompt_logprobs field: per prompt position None (the first) or token id ->
    {logprob, rank, decoded_token}."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {str(token): {"logprob": _clamp(p.logprob), "rank": p.rank,
                                                        "decoded_token": p.decoded_token}
                                           for token, p in position.items()}
            for position in prompt_logprobs]


class _NotJson:
    """What _json_value answers for a value JSON cannot carry (the caller leaves it out)."""


_NOT_JSON = _NotJson()


def _json_value(value: object) -> object:
    """value as JSON can carry it: an AddedToken as its text, tuples as lists, keys as strings;
    _NOT_JSON for what it cannot (objects, NaN or infinite floats), left out of its container."""
    if isinstance(value, AddedToken):
        return value.content
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_JSON
    if isinstance(value, dict):
        items = ((str(key), _json_value(item)) for key, item in value.items())
        return {key: item for key, item in items if item is not _NOT_JSON}
    if isinstance(value, list | tuple):
        return [item for item in map(_json_value, value) if item is not _NOT_JSON]
    return _NOT_JSON


def _sse(payload: Json) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _body(text: str) -> Message:
    """An ASGI message with more of the response's body."""
    return {"type": "http.response.body", "body": text.encode(), "more_body": True}


# A batch of one stream's outputs | the error that ended a stream | None: a stream finished.
_Queue = asyncio.Queue[list[WireOutput] | BaseException | None]


async def _pump(merged: _Queue, stream: RequestStream) -> None:
    try:
        while batch := await stream.next_wire_batch():
            merged.put_nowait(batch)
        merged.put_nowait(None)
    except Exception as error:  # noqa: BLE001 (re-raised by the consumer)
        merged.put_nowait(error)


class _Merged:
    """The outputs of a request's streams (one per prompt) in arrival order, a batch per
    `await next()` ([] once every stream finished). Used as an async context manager:
    leaving it (an error, a disconnect) aborts every unfinished stream."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._remaining = len(streams)
        self._merged: _Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        if len(streams) == 1:
            # Read directly: no task, queue or frame of ours on the path of every event.
            self.next: Callable[[], Awaitable[list[WireOutput]]] = streams[0].next_wire_batch
        else:
            self.next = self._next_merged
            self._tasks = [asyncio.create_task(_pump(self._merged, stream)) for stream in streams]

    async def _next_merged(self) -> list[WireOutput]:
        while self._remaining:
            item = await self._merged.get()
            if item is None:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return item
        return []

    async def __aenter__(self) -> "_Merged":
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.aclose()
