"""Feeds: a bulk submission's staged input, entering its job a window at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Call, Scripts
from vlmq.broker.state.jobs import Jobs, Queued, class_pairs, status_layout
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState
from vlmq.config.tenants import DEFAULT_TENANT

__all__ = ["Feeds"]


class Feeds:
    """A bulk submission's staged input entering Redis a window at a time (vlmq/broker/feeding.py
    drives it; each chunk is one ``feed`` script, applied once)."""

    def __init__(self, redis: redis_py.Redis, scripts: Scripts, keys: Keys, jobs: Jobs) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.jobs = jobs

    @property
    def ttl_s(self) -> int:
        return self.jobs.ttl_s

    def register(
        self,
        job_id: str,
        feed_id: str,
        input_key: str,
        lines: int,
        lane: str,
        size: int,
        lease_s: float,
        tokens: int = 0,
        read: tuple[int, int] = (0, 0),
    ) -> None:
        """Count a staged input's ``lines`` (``tokens`` their estimate, 0 when not estimated)
        in its job and its tenant's quota and make it a feed, leased to the caller for
        ``lease_s`` (``release`` offers it to the fleet's feeders). The feed is the whole
        submission: the job is sealed in the same step, with the ``read`` (lines, invalid
        lines) of the submission."""
        keys = [self.keys.job(job_id), self.keys.feed(feed_id), self.keys.feeds()]
        args = [job_id, feed_id, input_key, lines, lane, self.ttl_s, size, lease_s, tokens]
        self.scripts("register_feed", keys, [*args, *read])

    def take(self, lease_s: float, limit: int = 16) -> list[str]:
        return [str(f) for f in self.scripts("take_feeds", [self.keys.feeds()], [lease_s, limit])]

    def release(self, feed_id: str) -> None:
        self.scripts("release_feed", [self.keys.feeds()], [feed_id])

    def state(self, feed_id: str) -> dict[str, str]:
        raw: dict[str, str] = self.redis.hgetall(self.keys.feed(feed_id))  # type: ignore[assignment]
        return raw

    def of_job(self, job_id: str) -> list[str]:
        fields: list[str] = self.redis.hkeys(self.keys.job(job_id))  # type: ignore[assignment]
        return [f.removeprefix("feed:") for f in fields if f.startswith("feed:")]

    def drop(self, job_id: str, feed_id: str, state: TaskState, call: Call | None = None) -> int:
        """The rest of a feed will not run (``state``: cancelled, expired or failed)."""
        keys = [self.keys.job(job_id), self.keys.feed(feed_id), self.keys.feeds()]
        keys.append(self.keys.events())
        return int(self.scripts("drop_feed", keys, [job_id, feed_id, state.value], call=call))

    def feed(
        self,
        job_id: str,
        feed_id: str,
        cursor: tuple[str, str],
        consumed: int,
        lines: Sequence[Queued],
        lane: str = "bulk",
    ) -> tuple[str, list[str]]:
        """Feed one chunk (``feed`` in lua/jobs.lua): applied only if the feed's cursor is
        still ``cursor[0]``, which becomes ``cursor[1]``. Returns the outcome ('fed', 'stale',
        'cancelled', 'expired') and per line 'q' (enqueued), 's' (skipped) or 'd' (dup)."""
        submission = feed_id.partition(".")[2]
        keys = [
            self.keys.job(job_id),
            self.keys.job_custom_ids(job_id),
            self.keys.feed(feed_id),
            self.keys.feeds(),
            self.keys.job_depth(),
            self.keys.events(),
        ]
        tenant = self.jobs.tenant(job_id) if lane == "bulk" else DEFAULT_TENANT
        pairs = class_pairs(self.keys, keys, job_id, lines, lane, tenant)
        args: list[Any] = [job_id, self.ttl_s, submission, feed_id, self.keys.task_prefix]
        args += [*cursor, consumed, len(pairs), "1" if lane == "bulk" else "0"]
        header, values = status_layout(lines)
        args += [self.keys.job_ref_prefix, *header]
        for line, own in zip(lines, values, strict=True):
            keys.append(self.keys.task(line.task_id))
            claim = str(line.fields.get("claim") or "")
            args += [claim, pairs[line.modality], *own, line.message]
        outcome, codes = self.scripts("feed", keys, args)
        return str(outcome), [str(c) for c in codes]
