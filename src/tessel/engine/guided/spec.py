"""What a request's output must match, checked at the edge: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a Lark grammar (llguidance's dialect).

`GuidedDecoding.grammar()` is the llguidance grammar text; it is also the compile cache's key.
Schemas are bounded in size and nesting (`MAX_SCHEMA_CHARS`, `MAX_SCHEMA_DEPTH`): a 400 names the
limit. Recursive schemas (`$ref` to an enclosing definition) are supported: llguidance compiles
them to a recursive grammar, and `max_tokens` bounds the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tessel.errors import TesselError

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
MAX_SCHEMA_CHARS = 65_536  # a schema's JSON text; vLLM has no bound, 64 KiB holds any real API's schema
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays in a schema document
MAX_PATTERN_CHARS = 8_192  # a regex or a Lark grammar
MAX_CHOICES = 256  # guided_choice strings
# JSON without free whitespace between tokens: a small model otherwise loops on newlines
_JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidGuidedDecoding(TesselError, ValueError):
    """A schema, pattern or grammar that cannot guide decoding (a 400 at the server)."""


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """`spec`: the schema's JSON text (json_schema), the pattern (regex), the grammar (lark), the
    choices as a JSON list (choice), "" (json_object)."""

    kind: GuidedKind
    spec: str = ""

    def grammar(self) -> str:
        """The llguidance grammar (a JSON document naming one grammar)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(self.spec))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return LLMatcher.grammar_from_lark(self.spec)


def json_schema(schema: Any, name: str = "json_schema") -> GuidedDecoding:
    """A JSON schema (a dict or a boolean), bounded in size and depth."""
    if not isinstance(schema, dict | bool):
        raise InvalidGuidedDecoding(f"{name} must be a JSON Schema (an object), got {type(schema).__name__}")
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidGuidedDecoding(
            f"{name} has {len(text)} characters; max_schema_chars is {MAX_SCHEMA_CHARS}"
        )
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidGuidedDecoding(
            f"{name} nests {depth} levels deep; max_schema_depth is {MAX_SCHEMA_DEPTH}"
        )
    return GuidedDecoding("json_schema", text)


def regex(pattern: Any) -> GuidedDecoding:
    return GuidedDecoding("regex", _pattern(pattern, "guided_regex"))


def lark(grammar: Any) -> GuidedDecoding:
    return GuidedDecoding("lark", _pattern(grammar, "guided_grammar"))


def choice(choices: Any) -> GuidedDecoding:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidGuidedDecoding("guided_choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidGuidedDecoding(f"guided_choice has {len(choices)} strings; at most {MAX_CHOICES}")
    return GuidedDecoding("choice", json.dumps(choices, ensure_ascii=False))


def _pattern(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidGuidedDecoding(f"{name} must be a non-empty string")
    if len(value) > MAX_PATTERN_CHARS:
        raise InvalidGuidedDecoding(f"{name} has {len(value)} characters; at most {MAX_PATTERN_CHARS}")
    return value


def _depth(value: Any) -> int:
    """Nesting of dicts and lists, iteratively (a hostile document must not hit Python's recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest
