"""Request bodies to validated :class:`config.schemas.Request` objects.

A body is either a vlmq request (``messages`` plus generation fields at the
top level) or an OpenAI chat completions body (``model``, ``messages``,
``max_tokens``, ``n``, ``response_format``, ... and vLLM's extensions: see
config/jsonl.py), told apart by the ``model`` key OpenAI requires.
"""

from __future__ import annotations

from typing import Any

from vlmq.config.errors import InvalidRequest
from vlmq.config.jsonl import to_request_fields
from vlmq.config.schemas import Request
from vlmq.producers.client import as_request

__all__ = ["request_from_body"]

# Set by the server, never by a caller: a chosen id could overwrite another
# caller's task status.
_SERVER_FIELDS = ("id", "job_id")


def _openai_fields(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        raise InvalidRequest("streaming is not supported; poll the task instead", field="stream")
    try:
        return to_request_fields({"body": body, "custom_id": body.get("custom_id")})
    except ValueError as exc:  # our own messages ("body: must be an object")
        raise InvalidRequest(str(exc)) from None


def request_from_body(body: Any, where: str = "") -> Request:
    """Validate one body; InvalidRequest names the field (prefixed by ``where``)."""
    try:
        if not isinstance(body, dict):
            raise InvalidRequest("must be an object")
        for name in _SERVER_FIELDS:
            if name in body:
                raise InvalidRequest("is assigned by the server", field=name)
        fields = _openai_fields(body) if "model" in body else body
        return as_request(fields)
    except InvalidRequest as exc:
        if not where:
            raise
        raise InvalidRequest(exc.message, field=where) from None
