"""``POST /v1/chat/completions``: OpenAI's chat completions, answered when the task ends.

The body is validated and converted as a Batch API line is (``convert.request_from_body``),
then enqueued on the interactive lane for the caller's tenant, through the same checks as
``POST /v1/tasks`` (the gate's key and rate limit, queue capacity, the tenant's quota). The
call then waits for the task without a thread: it took a watch on the task before enqueueing
it (``waiter.py``: one pub/sub subscription per API process), and reads the task's status
and result when woken. It answers the ``chat.completion``, the task's error with its status
(``chat_outcome.py``), or after ``api.sync_timeout_s`` a 504 naming the task's status URL
(the task keeps its place and runs; its result is read there). ``stream: true`` answers
Server-Sent Events (``chat_stream.py``).

Errors are OpenAI's error object (``type``, ``message``, ``param``, ``code``); a bad body is
a 400, as OpenAI answers it (``openai_route.py``), a body or request larger than a worker
takes a 413. Nothing of a body is parsed, converted or enqueued on the event loop: the body
in the thread pool (``bodies.py``), the rest in ``_request_of`` and ``_submit``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from vlmq.config.schemas import Request
from vlmq.config.tenants import Caller
from vlmq.producers.api.auth import caller_of
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.convert import request_from_body
from vlmq.producers.api.errors import ApiError, error_responses
from vlmq.producers.api.openai.chat_outcome import NO_RETRY, Outcome, read_outcome, status_url
from vlmq.producers.api.openai.chat_stream import sse_answer
from vlmq.producers.api.openai.objects import ChatCompletion
from vlmq.producers.api.openai.objects import ChatCompletionCreate as Body
from vlmq.producers.api.openai.route import OpenAIRoute
from vlmq.producers.api.queues import check_capacity
from vlmq.producers.api.waiter import Watch

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The chat completion; with `stream: true`, Server-Sent Events: "
        "`data: <chat.completion.chunk>` lines (openai_models.ChatCompletionChunk), then "
        "`data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_responses(400, 401, 409, 413, 429, 500, 503, 504),
}
# The task's id, on every answer of a call that enqueued one.
TASK_HEADER = "x-vlmq-task-id"


def _request_of(body: Body) -> Request:
    """The vlmq request a body asks for (in the thread pool: a body may weigh megabytes)."""
    return request_from_body(
        body.model_dump(exclude_unset=True, exclude={"stream", "stream_options"})
    )


def _submit(ctx: ApiContext, request: Request, tenant: str, channel: str) -> None:
    check_capacity(ctx, {request.modality.value: 1})
    ctx.client.submit(request, lane="interactive", tenant=tenant, notify=channel)


async def _next_outcome(ctx: ApiContext, watch: Watch, timeout: float) -> Outcome | None:
    """The task's outcome once it ended, or None if it did not within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await watch.wait(deadline - loop.time()):
        outcome = await run_in_threadpool(read_outcome, ctx.client, watch.task_id)
        if outcome is not None:
            return outcome
    return None


async def _stream(
    ctx: ApiContext, watch: Watch, timeout_s: float, include_usage: bool
) -> AsyncIterator[bytes]:
    """The stream's events; the watch ends with it, however it ends (a client that hung up
    leaves a generator the event loop closes)."""
    try:
        async for event in sse_answer(
            lambda slice_s: _next_outcome(ctx, watch, slice_s),
            _timeout_error(watch.task_id, timeout_s),
            timeout_s,
            include_usage,
        ):
            yield event
    finally:
        watch.close()


def _timeout_error(task_id: str, timeout_s: float) -> ApiError:
    url = status_url(task_id)
    message = (
        f"the task did not finish within {timeout_s:g} s; it keeps its place and runs: "
        f"read its status at {url}"
    )
    extra = {"task_id": task_id, "status_url": url}
    return ApiError(504, "timeout", message, {**NO_RETRY, TASK_HEADER: task_id}, extra=extra)


def _answer(outcome: Outcome, task_id: str) -> JSONResponse:
    if outcome.error is not None:
        error = outcome.error
        error.headers = {**(error.headers or {}), TASK_HEADER: task_id}
        raise error
    return JSONResponse(outcome.completion, headers={TASK_HEADER: task_id})


@router.post("/chat/completions", response_model=ChatCompletion, responses=_RESPONSES)
async def create_chat_completion(
    body: Body, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> Response:
    """Run one chat completion on the fleet and answer it when it is done (or 504 with the
    task's status URL after `VLMQ_API__SYNC_TIMEOUT_S`)."""
    waiter = ctx.waiter
    stream = bool(body.stream)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    request = await run_in_threadpool(_request_of, body)
    # Watched before it exists: its end cannot be missed.
    watch = waiter.watch(request.id)
    try:
        await run_in_threadpool(_submit, ctx, request, caller.tenant, waiter.channel)
    except BaseException:
        watch.close()
        raise
    timeout_s = ctx.settings.api.sync_timeout_s
    if stream:
        events = _stream(ctx, watch, timeout_s, include_usage)
        headers = {TASK_HEADER: request.id, "Cache-Control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        outcome = await _next_outcome(ctx, watch, timeout_s)
    finally:
        watch.close()
    if outcome is None:
        raise _timeout_error(request.id, timeout_s)
    return _answer(outcome, request.id)
