"""W6 (structured serving) and W1-json: the schemas (benchmarks/schemas.py), the reply check,
the requests benchmarks/serving.py builds, its --w6 run against a fake server, and the
offline --json-schema flag of benchmarks/throughput.py."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from benchmarks.schemas import (
    W6_MAX_TOKENS,
    leading_object_counts,
    reply_error,
    response_format,
    schema_errors,
    w6_schema,
)
from benchmarks.serving import Prompt, Regime, benchmark, build_parser, request_body
from tests.server_utils import RemoteServer, serve_app

# The longest string each of W6's patterns matches.
LONGEST_MATCH = {"^[A-Za-z ]{1,32}$": "Z" * 32, "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$": "2099-19-39"}
# Separators of JSON without free whitespace (xgrammar's any_whitespace=False, vLLM's
# disable_any_whitespace).
COMPACT = (", ", ": ")


def longest_instance(schema: dict[str, Any]) -> Any:
    """The instance of a W6 schema whose compact serialisation is the longest."""
    if "enum" in schema:
        return max(schema["enum"], key=len)
    kind = schema["type"]
    if kind == "object":
        return {key: longest_instance(value) for key, value in schema["properties"].items()}
    if kind == "array":
        return [longest_instance(schema["items"])] * schema["maxItems"]
    if kind == "string":
        return LONGEST_MATCH[schema["pattern"]]
    return {"integer": schema.get("maximum"), "boolean": False}[kind]


def xgrammar_accepts(schema: dict[str, Any], text: str) -> bool:
    """Whether xgrammar's grammar for the schema, without free whitespace, accepts the whole text."""
    import xgrammar

    from minivllm.local_models import build_tokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(build_tokenizer())
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


# ------------------------------------------------------------------------------ schemas


def test_w6_schema_is_a_bounded_8_field_object() -> None:
    schema = w6_schema()
    properties = schema["properties"]
    assert len(properties) == 8 and schema["required"] == list(properties)
    assert schema["additionalProperties"] is False
    kinds = [p.get("type") for p in properties.values()]
    assert {"integer", "string", "boolean", "array"} <= set(kinds)
    assert any("enum" in p for p in properties.values())
    array = next(p for p in properties.values() if p["type"] == "array")
    assert array["minItems"] == array["maxItems"] > 0 and "enum" in array["items"]
    assert all("minimum" in p and "maximum" in p for p in properties.values() if p["type"] == "integer")
    # A string field's length is bounded by its pattern (no maxLength: see the module's docstring).
    assert all("pattern" in p for p in properties.values() if p["type"] == "string" and "enum" not in p)

    longest = json.dumps(longest_instance(schema), separators=COMPACT)
    assert schema_errors(json.loads(longest), schema) == []
    assert xgrammar_accepts(schema, longest)
    # Every token holds at least one byte: the longest reply fits in max_tokens.
    assert len(longest.encode()) < W6_MAX_TOKENS
    assert not xgrammar_accepts(schema, longest.replace("Z" * 32, "Z" * 33))  # the bound holds


def test_distinct_schemas_differ_in_every_name_but_not_in_length() -> None:
    names = [set(w6_schema(i)["properties"]) for i in range(40)]
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1:])
    assert len({len(json.dumps(w6_schema(i))) for i in (0, 1, 42, 9999)}) == 1
    assert xgrammar_accepts(w6_schema(42), json.dumps(longest_instance(w6_schema(42)), separators=COMPACT))
    with pytest.raises(ValueError, match="index"):
        w6_schema(10_000)


def test_response_format_is_openais_strict_json_schema() -> None:
    assert response_format(7) == {"type": "json_schema",
                                  "json_schema": {"name": "w6_0007", "schema": w6_schema(7), "strict": True}}


# ------------------------------------------------------------------------------ checking


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(instance: dict[str, Any]) -> None:
        instance[f"{field}_0000"] = value
    return mutate


def _drop(instance: dict[str, Any]) -> None:
    del instance["score_0000"]


def _extra(instance: dict[str, Any]) -> None:
    instance["extra"] = 1


