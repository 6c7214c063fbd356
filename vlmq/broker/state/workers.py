"""Workers' heartbeat records (``vlmq healthcheck worker``, ``GET /v1/models``): written by
each worker's heartbeat, the same beat that renews its leases (``intake.py``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Scripts
from vlmq.config.keys import Keys

__all__ = ["WorkerRecords"]


class WorkerRecords:
    """Workers' heartbeat records (``vlmq healthcheck worker``), pruned when silent."""

    def __init__(self, redis: redis_py.Redis, scripts: Scripts, keys: Keys) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys

    def announce(self, name: str, record: Mapping[str, Any], forget_after_s: float) -> int:
        """Write ``name``'s record, and drop those of workers silent for ``forget_after_s``
        (they died without a clean stop); returns how many were dropped."""
        args = [name, json.dumps(record, separators=(",", ":")), forget_after_s]
        return int(self.scripts("announce", self._keys(), args))

    def retire(self, name: str) -> None:
        """A clean stop takes the record away."""
        self.scripts("retire", self._keys(), [name])

    def all(self) -> dict[str, dict[str, Any]]:
        raw: dict[str, str] = self.redis.hgetall(self.keys.workers())  # type: ignore[assignment]
        return {name: json.loads(record) for name, record in raw.items()}

    def _keys(self) -> list[str]:
        return [self.keys.workers(), self.keys.workers_heard()]
