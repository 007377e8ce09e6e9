"""Where the fields of a JSON object are, while the object is still being written.

A streamed tool call is a JSON object that grows a few characters at a time. To send its
name as soon as it is complete and its arguments as they grow, we need the spans of the
object's top-level values in the text so far, not a parse of the whole: `scan_object`
walks the object once, leaving values it has not seen the end of open.
"""

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
# What ends a number, true, false or null.
_SCALAR_END = ",}]" + _WHITESPACE


@dataclass
class ObjectScan:
    """A JSON object's top-level fields as far as the text goes: each key's value span
    (start, end), end None while the value is still open. `end` is the index after the
    closing brace, None while the object is open; `malformed` says the text cannot be the
    start of a JSON object (the scan stopped there)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None
    malformed: bool = False

    def complete_value(self, text: str, key: str) -> object | None:
        """The value of `key` once it is complete (its JSON decoded), else None."""
        start, end = self.fields.get(key, (0, None))
        if end is None:
            return None
        try:
            return json.loads(text[start:end])
        except ValueError:
            return None

    def raw_value(self, text: str, key: str) -> str | None:
        """The text of `key`'s value so far (all of it once complete), None before it starts."""
        if key not in self.fields:
            return None
        start, end = self.fields[key]
        return text[start:end]


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """After the string that opens at text[i] (a quote), None while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _container_end(text: str, i: int) -> int | None:
    """After the object or array that opens at text[i], None while it is open (brackets
    inside strings do not count)."""
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """After the JSON value that starts at text[i], None while it may still grow."""
    if text[i] in "{[":
        return _container_end(text, i)
    if text[i] == '"':
        return _string_end(text, i)
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    return j if j < len(text) else None  # a number at the end of the text may go on


def scan_object(text: str, start: int) -> ObjectScan:
    """The object that opens at text[start] (see ObjectScan)."""
    scan = ObjectScan()
    if start >= len(text) or text[start] != "{":
        scan.malformed = True
        return scan
    i = start + 1
    while True:
        i = skip_whitespace(text, i)
        if i == len(text):
            return scan
        if text[i] == "}" and not scan.fields:
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.malformed = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:  # a bad escape
            scan.malformed = True
            return scan
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.malformed = True
            return scan
        i = skip_whitespace(text, i + 1)
        if i == len(text):
            return scan
        end = value_end(text, i)
        scan.fields[key] = (i, end)
        if end is None:
            return scan
        i = skip_whitespace(text, end)
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.malformed = True
            return scan
        i += 1
