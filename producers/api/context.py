"""What every route needs, built once by ``create_app``: the one way a handler gets its
collaborators is ``ctx: ApiContext = Depends(context)``."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from vlmq.broker.memory import MemoryGauge
from vlmq.config.settings import Settings
from vlmq.producers.api.limits import RateLimiter
from vlmq.producers.api.metrics import Metrics
from vlmq.producers.api.openai.batches import BatchService
from vlmq.producers.api.openai.files import FileRegistry
from vlmq.producers.api.waiter import TaskWaiter
from vlmq.producers.client import Client

__all__ = ["ApiContext", "context"]


@dataclass
class ApiContext:
    settings: Settings
    client: Client
    limiter: RateLimiter
    files: FileRegistry
    batches: BatchService
    # Chat completions wait for their tasks on one subscription per process (waiter.py).
    waiter: TaskWaiter
    metrics: Metrics = field(default_factory=Metrics)
    memory: MemoryGauge = field(default_factory=MemoryGauge)


def context(request: Request) -> ApiContext:
    """FastAPI dependency: the app's context."""
    ctx: ApiContext = request.app.state.ctx
    return ctx
