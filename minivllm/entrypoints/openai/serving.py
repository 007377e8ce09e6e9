"""/v1/completions and /v1/chat/completions over AsyncLLM, shaped as vLLM answers them.

A request becomes one engine request per prompt (n samples each); their delta outputs are
merged into one sequence of per-choice deltas, which a streaming request sends as one SSE
event per generated token and a plain request gathers into one response.
"""

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.async_llm import AsyncLLM, RequestStream
from minivllm.entrypoints.chat_utils import render_chat_prompt
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    _SamplingRequest,
)
from minivllm.outputs import Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

# The sampling fields a model's generation_config.json may set as defaults (vLLM applies them).
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# JSON has no -inf: a token with zero probability reports this (as vLLM does).
_MIN_LOGPROB = -9999.0

Json = dict[str, Any]


def generation_config_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults the model's generation_config.json sets (empty if none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {name: config[name] for name in _GENERATION_CONFIG_FIELDS if config.get(name) is not None}


@dataclass
class _Delta:
    """What one engine output adds to one choice."""

    index: int  # the choice: prompt index * n + sample index
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


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

    def add(self, delta: _Delta) -> None:
        self.text.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.sampling_defaults = generation_config_defaults(engine.config.model)

    # --- shared checks ----------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist: this server serves "
                              f"{', '.join(self.served_model_names)}.", 404, "model")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("This server has no tokenizer: send token ids instead of text.")
        return await self.engine.encode(text, add_special_tokens)

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        text = render_chat_prompt(self.tokenizer, [message.as_template_input() for message in messages],
                                  add_generation_prompt, chat_template_kwargs)
        return await self.tokenize(text, add_special_tokens=False)

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

    def _sampling_params(self, request: _SamplingRequest, max_tokens: int | None,
                         logprobs: int | None) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens, logprobs, self.sampling_defaults)
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

    async def create_completion(self, request: CompletionRequest) -> Awaitable[Json] | AsyncIterator[str]:
        """Queue the request; return what makes the response body, or the SSE events of a
        streaming response. Raises OpenAIError or ValueError (both 400) before anything is
        queued."""
        self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported: remove it from the request.", param="suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo with logprobs needs prompt logprobs, which minivllm does not compute: "
                              "drop one of them.", param="echo")
        params = self._sampling_params(request, request.max_tokens, request.logprobs)
        prompts = await self._completion_prompts(request.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(prompts, params, request_id)
        echoes = [self._prompt_text(text, token_ids) if request.echo else "" for text, token_ids in prompts]
        response = _CompletionResponse(request_id, request.model or self.served_model_names[0], request,
                                       params.n, echoes)
        if request.stream:
            return response.stream(streams, request.include_usage)
        return response.gather(streams)

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                                  ) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt is empty: give a string, a list of strings, token ids or lists of them.",
                              param="prompt")
        return [(p, await self.tokenize(p)) if isinstance(p, str) else (None, p) for p in prompt]

    def _prompt_text(self, text: str | None, token_ids: list[int]) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # --- /v1/chat/completions ---------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Awaitable[Json] | AsyncIterator[str]:
        self.check_model(request.model)
        token_ids = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                           request.template_kwargs())
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._sampling_params(request, max_tokens, num_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start([(None, token_ids)], params, request_id)
        response = _ChatResponse(request_id, request.model or self.served_model_names[0], num_logprobs, params.n)
        if request.stream:
            return response.stream(streams, request.include_usage)
        return response.gather(streams)


class _Response:
    """One response built from the merged deltas of its engine requests; subclasses shape
    the JSON of a choice, a chunk and the whole response."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, n: int) -> None:
        self.id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.usage = _Usage()

    async def deltas(self, streams: list[RequestStream]) -> AsyncIterator[list[_Delta]]:
        """Every choice's deltas, a list per batch of engine outputs (see RequestStream.batches).
        Closing this aborts what is unfinished."""
        finished: set[int] = set()
        async for prompt_index, outputs in _merge(streams):
            deltas = []
            for output in outputs:
                if output.finished:  # a prompt's cached-token count is final once it finishes
                    self.usage.prompt_tokens += len(output.prompt_token_ids)
                    self.usage.cached_tokens += output.num_cached_tokens
                for completion in output.outputs:
                    index = prompt_index * self.n + completion.index
                    if index in finished or not (completion.token_ids or completion.finish_reason):
                        continue
                    if completion.finish_reason is not None:
                        finished.add(index)
                    self.usage.completion_tokens += len(completion.token_ids)
                    deltas.append(_Delta(index, completion.text, completion.token_ids, completion.logprobs,
                                         completion.finish_reason, completion.stop_reason))
            yield deltas

    async def gather(self, streams: list[RequestStream]) -> Json:
        choices = [_Choice() for _ in range(len(streams) * self.n)]
        async for deltas in self.deltas(streams):
            for delta in deltas:
                choices[delta.index].add(delta)
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [self.final_choice(i, choice) for i, choice in enumerate(choices)],
                "usage": self.usage.as_json()}

    async def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """SSE events: one per generated token (those that arrived together written at once);
        an error after the start arrives as an error event; then the usage chunk (if asked)
        and [DONE]."""
        # Every chunk is this prefix, its choice and this suffix: only the choice is encoded
        # per event.
        prefix = (f'data: {{"id": "{self.id}", "object": "{self.chunk_object_name}", '
                  f'"created": {self.created}, "model": {json.dumps(self.model)}, "choices": [')
        suffix = '], "usage": null}\n\n' if include_usage else "]}\n\n"
        try:
            opening = self.opening_choices(len(streams) * self.n)
            if opening:
                yield "".join(prefix + json.dumps(choice) + suffix for choice in opening)
            async for deltas in self.deltas(streams):
                if deltas:
                    yield "".join(prefix + json.dumps(self.chunk_choice(delta)) + suffix for delta in deltas)
            if include_usage:
                yield _sse({"id": self.id, "object": self.chunk_object_name, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage.as_json()})
        except Exception as error:  # noqa: BLE001 (the status line is sent: report it in the stream)
            status = error.status if isinstance(error, OpenAIError) else 500
            yield _sse(OpenAIError(str(error), status).body())
        yield "data: [DONE]\n\n"

    def opening_choices(self, num_choices: int) -> list[Json]:
        return []

    def chunk_choice(self, delta: _Delta) -> Json:
        raise NotImplementedError

    def final_choice(self, index: int, choice: _Choice) -> Json:
        raise NotImplementedError


class _CompletionResponse(_Response):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, request: CompletionRequest, n: int, echoes: list[str]) -> None:
        super().__init__(request_id, model, n)
        self.num_logprobs = request.logprobs
        self.echoes = echoes  # per prompt: its text when echo is set, else ""
        self.echoed: set[int] = set()
        self.text_offsets: dict[int, int] = {}  # per choice, for streamed logprobs

    def _echo(self, index: int) -> str:
        """The prompt's text before a choice's first text (once), when echo is set."""
        if index in self.echoed:
            return ""
        self.echoed.add(index)
        return self.echoes[index // self.n]

    def chunk_choice(self, delta: _Delta) -> Json:
        text = self._echo(delta.index) + delta.text
        logprobs = None
        if self.num_logprobs is not None:
            offset = self.text_offsets.get(delta.index, 0)
            logprobs, self.text_offsets[delta.index] = _completion_logprobs(
                delta.token_ids, delta.logprobs, self.num_logprobs, offset)
        return {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}

    def final_choice(self, index: int, choice: _Choice) -> Json:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs, _ = _completion_logprobs(choice.token_ids, choice.logprobs, self.num_logprobs, 0)
        return {"index": index, "text": self._echo(index) + "".join(choice.text), "logprobs": logprobs,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


class _ChatResponse(_Response):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, num_logprobs: int | None, n: int) -> None:
        super().__init__(request_id, model, n)
        self.num_logprobs = num_logprobs

    def opening_choices(self, num_choices: int) -> list[Json]:
        """The assistant role, in each choice's first delta (as OpenAI and vLLM send it)."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_choice(self, delta: _Delta) -> Json:
        return {"index": delta.index, "delta": {"content": delta.text},
                "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}

    def final_choice(self, index: int, choice: _Choice) -> Json:
        return {"index": index, "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> Json | None:
        if self.num_logprobs is None or logprobs is None:
            return None
        return {"content": [{**_chat_logprob(position[token]),
                             "top_logprobs": [_chat_logprob(p) for p in _top(position, self.num_logprobs)]}
                            for token, position in zip(token_ids, logprobs)]}


def _top(position: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely candidates at one position, most likely first."""
    return sorted((p for p in position.values() if p.rank is not None and p.rank <= k), key=lambda p: p.rank)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _chat_logprob(logprob: Logprob) -> Json:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": _clamp(logprob.logprob), "bytes": list(token.encode())}


def _completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, k: int,
                         offset: int) -> tuple[Json, int]:
    """The legacy completions logprobs object, and the text offset after its tokens."""
    result: Json = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, position in zip(token_ids, logprobs or []):
        chosen = position[token]
        text = chosen.decoded_token or ""
        result["text_offset"].append(offset)
        result["token_logprobs"].append(_clamp(chosen.logprob))
        result["tokens"].append(text)
        result["top_logprobs"].append({p.decoded_token: _clamp(p.logprob) for p in [chosen, *_top(position, k)]})
        offset += len(text)
    return result, offset


def _sse(payload: Json) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
    """(prompt index, a batch of its outputs) from several request streams, in arrival order.
    Leaving early (an error, a disconnect) aborts every unfinished stream."""
    if len(streams) == 1:
        async for batch in streams[0].batches():
            yield 0, batch
        return
    merged: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for batch in stream.batches():
                merged.put_nowait((index, batch))
            merged.put_nowait((index, None))
        except Exception as error:  # noqa: BLE001 (re-raised by the consumer)
            merged.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()
