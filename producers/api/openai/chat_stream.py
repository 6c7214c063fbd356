"""``stream: true``: a chat completion as Server-Sent Events in OpenAI's chunk format.

The engines generate a batch as a whole and publish nothing before a task ends, so there is
no token streaming: the stream opens at once (headers, then a comment every
``KEEPALIVE_S`` so proxies keep an idle connection), and when the task ends it carries one
chunk per choice with the whole text (``delta.role`` and ``delta.content``), one chunk per
choice with its ``finish_reason``, a usage chunk (``choices: []``) when
``stream_options.include_usage`` asks for it, and ``data: [DONE]``. An error after the stream
opened (the task failed, the wait timed out) is an ``{"error": {...}}`` event then
``[DONE]``, which the official clients raise as an ``APIError``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from vlmq.producers.api.errors import ApiError, error_body
from vlmq.producers.api.openai.chat_outcome import Outcome

__all__ = ["DONE", "KEEPALIVE", "KEEPALIVE_S", "completion_chunks", "sse_answer", "sse_event"]

KEEPALIVE_S = 15.0
KEEPALIVE = b": keepalive\n\n"
DONE = b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def completion_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A ``chat.completion`` body as the ``chat.completion.chunk`` objects of its stream."""
    head = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }
    if include_usage:
        head["usage"] = None  # OpenAI's: null on every chunk but the last
    chunks = []
    for choice in completion["choices"]:
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        part = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs")}
        chunks.append({**head, "choices": [{**part, "finish_reason": None}]})
    for choice in completion["choices"]:
        end = {"index": choice["index"], "delta": {}, "logprobs": None}
        chunks.append({**head, "choices": [{**end, "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks


def _error_event(error: ApiError) -> bytes:
    return sse_event(error_body(error.status, error.code, error.message, error.param, error.extra))


async def sse_answer(
    next_outcome: Callable[[float], Awaitable[Outcome | None]],
    timeout_error: ApiError,
    timeout_s: float,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The stream's bytes: keep-alives while ``next_outcome(slice)`` finds nothing, then the
    outcome's chunks (or its error; ``timeout_error`` once ``timeout_s`` passed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            yield _error_event(timeout_error)
            yield DONE
            return
        outcome = await next_outcome(min(KEEPALIVE_S, remaining))
        if outcome is not None:
            break
        yield KEEPALIVE
    if outcome.completion is not None:
        for chunk in completion_chunks(outcome.completion, include_usage):
            yield sse_event(chunk)
    elif outcome.error is not None:
        yield _error_event(outcome.error)
    yield DONE
