"""The bounded queue: refuse new work once a class's queues are full.

Without this a producer faster than the fleet grows Redis until it runs out
of memory; a 429 with Retry-After pushes the backlog back to the caller.
"""

from __future__ import annotations

from collections.abc import Mapping

from vlmq.config.queues import queue_depth
from vlmq.producers.api.context import ApiContext
from vlmq.producers.api.errors import ApiError

__all__ = ["RETRY_FULL_S", "check_capacity"]

# How long a refused caller should wait: long enough for a batch or two to drain.
RETRY_FULL_S = 5


def check_capacity(ctx: ApiContext, wanted: Mapping[str, int]) -> None:
    """Raise 429 ``queue_full`` unless every class can take its new tasks."""
    limit = ctx.settings.api.max_queue_depth
    depths = queue_depth(ctx.client.redis, ctx.client.keys, wanted)
    for modality, extra in wanted.items():
        if depths[modality] + extra > limit:
            raise ApiError(
                429,
                "queue_full",
                f"the {modality} queue is full; retry later",
                {"Retry-After": str(RETRY_FULL_S)},
            )
