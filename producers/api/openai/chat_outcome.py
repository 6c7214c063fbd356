"""What a waiting chat completion answers once its task ended: the chat completion, or the
task's error with the HTTP status that error deserves.

Read on a worker thread through ``Client.outcome`` (the one read of status, location and
stored record, shared with ``Client.result``); the status is the truth, whatever woke the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmq.config.status import TaskState
from vlmq.producers.api.errors import ApiError
from vlmq.producers.api.openai.mapping import to_chat_completion
from vlmq.producers.client import Client

__all__ = ["NO_RETRY", "Outcome", "read_outcome", "status_url", "task_error"]

# The task ran and ended: sending the same call again would run it again (a new task), which
# the official clients do for a 5xx unless told not to.
NO_RETRY = {"x-should-retry": "false"}

# A failed task's HTTP status, by its error code: the request's own fault is a 400 (as
# OpenAI answers an image it cannot read); a task someone cancelled a 409; one that expired
# before it ran a 504; the store down a 503; anything else the server's fault, 500.
_STATUS_BY_CODE = {
    "invalid_request": 400,
    "staging_refused": 400,
    "media_error": 400,
    "media_fetch_failed": 400,
    "media_too_large": 400,
    "media_forbidden": 400,
    "media_decode_failed": 400,
    "too_many_media": 400,
    "prompt_too_long": 400,
    "cancelled": 409,
    "expired": 504,
    "store_unavailable": 503,
}


@dataclass(frozen=True)
class Outcome:
    """A finished task's answer: its completion (the ``chat.completion`` body) or its error."""

    completion: dict[str, Any] | None = None
    error: ApiError | None = None


def status_url(task_id: str) -> str:
    return f"/v1/tasks/{task_id}"


def task_error(task_id: str, state: str, status: dict[str, str]) -> ApiError:
    """The error a task that did not succeed answers (its own code and message)."""
    code = status.get("error_code") or state
    message = status.get("error_message") or f"the task was {state}"
    http_status = _STATUS_BY_CODE.get(code, _STATUS_BY_CODE.get(state, 500))
    extra = {"task_id": task_id, "status_url": status_url(task_id)}
    return ApiError(http_status, code, message, dict(NO_RETRY), extra=extra)


def read_outcome(client: Client, task_id: str) -> Outcome | None:
    """The task's outcome, or None while it has not ended."""
    ended = client.outcome(task_id)
    if ended is None:
        return None
    if ended.state == TaskState.SUCCEEDED.value:
        if ended.record is None:
            message = "the task's result object is missing from the store"
            return Outcome(error=ApiError(500, "result_missing", message, dict(NO_RETRY)))
        return Outcome(completion=to_chat_completion(ended.record))
    if ended.ended:
        return Outcome(error=task_error(task_id, ended.state, ended.status))
    # Its status is gone (Redis lost it): nothing will ever wake this call.
    message = "the task's status is gone"
    return Outcome(error=ApiError(500, "internal_error", message, dict(NO_RETRY)))
