"""Celery protocol-2 messages on kombu's Redis transport, as JSON.

vlmq enqueues messages that a stock Celery producer would have written, so a
web app that already uses Celery can enqueue with a plain::

    app.send_task("vlmq.generate", kwargs={"request": {...}}, queue="vlmq.image")

and vlmq's own producers push the very same bytes in a Redis pipeline
(no per-task round trip). Only JSON is ever accepted on the wire.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "PRIORITY_STEPS",
    "TASK_NAME",
    "Envelope",
    "TaskMessage",
    "WireError",
    "decode_envelope",
    "decode_message",
    "encode_message",
    "largest_request",
    "peek_envelope",
    "priority_lists",
]

TASK_NAME = "vlmq.generate"
# kombu's Redis transport keeps one list per priority step; 0 is served first.
PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEP = "\x06\x16"


class WireError(ValueError):
    """A message that is not a JSON Celery protocol-2 vlmq task."""


@dataclass(frozen=True)
class Envelope:
    """What Celery reads of a message besides the task's arguments: its headers (id, group,
    ignore_result, root and parent ids...), properties (reply_to, correlation_id, priority)
    and the body's embed (callbacks, errbacks, chain, chord). Read even when the request in
    it is not valid, so a Celery caller hears of that failure too."""

    task_id: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: Any

    @property
    def embed(self) -> dict[str, Any]:
        """The protocol-2 body's third element ({} when there is none)."""
        body = self.body
        if isinstance(body, list) and len(body) >= 3 and isinstance(body[2], dict):
            return body[2]
        return {}


@dataclass(frozen=True)
class TaskMessage:
    task_id: str
    task_name: str
    request: dict[str, Any]
    expires: datetime | None
    priority: int
    raw: str
    envelope: Envelope | None = None


