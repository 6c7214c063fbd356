"""Tenants: a tenant's queued work against its quota, and request rates (token buckets).

The quota counts are kept by the scripts that move tasks (``lua/tenants.lua``): a tenant's
``Keys.quota`` hash holds its queued tasks (fed or not yet fed) and their estimated tokens.
The check reads them once and refuses the whole submission when it would pass a limit; two
submitters checking at the same moment may both pass (the quota is a bound on what waits,
not a reservation), so a tenant can overshoot by at most one submission each. A rate bucket
is one script call per request, shared by every API process; a retried call spends nothing
more. What tenants used is ``state/usage.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis as redis_py

from vlmq.broker.scripts import Scripts
from vlmq.config.errors import QuotaExceeded
from vlmq.config.keys import Keys
from vlmq.config.settings import TenantQuota

__all__ = ["RETRY_AFTER_S", "QueuedWork", "Tenants"]

# A refused submitter is told to come back after this long (the fleet drains meanwhile).
RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class QueuedWork:
    tasks: int = 0
    tokens: int = 0


class Tenants:
    def __init__(self, redis: redis_py.Redis, scripts: Scripts, keys: Keys) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys

    def queued(self, tenant: str) -> QueuedWork:
        """A tenant's queued work (tasks, estimated tokens); missing counts read as 0."""
        raw: list[str | None] = self.redis.hmget(self.keys.quota(tenant), ["tasks", "tokens"])  # type: ignore[assignment]
        return QueuedWork(*(max(0, int(value or 0)) for value in raw))

    def check_quota(self, tenant: str, quota: TenantQuota, tasks: int, tokens: int = 0) -> None:
        """Raises QuotaExceeded when ``tasks`` more (``tokens`` their estimate) would pass
        ``quota``."""
        if quota.max_queued_tasks is None and quota.max_queued_tokens is None:
            return
        if tasks == 0:
            # "May this tenant submit at all?" (before a file is read): a tenant already at its
            # quota may not, since any line it has would pass it.
            tasks, tokens = 1, max(tokens, 1)
        queued = self.queued(tenant)
        limit = quota.max_queued_tasks
        if limit is not None and queued.tasks + tasks > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r}: {queued.tasks:,} tasks queued, {tasks:,} more would pass "
                f"its quota of {limit:,} (max_queued_tasks)",
                RETRY_AFTER_S,
            )
        limit = quota.max_queued_tokens
        if limit is not None and queued.tokens + tokens > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r}: about {queued.tokens:,} tokens queued, {tokens:,} more "
                f"would pass its quota of {limit:,} (max_queued_tokens)",
                RETRY_AFTER_S,
            )

    def take_rate(self, caller: str, per_s: float, burst: int) -> float:
        """Spend one token of ``caller``'s bucket: 0 when allowed, else the seconds until one
        is free."""
        return float(self.scripts("rate", [self.keys.rate_bucket(caller)], [per_s, burst]))
