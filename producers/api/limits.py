"""Request rates as the API reads them before taking work: a token bucket per tenant, in
Redis, shared by every API process (``vlmq/broker/state/tenants.py``). Redis's memory headroom is
``vlmq/broker/memory.py``, the bounded-queue check ``vlmq/broker/queues.py``, the queued-work quota
``Tenants.check_quota``."""

from __future__ import annotations

import logging

from redis import RedisError

from vlmq.broker.state.tenants import Tenants
from vlmq.config.errors import LayoutUnreadable
from vlmq.config.settings import Settings

__all__ = ["RateLimiter"]

log = logging.getLogger(__name__)


class RateLimiter:
    """Token buckets in Redis: a tenant's (its quota's rate, else the API's) and, for callers
    without a valid key, one per client address (``unauthenticated_rate_limit_*``)."""

    def __init__(self, settings: Settings, tenants: Tenants) -> None:
        self.settings = settings
        self.tenants = tenants

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
            return self.tenants.take_rate(caller, per_s, burst)
        except (RedisError, LayoutUnreadable) as exc:
            # Without Redis (or on a server older than the task layout in force) no work is
            # taken anyway (the routes answer 503): let it through to that answer rather than
            # refuse with a made-up rate.
            log.warning("rate limit not checked: %s", type(exc).__name__)
            return 0.0
