"""The OpenAI-compatible server, end to end: a real `minivllm serve` process on 127.0.0.1,
driven by the official `openai` client (and raw HTTP where the client would refuse to send
what we test). Greedy outputs are checked against the offline engine, itself checked
against Hugging Face here too."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from tests.hf_oracle import hf_greedy
from tests.server_utils import RemoteServer, alive, descendants, openai_error, serving

pytestmark = pytest.mark.slow  # server subprocesses, each loading a model

PROMPTS = ["The quick brown fox", "Once upon a time there was", "A language model reads a prompt",
           "The dog sleeps in the sun, and"]
MAX_MODEL_LEN = 256
KV_CACHE_BYTES = 24 << 20  # not the CPU default (a quarter of free RAM)
NO_EOS = {"ignore_eos": True}  # vLLM's extra field, sent through the client's extra_body


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[RemoteServer]:
    # 8-token pages: the tests' short prompts, repeated, then fill whole pages and hit the prefix cache
    with serving(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "8",
                 "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), stop_signal=signal.SIGINT) as server:
        yield server


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)


def greedy_text(offline: LLM, prompt: str | list[int], max_tokens: int) -> str:
    """The offline engine's greedy text (its token ids checked against Hugging Face)."""
    output = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                              use_tqdm=False)[0]
    token_ids = output.prompt_token_ids
    assert output.outputs[0].token_ids == hf_greedy(offline.llm_engine.config.model, token_ids, max_tokens)[0]
    return output.outputs[0].text


# --- the happy paths ---------------------------------------------------------------------------


def test_models_version_health(server: RemoteServer) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()


def test_completion_matches_offline_and_hf(server: RemoteServer, offline: LLM) -> None:
    client = server.client()
    for prompt in PROMPTS:
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body=NO_EOS)
        choice = response.choices[0]
        assert choice.text == greedy_text(offline, prompt, 12)
        assert choice.finish_reason == "length"
        num_prompt = len(offline.get_tokenizer().encode(prompt))
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (num_prompt, 12)
        assert response.usage.total_tokens == num_prompt + 12


def test_default_max_tokens_is_16(server: RemoteServer) -> None:
    response = server.client().completions.create(model="tiny", prompt=PROMPTS[0], temperature=0,
                                                  extra_body=NO_EOS)
    assert response.usage.completion_tokens == 16


def test_streamed_deltas_join_to_the_text_one_event_per_token(server: RemoteServer) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "extra_body": NO_EOS}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 20  # one event per generated token
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    usage = chunks[-1].usage  # the last chunk: no choices, the usage
    assert not chunks[-1].choices and usage.completion_tokens == 20
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # The same prompt again: its full blocks come from the prefix cache, and usage says so.
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens // 16) * 16


def test_chat_streaming_and_not(server: RemoteServer, offline: LLM) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    kwargs = {"model": "tiny", "messages": messages, "max_completion_tokens": 10, "temperature": 0,
              "extra_body": NO_EOS}
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    template_messages = [messages[0], {"role": "user", "content": "Tell me\na story"}]
    expected = offline.chat(template_messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0]
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    # continue_final_message: the reply continues the last (assistant) message instead of a new one.
    partial = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
    continued = client.chat.completions.create(model="tiny", messages=partial, max_tokens=2, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    tokenizer = offline.get_tokenizer()
    rendered = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert rendered.endswith("Once upon")
    assert continued.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seeds(server: RemoteServer) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 11,
              "extra_body": NO_EOS}
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeds reproduce
    assert len({c.text for c in first.choices}) > 1  # each sample has its own stream
    assert first.usage.completion_tokens == 24
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in first.choices]


