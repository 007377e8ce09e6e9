"""GrammarSpec: a request's StructuredOutputsParams as the grammar xgrammar builds, checked when
the request is added and compiled against the vocabulary later (engine/structured_outputs.py).

Checking parses the schema, regex or grammar without the vocabulary (well under a millisecond
for ordinary ones), so a bad one is refused with xgrammar's own message before anything is
queued; compiling (token masks for every grammar state, milliseconds to seconds) happens off
the step loop. xgrammar is imported only when a request asks for structured outputs: `import
minivllm` and an engine that serves none never load it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# json_object: any JSON object, as vLLM asks xgrammar for it.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's messages start with a log prefix: "[15:06:54] /project/cpp/regex_converter.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# What each field holds, for error messages.
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar",
         "structural_tag": "structural tag"}
# Specs checked recently, valid ones (requests often repeat one schema).
_CHECKED_SPECS = 1024


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match, hashable: the key of the compiled-grammar cache."""

    # The StructuredOutputsParams field it comes from ("json" for json_object too); choice
    # lists arrive as an EBNF grammar of their alternatives.
    field: str
    source: str  # a JSON schema's text, a regex, EBNF or Lark, a structural tag's JSON text
    any_whitespace: bool = True  # JSON: whitespace allowed between tokens

    @classmethod
    def of(cls, params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> GrammarSpec:
        """disable_any_whitespace: the engine's setting (StructuredOutputsConfig), for every
        request. Raises ValueError for a json dict that JSON cannot hold."""
        field = params.constraint
        any_whitespace = not (params.disable_any_whitespace or disable_any_whitespace)
        if field == "json_object":
            return cls("json", _ANY_OBJECT_SCHEMA, any_whitespace)
        if field == "json":
            schema = params.json
            try:  # property order stays as given: it is the order the output writes them in
                source = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
            except (TypeError, ValueError) as error:  # a value JSON cannot hold, a circular reference
                raise ValueError(f"The JSON schema is not JSON: {error}") from error
            return cls("json", source, any_whitespace)
        if field == "choice":
            assert params.choice is not None  # the constraint given
            # JSON string escapes are the EBNF grammar's own.
            return cls("choice", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
        source = getattr(params, field)
        assert isinstance(source, str)  # regex, grammar, structural_tag: checked by StructuredOutputsParams
        return cls(field, source)

    def build(self) -> xgr.Grammar:
        """xgrammar's grammar for this spec. Raises ValueError quoting xgrammar's message."""
        import xgrammar as xgr

        try:
            if self.field == "json":
                json.loads(self.source)  # a clearer message than xgrammar's for text that is not JSON
                return xgr.Grammar.from_json_schema(self.source, any_whitespace=self.any_whitespace)
            if self.field == "regex":
                return xgr.Grammar.from_regex(self.source)
            if self.field == "structural_tag":
                return xgr.Grammar.from_structural_tag(self.source)
            # grammar (and choice): EBNF, whose rules are written `::=`; otherwise Lark, as vLLM reads it.
            if "::=" in self.source:
                return xgr.Grammar.from_ebnf(self.source)
            return xgr.Grammar.from_lark(self.source)
        except json.JSONDecodeError as error:
            raise ValueError(f"The JSON schema is not valid JSON: {error}") from error
        except Exception as error:  # xgrammar raises RuntimeError and kinds of its own
            message = _LOG_PREFIX.sub("", str(error)).strip()
            raise ValueError(f"Invalid {_WHAT[self.field]}: {message}") from error


@functools.lru_cache(maxsize=_CHECKED_SPECS)
def check(spec: GrammarSpec) -> None:
    """Raise ValueError (xgrammar's message) if the spec is not a valid grammar; remembered
    when valid (an error is not cached: it raises again)."""
    spec.build()


def check_structured_outputs(params: StructuredOutputsParams) -> GrammarSpec:
    """The spec of a request's structured outputs, checked (ValueError if invalid)."""
    spec = GrammarSpec.of(params)
    check(spec)
    return spec
