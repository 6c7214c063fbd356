"""What every route needs, built once by ``create_app`` and found on app.state."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from vlmq.broker.memory import MemoryGauge
from vlmq.config.settings import Settings
from vlmq.producers.api.limits import RateLimiter
from vlmq.producers.api.metrics import Metrics
from vlmq.producers.client import Client

__all__ = ["ApiContext", "context"]


@dataclass
class ApiContext:
    settings: Settings
    client: Client
    limiter: RateLimiter
    metrics: Metrics = field(default_factory=Metrics)
    memory: MemoryGauge = field(default_factory=MemoryGauge)


def context(request: Request) -> ApiContext:
    """FastAPI dependency: the app's context."""
    ctx: ApiContext = request.app.state.ctx
    return ctx
