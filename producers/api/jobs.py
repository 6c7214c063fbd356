"""Jobs: progress and cancellation of a group of tasks (``POST /v1/tasks:batch``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from vlmq.config.ids import valid_id
from vlmq.config.tenants import Caller
from vlmq.producers.api.auth import caller_of
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import ApiError, error_responses
from vlmq.producers.export import job_summary

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["jobs"])

_ERRORS = error_responses(401, 404, 429, 503)


class JobCancelled(BaseModel):
    job_id: str
    cancelled: int


def _known_job(ctx: ApiContext, job_id: str, caller: Caller) -> dict[str, Any]:
    """The job's summary; 404 for an id that is not one (``J:custom_ids`` never forms a key)
    or another tenant's job."""
    if not valid_id(job_id):
        raise ApiError(404, "not_found", "no such job")
    summary = job_summary(ctx.client, job_id)
    if summary.get("state") == "unknown" or not caller.may_see(summary):
        raise ApiError(404, "not_found", "no such job")
    return summary


@router.get("/jobs/{job_id}", responses=_ERRORS)
def get_job(
    job_id: str, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> dict[str, Any]:
    """State, counts per task state, invalid lines, rate and ETA of a job."""
    return _known_job(ctx, job_id, caller)


@router.post("/jobs/{job_id}/cancel", responses=_ERRORS)
def cancel(
    job_id: str, ctx: ApiContext = Depends(context), caller: Caller = Depends(caller_of)
) -> JobCancelled:
    """Cancel every task of the job that is still queued; returns how many."""
    _known_job(ctx, job_id, caller)
    return JobCancelled(job_id=job_id, cancelled=ctx.client.cancel(job_id))
