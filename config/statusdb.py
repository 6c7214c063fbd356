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

# Shared Lua: a sealed job (submission complete) whose every task is terminal
# is finished once: finished_at is set and an event queued for its webhook.
_FINISH_CHECK = """
local function finish_check(jobkey, job, now, events)
  local f = redis.call('HMGET', jobkey, 'sealed', 'total', 'succeeded', 'failed',
                       'cancelled', 'expired', 'finished_at')
  if f[1] ~= '1' or f[7] then return end
  local done = (tonumber(f[3]) or 0) + (tonumber(f[4]) or 0)
             + (tonumber(f[5]) or 0) + (tonumber(f[6]) or 0)
  if done >= (tonumber(f[2]) or 0) then
    redis.call('HSET', jobkey, 'finished_at', now)
    redis.call('LPUSH', events, job)
  end
end
"""

# One task's move: allowed from-states ("," separated, "-" = absent); job
# counters and the job's finish check in the same step. Returns {previous, 1|0}.
_MOVE = """
local function move(key, new, jobprefix, allowed_from, now, events, fields)
  local current = redis.call('HGET', key, 'state') or ''
  local allowed = false
  for from in string.gmatch(allowed_from, '([^,]+)') do
    if (from == '-' and current == '') or from == current then allowed = true end
  end
  if not allowed then return {current, 0} end
  if #fields > 0 then redis.call('HSET', key, unpack(fields)) end
  redis.call('HSET', key, 'state', new)
  local job = redis.call('HGET', key, 'job_id')
  if job and job ~= '' and current ~= new
     and redis.call('HGET', key, 'superseded') ~= '1' then
    local jobkey = jobprefix .. job
    if current ~= '' then redis.call('HINCRBY', jobkey, current, -1) end
    redis.call('HINCRBY', jobkey, new, 1)
    finish_check(jobkey, job, now, events)
  end
  return {current, 1}
end
"""

# KEYS[1] task hash; ARGV[1] new state, ARGV[2] job key prefix, ARGV[3] allowed
# from-states, ARGV[4] now, ARGV[5] events list, ARGV[6..] field/value pairs.
_TRANSITION = (
    _FINISH_CHECK
    + _MOVE
    + """
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
return move(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], fields)
"""
)

# Many tasks in one call (a batch's start or finish). KEYS: task hashes.
# ARGV[1] job key prefix, ARGV[2] now, ARGV[3] events list, then per task:
# new state, allowed from-states, number of field/value pairs, the pairs.
_TRANSITION_MANY = (
    _FINISH_CHECK
    + _MOVE
    + """
local replies = {}
local at = 4
for i = 1, #KEYS do
  local new, allowed, n = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local fields = {}
  for j = 1, 2 * n do fields[j] = ARGV[at + 2 + j] end
  at = at + 3 + 2 * n
  replies[i] = move(KEYS[i], new, ARGV[1], allowed, ARGV[2], ARGV[3], fields)
end
return replies
"""
)


