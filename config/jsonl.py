"""Bulk JSONL input: one request per line, vlmq/HF or OpenAI Batch format.

Detected per line:

* vlmq / Hugging Face: ``{"custom_id": "...", "messages": [...], "max_new_tokens": 64}``
* OpenAI Batch: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
  "body": {"model": "...", "messages": [...], "max_tokens": 64}}``; the body's OpenAI
  sampling and ``response_format`` fields, and vLLM's extensions (``repetition_penalty``,
  ``min_tokens``, ``structured_outputs`` and the older ``guided_*`` constraints), map onto
  the request's generation fields.

A bad line never stops a run: it becomes a :class:`LineError` naming the line
and the reason (as in vLLM's ``run_batch``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from vlmq.config.schemas import Request

__all__ = ["LineError", "ParsedLine", "describe_validation_error", "parse_line", "read_requests"]

# OpenAI chat body fields, plus the extensions vLLM accepts in one (repetition_penalty,
# min_tokens) and vlmq's own constraint fields, by the Request field each sets.
_OPENAI_BODY_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    "n": "n",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "response_format": "response_format",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
# vLLM's constraint fields: the ``structured_outputs`` object's keys and the older top-level
# ``guided_*`` names, by the vlmq constraint each is. A JSON schema becomes an OpenAI
# ``response_format`` so that results carry ``parsed`` as for any JSON constraint.
_VLLM_CONSTRAINTS = ("json", "regex", "choice", "grammar")
_VLLM_GUIDED = {f"guided_{name}": name for name in _VLLM_CONSTRAINTS}
# A vLLM constraint vlmq cannot honour: refused rather than ignored, since ignoring it would
# return unconstrained output to a caller who asked for a shape.
_VLLM_UNSUPPORTED = ("structural_tag",)
_CHAT_URLS = {"/v1/chat/completions", "/chat/completions"}


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str

    def to_record(self) -> dict[str, Any]:
        return {
            "custom_id": self.custom_id,
            "line": self.line,
            "status": "failed",
            "error": {"code": self.code, "message": self.message},
        }


@dataclass(frozen=True)
class ParsedLine:
    line: int
    request: Request | None = None
    error: LineError | None = None


def describe_validation_error(exc: ValidationError) -> str:
    """First problem of a pydantic error, as 'field.path: reason' (no input echo)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    reason = str(first.get("msg", "invalid value"))
    return f"{where}: {reason}" if where else reason


def _json_schema(value: Any, where: str) -> dict[str, Any]:
    """A vLLM JSON constraint (a schema object, or its JSON text) as a response_format."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON Schema object")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}


def _structured_outputs(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The constraints of vLLM's ``structured_outputs`` object, as (body field, vLLM name,
    value); its tuning options (whitespace_pattern, disable_*) are the engine's business."""
    structured = body.get("structured_outputs")
    if structured is None:
        return []
    if not isinstance(structured, dict):
        raise ValueError("structured_outputs: must be an object")
    for key in _VLLM_UNSUPPORTED:
        if structured.get(key) is not None:
            raise ValueError(f"structured_outputs.{key}: is not supported")
    found = [(f"structured_outputs.{key}", key, structured.get(key)) for key in _VLLM_CONSTRAINTS]
    if structured.get("json_object"):
        found.append(("structured_outputs.json_object", "json_object", True))
    return [(where, key, value) for where, key, value in found if value is not None]


def _vllm_constraint(name: str, value: Any, where: str) -> tuple[str, Any]:
    """One vLLM constraint as (Request field, value)."""
    if name == "json":
        return "response_format", _json_schema(value, where)
    if name == "json_object":
        return "response_format", {"type": "json_object"}
    return name, value


def _vllm_constraints(body: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """vLLM's constraint fields in a body, as {Request field: (body field, value)}."""
    found = _structured_outputs(body)
    found += [
        (key, name, body[key]) for key, name in _VLLM_GUIDED.items() if body.get(key) is not None
    ]
    fields: dict[str, tuple[str, Any]] = {}
    for where, name, value in found:
        target, value = _vllm_constraint(name, value, where)
        if target in fields:
            raise ValueError(_two_constraints(where, fields[target][0]))
        fields[target] = (where, value)
    return fields


def _two_constraints(where: str, other: str) -> str:
    # Two fields setting one Request field: the schema would only ever see the last one.
    return f"{where}: at most one constraint per request; also got {other}"


def _from_openai(obj: dict[str, Any]) -> dict[str, Any]:
    url = obj.get("url", "/v1/chat/completions")
    if url not in _CHAT_URLS:
        raise ValueError(f"url: only /v1/chat/completions is supported, got {str(url)[:60]!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: must be an object")
    fields: dict[str, Any] = {"custom_id": obj.get("custom_id"), "messages": body.get("messages")}
    # Other body fields (user, tools, logit_bias, top_k, ...) are ignored, as an
    # OpenAI-compatible server ignores what it does not implement.
    for source, target in _OPENAI_BODY_FIELDS.items():
        if body.get(source) is not None:
            fields[target] = body[source]
    for target, (where, value) in _vllm_constraints(body).items():
        if target in fields and not _plain_text(fields[target]):
            raise ValueError(_two_constraints(where, target))
        fields[target] = value
    return fields


def _plain_text(value: Any) -> bool:
    """``response_format: {"type": "text"}``: OpenAI's default, no constraint."""
    return isinstance(value, dict) and value.get("type") == "text"


def to_request_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """Either format, as the keyword fields of a :class:`Request`."""
    if "body" in obj or "method" in obj:
        return _from_openai(obj)
    return obj


def parse_line(
    text: str, line: int, job_id: str | None = None, task_id: str | None = None
) -> ParsedLine:
    """One line as a request or an error. ``task_id`` sets the request's id (a caller that
    names its tasks itself saves generating one per line)."""
    custom_id = None
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
        fields = to_request_fields(obj)
        if job_id is not None:
            fields = {**fields, "job_id": job_id}
        if task_id is not None:
            fields = {**fields, "id": task_id}
        return ParsedLine(line, request=Request.model_validate(fields))
    except json.JSONDecodeError as exc:
        message = f"not valid JSON (column {exc.colno})"
    except ValidationError as exc:
        message = describe_validation_error(exc)
    except ValueError as exc:
        message = str(exc)
    return ParsedLine(line, error=LineError(line, custom_id, "invalid_request", message))


def read_requests(lines: Iterable[str], job_id: str | None = None) -> Iterator[ParsedLine]:
    """Stream parsed lines; blank lines are skipped; duplicate custom_ids are errors."""
    seen: set[str] = set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed = parse_line(text, number, job_id)
        custom_id = parsed.request.custom_id if parsed.request else None
        if custom_id is not None:
            if custom_id in seen:
                error = LineError(
                    number,
                    custom_id,
                    "duplicate_custom_id",
                    f"custom_id {custom_id[:80]!r} appears more than once",
                )
                parsed = ParsedLine(number, error=error)
            else:
                seen.add(custom_id)
        yield parsed
