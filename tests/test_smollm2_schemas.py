"""A real model under structured outputs: SmolLM2-135M-Instruct, asked through its chat template,
writes valid output for every one of a dozen JSON schemas (nested objects, bounded arrays, enums,
bounded integers and numbers, pattern strings, booleans, optional fields, anyOf, $ref), a choice
and a regex, greedy and sampled, all in one batch; jsonschema checks each output.

Bounded strings use `pattern`, not `maxLength`: xgrammar 0.2.9 lets raw control characters
(invalid JSON) into strings with only a length bound, and no escape sequences."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # the real SmolLM2, ~30 sequences under grammars

NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}
WORDS = {"type": "string", "pattern": "^[A-Za-z][A-Za-z ]{0,19}$"}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                          "y": {"type": "integer", "minimum": -100, "maximum": 100}},
         "required": ["x", "y"]}

# (question, schema): each question asks for JSON, as one would ask a model this small.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person as JSON with a name, an age and an address.", {
        "type": "object", "properties": {
            "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "required": ["city", "zip"], "properties": {
                "city": WORDS, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}},
        "required": ["name", "age", "address"]}),
    ("Write a shopping list as JSON.", {
        "type": "object", "properties": {"items": {"type": "array", "items": WORDS, "minItems": 2, "maxItems": 4}},
        "required": ["items"]}),
    ("Describe a shirt as JSON: its color and its size.", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"]}),
    ("Report today's weather as JSON.", {
        "type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                         "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                                         "sunny": {"type": "boolean"}},
        "required": ["temperature", "humidity", "sunny"]}),
    ("Describe a shop as JSON.", {  # an optional field
        "type": "object", "properties": {"open": {"type": "boolean"}, "parking": {"type": "boolean"}, "name": WORDS},
        "required": ["open", "parking"]}),
    ("Describe a book as JSON.", {  # optional fields, one a string without bounds
        "type": "object", "properties": {"title": WORDS, "subtitle": {"type": "string"},
                                         "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title"]}),
    ("Give a measurement as JSON.", {
        "type": "object", "properties": {"value": {"anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 1000},
            {"type": "string", "pattern": "^[0-9]{1,4} ?(cm|m|km)$"}]}},
        "required": ["value"]}),
    ("List the students of a class with their grades as JSON.", {
        "type": "object", "properties": {"students": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": NAME, "grade": {"type": "integer", "minimum": 1, "maximum": 12}},
            "required": ["name", "grade"]}}},
        "required": ["students"]}),
    ("Give a contact's date of birth and phone number as JSON.", {
        "type": "object", "properties": {
            "birthday": {"type": "string", "pattern": "^[12][0-9]{3}-[01][0-9]-[0-3][0-9]$"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9]{10,12}$"}},
        "required": ["birthday", "phone"]}),
    ("Write a 2 by 2 matrix of small integers as JSON.", {
        "type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["rows"]}),
    ("Rate a film from 1 to 5 as JSON.", {
        "type": "object", "properties": {"rating": {"enum": [1, 2, 3, 4, 5]}, "comment": WORDS},
        "required": ["rating", "comment"]}),
    ("List two or three animals as a JSON array.", {
        "type": "array", "minItems": 2, "maxItems": 3, "items": {
            "type": "object", "properties": {"animal": WORDS, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["animal", "legs"]}}),
    ("Describe a pet as JSON: a cat or a dog.", {"anyOf": [
        {"type": "object", "properties": {"cat": NAME, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["cat", "lives"]},
        {"type": "object", "properties": {"dog": NAME, "good": {"type": "boolean"}}, "required": ["dog", "good"]}]}),
    ("Give the start and the end of a line as JSON.", {  # $ref, as pydantic writes nested models
        "type": "object", "$defs": {"Point": POINT},
        "properties": {"start": {"$ref": "#/$defs/Point"}, "end": {"$ref": "#/$defs/Point"}},
        "required": ["start", "end"]}),
]
CHOICE = ("Is this review positive, negative or neutral? 'The food was great.'", ["positive", "negative", "neutral"])
REGEX = ("Make up an email address.", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)")
MAX_TOKENS = 120  # the longest reply takes ~65 tokens; every one must end by itself


@pytest.fixture(scope="module")
def llm(gguf_path: str) -> LLM:
    return LLM(gguf_path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=192 << 20, block_size=16)


def test_every_output_is_valid_greedy_and_sampled(llm: LLM) -> None:
    specs = [(question, StructuredOutputsParams(json=schema)) for question, schema in SCHEMAS]
    specs += [(CHOICE[0], StructuredOutputsParams(choice=CHOICE[1])),
              (REGEX[0], StructuredOutputsParams(regex=REGEX[1]))]
    requests = [(question, spec, SamplingParams(temperature=temperature, seed=0, max_tokens=MAX_TOKENS,
                                                structured_outputs=spec))
                for question, spec in specs for temperature in (0, 0.8)]
    outputs = llm.chat([[{"role": "user", "content": question}] for question, _, _ in requests],
                       [params for _, _, params in requests], use_tqdm=False)
    for (question, spec, params), output in zip(requests, outputs):
        completion = output.outputs[0]
        where = f"{question!r} at temperature {params.temperature}: {completion.text!r}"
        assert completion.finish_reason == "stop", where
        if spec.json is not None:
            jsonschema.validate(json.loads(completion.text), spec.json)
        elif spec.choice is not None:
            assert completion.text in spec.choice, where
        else:
            assert re.fullmatch(REGEX[1], completion.text), where
