"""The server against hostile and malformed input, and at shutdown: a real `minivllm serve`
process on 127.0.0.1, driven by httpx (keep-alive connections, raw bodies) and the openai
client. No request may run code of its own, stall the server, or get anything but an
OpenAI-shaped JSON answer; a stopping server drains its requests instead of cutting them."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_utils import RemoteServer, alive, descendants, openai_error, serving

pytestmark = pytest.mark.slow  # server subprocesses, signals, fuzzed bodies

MAX_MODEL_LEN = 256
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(24 << 20))
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[RemoteServer]:
    with serving(model_dir, *SERVER_ARGS) as server:
        yield server


@pytest.fixture
def client(server: RemoteServer) -> Iterator[httpx.Client]:
    """One keep-alive connection: an answer that broke it would fail the next request."""
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def _post_raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _assert_serving(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


# --- request chat templates -------------------------------------------------------------------

SLOW_TEMPLATE = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"
HUGE_TEMPLATE = "{{ 'x' * 3000000000 }}"


@pytest.mark.parametrize("body", [{**CHAT, "chat_template": "{{ 'hi' }}"},
                                  {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 'hi' }}"}}])
def test_a_request_template_is_refused_by_default(client: httpx.Client, body: dict[str, Any]) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert "--trust-request-chat-template" in openai_error(response, 400)
    assert response.json()["error"]["param"] == "chat_template"
    _assert_serving(client)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "return_dict", "conversation"])
def test_template_kwargs_may_not_set_the_calls_own_arguments(client: httpx.Client, key: str) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {key: True}})
    message = openai_error(response, 400)
    assert repr(key) in message and "multiple values" not in message
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    # Other keys reach the template, as a model's own variables (enable_thinking, ...) do.
    assert client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"x": 1}}).status_code == 200


def test_trusted_request_templates_are_bounded_in_time_and_memory(model_dir: str) -> None:
    with (serving(model_dir, *SERVER_ARGS, "--trust-request-chat-template") as server,
          httpx.Client(base_url=server.url, timeout=60) as client):
        # A trusted template renders (this one ignores the messages).
        body = {**CHAT, "chat_template": "Hello there", "max_tokens": 1}
        tokens = client.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()
        assert client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == tokens["count"]
        # A template that runs forever is stopped; /health answers meanwhile (the render is
        # not on the event loop, nor in the server's process).
        slow: dict[str, httpx.Response] = {}
        render = threading.Thread(target=lambda: slow.setdefault("response", client.post(
            "/v1/chat/completions", json={**CHAT, "chat_template": SLOW_TEMPLATE})))
        start = time.monotonic()
        render.start()
        time.sleep(0.5)
        health_start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert time.monotonic() - health_start < 1.0
        render.join()
        assert "took longer than 5 s" in openai_error(slow["response"], 400)
        assert time.monotonic() - start < 15
        # A template that allocates gigabytes fails on the render process's memory limit.
        huge = client.post("/v1/chat/completions", json={**CHAT, "chat_template": HUGE_TEMPLATE})
        assert "MiB of memory" in openai_error(huge, 400)
        # The render process came back: chat works again.
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


# --- text that is not valid Unicode, and malformed JSON ---------------------------------------

LONE_SURROGATE = b"a\\ud800b"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "%s", "max_tokens": 2}' % LONE_SURROGATE),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "%s"}]}' % LONE_SURROGATE),
    ("/tokenize", b'{"model": "tiny", "prompt": "%s"}' % LONE_SURROGATE),
    ("/v1/completions", b'{"model": "%s", "prompt": "x"}' % LONE_SURROGATE),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\udc00"]}'),
])
def test_lone_surrogates_are_a_400_and_the_connection_stays_usable(client: httpx.Client, path: str,
                                                                   body: bytes) -> None:
    assert "surrogate pair" in openai_error(_post_raw(client, path, body), 400)
    _assert_serving(client)
    # A surrogate pair is one character, and fine.
    pair = body.replace(LONE_SURROGATE, b"a\\ud83d\\ude00b").replace(b"\\udc00", b"\\ud83d\\ude00")
    assert _post_raw(client, path, pair).status_code in (200, 404)  # 404: the model name


@pytest.mark.parametrize("body, fragment", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "must be UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays and objects too deeply"),
    (b'{"model": "tiny", "prompt": ', "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_malformed_json_says_what_is_wrong(client: httpx.Client, body: bytes, fragment: str) -> None:
    assert fragment in openai_error(_post_raw(client, "/v1/completions", body), 400)
    _assert_serving(client)


@pytest.mark.parametrize("path, change, fragment, param", [
    ("/v1/completions", {"max_tokens": True}, "max_tokens: Input should be a valid integer", "max_tokens"),
    ("/v1/completions", {"n": "2"}, "n: Input should be a valid integer", "n"),
    ("/v1/completions", {"stream": 1}, "stream: Input should be a valid boolean", "stream"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt: must be a string, a list of strings, a list of token ids",
     "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]},
     "'image_url': minivllm serves text-only models", "messages.0.content"),
])
def test_confusing_fields_get_one_clear_message(client: httpx.Client, path: str, change: dict[str, Any],
                                                fragment: str, param: str) -> None:
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **change}
    response = client.post(path, json=body)
    message = openai_error(response, 400)
    assert fragment in message and message.count(";") == 0, message  # one problem, not one per form
    assert response.json()["error"]["param"] == param


def test_an_unexpected_error_is_a_logged_json_500(caplog: pytest.LogCaptureFixture) -> None:
    """A bug in a route: the client gets OpenAI's JSON 500 (not text/plain), the traceback is
    logged once, and nothing reaches uvicorn (which would close the connection)."""
    from fastapi import FastAPI

    from minivllm.entrypoints.openai.api_server import _add_error_handlers, _EdgeApp

    app = FastAPI()
    _add_error_handlers(app)

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    edge = _EdgeApp(app)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=edge), base_url="http://test") as client:
            return await client.get("/bug")  # an exception out of the app would raise here

    assert "RuntimeError" in openai_error(asyncio.run(get()), 500)
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError]
    edge.draining = True
    assert "shutting down" in openai_error(asyncio.run(get()), 503)


# --- a fuzz of malformed bodies ---------------------------------------------------------------

# Per known field, values that are wrong for it (a wrong type, or out of range).
_WRONG_VALUES: dict[str, list[Any]] = {
    "model": [5, [], {}, True, "no-such-model"],
    "prompt": [5, True, {}, None, [1, "a"], [[1], "a"], [1.5], "", [], [10**9], [-1], [[]], [[1, None]]],
    "messages": ["Hi", [], [5], [{"content": "x"}], [{"role": 5}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": [{}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}], None],
    "max_tokens": [True, "5", 1.5, [], {}, 0, -1, 10**6, 2**70],
    "n": [True, "2", 2.5, 0, -3, None],
    "temperature": ["hot", True, [], -1, float("inf")],
    "top_p": ["x", 0, 2, -1],
    "top_k": [1.5, "3", -5],
    "min_p": [2, -0.5, "x"],
    "seed": [2**70, -(2**70), 1.5, "7"],
    "stop": [5, [5], [""], {"a": 1}, [None]],
    "stop_token_ids": [5, ["x"], [-1], [10**9], "1"],
    "presence_penalty": [5, -9, "x"],
    "frequency_penalty": [3, "x"],
    "repetition_penalty": [0, -1, "x"],
    "logprobs": [21, -1, "3", True],
    "stream": [1, "yes", None],
    "stream_options": [{"include_usage": True}, 5],
    "ignore_eos": ["no", 0],
    "min_tokens": [-1, 10**6, "2"],
    "echo": ["yes"],
    "best_of": [3, "x"],
    "logit_bias": [{"x": 5}, {"1": "a"}, {"1": float("inf")}, {str(10**9): 5}, 5],
    "allowed_token_ids": [[], ["x"], [10**9], [-1], 5],
    "prompt_logprobs": [-1, 21, "3", True],
    "bad_words": ["x", [5], [""], 5],
    "top_logprobs": [2, 50, "x"],
    "tools": [[{"type": "function", "function": {"name": "f"}}], [], [{"type": "function"}], 5],
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}, 5],
    "structured_outputs": [{}, {"regex": "("}, {"json": 5}, {"regex": "a", "choice": ["a"]}, {"nope": 1}, 5],
    "chat_template_kwargs": [{"tokenize": True}, {"chat_template": "x"}, 5],
    "chat_template": ["{{ 'x' }}", 5],
    "continue_final_message": ["yes"],
    "add_generation_prompt": [5],
}
_COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                      "stream", "stream_options", "ignore_eos", "min_tokens", "echo", "best_of", "logit_bias",
                      "allowed_token_ids", "response_format", "structured_outputs", "prompt_logprobs",
                      "bad_words"]
_CHAT_FIELDS = [f for f in _COMPLETION_FIELDS if f not in ("prompt", "logprobs", "echo")] + [
    "messages", "top_logprobs", "tools", "chat_template_kwargs", "chat_template",
    "continue_final_message", "add_generation_prompt"]


def _malformed_bodies(count: int, seed: int = 0) -> Iterator[tuple[str, bytes, str]]:
    """(path, body, content type) of bodies every one of which is wrong: fields with wrong
    values, broken JSON, bodies that are not objects, bytes that are not UTF-8, surrogates,
    deep nesting, a wrong content type."""
    rng = random.Random(seed)
    json_type = "application/json"
    for _ in range(count):
        chat = rng.random() < 0.5
        path, good, fields = (("/v1/chat/completions", CHAT, _CHAT_FIELDS) if chat
                              else ("/v1/completions", COMPLETION, _COMPLETION_FIELDS))
        kind = rng.choice(["field", "field", "field", "fields", "truncated", "garbage", "not an object",
                           "not utf-8", "surrogate", "deep", "content type"])
        if kind in ("field", "fields"):
            body = dict(good)
            for field in rng.sample(fields, 1 if kind == "field" else rng.randint(2, 4)):
                body[field] = rng.choice(_WRONG_VALUES[field])
            yield path, json.dumps(body).encode(), json_type
        elif kind == "truncated":
            text = json.dumps(good).encode()
            yield path, text[:rng.randrange(len(text))], json_type
        elif kind == "garbage":
            text = json.dumps(good)
            yield path, rng.choice([text[:-1] + ", }", text.replace('"', "'"), text.replace('"model"', "model"),
                                    text + "}", "{" + text, text.replace(":", "=", 1)]).encode(), json_type
        elif kind == "not an object":
            yield path, json.dumps(rng.choice([[], [good], "x", 5, None, True])).encode(), json_type
        elif kind == "not utf-8":
            yield path, json.dumps(good).encode().replace(b"tiny", b"ti\xc3\x28ny"), json_type
        elif kind == "surrogate":
            escape = rng.choice([b"\\ud800", b"\\udfff", b"\\ud83d\\u0041"])
            yield path, json.dumps(good).encode().replace(b"tiny", b"ti" + escape + b"ny"), json_type
        elif kind == "deep":
            depth = rng.randint(300, 5000)
            yield path, json.dumps(good)[:-1].encode() + b', "x": ' + b"[" * depth + b"]" * depth + b"}", json_type
        else:
            yield path, json.dumps(good).encode(), rng.choice(["text/plain", "application/x-www-form-urlencoded",
                                                                 "multipart/form-data", "", "application/xml"])


def test_fuzzed_malformed_bodies_get_openai_errors_and_the_server_keeps_serving(client: httpx.Client) -> None:
    statuses: dict[int, int] = {}
    for path, body, content_type in _malformed_bodies(300):
        headers = {"content-type": content_type} if content_type else {}
        response = client.post(path, content=body, headers=headers)
        assert 400 <= response.status_code < 500, (path, body[:300], response.status_code, response.text[:300])
        openai_error(response, response.status_code)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _assert_serving(client)
    assert statuses.keys() <= {400, 404}, statuses


# --- shutdown and start-up --------------------------------------------------------------------


def _stream(url: str, max_tokens: int, events: list[str]) -> None:
    body = {**COMPLETION, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events.extend(line for line in response.iter_lines() if line)


def _post(url: str, max_tokens: int, responses: list[httpx.Response]) -> None:
    body = {**COMPLETION, "max_tokens": max_tokens, "ignore_eos": True}
    responses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))


def test_sigterm_drains_then_ends_what_is_left_and_exits_0(tiny_model_factory) -> None:
    """Requests in flight when SIGTERM comes: a short one finishes; long ones end after
    --shutdown-timeout with an OpenAI error (a stream: an error event, then [DONE]); new ones
    are refused; the server exits 0 with every child process gone."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM", max_position_embeddings=8192)
    server = RemoteServer(model_dir, "--max-model-len", "8192", "--kv-cache-memory-bytes", str(64 << 20),
                          "--shutdown-timeout", "3")
    children = descendants(server.process.pid)
    short: list[httpx.Response] = []
    long_plain: list[httpx.Response] = []
    long_events: list[list[str]] = [[], []]
    threads = [threading.Thread(target=_post, args=(server.url, 8000, long_plain)),
               *(threading.Thread(target=_stream, args=(server.url, 8000, events)) for events in long_events),
               threading.Thread(target=_post, args=(server.url, 100, short))]
    for running, thread in enumerate(threads, 1):  # the short one last: it is in flight at SIGTERM
        thread.start()
        deadline = time.monotonic() + 30
        while server.metrics()["vllm:num_requests_running"] < running and time.monotonic() < deadline:
            time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=5)
    for thread in threads:
        thread.join(30)
    assert server.process.wait(30) == 0, server.output()
    log = server.output()
    server.stop()
    assert short[0].status_code == 200 and short[0].json()["usage"]["completion_tokens"] == 100
    assert "shut down before this request finished" in openai_error(long_plain[0], 503)
    for events in long_events:
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down" in error["message"]
        assert len(events) > 3  # tokens came before the end
    assert "Traceback" not in log
    assert log.index("Signal 15: shutting down") < log.index("Finished server process")
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children), "a process outlived the server"


def test_a_port_in_use_fails_before_the_model_loads(model_dir: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "minivllm", "serve", model_dir, "--host", "127.0.0.1",
                                 "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Loaded weights" not in result.stderr, "the model loaded before the port was checked"
    assert time.monotonic() - start < 60
