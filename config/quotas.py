"""A tenant's queued work against its quota, checked before a submission enqueues anything.

The counts are kept by the scripts that move tasks (scripts.lua, "quotas"): a tenant's
``Keys.quota`` hash holds its queued tasks (fed or not yet fed) and their estimated tokens.
The check reads them once and refuses the whole submission when it would pass a limit; two
submitters checking at the same moment may both pass (the quota is a bound on what waits,
not a reservation), so a tenant can overshoot by at most one submission each.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis

from vlmq.config.errors import QuotaExceeded
from vlmq.config.keys import Keys
from vlmq.config.settings import TenantQuota

__all__ = ["QueuedWork", "check_quota", "queued_work"]

# A refused submitter is told to come back after this long (the fleet drains meanwhile).
RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class QueuedWork:
    tasks: int = 0
    tokens: int = 0


def queued_work(redis: Redis, keys: Keys, tenant: str) -> QueuedWork:
    raw: list[str | None] = redis.hmget(keys.quota(tenant), ["tasks", "tokens"])  # type: ignore[assignment]
    return QueuedWork(*(max(0, int(value or 0)) for value in raw))


def check_quota(
    redis: Redis, keys: Keys, tenant: str, quota: TenantQuota, tasks: int, tokens: int = 0
) -> None:
    """Raises QuotaExceeded when ``tasks`` more (``tokens`` their estimate) would pass it."""
    if quota.max_queued_tasks is None and quota.max_queued_tokens is None:
        return
    if tasks == 0:
        # "May this tenant submit at all?" (before a file is read): a tenant already at its
        # quota may not, since any line it has would pass it.
        tasks, tokens = 1, max(tokens, 1)
    queued = queued_work(redis, keys, tenant)
    limit = quota.max_queued_tasks
    if limit is not None and queued.tasks + tasks > limit:
        raise QuotaExceeded(
            f"tenant {tenant!r}: {queued.tasks:,} tasks queued, {tasks:,} more would pass its "
            f"quota of {limit:,} (max_queued_tasks)",
            RETRY_AFTER_S,
        )
    limit = quota.max_queued_tokens
    if limit is not None and queued.tokens + tokens > limit:
        raise QuotaExceeded(
            f"tenant {tenant!r}: about {queued.tokens:,} tokens queued, {tokens:,} more would "
            f"pass its quota of {limit:,} (max_queued_tokens)",
            RETRY_AFTER_S,
        )
