"""Tasks: submit one conversation (or a small batch), read status and result, cancel.

Single tasks go to the interactive lane, so a person waiting on an answer is
served before bulk jobs of the same class. Bodies are parsed off the event loop
(``bodies.py``), and what they cost is bounded before any request is built: a conversation's
content parts (``config/schemas.py`` MAX_PARTS), a batch's in all (MAX_BATCH_PARTS).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from vlmq.config.ids import valid_id
from vlmq.config.schemas import MAX_N, MAX_PARTS, MAX_TOP_LOGPROBS, Request, count_parts
from vlmq.config.status import TaskState
from vlmq.config.tenants import Caller
from vlmq.producers.api.auth import caller_of
from vlmq.producers.api.bodies import BodyRoute
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.convert import request_from_body
from vlmq.producers.api.errors import ApiError, ErrorDetail, error_responses
from vlmq.producers.api.openai.mapping import to_chat_completion
from vlmq.producers.api.openai.objects import ChatCompletion, Conversation
from vlmq.producers.api.queues import check_capacity
from vlmq.stores.base import ObjectStore, result_location

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["tasks"], route_class=BodyRoute)

_TERMINAL = {s.value for s in TaskState if s.terminal}
_READ_ERRORS = error_responses(401, 404, 429, 503)
_WRITE_ERRORS = error_responses(401, 413, 422, 429, 503)


class TaskBody(BaseModel):
    """A vlmq request, or an OpenAI chat completions body (``model`` present).

    Both take the sampling fields below and at most one constraint (``response_format``,
    ``regex``, ``choice``, ``grammar``); an OpenAI body also takes vLLM's
    ``structured_outputs`` object and ``guided_*`` fields. Bounds and constraints are checked
    at submit (422 ``invalid_request`` naming the field).
    """

    model_config = ConfigDict(extra="allow")

    messages: Conversation = Field(
        min_length=1, description=f"At most {MAX_PARTS} content parts in all"
    )
    custom_id: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, description=f"Completions, 1 to {MAX_N}")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, description=f"0 to {MAX_TOP_LOGPROBS}; needs logprobs")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="OpenAI: {type: text | json_object | json_schema, json_schema}"
    )
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark grammar")
    model: str | None = None
    max_tokens: int | None = None


class TaskAccepted(BaseModel):
    id: str
    status: Literal["queued"] = "queued"
    status_url: str
    result_url: str
    modality: str
    custom_id: str | None = None


class TaskStatus(BaseModel):
    id: str
    status: str
    modality: str | None = None
    custom_id: str | None = None
    job_id: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    # While queued: a prepare worker is fetching and decoding its media ('preparing'), or
    # has, and it waits for a GPU worker ('prepared'); None otherwise.
    stage: str | None = None
    error: ErrorDetail | None = None
    result_url: str | None = None


class CancelReply(BaseModel):
    id: str
    cancelled: bool
    status: str


# The content parts of one POST /v1/tasks:batch in all (each request counts one at least):
# what its requests cost to build is bounded whatever their number.
MAX_BATCH_PARTS = 16 * MAX_PARTS


def _bounded_batch(items: Any) -> Any:
    """Refuse a batch of more than MAX_BATCH_PARTS parts before any item is validated."""
    if not isinstance(items, list):
        return items
    if len(items) > MAX_BATCH_PARTS or sum(_parts_of(item) for item in items) > MAX_BATCH_PARTS:
        raise ValueError(f"at most {MAX_BATCH_PARTS} content parts in all the requests")
    return items


def _parts_of(item: Any) -> int:
    return max(1, count_parts(item.get("messages"))) if isinstance(item, dict) else 1


class BatchBody(BaseModel):
    requests: Annotated[list[dict[str, Any]], BeforeValidator(_bounded_batch)] = Field(
        min_length=1, description=f"At most {MAX_BATCH_PARTS} content parts in all"
    )
    lane: Literal["bulk", "interactive"] = "bulk"
    name: str | None = Field(None, max_length=200)


class BatchAccepted(BaseModel):
    job_id: str
    count: int
    task_ids: list[str]
    status_url: str


def _accepted(request: Request) -> TaskAccepted:
    return TaskAccepted(
        id=request.id,
        status_url=f"/v1/tasks/{request.id}",
        result_url=f"/v1/tasks/{request.id}/result",
        modality=request.modality.value,
        custom_id=request.custom_id,
    )


@router.post("/tasks", status_code=202, responses=_WRITE_ERRORS)
def submit_task(
    body: TaskBody, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> TaskAccepted:
    """Queue one conversation on the interactive lane (429 ``quota_exceeded`` past the
    tenant's quota)."""
    request = request_from_body(body.model_dump(exclude_unset=True))
    check_capacity(ctx, {request.modality.value: 1})
    ctx.client.submit(request, lane="interactive", tenant=caller.tenant)
    return _accepted(request)


@router.post("/tasks:batch", status_code=202, responses=_WRITE_ERRORS)
def submit_batch(
    body: BatchBody, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> BatchAccepted:
    """Queue up to ``max_batch_items`` conversations as one job; all or nothing."""
    limit = ctx.settings.api.max_batch_items
    if len(body.requests) > limit:
        raise ApiError(422, "invalid_request", f"requests: at most {limit} items per call")
    requests = [request_from_body(item, f"requests.{i}") for i, item in enumerate(body.requests)]
    wanted: dict[str, int] = {}
    for request in requests:
        wanted[request.modality.value] = wanted.get(request.modality.value, 0) + 1
    check_capacity(ctx, wanted)
    job_id = ctx.client.submit_many(requests, lane=body.lane, name=body.name, tenant=caller.tenant)
    return BatchAccepted(
        job_id=job_id,
        count=len(requests),
        task_ids=[r.id for r in requests],
        status_url=f"/v1/jobs/{job_id}",
    )


def _known_task(ctx: ApiContext, task_id: str, caller: Caller) -> dict[str, str]:
    """The task's status; 404 for an id that is not one, or another tenant's (its existence
    is not confirmed)."""
    if not valid_id(task_id):
        raise ApiError(404, "not_found", "no such task")
    state = ctx.client.state
    status = state.tasks.get(task_id)
    if status.get("state", "unknown") == TaskState.UNKNOWN.value:
        raise ApiError(404, "not_found", "no such task")
    if not caller.admin and state.jobs.task_tenant(status) != caller.tenant:
        raise ApiError(404, "not_found", "no such task")
    return status


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _task_status(task_id: str, status: dict[str, str]) -> TaskStatus:
    state = status.get("state", "unknown")
    code = status.get("error_code")
    error = ErrorDetail(code=code, message=status.get("error_message") or code) if code else None
    return TaskStatus(
        id=task_id,
        status=state,
        modality=status.get("modality") or None,
        custom_id=status.get("custom_id") or None,
        job_id=status.get("job_id") or None,
        created_at=_number(status.get("created_at") or status.get("queued_at")),
        started_at=_number(status.get("started_at")),
        finished_at=_number(status.get("finished_at")),
        attempts=int(_number(status.get("attempts")) or 0),
        stage=(status.get("stage") or None) if state == "queued" else None,
        error=error,
        result_url=f"/v1/tasks/{task_id}/result" if state in _TERMINAL else None,
    )


@router.get("/tasks/{task_id}", responses=_READ_ERRORS)
def task_status(
    task_id: str, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> TaskStatus:
    return _task_status(task_id, _known_task(ctx, task_id, caller))


def _record_without_object(task_id: str, status: dict[str, str]) -> dict[str, Any]:
    """A cancelled or expired task has no stored object: describe it from its status."""
    view = _task_status(task_id, status)
    return {
        "id": task_id,
        "custom_id": view.custom_id,
        "job_id": view.job_id,
        "status": view.status,
        "error": view.error.model_dump() if view.error else None,
    }


def _presigned(store: ObjectStore, url: str) -> dict[str, str]:
    signed = store.presign(store.key_of(url))
    if signed is None:
        raise ApiError(400, "presign_unsupported", "the results store cannot presign URLs")
    return {"url": signed}


def _in_format(record: dict[str, Any], format: str) -> dict[str, Any]:
    """The record as asked: a succeeded one as a chat completion with ``format=openai``; one
    that did not succeed has no completion, so it is answered as is (``status``, ``error``)."""
    if format == "openai" and record.get("status") == "succeeded":
        return to_chat_completion(record)
    return record


@router.get("/tasks/{task_id}/result", responses=error_responses(400, 401, 404, 409, 422, 429, 503))
def task_result(
    task_id: str,
    presign: bool = Query(False, description="Answer a presigned URL of the stored object"),
    format: Literal["vlmq", "openai"] = Query(
        "vlmq",
        description="vlmq: the stored result record. openai: a succeeded task's result as an "
        "OpenAI chat completion (choices[i].message.content, choices[i].logprobs, usage)",
    ),
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> ChatCompletion | dict[str, Any]:
    """The result once the task is terminal (409 ``not_finished`` before).

    ``format=vlmq`` (the default) answers the stored record: ``output``, ``choices`` (with
    n > 1 or logprobs), ``parsed``, ``usage``, ``error``. ``format=openai`` answers a
    succeeded task as an OpenAI ``chat.completion`` object, the body of an OpenAI Batch output
    line; a failed, cancelled or expired task is answered as with ``format=vlmq``.
    ``presign`` answers a URL of the stored record instead, so it takes no ``format``.
    """
    status = _known_task(ctx, task_id, caller)
    if status.get("state") not in _TERMINAL:
        raise ApiError(409, "not_finished", "the task has not finished yet")
    if presign and format != "vlmq":
        raise ApiError(422, "invalid_request", "format: presign answers the stored vlmq record")
    url = result_location(status)
    store = ctx.client.store
    if not url:
        if presign:
            raise ApiError(404, "not_found", "the task has no stored result object")
        return _record_without_object(task_id, status)
    if presign:
        return _presigned(store, url)
    record = store.get(url)
    if record is None:
        raise ApiError(404, "not_found", "the result object is missing from the store")
    return _in_format(record, format)


@router.post("/tasks/{task_id}/cancel", responses=_READ_ERRORS)
def cancel_task(
    task_id: str, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> CancelReply:
    """Cancel a task that is still queued; a running or finished task is left alone."""
    _known_task(ctx, task_id, caller)
    cancelled = ctx.client.cancel(task_id) > 0
    state = ctx.client.state.tasks.get(task_id).get("state", "unknown")
    return CancelReply(id=task_id, cancelled=cancelled, status=state)
