"""The OpenAI side of a batch in Redis: its request fields, milestones and locks.

The vlmq job (same id) holds the tasks and counters; this hash holds what the
job does not know: the input file, the endpoint and window, metadata, when it
was asked to cancel, and whether its output files are written. Short-lived
lock keys make sure one API process at a time feeds or finalizes a batch.
"""

from __future__ import annotations

import re
import time
import uuid
from contextlib import AbstractContextManager
from typing import Any

from vlmq.config.tenants import Caller, owner_of
from vlmq.producers.client import Client

__all__ = ["BatchRecords", "new_batch_id", "valid_batch_id"]

_BATCH_ID = re.compile(r"^batch_[A-Za-z0-9]{1,64}$")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def valid_batch_id(batch_id: str) -> bool:
    return bool(_BATCH_ID.match(batch_id))


class BatchRecords:
    def __init__(self, client: Client) -> None:
        self.redis = client.redis
        self.leases = client.state.named
        self.keys = client.keys
        self.ttl_s = client.settings.fleet.task_ttl_s
        self.index = client.keys.batches_index()

    def key(self, batch_id: str) -> str:
        return self.keys.batch(batch_id)

    def create(self, batch_id: str, fields: dict[str, str]) -> None:
        """A new batch record, listed for everyone's view and for its tenant's."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key(batch_id), mapping={k: v for k, v in fields.items()})
        pipe.expire(self.key(batch_id), self.ttl_s)
        now = time.time()
        for index in (self.index, self.keys.batches_index(owner_of(fields))):
            pipe.zadd(index, {batch_id: now})
            # Entries older than a record's ttl name records Redis already dropped.
            pipe.zremrangebyscore(index, "-inf", now - self.ttl_s)
        pipe.execute()

    def get(self, batch_id: str, caller: Caller | None = None) -> dict[str, str] | None:
        """The record, or None: no such batch, or (``caller``) another tenant's."""
        if not valid_batch_id(batch_id):
            return None
        raw: dict[str, str] = self.redis.hgetall(self.key(batch_id))  # type: ignore[assignment]
        if not raw or (caller is not None and not caller.may_see(raw)):
            return None
        return raw

    def update(self, batch_id: str, **fields: Any) -> None:
        self.redis.hset(self.key(batch_id), mapping={k: str(v) for k, v in fields.items()})

    def mark_once(self, batch_id: str, field: str) -> None:
        """Record when a milestone was first reached (later calls keep the first time)."""
        self.redis.hsetnx(self.key(batch_id), field, str(int(time.time())))

    def has(self, batch_id: str, field: str) -> bool:
        return bool(self.redis.hexists(self.key(batch_id), field))

    # locks: one holder per (batch, activity), owner-checked, renewed while it works; they
    # lapse if the holder dies.
    def holding(self, batch_id: str, what: str, ttl_s: int) -> AbstractContextManager[bool]:
        """Hold (batch, activity) while the block runs; yields whether it was taken."""
        return self.leases.holding(self.keys.batch_lock(batch_id, what), ttl_s)

    def held(self, batch_id: str, what: str) -> bool:
        return self.leases.held(self.keys.batch_lock(batch_id, what))