def priority_lists(queue: str) -> list[str]:
    """The Redis lists behind one queue, highest priority first."""
    return [queue if step == 0 else f"{queue}{_PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_JSON = json.dumps(_EMBED, separators=(",", ":"))
# What a message adds to its request's JSON besides base64: the protocol-2 body around it
# (its kwargs and embed) and the headers and properties. Measured at their longest (ids of
# 128 characters, a job's prepared queue under the prefix "vlmq", a host name of 253
# characters, an expiry): 1,464 bytes; the rest is room for a longer key prefix.
_ENVELOPE_BYTES = 2048
_BODY_FRAME_BYTES = len(f'[[],{{"request":}},{_EMBED_JSON}]')


def encode_message(
    request: dict[str, Any] | str,
    task_id: str,
    queue: str,
    priority: int = 0,
    expires: datetime | None = None,
    ignore_result: bool = True,
) -> str:
    """A Celery protocol-2 message body as kombu's Redis transport stores it.

    ``request`` may be given already serialised (``Request.model_dump_json``),
    which saves re-encoding it on the bulk path. ``ignore_result`` False asks the worker to
    record the task's result in the Celery result backend too (docs/celery.md).
    """
    request_json = request if isinstance(request, str) else json.dumps(request)
    body = f'[[],{{"request":{request_json}}},{_EMBED_JSON}]'
    headers = {
        "lang": "py",
        "task": TASK_NAME,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": expires.isoformat() if expires else None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "",
        "kwargsrepr": "",
        "origin": _ORIGIN,
        "ignore_result": ignore_result,
    }
    properties = {
        "delivery_tag": uuid.uuid4().hex,
        "correlation_id": task_id,
        "reply_to": "",
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": priority,
        "body_encoding": "base64",
    }
    # Headers and properties before the body: a pull finds the task id and tag by scanning
    # the text from its start (vlmq/broker/lua/intake.lua, identify); JSON's keys have no order.
    message = {
        "headers": headers,
        "properties": properties,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "body": base64.b64encode(body.encode()).decode(),
    }
    return json.dumps(message, separators=(",", ":"))


def largest_request(max_message_bytes: int) -> int:
    """The most UTF-8 bytes a request's JSON may take for its message to stay within
    ``max_message_bytes`` (what a worker takes: ``fleet.max_message_bytes``). The body is
    base64: a message weighs 4/3 of its request, and the envelope."""
    return max(0, (max_message_bytes - _ENVELOPE_BYTES) * 3 // 4 - _BODY_FRAME_BYTES)


def _parse_expires(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, tz=timezone.utc)  # an epoch from some producer
        parsed = datetime.fromisoformat(str(value))
    except (ValueError, OverflowError, OSError) as exc:
        raise WireError("expires: not an ISO 8601 time") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _body(message: dict[str, Any]) -> Any:
    if message.get("content-type") != "application/json":
        raise WireError("only application/json messages are accepted")
    body = message.get("body", "")
    properties = message.get("properties")
    if isinstance(properties, dict) and properties.get("body_encoding") == "base64":
        body = base64.b64decode(body, validate=True)
    return json.loads(body)


def _request_of(body: Any) -> dict[str, Any]:
    if not (isinstance(body, list) and len(body) >= 2):
        raise WireError("body is not a Celery protocol-2 [args, kwargs, embed] triple")
    args, kwargs = body[0], body[1]
    request = kwargs.get("request") if isinstance(kwargs, dict) else None
    if request is None and isinstance(args, list) and args:
        request = args[0]
    if not isinstance(request, dict):
        raise WireError("the task takes one argument: request (an object)")
    return request


def _priority(properties: Any) -> int:
    """kombu's priority, clamped to 0-9 (absent: 0)."""
    value = properties.get("priority") if isinstance(properties, dict) else None
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise WireError("properties.priority: not a number")
    return int(max(0, min(value, 9)))


def decode_envelope(raw: str | bytes) -> Envelope:
    """A raw list entry's headers, properties and body; never unpickles anything. Whatever
    the entry holds, the only exception is WireError."""
    try:
        message = json.loads(raw)
        headers = message["headers"]
        task_id = headers["id"]
        body = _body(message)
    except (KeyError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
        raise WireError("not a JSON Celery protocol-2 message") from exc
    if not isinstance(headers, dict):
        raise WireError("headers: not an object")
    if not isinstance(task_id, str):
        raise WireError("headers.id: not a string")
    properties = message.get("properties")
    return Envelope(task_id, headers, properties if isinstance(properties, dict) else {}, body)


# A message's body as kombu writes it (base64: no quote or backslash inside).
_BODY_KEY = re.compile(r'"body"\s*:\s*"')


def peek_envelope(raw: str, task_id: str, limit: int) -> Envelope:
    """What Celery reads of a message that is not read whole (over the size limit, or its
    body unreadable): its headers and properties, parsed from the text around its body (a
    base64 string, which kombu writes first) when that text is at most ``limit`` characters
    and its headers name ``task_id``; else ``task_id`` alone. The body (the request, the embed)
    is never parsed. Never raises."""
    alone = Envelope(task_id, {"id": task_id}, {}, None)
    found = _BODY_KEY.search(raw)
    if found is None:
        return alone
    end = raw.find('"', found.end())
    if end < 0 or raw.find("\\", found.end(), end) >= 0:
        return alone
    if len(raw) - (end - found.end()) > limit:
        return alone
    try:
        message = json.loads(f'{raw[: found.start()]}"body":""{raw[end + 1 :]}')
        headers, properties = message["headers"], message.get("properties")
    except (KeyError, TypeError, ValueError, RecursionError):
        return alone
    if not isinstance(headers, dict) or headers.get("id") != task_id:
        return alone
    return Envelope(task_id, headers, properties if isinstance(properties, dict) else {}, None)


def decode_message(raw: str | bytes, envelope: Envelope | None = None) -> TaskMessage:
    """Parse a raw list entry (or the ``envelope`` already read from it) into the task it
    asks for; the only exception is WireError."""
    envelope = envelope or decode_envelope(raw)
    headers = envelope.headers
    return TaskMessage(
        task_id=envelope.task_id,
        task_name=str(headers.get("task", "")),
        request=_request_of(envelope.body),
        expires=_parse_expires(headers.get("expires")),
        priority=_priority(envelope.properties),
        raw=raw if isinstance(raw, str) else raw.decode(errors="replace"),
        envelope=envelope,
    )
