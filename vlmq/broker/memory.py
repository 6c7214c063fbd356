"""Redis's memory headroom: the used share of ``maxmemory``, read at most once per ``ttl_s``.

The API refuses new work past ``api.max_memory_share`` and feeders stop adding past
``fleet.feed_max_memory_share``: under ``noeviction`` a full Redis refuses writes, so queued
work must never crowd out the fleet's own bookkeeping (settles, leases).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from redis import Redis

__all__ = ["MemoryGauge"]


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
