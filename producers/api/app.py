"""The HTTP API application: ``create_app(settings)`` builds it, ``vlmq serve`` runs it.

Producer side only: it imports nothing from ``workers`` and never torch.
Request flow: metrics → gate (Host, API key → tenant, rate limit, body cap) → routes, each
answering errors as ``{"error": {"code", "message", "type", "param"}}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vlmq import __version__
from vlmq.config.settings import Settings
from vlmq.producers.api import health, jobs, tasks, usage
from vlmq.producers.api.auth import KeyBook, bearer_scheme
from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import install_error_handlers
from vlmq.producers.api.gate import Gate
from vlmq.producers.api.limits import RateLimiter
from vlmq.producers.api.metrics import MetricsMiddleware
from vlmq.producers.api.openai import chat, files_batches, fleet_models
from vlmq.producers.api.openai.batches import BatchService
from vlmq.producers.api.openai.files import FileRegistry
from vlmq.producers.api.waiter import TaskWaiter
from vlmq.producers.client import Client

__all__ = ["create_app"]


def create_app(settings: Settings, client: Client | None = None) -> FastAPI:
    """The API for ``settings``; raises ConfigError for keys it refuses (too short, a bad
    tenant name, one key for two tenants)."""
    keys = KeyBook(settings.api)
    # A server acts for remote callers: it never reads media paths from its own disk.
    client = client or Client(settings, local_media=False)
    files = FileRegistry(client)
    ctx = ApiContext(
        settings=settings,
        client=client,
        limiter=RateLimiter(settings, client.state.tenants),
        files=files,
        batches=BatchService(client, files),
        waiter=TaskWaiter(settings),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await ctx.waiter.close()
        ctx.batches.work.shutdown()

    app = FastAPI(
        title="vlmq",
        version=__version__,
        summary="Batched vision-language-model inference on a vlmq worker fleet",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    secured = [Depends(bearer_scheme)]
    routers = (tasks.router, jobs.router, files_batches.router, usage.router)
    for router in (*routers, chat.router, fleet_models.router):
        app.include_router(router, dependencies=secured)
    app.include_router(health.router)
    # Operational, not part of the API contract (Prometheus text format).
    app.add_api_route(
        "/metrics", _metrics, methods=["GET"], dependencies=secured, include_in_schema=False
    )
    # Added last = outermost: metrics see every answer, the gate's refusals too.
    app.add_middleware(
        Gate,
        settings=settings.api,
        keys=keys,
        limiter=ctx.limiter,
        max_message_bytes=settings.fleet.max_message_bytes,
    )
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    return app


def _metrics(
    ctx: ApiContext = Depends(context),
    format: str = Query("prometheus", pattern="^(prometheus|json)$"),
) -> Response:
    """Request counts and latencies per route (Prometheus text, or JSON)."""
    if format == "json":
        return JSONResponse({"routes": ctx.metrics.snapshot()})
    return Response(ctx.metrics.prometheus(), media_type=CONTENT_TYPE_LATEST)
