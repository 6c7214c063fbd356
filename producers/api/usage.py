"""Usage: what a tenant's (or one job's) tasks used, as the fleet counted it when each settled.

A caller sees its own tenant's usage and its own jobs'; an admin sees every tenant's (or the
ones it names). Another tenant's job is not found (404), as everywhere.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from vlmq.broker.state.usage import usage_report
from vlmq.config.ids import valid_id
from vlmq.config.tenants import Caller
from vlmq.producers.api.auth import caller_of
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import ApiError, error_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["usage"])


@router.get("/usage", responses=error_responses(401, 404, 429, 503))
def get_usage(
    job_id: str | None = Query(None, description="One job's usage instead of the tenant's"),
    tenant: list[str] | None = Query(None, description="Admins: these tenants (default: all)"),
    ctx: ApiContext = Depends(context),
    caller: Caller = Depends(caller_of),
) -> dict[str, Any]:
    """Prompt tokens (visual included), completion tokens, requests, model seconds, GPU
    seconds and cost (``cost`` to the cent, ``cost_ucents`` exact, in ``currency``), by model
    and modality and per model: ``{"tenants": [{"tenant", "totals", "by", "models"}],
    "models"}``, or with ``job_id`` ``{"job_id", "totals", "by", "models"}``."""
    client = ctx.client
    currency = client.settings.cost.currency
    if job_id is not None:
        if not valid_id(job_id) or not client.state.jobs.exists(job_id):
            raise ApiError(404, "not_found", "no such job")
        if not caller.admin and client.state.jobs.tenant(job_id) != caller.tenant:
            raise ApiError(404, "not_found", "no such job")
        return usage_report(client.redis, client.keys, job_id=job_id, currency=currency)
    if caller.admin:
        return usage_report(client.redis, client.keys, tenant or None, currency=currency)
    if tenant and set(tenant) != {caller.tenant}:
        raise ApiError(404, "not_found", "no such tenant")
    return usage_report(client.redis, client.keys, [caller.tenant], currency=currency)
