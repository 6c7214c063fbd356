"""What every route needs, built once by ``create_app`` and found on app.state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from config.settings import Settings
from producers.api.limits import RateLimiter
from producers.api.metrics import Metrics
from producers.client import Client

__all__ = ["ApiContext", "context"]


@dataclass
class ApiContext:
    settings: Settings
    client: Client
    limiter: RateLimiter
    metrics: Metrics = field(default_factory=lambda: Metrics())
    # Background work that must not hold a request open: feeding an uploaded
    # file into a job, writing a finished batch's output files.
    background: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="vlmq-api")
    )


def context(request: Request) -> ApiContext:
    """FastAPI dependency: the app's context."""
    ctx: ApiContext = request.app.state.ctx
    return ctx
