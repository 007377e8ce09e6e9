"""Where the fields of a JSON object are, while the object is still being written.

A streamed tool call is a JSON object that grows a few characters at a time. To send its
name as soon as it is complete and its arguments as they grow, we need the spans of the
object's top-level values in the text so far, not a parse of the whole. An ObjectScanner
reads the object once: each scan goes on where the last one stopped (the text only grows),
and jumps over strings and numbers with regular expressions, so a call of any length costs
the server about its length in all, not its length at every token.
"""

import json
import re
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
# A string's characters, up to its closing quote (or a lone backslash at the text's end).
_STRING_CHARS = re.compile(r'(?:[^"\\]++|\\.)*+', re.DOTALL)
# What opens or closes a container, or opens a string.
_STRUCTURE = re.compile(r'[{}\[\]"]')
# A number, true, false or null, up to what ends it.
_SCALAR_CHARS = re.compile(r"[^,}\]\s]*")


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


def _match_end(pattern: re.Pattern[str], text: str, i: int) -> int:
    """Where `pattern`, which matches the empty string too, stops matching from text[i]."""
    match = pattern.match(text, i)
    assert match is not None, "the pattern matches the empty string"
    return match.end()


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


class ObjectScanner:
    """The object that opens at `start` (after whitespace) of a text that only grows."""

    def __init__(self, start: int) -> None:
        self.result = ObjectScan()
        self._pos = start  # where the next scan goes on
        self._expect = "{"  # "{", "first key" (or "}"), "key", ":", "value", "," (or "}"), or an open value's kind
        self._key = ""
        self._value_start = 0
        self._depth = 0  # in an open container value
        self._in_string = False  # in an open value, inside a string

    def scan(self, text: str) -> ObjectScan:
        result = self.result
        i = self._pos
        while result.end is None and not result.malformed:
            if self._expect in ("container", "string", "scalar"):
                value_end, i = self._value(text, i)
                if value_end is None:
                    break
                result.fields[self._key] = (self._value_start, value_end)
                self._expect = ","
                continue
            i = skip_whitespace(text, i)
            if i == len(text):
                break
            char = text[i]
            if self._expect == "{":
                result.malformed = char != "{"
                self._expect, i = "first key", i + 1
            elif self._expect in ("first key", "key"):
                if char == "}" and self._expect == "first key":
                    result.end = i + 1
                    break
                if char != '"':
                    result.malformed = True
                    break
                if (key_end := self._string_end(text, i)) is None:
                    break  # read again from the key's quote next time (keys are short)
                try:
                    self._key = json.loads(text[i:key_end])
                except ValueError:  # a bad escape
                    result.malformed = True
                    break
                self._expect, i = ":", key_end
            elif self._expect == ":":
                result.malformed = char != ":"
                self._expect, i = "value", i + 1
            elif self._expect == "value":
                self._value_start = i
                result.fields[self._key] = (i, None)
                self._expect = "container" if char in "{[" else "string" if char == '"' else "scalar"
                self._depth, self._in_string = 0, False
                if self._expect == "string":
                    self._in_string, i = True, i + 1
            else:  # ","
                if char == "}":
                    result.end = i + 1
                elif char == ",":
                    self._expect, i = "key", i + 1
                else:
                    result.malformed = True
        self._pos = i
        return result

    def _value(self, text: str, i: int) -> tuple[int | None, int]:
        """Read on in the open value from i: (its end, where it ended), or (None, where to go
        on) if the text ends first."""
        if self._expect == "scalar":
            j = _match_end(_SCALAR_CHARS, text, i)
            return (j if j < len(text) else None), j  # a number at the text's end may go on
        while True:
            if self._in_string:
                i = _match_end(_STRING_CHARS, text, i)
                if i == len(text) or text[i] != '"':  # open, or a lone backslash at the end
                    return None, i
                i += 1
                self._in_string = False
                if self._expect == "string":
                    return i, i
                continue
            match = _STRUCTURE.search(text, i)
            if match is None:
                return None, len(text)
            i = match.end()
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return i, i

    @staticmethod
    def _string_end(text: str, i: int) -> int | None:
        """After the string that opens at text[i] (a quote), None while it is open."""
        j = _match_end(_STRING_CHARS, text, i + 1)
        return j + 1 if j < len(text) and text[j] == '"' else None