def test_stop_strings_and_stop_token_ids(server: RemoteServer, offline: LLM) -> None:
    client = server.client()
    text = greedy_text(offline, PROMPTS[3], 24)
    stop = text[8:11]
    assert stop.strip()
    response = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                         stop=[stop], extra_body=NO_EOS)
    choice = response.choices[0]
    assert choice.text == text[:text.index(stop)]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop], stream=True, extra_body=NO_EOS))
    assert streamed == choice.text
    # A stop token: the third greedy token ends the text.
    token_ids = offline.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
    response = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                         extra_body={**NO_EOS, "stop_token_ids": [token_ids[2]]})
    assert response.choices[0].model_extra["stop_reason"] == token_ids[2]
    assert response.usage.completion_tokens == 3


def test_prompt_forms_echo_and_logprobs(server: RemoteServer, offline: LLM) -> None:
    client = server.client()
    tokenizer = offline.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    by_text = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0,
                                        extra_body=NO_EOS)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices] == [
        greedy_text(offline, p, 6) for p in PROMPTS[:2]]
    single_ids = client.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0,
                                           extra_body=NO_EOS)
    assert single_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
                                       extra_body=NO_EOS)
    assert echoed.choices[0].text == PROMPTS[0] + by_text.choices[0].text
    with_logprobs = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                              logprobs=2, extra_body=NO_EOS)
    logprobs = with_logprobs.choices[0].logprobs
    assert "".join(logprobs.tokens) == with_logprobs.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in logprobs.token_logprobs)
    # Greedy: the chosen token is the most likely one, so it leads its top-2.
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)


