"""Bulk JSONL input: one request per line, vlmq/HF or OpenAI Batch format.

Detected per line:

* vlmq / Hugging Face: ``{"custom_id": "...", "messages": [...], "max_new_tokens": 64}``
* OpenAI Batch: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
  "body": {"model": "...", "messages": [...], "max_tokens": 64}}``

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

_OPENAI_BODY_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
}
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


def _from_openai(obj: dict[str, Any]) -> dict[str, Any]:
    url = obj.get("url", "/v1/chat/completions")
    if url not in _CHAT_URLS:
        raise ValueError(f"url: only /v1/chat/completions is supported, got {str(url)[:60]!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: must be an object")
    fields: dict[str, Any] = {"custom_id": obj.get("custom_id"), "messages": body.get("messages")}
    for source, target in _OPENAI_BODY_FIELDS.items():
        if body.get(source) is not None:
            fields[target] = body[source]
    return fields


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
