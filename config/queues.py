"""Where a modality class's waiting messages are, and how many there are.

Shared by the API (to refuse work when a class is full) and the workers (the
``vlmq_queue_depth`` metric), so both count the same lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from config.status import LANES, Keys
from config.wire import priority_lists

__all__ = ["queue_depth", "queue_lists"]


def queue_lists(client: redis.Redis, keys: Keys, modality: str) -> list[str]:
    """Every Redis list holding a class's waiting messages: both lanes and each
    bulk job's own list, at every priority step."""
    queues = [keys.queue(modality, lane) for lane in LANES]
    members: set[Any] = client.smembers(keys.active_jobs(modality))
    queues += sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
    return [name for queue in queues for name in priority_lists(queue)]


def queue_depth(client: redis.Redis, keys: Keys, modalities: Iterable[str]) -> dict[str, int]:
    """Messages waiting per class (the lists, then their lengths pipelined)."""
    names = {m: queue_lists(client, keys, m) for m in modalities}
    pipe = client.pipeline(transaction=False)
    for lists in names.values():
        for name in lists:
            pipe.llen(name)
    lengths = iter(pipe.execute())
    return {m: sum(int(next(lengths)) for _ in lists) for m, lists in names.items()}