@pytest.mark.parametrize(("mutate", "message"), [
    (_set("status", "asleep"), "is not one of"),
    (_set("id", 0), "< minimum 1"),
    (_set("score", 101), "> maximum 100"),
    (_set("score", True), "is not of type integer"),
    (_set("score", 5.5), "is not of type integer"),
    (_set("verified", 1), "is not of type boolean"),
    (_set("name", "Z" * 33), "does not match"),
    (_set("created", "1999-01-01"), "does not match"),
    (_set("tags", ["red"]), "1 items"),
    (_set("tags", ["red", "red", "red", "pink"]), "$.tags_0000[3]"),
    (_set("priority", None), "is not of type string"),
    (_drop, "no 'score_0000'"),
    (_extra, "'extra' is not a property"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_schema_errors_finds_each_violation(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    schema = w6_schema()
    instance = longest_instance(schema)
    mutate(instance)
    errors = schema_errors(instance, schema)
    assert len(errors) == 1 and message in errors[0], errors
    assert message in (reply_error(json.dumps(instance), schema) or "")


def test_reply_error_accepts_only_one_strict_json_document() -> None:
    schema = w6_schema()
    text = json.dumps(longest_instance(schema), separators=COMPACT)
    assert reply_error(text, schema) is None
    assert reply_error(f" {text}\n", schema) is None  # whitespace around a document is JSON
    for bad in (text[:-1], text + " {}", text.replace('"Z', '"\tZ'),  # cut, two documents, a raw tab
                text.replace("999999", "NaN"), text[:-1] + ', "id_0000": 1}'):  # NaN, a key twice
        assert reply_error(bad, schema) is not None and reply_error(bad, schema).startswith("not JSON"), bad


def test_schema_errors_refuses_what_it_does_not_check() -> None:
    with pytest.raises(ValueError, match="maxLength"):
        schema_errors("x", {"type": "string", "maxLength": 3})
    with pytest.raises(ValueError, match="number"):
        schema_errors(1.5, {"type": "number"})


def test_leading_object_counts() -> None:
    schema = w6_schema()
    valid = json.dumps(longest_instance(schema))
    texts = [valid + "<garbage past the object>", valid.replace("999999", "0") + "x", valid[:40], "no json"]
    assert leading_object_counts(texts, schema) == {"json_valid": 1, "json_invalid": 1, "json_none": 2}


# ------------------------------------------------------------------------------ the client


def test_request_bodies() -> None:
    w4 = request_body("m", Prompt("hi", 2, 128))
    assert w4 == {"model": "m", "prompt": "hi", "max_tokens": 128, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    w6 = request_body("m", Prompt("hi", 2, W6_MAX_TOKENS, response_format(3)))
    assert w6 == {"model": "m", "prompt": "hi", "max_tokens": W6_MAX_TOKENS, "temperature": 1.0,
                  "response_format": response_format(3), "stream": True, "stream_options": {"include_usage": True}}


class FakeW6Server:
    """/v1/completions answering with the longest reply valid under the request's schema, in
    pieces of 16 characters (or, off_schema, with an object of other fields); keeps every body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.off_schema = False
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)

    async def completions(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.bodies.append(body)
        schema = body["response_format"]["json_schema"]["schema"]
        text = '{"a": 1}' if self.off_schema else json.dumps(longest_instance(schema), separators=COMPACT)
        pieces = [text[i:i + 16] for i in range(0, len(text), 16)]

        async def events() -> AsyncIterator[str]:
            for i, piece in enumerate(pieces):
                choice = {"index": 0, "text": piece, "finish_reason": "stop" if i == len(pieces) - 1 else None}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": len(pieces)}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_w6() -> Iterator[tuple[FakeW6Server, str]]:
    fake = FakeW6Server()
    with serve_app(fake.app) as url:
        yield fake, url


def run_w6(url: str, tokenizer_dir: str, out: str, *flags: str, model: str = "m") -> None:
    """--w6 with the given flags (seed 1), two warm-ups, then 6 requests at concurrency 3."""
    args = build_parser().parse_args(["--base-url", url, "--model", model, "--tokenizer", tokenizer_dir,
                                      "--random-input-len", "16", "--seed", "1", "--json-out", out, "--w6", *flags])
    asyncio.run(benchmark(args, [Regime(6, 3, math.inf)], num_warmups=2))


def test_w6_sends_distinct_schemas_and_checks_every_reply(fake_w6, tokenizer, tmp_path) -> None:
    fake, url = fake_w6
    tokenizer.save_pretrained(tmp_path)
    out = tmp_path / "w6.jsonl"
    fake.bodies.clear()
    run_w6(url, str(tmp_path), str(out), "--distinct-schemas")
    names = [b["response_format"]["json_schema"]["name"] for b in fake.bodies]
    assert sorted(names) == [f"w6_{i:04d}" for i in range(1, 9)]  # warm-ups included, no two alike
    assert all(b["max_tokens"] == W6_MAX_TOKENS and "ignore_eos" not in b for b in fake.bodies)
    line = json.loads(out.read_text())
    assert line["workload"] == "W6-distinct" and line["completed"] == 6
    assert (line["valid_replies"], line["invalid_replies"], line["valid_fraction"]) == (6, 0, 1.0)

    fake.bodies.clear()
    run_w6(url, str(tmp_path), str(out))
    assert {b["response_format"]["json_schema"]["name"] for b in fake.bodies} == {"w6_0000"}


def test_w6_fails_on_replies_outside_the_schema(fake_w6, tokenizer, tmp_path) -> None:
    fake, url = fake_w6
    tokenizer.save_pretrained(tmp_path)
    out = tmp_path / "w6.jsonl"
    fake.off_schema = True
    try:
        with pytest.raises(SystemExit, match="6 requests failed or replied outside their schema"):
            run_w6(url, str(tmp_path), str(out))
    finally:
        fake.off_schema = False
    line = json.loads(out.read_text())
    assert (line["valid_replies"], line["invalid_replies"]) == (0, 6)
    assert "no 'id_0000'" in line["invalid_examples"][0] and "finish_reason stop" in line["invalid_examples"][0]


@pytest.mark.slow
def test_w6_against_minivllm_serve(tiny_model_factory, tmp_path) -> None:
    """The real server, W6's flags: every reply valid under its schema, ended by the server."""
    model = tiny_model_factory("Qwen3ForCausalLM")
    server = RemoteServer(model, "--structured-outputs-config",
                          '{"backend": "xgrammar", "disable_any_whitespace": true}')
    try:
        out = tmp_path / "w6.jsonl"
        run_w6(server.url, model, str(out), "--distinct-schemas", model="tiny")
    finally:
        server.stop()
    line = json.loads(out.read_text())
    assert (line["failed"], line["valid_fraction"]) == (0, 1.0)
    assert line["total_output_tokens"] < 6 * W6_MAX_TOKENS


# ------------------------------------------------------------------------------ W1-json


def test_throughput_json_schema_puts_w6s_schema_on_every_request(tiny_model_factory, tmp_path, monkeypatch) -> None:
    from benchmarks import throughput
    from minivllm.llm import LLM

    model = tiny_model_factory("Qwen3ForCausalLM")
    out = tmp_path / "w1.jsonl"
    monkeypatch.setattr(sys, "argv", ["throughput", "--model", model, "--scale", "0.02", "--json-schema",
                                      "--json-out", str(out)])
    seen = []
    generate = LLM.generate

    def recording(self: LLM, prompts: Any, params: Any, **kwargs: Any) -> Any:
        seen.extend(params)
        return generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording)
    throughput.main()
    line = json.loads(out.read_text())
    assert line["workload"] == "W1-json"
    assert len(seen) == 1 + line["num_requests"]  # the warm-up request, then the timed ones
    assert all(p.structured_outputs is not None and p.structured_outputs.json == w6_schema() for p in seen)
    assert line["json_valid"] + line["json_invalid"] + line["json_none"] == line["num_requests"]