def lm_eval_parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval 0.4.13's local-completions model reads of a log-likelihood answer
    (LocalCompletionsAPI.parse_logprobs; it asks echo, logprobs 1, max_tokens 1): per choice,
    by index, the continuation's summed logprob and whether each of its tokens was the most
    likely one, from token_logprobs and top_logprobs past the context, the generated token
    dropped."""
    results = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda choice: choice["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(token_logprobs),
                        all(token == max(top.values()) for token, top in zip(token_logprobs, top_logprobs))))
    return results


def test_echo_logprobs_score_prompts_as_lm_eval_reads_them(server: RemoteServer, offline: LLM) -> None:
    """echo + logprobs: the prompt's tokens first (the first one's logprob null), from the
    prompt logprobs the offline engine computes; lm-eval's request (max_tokens 1) and
    max_tokens 0 (the prompt alone), streamed or not."""
    client = server.client()
    tokenizer = offline.get_tokenizer()
    contexts, continuation = [tokenizer.encode(p) for p in PROMPTS[:3]], tokenizer.encode(" sat on the mat")
    prompts = [context + continuation for context in contexts]
    want = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    lm_eval = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                        seed=1234, echo=True).model_dump()
    parsed = lm_eval_parse_logprobs(lm_eval, [len(context) for context in contexts])
    for (total, is_greedy), context, output in zip(parsed, contexts, want):
        positions = output.prompt_logprobs[len(context):]
        assert total == pytest.approx(sum(p[t].logprob for p, t in zip(positions, continuation)), abs=1e-4)
        assert is_greedy == all(p[t].rank == 1 for p, t in zip(positions, continuation))
    scored = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=0, logprobs=1,
                                       echo=True).model_dump()
    for choice, lm_eval_choice, prompt, output in zip(scored["choices"], lm_eval["choices"], prompts, want):
        logprobs = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(prompt) == "".join(logprobs["tokens"])
        assert choice["finish_reason"] == "length"
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            [p[t].logprob for p, t in zip(output.prompt_logprobs[1:], prompt[1:])], abs=1e-4)
        assert logprobs["text_offset"] == [len(tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
        # max_tokens 1 shows the same, then the generated token.
        assert_logprobs_close({key: value[:len(prompt)] for key, value in lm_eval_choice["logprobs"].items()}, logprobs)
        assert len(lm_eval_choice["logprobs"]["tokens"]) == len(prompt) + 1
        assert choice["prompt_logprobs"][1][str(prompt[1])]["rank"] == output.prompt_logprobs[1][prompt[1]].rank
    for max_tokens, whole in ((0, scored), (1, lm_eval)):
        chunks = [chunk.model_dump() for chunk in client.completions.create(
            model="tiny", prompt=prompts, temperature=0, max_tokens=max_tokens, logprobs=1, echo=True, stream=True)]
        for index, choice in enumerate(whole["choices"]):
            mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert_logprobs_close({key: [value for c in mine for value in c["logprobs"][key]]
                                   for key in choice["logprobs"]}, choice["logprobs"])


def assert_logprobs_close(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    """Completions logprobs equal but for float rounding: the same prompt can run in steps of
    other shapes (another batch, another chunking), whose matmuls round differently."""
    assert got.keys() == want.keys()
    assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
    assert [v is None for v in got["token_logprobs"]] == [v is None for v in want["token_logprobs"]]
    assert [v for v in got["token_logprobs"] if v is not None] == pytest.approx(
        [v for v in want["token_logprobs"] if v is not None], abs=1e-5)
    for got_top, want_top in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert (got_top is None) == (want_top is None)
        if got_top is not None:
            assert got_top == pytest.approx(want_top, abs=1e-5)


def test_prompt_logprobs_bad_words_and_chat_logprobs(server: RemoteServer, offline: LLM) -> None:
    """vLLM's prompt_logprobs and bad_words extras (completions and chat); chat's logprobs
    with top_logprobs, streamed or not, as OpenAI shapes them."""
    client = server.client()
    prompt = PROMPTS[2]
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2), use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=4,
                                         extra_body={"prompt_logprobs": 2}).model_dump()
    got = response["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for position, expected in zip(got[1:], want.prompt_logprobs[1:]):
        assert {int(t): (p["rank"], p["decoded_token"]) for t, p in position.items()} == {
            t: (p.rank, p.decoded_token) for t, p in expected.items()}
    assert response["choices"][0]["logprobs"] is None  # prompt logprobs alone: not echoed
    free = greedy_text(offline, prompt, 8)
    tokenizer = offline.get_tokenizer()
    # A word the greedy text holds, as a token spelt the way the word alone is.
    word = next(text for token in tokenizer.encode(free) if (text := tokenizer.decode([token])).isalpha()
                and tokenizer.encode(text) == [token])
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    expected_text = offline.generate(prompt, banned, use_tqdm=False)[0].outputs[0].text
    assert expected_text != free
    avoided = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=8,
                                        extra_body={**NO_EOS, "bad_words": [word]})
    assert avoided.choices[0].text == expected_text
    messages = [{"role": "user", "content": "Tell me a story"}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
              "top_logprobs": 3, "extra_body": NO_EOS}
    chat = client.chat.completions.create(**{**kwargs, "extra_body": {**NO_EOS, "prompt_logprobs": 1}})
    offline_chat = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                         prompt_logprobs=1), use_tqdm=False)[0]
    content = chat.choices[0].logprobs.content
    expected = offline_chat.outputs[0]
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content == expected.text
    for entry, token, position in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(position[token].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        top = sorted((p for p in position.values() if p.rank <= 3), key=lambda p: p.rank)
        assert [t.token for t in entry.top_logprobs] == [p.decoded_token for p in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([p.logprob for p in top], abs=1e-4)
    assert len(chat.model_extra["prompt_logprobs"]) == len(offline_chat.prompt_token_ids)
    streamed = [chunk.choices[0].logprobs for chunk in client.chat.completions.create(**kwargs, stream=True)]
    assert [entry for logprobs in streamed if logprobs for entry in logprobs.content] == content


def test_tokenize_detokenize(server: RemoteServer, offline: LLM) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode(PROMPTS[0])
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPTS[0]}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_64_concurrent_streams(server: RemoteServer, offline: LLM) -> None:
    expected = {p: greedy_text(offline, p, 16) for p in PROMPTS}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body=NO_EOS)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        client = server.async_client()
        return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(64)))

    assert asyncio.run(run_all()) == [expected[PROMPTS[i % 4]] for i in range(64)]
    server.wait_idle()


def test_metrics(server: RemoteServer) -> None:
    for _ in range(2):  # the repeat hits the prefix cache (the prompt fills whole 8-token blocks)
        server.client().completions.create(model="tiny", prompt=" ".join(PROMPTS), max_tokens=4, extra_body=NO_EOS)
    samples = server.wait_idle()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        assert name in samples, name
    assert samples["vllm:generation_tokens_total"] >= 4 and samples["vllm:request_success_total"] >= 1
    assert samples["vllm:prefix_cache_hits_total"] > 0


def test_kv_cache_memory_bytes_sizes_the_cache(server: RemoteServer) -> None:
    with open(server.log_path) as log:  # the whole log: output() keeps only its end
        match = re.search(r"KV cache: (\d+) blocks of 8 tokens \(([\d.]+) GiB\)", log.read())
    assert match, server.output()
    assert float(match.group(2)) == pytest.approx(KV_CACHE_BYTES / 2**30, abs=0.01)


# --- bad input ---------------------------------------------------------------------------------


def test_bad_requests_get_400_and_the_server_keeps_serving(server: RemoteServer, offline: LLM) -> None:
    url = f"{server.url}/v1/completions"
    good = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    expected = greedy_text(offline, PROMPTS[0], 5)
    long_prompt = list(range(5, 5 + MAX_MODEL_LEN))
    chat_url = f"{server.url}/v1/chat/completions"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    aborts_before = server.metrics().get("vllm:request_success_total", 0)
    cases = [
        (httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}),
         400, "not valid JSON"),
        (httpx.post(url, content=b"prompt=Hi"), 400, "Content-Type: application/json"),
        (httpx.post(url, json={**good, "prompt": ["fine", ""]}), 400, "empty"),
        (httpx.post(url, json={**good, "stream_options": {"include_usage": True}}), 400, "stream=true"),
        (httpx.post(url, json={**good, "best_of": 3}), 400, "best_of"),
        (httpx.post(url, json={**good, "logprobs": 21}), 400, "logprobs"),
        (httpx.post(url, json={**good, "prompt_logprobs": -1}), 400, "prompt_logprobs"),
        (httpx.post(url, json={**good, "prompt_logprobs": 1, "stream": True}), 400, "stream=true"),
        (httpx.post(url, json={**good, "bad_words": [""]}), 400, "bad_words"),
        (httpx.post(url, json={**good, "max_tokens": 0}), 400, "max_tokens"),
        (httpx.post(chat_url, json={**chat, "response_format": {"type": "xml"}}), 400, "response_format"),
        # Tool calls need --enable-auto-tool-choice and --tool-call-parser (as in vLLM); tool_choice
        # "none" leaves the tools to the template.
        (httpx.post(chat_url, json={**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}),
         400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        (httpx.post(chat_url, json={**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                                    "tool_choice": "required"}), 400, "--enable-auto-tool-choice"),
        (httpx.post(chat_url, json={**chat, "top_logprobs": 2}), 400, "logprobs=true"),
        (httpx.post(url, json={**good, "max_tokens": "many"}), 400, "max_tokens"),
        (httpx.post(url, json={**good, "prompt": {"not": "a prompt"}}), 400, "prompt"),
        (httpx.post(url, json={**good, "temperature": -1}), 400, "temperature"),
        (httpx.post(url, json={**good, "top_p": 0}), 400, "top_p"),
        (httpx.post(url, json={**good, "n": 0}), 400, "n must be"),
        (httpx.post(url, json={**good, "prompt": ""}), 400, "empty"),
        (httpx.post(url, json={**good, "prompt": []}), 400, "empty"),
        (httpx.post(url, json={**good, "prompt": [1, 2, 10**9]}), 400, "vocabulary"),
        (httpx.post(url, json={**good, "prompt": long_prompt}), 400, f"maximum context length is {MAX_MODEL_LEN}"),
        (httpx.post(url, json={**good, "max_tokens": MAX_MODEL_LEN}), 400, f"{MAX_MODEL_LEN} tokens"),
        (httpx.post(url, json={**good, "model": "gpt-4"}), 404, "gpt-4"),
        (httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, "messages"),
        (httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": [{"content": "x"}]}),
         400, "role"),
    ]
    for response, status, fragment in cases:
        message = openai_error(response, status)
        assert fragment in message, (fragment, message)
        assert httpx.post(url, json=good).json()["choices"][0]["text"] == expected
    # A refused list of prompts queued none of them (nothing was aborted).
    assert server.metrics().get("vllm:request_success_total", 0) == aborts_before + len(cases)
    # Sampling errors name their field, tool calling errors tool_choice.
    for field, value in (("top_p", 0), ("prompt_logprobs", -1), ("bad_words", [" "]), ("max_tokens", 0),
                         ("best_of", 3)):
        assert httpx.post(url, json={**good, field: value}).json()["error"]["param"] == field
    tools = [{"type": "function", "function": {"name": "f"}}]
    response = httpx.post(chat_url, json={**chat, "tools": tools})
    assert response.json()["error"]["param"] == "tool_choice"
    assert httpx.post(chat_url, json={**chat, "tools": tools, "tool_choice": "none"}).status_code == 200
    # The length error names the tokens asked for.
    too_long = httpx.post(url, json={**good, "prompt": long_prompt})
    assert f"has {MAX_MODEL_LEN} input tokens" in openai_error(too_long, 400)
    # Unknown fields are accepted (and logged), as vLLM does.
    assert httpx.post(url, json={**good, "not_a_field": 1}).json()["choices"][0]["text"] == expected
    # The official client sees the same errors as exceptions.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model="tiny", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    server.wait_idle()


def test_logit_bias_and_allowed_token_ids(server: RemoteServer, offline: LLM) -> None:
    """logit_bias (string keys, as OpenAI's JSON has them) forces a token, as offline; vLLM's
    allowed_token_ids restricts chat; bad keys or ids are a 400 naming the field."""
    client = server.client()
    forced = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                         logit_bias={123: 100.0}), use_tqdm=False)[0].outputs[0]
    assert list(forced.token_ids) == [123] * 4
    completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                           logit_bias={"123": 100}, extra_body=NO_EOS)
    assert completion.choices[0].text == forced.text
    allowed = [17, 250]
    only = offline.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True,
                                                       allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)
    completion = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, seed=4,
                                           extra_body={**NO_EOS, "allowed_token_ids": allowed})
    assert completion.choices[0].text == only.text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"250": 100}, extra_body=NO_EOS)
    assert chat.choices[0].message.content == offline.llm_engine.tokenizer.decode([250] * 3)
    for body, param, fragment in [({"logit_bias": {"x": 5}}, "logit_bias", "logit_bias keys must be token ids"),
                                  ({"logit_bias": {"99999": 5}}, "logit_bias", "outside the vocabulary"),
                                  ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
                                  ({"allowed_token_ids": [3, 99999]}, "allowed_token_ids", "outside the vocabulary")]:
        with pytest.raises(openai.BadRequestError, match=fragment) as error:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=body)
        assert error.value.param == param
    server.wait_idle()


SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "notes": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, "required": ["answer", "score", "notes"]}


def test_structured_outputs(server: RemoteServer, offline: LLM) -> None:
    """response_format (json_schema, json_object) on chat and completions, and vLLM's
    structured_outputs extra body, through the official client: the offline engine's greedy
    text, in the format asked; streamed deltas join to it."""
    client = server.client()
    messages = [{"role": "user", "content": "Answer in JSON."}]
    # structured_outputs' option with response_format's schema (its constraint), as vLLM merges them.
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    text = chat.choices[0].message.content
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=60, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))), use_tqdm=False)[0].outputs[0]
    assert text == expected.text and chat.choices[0].finish_reason == "stop"
    value = json.loads(text)
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and len(value["notes"]) <= 2
    completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert completion.choices[0].text == offline.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json_object=True)),
        use_tqdm=False)[0].outputs[0].text
    assert completion.choices[0].text.startswith("{")
    regex = "[a-z]{2,5}-[0-9]{1,3}"
    for constraint, follows in [({"regex": regex}, lambda t: re.fullmatch(regex, t)),
                                ({"choice": ["red", "green"]}, lambda t: t in ("red", "green"))]:
        kwargs = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 1.0, "seed": 3, "n": 2,
                  "extra_body": {"structured_outputs": constraint}}
        whole = client.completions.create(**kwargs)
        assert all(follows(c.text) and c.finish_reason == "stop" for c in whole.choices), whole.choices
        streamed = ["", ""]
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == [c.text for c in whole.choices]
    server.wait_idle()


def test_bad_structured_outputs_get_400_naming_the_field(server: RemoteServer) -> None:
    """An invalid schema, regex or grammar is a 400 that quotes xgrammar, param naming the field
    that carried it; so are two constraints at once, or keys that do not exist."""
    client = server.client()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs", "Regex parsing error"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "structured_outputs", "EBNF parser error"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", 'Unsupported type "foo"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "'schema'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
         "response_format", "exactly one"),
        ({"extra_body": {"structured_outputs": {}}}, "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "structured_outputs", "no key 'regexp'"),
    ]
    for kwargs, param, fragment in cases:
        with pytest.raises(openai.BadRequestError, match=re.escape(fragment)) as error:
            client.chat.completions.create(**chat, **kwargs)
        assert error.value.param == param, (kwargs, error.value)
    with pytest.raises(openai.BadRequestError, match="Regex parsing error"):
        client.completions.create(model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "(ab"}})
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None
    server.wait_idle()


def test_bad_streaming_request_is_refused_before_the_stream_starts(server: RemoteServer) -> None:
    # A bad request is refused before the stream starts: a plain 400, no event stream.
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"model": "tiny", "prompt": "x", "stream": True, "temperature": -1})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")


# --- disconnects -------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server: RemoteServer) -> None:
    client = server.client()
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, stream=True,
                                       extra_body=NO_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()["vllm:num_requests_running"] == 1
    stream.close()
    samples = server.wait_idle()
    assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_requests_running"] == 0


def test_burst_with_random_disconnects_leaks_nothing(server: RemoteServer) -> None:
    rng = random.Random(0)

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        leave_after = rng.choice([None, 0, 1, 5])
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 4] + f" {i}", max_tokens=40,
                                                 stream=True, extra_body=NO_EOS)
        count = 0
        async for _ in stream:
            count += 1
            if leave_after is not None and count > leave_after:
                await stream.close()
                return
        assert count == 40

    async def run_all() -> None:
        client = server.async_client()
        await asyncio.gather(*(one(client, i) for i in range(40)))

    asyncio.run(run_all())
    samples = server.wait_idle()
    assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_requests_running"] == 0


def test_abandoned_requests_do_not_hold_up_new_ones(server: RemoteServer) -> None:
    """200 long non-streaming requests whose clients give up after half a second: the
    server aborts them, and a new request is answered within 5 s."""

    async def abandoned(client: httpx.AsyncClient, i: int) -> None:
        with pytest.raises(httpx.TimeoutException):
            await client.post("/v1/completions", json={"model": "tiny", "prompt": f"{PROMPTS[i % 4]} {i}",
                                                       "max_tokens": 200, "ignore_eos": True})

    async def run_all() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=0.5, limits=limits) as client:
            await asyncio.gather(*(abandoned(client, i) for i in range(200)))

    asyncio.run(run_all())
    start = time.monotonic()
    response = server.client(timeout=5).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5,
                                                            extra_body=NO_EOS)
    assert response.usage.completion_tokens == 5 and time.monotonic() - start < 5
    samples = server.wait_idle()
    assert samples["vllm:kv_cache_usage_perc"] == 0
    assert samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0


def test_tokenizer_info_is_off_by_default(server: RemoteServer) -> None:
    assert openai_error(httpx.get(f"{server.url}/tokenizer_info"), 404) == "Not Found"


def test_tokenizer_info(model_dir: str) -> None:
    """With the flag, what lm-eval's remote tokenizer reads: the special tokens and the chat
    template as transformers loads them from the same directory, and eos_token_id as lm-eval
    finds it (by /tokenize). (This server, started for it, also shows that --disable-dashboard
    leaves no /dashboard.)"""
    hf = AutoTokenizer.from_pretrained(model_dir)
    with serving(model_dir, "--enable-tokenizer-info-endpoint", "--disable-dashboard") as server:
        for path in ("/dashboard", "/dashboard/events", "/dashboard/snapshot"):
            openai_error(httpx.get(server.url + path), 404)
        response = httpx.get(f"{server.url}/tokenizer_info")
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["eos_token"] == hf.eos_token == "<|endoftext|>"
        assert info.get("bos_token") == hf.bos_token
        assert info["pad_token"] == hf.pad_token
        assert info["chat_template"] == hf.chat_template and "<|im_start|>" in info["chat_template"]
        assert info["tokenizer_class"] == type(hf).__name__
        assert info["model_max_length"] == hf.model_max_length
        assert info["added_tokens_decoder"] == {str(i): str(t) for i, t in hf.added_tokens_decoder.items()}
        assert "vocab_file" not in info and "merges_file" not in info
        tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
        assert tokens.json()["tokens"] == [hf.eos_token_id]


# --- API key, tensor parallelism, shutdown ----------------------------------------------------


def test_api_key(model_dir: str) -> None:
    with serving(model_dir, api_key="sekrit") as server:
        url = f"{server.url}/v1/completions"
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        assert "API key" in openai_error(httpx.post(url, json=body), 401)
        assert "API key" in openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        openai_error(httpx.get(f"{server.url}/v1/models"), 401)
        for open_path in ("/health", "/metrics", "/version"):
            assert httpx.get(server.url + open_path).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert server.client().completions.create(**body).usage.completion_tokens >= 1


def _engine_pid(server_pid: int) -> int:
    """The engine core process (the server's other child is multiprocessing's resource tracker)."""
    (pid,) = [child for child in descendants(server_pid) if _cmdline(child).endswith("--multiprocessing-fork")
              and _parent(child) == server_pid]
    return pid


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ").strip()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_tensor_parallel_server_answers_and_shuts_down(model_dir: str, offline: LLM) -> None:
    expected = greedy_text(offline, PROMPTS[1], 8)
    with serving(model_dir, "--tensor-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN)) as server:
        processes = descendants(server.process.pid)
        assert len(processes) >= 3, "the engine process and its tensor-parallel worker (and a resource tracker)"
        response = server.client().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                                      extra_body=NO_EOS)
        assert response.choices[0].text == expected
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in processes), "a process outlived the server"


def test_engine_death_mid_stream_is_an_error_event_then_done(model_dir: str) -> None:
    server = RemoteServer(model_dir)
    try:
        engine_pid = _engine_pid(server.process.pid)
        events = []
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    os.kill(engine_pid, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "engine stopped" in error["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"})
        assert refused.status_code == 500 and "restart" in refused.json()["error"]["message"]
    finally:
        server.stop(signal.SIGTERM)


def test_sse_wire_format(server: RemoteServer) -> None:
    """The raw stream: `data: {json}` events, a final `data: [DONE]`."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "stream": True, "ignore_eos": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len(chunks) == 1 + 3  # the role, then one per token
