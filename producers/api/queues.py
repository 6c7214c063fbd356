"""The bounded queue: refuse new work once a class's queues are full, or Redis nearly is.

Without this a producer faster than the fleet grows Redis until it runs out
of memory; a 429 with Retry-After pushes the backlog back to the caller. Depth alone
is not enough (a few large messages, or other data, fill Redis too), so the share of
``maxmemory`` in use is checked as well, from ``INFO memory`` read at most once a second.
"""

from __future__ import annotations

from collections.abc import Mapping

from vlmq.broker.queues import queue_depth
from vlmq.producers.api.context import ApiContext
from vlmq.producers.api.errors import ApiError

__all__ = ["RETRY_FULL_S", "check_capacity"]

# How long a refused caller should wait: long enough for a batch or two to drain.
RETRY_FULL_S = 5


def check_capacity(ctx: ApiContext, wanted: Mapping[str, int]) -> None:
    """Raise 429 ``queue_full`` unless every class can take its new tasks, and 429
    ``broker_full`` while Redis is past its share of maxmemory."""
    share = ctx.memory.share(ctx.client.redis)
    if share >= ctx.settings.api.max_memory_share:
        raise ApiError(
            429,
            "broker_full",
            f"the queue's Redis is {share:.0%} full; retry later",
            {"Retry-After": str(RETRY_FULL_S)},
        )
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
