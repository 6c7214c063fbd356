"""Rate limiting (a token bucket per caller) and Redis's memory headroom, as the API reads
them before taking work (the bounded-queue check itself is ``queues.py``).

The bucket lives in the API process: with several API processes each allows
``rate_limit_per_s``; a shared limiter belongs in front of them (a proxy).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Any

from redis import Redis

__all__ = ["MemoryGauge", "RateLimiter"]


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


class MemoryGauge:
    """Redis's used share of maxmemory (0 when none is set), cached for ``ttl_s``."""

    def __init__(self, ttl_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self._read_at = float("-inf")
        self._share = 0.0
        self._lock = threading.Lock()

    def share(self, redis: Redis) -> float:
        with self._lock:
            if time.monotonic() - self._read_at < self.ttl_s:
                return self._share
        info: dict[str, Any] = redis.info("memory")
        limit = int(info.get("maxmemory") or 0)
        share = int(info.get("used_memory") or 0) / limit if limit else 0.0
        with self._lock:
            self._share, self._read_at = share, time.monotonic()
        return share
