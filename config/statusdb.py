"""Task and job status in Redis: one hash per task, one per bulk job.

Writes that change state go through one Lua script, so the task's state and
its job's counters change together and only forward. Reads of many tasks are
one pipelined round trip.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from config.status import COUNTED, TERMINAL, Keys, TaskState

__all__ = ["TRANSITIONS", "StatusDB"]

# state -> the states it may move to (a terminal state never moves).
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "": ("queued", "running", "succeeded", "failed", "cancelled", "expired"),
    "queued": ("running", "succeeded", "failed", "cancelled", "expired"),
    "running": ("running", "succeeded", "failed", "cancelled", "expired"),
}

# KEYS[1] task hash; ARGV[1] new state, ARGV[2] job key prefix, ARGV[3] allowed
# from-states ("," separated, "-" = absent), ARGV[4..] field/value pairs.
# Returns the previous state ("" if none) and 1 if the move happened, else 0.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'state') or ''
local allowed = false
for from in string.gmatch(ARGV[3], '([^,]+)') do
  if (from == '-' and current == '') or from == current then allowed = true end
end
if not allowed then return {current, 0} end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
local job = redis.call('HGET', KEYS[1], 'job_id')
if job and job ~= '' and current ~= ARGV[1] then
  local jobkey = ARGV[2] .. job
  if current ~= '' then redis.call('HINCRBY', jobkey, current, -1) end
  redis.call('HINCRBY', jobkey, ARGV[1], 1)
end
return {current, 1}
"""


def _allowed_from(new_state: str) -> str:
    sources = [src for src, targets in TRANSITIONS.items() if new_state in targets]
    return ",".join("-" if s == "" else s for s in sources)


def _decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items()}


class StatusDB:
    """Status reads and writes for tasks and jobs (both producers and workers use it)."""

    def __init__(self, client: redis.Redis, keys: Keys | None = None, ttl_s: int = 7 * 86400):
        self.redis = client
        self.keys = keys or Keys()
        self.ttl_s = ttl_s
        self._transition = client.register_script(_TRANSITION)

    # writes --------------------------------------------------------------
    def queue_task_fields(self, fields: Mapping[str, Any]) -> dict[str, str]:
        now = f"{time.time():.6f}"
        base = {"state": TaskState.QUEUED.value, "created_at": now, "queued_at": now}
        return {**base, **{k: "" if v is None else str(v) for k, v in fields.items()}}

    def add_queued(self, pipe: Any, task_id: str, fields: Mapping[str, Any]) -> None:
        """Record a new queued task inside the caller's pipeline (with the publish)."""
        key = self.keys.task(task_id)
        pipe.hset(key, mapping=self.queue_task_fields(fields))
        pipe.expire(key, self.ttl_s)
        job_id = fields.get("job_id")
        if job_id:
            job = self.keys.job(job_id)
            pipe.hincrby(job, "total", 1)
            pipe.hincrby(job, TaskState.QUEUED.value, 1)
            pipe.expire(job, self.ttl_s)
            pipe.expire(self.keys.job_tasks(job_id), self.ttl_s)

    def transition(
        self,
        task_id: str,
        new_state: TaskState,
        fields: Mapping[str, Any] | None = None,
        client: Any = None,
        only_from: Iterable[TaskState] | None = None,
    ) -> tuple[str, bool]:
        """Move a task forward; returns (previous state, whether it moved).

        ``only_from`` narrows the states it may leave (cancel: queued only).
        Inside a pipeline the reply comes from ``execute()`` instead.
        """
        sources = (
            ",".join(s.value for s in only_from)
            if only_from is not None
            else _allowed_from(new_state.value)
        )
        argv: list[Any] = [new_state.value, f"{self.keys.job('')}", sources]
        for name, value in (fields or {}).items():
            argv += [name, "" if value is None else str(value)]
        reply = self._transition(
            keys=[self.keys.task(task_id)], args=argv, client=client or self.redis
        )
        if client is not None and client is not self.redis:
            return "", False  # pipelined: the reply arrives with execute()
        return _text(reply[0]), bool(reply[1])

    # reads ---------------------------------------------------------------
    def task(self, task_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.task(task_id))
        return _decode(raw) if raw else {"state": TaskState.UNKNOWN.value}

    def tasks(self, task_ids: Sequence[str], fields: Sequence[str] = ()) -> list[dict[str, str]]:
        """Status of many tasks in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            key = self.keys.task(task_id)
            if fields:
                pipe.hmget(key, list(fields))
            else:
                pipe.hgetall(key)
        replies = pipe.execute()
        if fields:
            return [_fields(fields, values) for values in replies]
        return [_decode(r) if r else {"state": TaskState.UNKNOWN.value} for r in replies]

    def states(self, task_ids: Sequence[str]) -> list[TaskState]:
        return [TaskState(t.get("state") or "unknown") for t in self.tasks(task_ids, ("state",))]

    def job(self, job_id: str) -> dict[str, Any]:
        raw = _decode(self.redis.hgetall(self.keys.job(job_id)))
        if not raw:
            return {"state": TaskState.UNKNOWN.value}
        counts = {s.value: int(raw.get(s.value, 0) or 0) for s in COUNTED}
        total = int(raw.get("total", 0) or 0)
        done = sum(counts[s.value] for s in TERMINAL)
        return {
            **raw,
            "total": total,
            "counts": counts,
            "done": done,
            "finished": total > 0 and done >= total,
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(names: Iterable[str], values: Sequence[bytes | None]) -> dict[str, str]:
    out = {n: v.decode() for n, v in zip(names, values, strict=True) if v is not None}
    return out if out else {"state": TaskState.UNKNOWN.value}