# KEYS[1] job hash; ARGV[1] job id, ARGV[2] now, ARGV[3] events list, ARGV[4] lines.
_SEAL = (
    _FINISH_CHECK
    + """
redis.call('HSET', KEYS[1], 'sealed', '1', 'lines', ARGV[4])
finish_check(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return 1
"""
)


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
        self._transition_many = client.register_script(_TRANSITION_MANY)
        self._seal = client.register_script(_SEAL)

    # writes --------------------------------------------------------------
    def queue_task_fields(self, fields: Mapping[str, Any]) -> dict[str, str]:
        now = f"{time.time():.6f}"
        base = {"state": TaskState.QUEUED.value, "created_at": now, "queued_at": now}
        return {**base, **{k: "" if v is None else str(v) for k, v in fields.items()}}

    def add_queued(
        self, pipe: Any, task_id: str, fields: Mapping[str, Any], count_job: bool = True
    ) -> None:
        """Record a new queued task inside the caller's pipeline (with the publish)."""
        key = self.keys.task(task_id)
        pipe.hset(key, mapping=self.queue_task_fields(fields))
        pipe.expire(key, self.ttl_s)
        job_id = fields.get("job_id")
        if job_id and count_job:
            self.count_queued(pipe, str(job_id), 1)

    def count_queued(self, pipe: Any, job_id: str, count: int) -> None:
        """Add ``count`` new queued tasks to a job's counters."""
        job = self.keys.job(job_id)
        pipe.hincrby(job, "total", count)
        pipe.hincrby(job, TaskState.QUEUED.value, count)
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
        argv: list[Any] = [
            new_state.value,
            self.keys.job(""),
            sources,
            f"{time.time():.6f}",
            self.keys.events(),
        ]
        for name, value in (fields or {}).items():
            argv += [name, "" if value is None else str(value)]
        reply = self._transition(
            keys=[self.keys.task(task_id)], args=argv, client=client or self.redis
        )
        if client is not None and client is not self.redis:
            return "", False  # pipelined: the reply arrives with execute()
        return _text(reply[0]), bool(reply[1])

    def open_job(
        self,
        job_id: str,
        name: str | None = None,
        expires_in_s: float | None = None,
        webhook_url: str | None = None,
    ) -> None:
        """Create (or reopen, for a resubmission) a job; unsealed until submitted."""
        key = self.keys.job(job_id)
        now = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, "created_at", f"{now:.6f}")
        pipe.hset(key, mapping={"job_id": job_id, "sealed": "0"})
        pipe.hdel(key, "finished_at")
        if name:
            pipe.hset(key, "name", name)
        if webhook_url:
            pipe.hset(key, "webhook_url", webhook_url)
        if expires_in_s:
            pipe.hsetnx(key, "expires_at", f"{now + expires_in_s:.3f}")
            pipe.zadd(self.keys.job_expiry(), {job_id: now + expires_in_s}, nx=True)
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def seal_job(self, job_id: str, lines: int = 0) -> None:
        """Submission complete: the job may now finish."""
        self._seal(
            keys=[self.keys.job(job_id)],
            args=[job_id, f"{time.time():.6f}", self.keys.events(), lines],
        )

    def transition_many(
        self,
        moves: Sequence[tuple[str, TaskState, Mapping[str, Any]]],
        client: Any = None,
    ) -> list[tuple[str, bool]]:
        """Move many tasks forward in one script call: (task id, state, fields)."""
        if not moves:
            return []
        argv: list[Any] = [self.keys.job(""), f"{time.time():.6f}", self.keys.events()]
        for _, state, fields in moves:
            pairs = [x for k, v in fields.items() for x in (k, "" if v is None else str(v))]
            argv += [state.value, _allowed_from(state.value), len(pairs) // 2, *pairs]
        keys = [self.keys.task(task_id) for task_id, _, _ in moves]
        reply = self._transition_many(keys=keys, args=argv, client=client or self.redis)
        if client is not None and client is not self.redis:
            return []  # pipelined: the replies arrive with execute()
        return [(_text(r[0]), bool(r[1])) for r in reply]

    # reads ---------------------------------------------------------------
    def task(self, task_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.task(task_id))
        return _with_state(_decode(raw)) if raw else {"state": TaskState.UNKNOWN.value}

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
        return [
            _with_state(_decode(r)) if r else {"state": TaskState.UNKNOWN.value} for r in replies
        ]

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
            "finished": bool(raw.get("finished_at")),
        }


def _with_state(fields: dict[str, str]) -> dict[str, str]:
    """A task enqueued by a plain ``send_task`` has a hash (its delivery count)
    before its first transition: it is queued."""
    fields.setdefault("state", TaskState.QUEUED.value)
    return fields


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(names: Iterable[str], values: Sequence[bytes | None]) -> dict[str, str]:
    out = {n: v.decode() for n, v in zip(names, values, strict=True) if v is not None}
    return out if out else {"state": TaskState.UNKNOWN.value}
