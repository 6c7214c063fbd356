"""Liveness (the process answers) and readiness (Redis and the results store answer)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import ErrorBody

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    checks: dict[str, str]


@router.get("/healthz")
def healthz() -> Health:
    return Health(status="ok")


def _check(name: str, probe: Any) -> str:
    try:
        probe()
    except Exception as exc:  # any failure means not ready; the reason is only logged
        log.warning("readiness: %s unavailable (%s)", name, type(exc).__name__)
        return "unavailable"
    return "ok"


@router.get("/readyz", response_model=Readiness, responses={503: {"model": ErrorBody}})
def readyz(ctx: ApiContext = Depends(context)) -> Any:
    checks = {
        "redis": _check("redis", ctx.client.redis.ping),
        "store": _check("store", lambda: ctx.client.store.ping()),
        # A newer task layout in force than this version reads (vlmq/broker/layouts.py):
        # every call would be refused, so traffic goes to servers that were updated.
        "layout": _check("layout", ctx.client.state.layouts.check),
    }
    if all(v == "ok" for v in checks.values()):
        return Readiness(status="ok", checks=checks)
    down = ", ".join(k for k, v in checks.items() if v != "ok")
    body = {"error": {"code": "not_ready", "message": f"unavailable: {down}"}, "checks": checks}
    return JSONResponse(body, status_code=503)
