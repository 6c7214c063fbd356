"""Rate limiting (a token bucket per caller) and the bounded-queue check.

The bucket lives in the API process: with several API processes each allows
``rate_limit_per_s``; a shared limiter belongs in front of them (a proxy).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import redis

from config.status import Keys
from config.wire import priority_lists
from producers.client import LANES

__all__ = ["RateLimiter", "queue_depth", "queue_lists"]


class RateLimiter:
    """One token bucket per caller: ``burst`` tokens, refilled at ``per_s``."""

    def __init__(self, per_s: float, burst: int, max_callers: int = 100_000) -> None:
        self.per_s = per_s
        self.burst = max(1, burst)
        # caller -> (tokens, last refill); oldest callers are forgotten first,
        # so a flood of client addresses cannot grow this without bound.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._max_callers = max_callers
        self._lock = threading.Lock()

    def take(self, caller: str, now: float | None = None) -> float:
        """Spend one token; returns 0 when allowed, else seconds until one is free."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.pop(caller, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.per_s)
            wait = 0.0
            if tokens >= 1:
                tokens -= 1
            elif self.per_s > 0:
                wait = (1 - tokens) / self.per_s
            else:
                wait = math.inf
            self._buckets[caller] = (tokens, now)
            while len(self._buckets) > self._max_callers:
                self._buckets.popitem(last=False)
            return wait


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
