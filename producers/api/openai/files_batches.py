"""OpenAI-compatible files and batches: the official client works unchanged
with ``base_url="http://host:port/v1"``.

Routes stay thin: parse, call the registry or the batch service, answer the
OpenAI object. Input files must have purpose ``batch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse

from vlmq.config.schemas import Modality
from vlmq.config.tenants import Caller
from vlmq.producers.api.auth import caller_of
from vlmq.producers.api.bodies import BodyRoute
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import ApiError, error_responses
from vlmq.producers.api.openai.files import FileTooLarge
from vlmq.producers.api.openai.objects import (
    BatchCreate,
    BatchList,
    BatchObject,
    FileList,
    FileObject,
)
from vlmq.producers.api.openai.partial_output import partial_file_object, snapshot_lines
from vlmq.producers.api.queues import check_capacity
from vlmq.stores.base import READ_CHUNK

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], route_class=BodyRoute)

_READ_ERRORS = error_responses(401, 404, 422, 429, 503)
_WRITE_ERRORS = error_responses(401, 404, 413, 422, 429, 503)
_BINARY: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    }
}


# files -------------------------------------------------------------------------
@router.post("/files", responses=_WRITE_ERRORS)
def upload_file(
    file: UploadFile = File(...),
    purpose: Literal["batch"] = Form(...),
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> FileObject:
    """Upload a JSONL file of requests (purpose ``batch``).

    Streamed to the store a chunk at a time (Starlette has spooled the upload
    to a temporary file), so a file of any allowed size costs the same memory.
    """
    filename = (file.filename or "input.jsonl")[:255]
    try:
        return ctx.files.create_stream(
            _chunks(file.file),
            filename,
            purpose,
            max_bytes=ctx.settings.api.max_file_bytes,
            tenant=caller.tenant,
        )
    except FileTooLarge:
        # The gate caps the whole body; this holds for the file itself wherever it came from.
        raise ApiError(413, "body_too_large", "the file is too large") from None


def _chunks(source: IO[bytes]) -> Iterator[bytes]:
    while chunk := source.read(READ_CHUNK):
        yield chunk


@router.get("/files", responses=_READ_ERRORS)
def list_files(
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, max_length=200),
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> FileList:
    data, more = ctx.files.list(limit, after, caller)
    return _file_page(data, more)


def _file_page(data: list[FileObject], more: bool) -> FileList:
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return FileList(data=data, first_id=first, last_id=last, has_more=more)


@router.get("/files/{file_id}", responses=_READ_ERRORS)
def get_file(
    file_id: str,
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> FileObject:
    if (batch_id := ctx.batches.partial_batch(file_id, caller)) is not None:
        return partial_file_object(batch_id)
    ctx.batches.ensure_output(file_id, caller)
    found = ctx.files.get(file_id, caller)
    if found is None:
        raise ApiError(404, "not_found", "no such file")
    return found


@router.get(
    "/files/{file_id}/content",
    response_class=Response,
    responses={**_BINARY, **error_responses(401, 404, 409, 429, 503)},
)
def file_content(
    file_id: str,
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> Response:
    """The uploaded input, a finished batch's output or error file, or a batch's lines
    finished so far (its ``vlmq_partial_output_file_id``), streamed."""
    if (batch_id := ctx.batches.partial_batch(file_id, caller)) is not None:
        # A snapshot read as it is sent: its length is not known up front.
        lines = snapshot_lines(ctx.client, batch_id)
        return StreamingResponse(lines, media_type="application/octet-stream")
    ctx.batches.ensure_output(file_id, caller)
    if ctx.files.get(file_id, caller) is None:
        raise ApiError(404, "not_found", "no such file")
    size = ctx.files.size(file_id)
    if size is None:
        raise ApiError(404, "not_found", "the file's content is missing from the store")
    # The length up front: a download cut short by a store failure is seen as incomplete.
    return StreamingResponse(
        ctx.files.read(file_id),
        media_type="application/octet-stream",
        headers={"Content-Length": str(size)},
    )


# batches -----------------------------------------------------------------------
@router.post("/batches", responses=_WRITE_ERRORS)
def create_batch(
    body: BatchCreate,
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> BatchObject:
    """Start a batch over an uploaded file; answers at once, the file is fed in behind.

    Refused with 429 ``queue_full`` while any class's queues are full: the
    file's classes are unknown until it is read.
    """
    check_capacity(ctx, {m.value: 1 for m in Modality})
    return ctx.batches.create(body, caller)


@router.get("/batches", responses=_READ_ERRORS)
def list_batches(
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, max_length=200),
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> BatchList:
    data, more = ctx.batches.list(limit, after, caller)
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return BatchList(data=data, first_id=first, last_id=last, has_more=more)


@router.get("/batches/{batch_id}", responses=_READ_ERRORS)
def get_batch(
    batch_id: str,
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> BatchObject:
    return ctx.batches.get(batch_id, caller)


@router.post("/batches/{batch_id}/cancel", responses=_READ_ERRORS)
def cancel_batch(
    batch_id: str,
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> BatchObject:
    return ctx.batches.cancel(batch_id, caller)
