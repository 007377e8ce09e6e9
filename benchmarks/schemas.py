"""W6's JSON schema (benchmarks/README.md) and the check of what a server returns under it.

W6's object has 8 fields: a bounded integer id, a name held by a pattern, an enum status, a
bounded integer score, a boolean, a date-like string held by a pattern, an enum priority and
an array of exactly W6_TAGS enum colours. Every part is bounded, so a reply ends, whatever a
model with random weights picks, within W6_MAX_TOKENS tokens once the server allows no free
whitespace: every token holds at least one byte of the reply. Strings are held by patterns,
not maxLength: xgrammar's maxLength strings admit raw control characters, which strict JSON
parsers refuse. Property names end in a 4-digit index: w6_schema(i) for different i differ in
every name (a server's grammar cache never hits) and serialise to the same length.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

W6_TAGS = 4  # items in the array
# Past the longest reply the schema allows (255 bytes with ", " and ": "): only the closed
# object ends a reply of a server that enforces the schema.
W6_MAX_TOKENS = 512
W6_INDICES = 10_000  # distinct schemas: 4-digit indices

STATUSES = ["pending", "active", "suspended", "closed"]
PRIORITIES = ["low", "medium", "high", "urgent"]
COLOURS = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]


def w6_schema(index: int = 0) -> dict[str, Any]:
    """W6's schema, its property names suffixed _NNNN with the index (0: plain W6's)."""
    if not 0 <= index < W6_INDICES:
        raise ValueError(f"W6 schema index {index} is outside [0, {W6_INDICES})")

    def name(field: str) -> str:
        return f"{field}_{index:04d}"

    properties = {
        name("id"): {"type": "integer", "minimum": 1, "maximum": 999_999},
        name("name"): {"type": "string", "pattern": "^[A-Za-z ]{1,32}$"},
        name("status"): {"type": "string", "enum": STATUSES},
        name("score"): {"type": "integer", "minimum": 0, "maximum": 100},
        name("verified"): {"type": "boolean"},
        name("created"): {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        name("priority"): {"type": "string", "enum": PRIORITIES},
        name("tags"): {"type": "array", "items": {"type": "string", "enum": COLOURS},
                       "minItems": W6_TAGS, "maxItems": W6_TAGS},
    }
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def response_format(index: int = 0) -> dict[str, Any]:
    """OpenAI's response_format carrying w6_schema(index), strict."""
    return {"type": "json_schema",
            "json_schema": {"name": f"w6_{index:04d}", "schema": w6_schema(index), "strict": True}}


# ------------------------------------------------------------------------------ checking

_TYPES: dict[str, type] = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum", "minimum", "maximum",
                       "pattern", "items", "minItems", "maxItems"})


def schema_errors(instance: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Where the instance breaks the schema (none: it is valid), for the JSON Schema keywords
    W6's schemas use; a schema with any other keyword or type is a ValueError, so that no
    constraint goes unchecked."""
    unknown = set(schema) - _KEYWORDS
    if unknown or schema.get("type", "object") not in _TYPES:
        raise ValueError(f"schema_errors checks {sorted(_KEYWORDS)} and the types {sorted(_TYPES)}; "
                         f"this schema has {sorted(unknown) or schema['type']}")
    if "type" in schema and not _has_type(instance, schema["type"]):
        return [f"{path}: {json.dumps(instance)[:40]} is not of type {schema['type']}"]
    errors = []
    if "enum" in schema and not any(type(instance) is type(v) and instance == v for v in schema["enum"]):
        errors.append(f"{path}: {json.dumps(instance)[:40]} is not one of {schema['enum']}")
    if isinstance(instance, (int, float)) and not isinstance(instance, bool):
        if "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{path}: {instance} < minimum {schema['minimum']}")
        if "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{path}: {instance} > maximum {schema['maximum']}")
    if isinstance(instance, str) and "pattern" in schema and re.search(schema["pattern"], instance) is None:
        errors.append(f"{path}: {json.dumps(instance)[:40]} does not match {schema['pattern']}")
    if isinstance(instance, list):
        if not schema.get("minItems", 0) <= len(instance) <= schema.get("maxItems", len(instance)):
            errors.append(f"{path}: {len(instance)} items, outside [{schema.get('minItems', 0)}, "
                          f"{schema.get('maxItems', 'any')}]")
        for i, item in enumerate(instance):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        errors += [f"{path}: no {key!r}" for key in schema.get("required", []) if key not in instance]
        if schema.get("additionalProperties", True) is False:
            errors += [f"{path}: {key!r} is not a property of the schema" for key in instance if key not in properties]
        for key, value in instance.items():
            if key in properties:
                errors += schema_errors(value, properties[key], f"{path}.{key}")
    return errors


def _has_type(instance: Any, kind: str) -> bool:
    return isinstance(instance, _TYPES[kind]) and not (kind == "integer" and isinstance(instance, bool))


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError(f"an object repeats a key: {keys}")
    return dict(pairs)


# Strict JSON: no NaN or Infinity, no key twice in one object.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)


def reply_error(text: str, schema: dict[str, Any]) -> str | None:
    """Why a reply is not one JSON document valid under the schema; None when it is."""
    try:
        instance = _DECODER.decode(text)
    except ValueError as error:
        return f"not JSON ({error}): {text[:60]!r}"
    errors = schema_errors(instance, schema)
    return "; ".join(errors[:3]) or None


def leading_object_counts(texts: list[str], schema: dict[str, Any]) -> dict[str, int]:
    """Offline W1 with a schema, where ignore_eos lets a text go on past its object: how many
    texts begin with a JSON document valid under the schema (json_valid), with one that is not
    (json_invalid), and with none (json_none: max_tokens came before the object closed, or
    nothing held the text to the schema)."""
    counts = {"json_valid": 0, "json_invalid": 0, "json_none": 0}
    for text in texts:
        try:
            instance, _ = _DECODER.raw_decode(text)
        except ValueError:
            counts["json_none"] += 1
            continue
        counts["json_invalid" if schema_errors(instance, schema) else "json_valid"] += 1
    return counts
