"""Request rates (a token bucket per tenant, in Redis, shared by every API process) and
Redis's memory headroom, as the API reads them before taking work (the bounded-queue check
itself is ``queues.py``, the queued-work quota ``config/quotas.py``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis import Redis, RedisError

from vlmq.config.keys import Keys
from vlmq.config.scripts import Scripts
from vlmq.config.settings import Settings

__all__ = ["MemoryGauge", "RateLimiter"]

log = logging.getLogger(__name__)


class RateLimiter:
    """Token buckets in Redis: a tenant's (its quota's rate, else the API's) and, for callers
    without a valid key, one per client address (``unauthenticated_rate_limit_*``)."""

    def __init__(self, settings: Settings, redis: Redis, keys: Keys) -> None:
        self.settings = settings
        self.keys = keys
        self.scripts = Scripts(redis)

    def take_tenant(self, tenant: str) -> float:
        """Spend one of the tenant's tokens; 0 when allowed, else seconds until one is free."""
        api, quota = self.settings.api, self.settings.tenants.quota(tenant)
        per_s = (
            quota.rate_limit_per_s if quota.rate_limit_per_s is not None else api.rate_limit_per_s
        )
        burst = quota.rate_limit_burst or api.rate_limit_burst
        return self._take(f"t:{tenant}", per_s, burst)

    def take_address(self, address: str) -> float:
        api = self.settings.api
        return self._take(
            f"a:{address}",
            api.unauthenticated_rate_limit_per_s,
            api.unauthenticated_rate_limit_burst,
        )

    def _take(self, caller: str, per_s: float, burst: int) -> float:
        try:
            reply = self.scripts("rate", [self.keys.rate_bucket(caller)], [per_s, burst])
        except RedisError as exc:
            # Without Redis no work is taken anyway (the routes answer 503): let it through
            # to that answer rather than refuse with a made-up rate.
            log.warning("rate limit not checked: Redis %s", type(exc).__name__)
            return 0.0
        return float(reply)


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
