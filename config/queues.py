"""Where a modality class's waiting messages are, and how many there are.

Shared by the API (to refuse work when a class is full) and the workers (the
``vlmq_queue_depth`` metric), so both count the same lists.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis

from vlmq.config.keys import LANES, Keys
from vlmq.config.wire import priority_lists

__all__ = ["queue_depth", "queue_lists"]


def queue_lists(redis: Redis, keys: Keys, modality: str) -> list[str]:
    """Every Redis list holding a class's waiting messages: both lanes and each
    bulk job's own list, at every priority step."""
    queues = [keys.queue(modality, lane) for lane in LANES]
    members: set[str] = redis.smembers(keys.active_jobs(modality))  # type: ignore[assignment]
    queues += sorted(members)
    return [name for queue in queues for name in priority_lists(queue)]


def queue_depth(redis: Redis, keys: Keys, modalities: Iterable[str]) -> dict[str, int]:
    """Messages waiting per class (the lists, then their lengths pipelined)."""
    names = {m: queue_lists(redis, keys, m) for m in modalities}
    pipe = redis.pipeline(transaction=False)
    for lists in names.values():
        for name in lists:
            pipe.llen(name)
    lengths = iter(pipe.execute())
    return {m: sum(int(next(lengths)) for _ in lists) for m, lists in names.items()}
