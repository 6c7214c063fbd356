"""Decoding constraints: a request's ``response_format``, ``regex``, ``choice`` or ``grammar``
as one llguidance grammar, checked without torch or a tokenizer.

The producer side (client, bulk validation, the HTTP API) and the worker use the same
grammar text: producers check it here at submit time (``check``) and the worker compiles it
against its model's tokenizer (workers/engine/constraints.py), where the few problems that
need the vocabulary show up. Checks are cached by grammar text, so a schema repeated on a
million lines is checked once per process. Why llguidance: docs/design.md, "Structured
outputs".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "MAX_CHOICES",
    "MAX_GRAMMAR_CHARS",
    "Constraint",
    "ConstraintError",
    "choice_grammar",
    "constraint_of",
]

# Limits, in one place: a constraint is part of every message of its task.
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema (as JSON), a regex or a Lark grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 512

# Compact JSON (no free whitespace): random or weak models cannot pad an object with
# endless spaces, and the output is what json.dumps(separators=(",", ":")) would give.
_JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(ValueError):
    """A constraint the grammar engine refuses; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class Constraint:
    """A request's constraint: which field set it, the grammar, whether output is JSON."""

    field: str
    grammar: str
    json: bool


def _llguidance() -> Any:
    import llguidance

    return llguidance.LLMatcher


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    # llguidance's regex errors put the reason after the caret line.
    for line in lines:
        if line.startswith("error:"):
            return line[len("error:") :].strip()[:300]
    return (lines[0] if lines else "rejected by the grammar engine")[:300]


@lru_cache(maxsize=1024)
def _validate(grammar: str, field: str) -> None:
    error = _llguidance().validate_grammar(grammar)
    if error:
        raise ConstraintError(field, _first_line(error))


def json_schema_grammar(schema: Any, field: str = "response_format.json_schema.schema") -> str:
    if not isinstance(schema, dict):
        raise ConstraintError(field, "must be a JSON object (a JSON Schema)")
    # Property order is generation order (as in OpenAI's structured outputs): keep the schema's.
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(field, f"is over {MAX_GRAMMAR_CHARS} characters as JSON")
    return _schema_grammar(text, field)


@lru_cache(maxsize=1024)
def _schema_grammar(text: str, field: str) -> str:
    try:
        return str(_llguidance().grammar_from_json_schema(text, defaults=_JSON_OPTIONS))
    except ValueError as exc:
        raise ConstraintError(field, str(exc)[:300]) from None


@lru_cache(maxsize=1024)
def regex_grammar(pattern: str) -> str:
    return str(_llguidance().grammar_from_regex(pattern))


@lru_cache(maxsize=1024)
def lark_grammar(text: str) -> str:
    return str(_llguidance().grammar_from_lark(text))


def choice_grammar(options: list[str]) -> str:
    # Lark string literals take JSON escapes, so any text is one literal.
    return lark_grammar("start: " + " | ".join(json.dumps(option) for option in options))


def _response_format(value: dict[str, Any]) -> Constraint | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", json_schema_grammar({"type": "object"}), True)
    spec = value.get("json_schema") or {}
    return Constraint("response_format", json_schema_grammar(spec.get("schema")), True)


def constraint_of(
    response_format: dict[str, Any] | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> Constraint | None:
    """The one constraint a request sets (the schema has already checked the shapes and
    that at most one is set), its grammar checked; ConstraintError names the field."""
    if response_format is not None:
        constraint = _response_format(response_format)
    elif regex is not None:
        constraint = Constraint("regex", regex_grammar(regex), False)
    elif choice is not None:
        constraint = Constraint("choice", choice_grammar(choice), False)
    elif grammar is not None:
        constraint = Constraint("grammar", lark_grammar(grammar), False)
    else:
        return None
    if constraint is not None:
        field = (
            "response_format.json_schema.schema"
            if constraint.field == "response_format"
            else constraint.field
        )
        _validate(constraint.grammar, field)
    return constraint
