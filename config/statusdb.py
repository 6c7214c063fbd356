"""Task and job status in Redis: one hash per task, one per bulk job.

Writes that change state go through one Lua script, so the task's state and its job's counters
change together and only forward (``config/status.py`` holds the table). Reads of many tasks
are one pipelined round trip. The connection decodes replies to ``str``
(``config/connection.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import redis as redis_py

from vlmq.config.keys import Keys
from vlmq.config.status import JobStatus, TaskState, sources_of

__all__ = ["StatusDB"]

# Shared Lua: a sealed job (submission complete) whose every task is terminal is finished once:
# finished_at is set and an event queued for its webhook.
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

# One task's move: allowed from-states ("," separated, "-" = absent); job counters and the
# job's finish check in the same step. ``jobprefix`` is ``Keys.job_prefix``: the task hash names
# its job by id. Returns {previous, 1|0}.
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

# Many tasks in one call (a batch's start or finish, a page of a job's cancel).
# KEYS[1] events list, KEYS[2..] task hashes. ARGV[1] job key prefix, ARGV[2] now, then per
# task: new state, allowed from-states, number of field/value pairs, the pairs.
_TRANSITION_MANY = (
    _FINISH_CHECK
    + _MOVE
    + """
local replies = {}
local at = 3
for i = 2, #KEYS do
  local new, allowed, n = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local fields = {}
  for j = 1, 2 * n do fields[j] = ARGV[at + 2 + j] end
  at = at + 3 + 2 * n
  replies[i - 1] = move(KEYS[i], new, ARGV[1], allowed, ARGV[2], KEYS[1], fields)
end
return replies
"""
)

# KEYS[1] job hash, KEYS[2] events list; ARGV[1] job id, ARGV[2] now, ARGV[3] lines.
_SEAL = (
    _FINISH_CHECK
    + """
redis.call('HSET', KEYS[1], 'sealed', '1', 'lines', ARGV[3])
finish_check(KEYS[1], ARGV[1], ARGV[2], KEYS[2])
return 1
"""
)

Move = tuple[str, TaskState, Mapping[str, Any]]


def _allowed_from(states: Iterable[TaskState | None]) -> str:
    return ",".join("-" if s is None else s.value for s in states)


def _now() -> str:
    return f"{time.time():.6f}"


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


class StatusDB:
    """Status reads and writes for tasks and jobs (both producers and workers use it)."""

    def __init__(self, redis: redis_py.Redis, keys: Keys, ttl_s: int = 7 * 86400) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._transition_many = redis.register_script(_TRANSITION_MANY)
        self._seal = redis.register_script(_SEAL)

    # writes --------------------------------------------------------------
    def queue_task_fields(self, fields: Mapping[str, Any]) -> dict[str, str]:
        now = _now()
        base = {"state": TaskState.QUEUED.value, "created_at": now, "queued_at": now}
        return {**base, **{k: _as_text(v) for k, v in fields.items()}}

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
        only_from: Iterable[TaskState] | None = None,
    ) -> tuple[str, bool]:
        """Move a task forward; returns (previous state, whether it moved).

        ``only_from`` narrows the states it may leave (cancel: queued only).
        """
        moves = [(task_id, new_state, fields or {})]
        return self.transition_many(moves, only_from=only_from)[0]

    def transition_many(
        self,
        moves: Sequence[Move],
        pipe: Any = None,
        only_from: Iterable[TaskState] | None = None,
    ) -> list[tuple[str, bool]]:
        """Move many tasks forward in one script call: (task id, state, fields).

        Inside the caller's ``pipe`` the replies arrive with its ``execute()``
        (:meth:`moved` reads them); without one they are returned.
        """
        if not moves:
            return []
        narrowed = None if only_from is None else _allowed_from(only_from)
        argv: list[Any] = [self.keys.job_prefix, _now()]
        for _, state, fields in moves:
            pairs = [x for k, v in fields.items() for x in (k, _as_text(v))]
            allowed = narrowed or _allowed_from(sources_of(state))
            argv += [state.value, allowed, len(pairs) // 2, *pairs]
        keys = [self.keys.events(), *(self.keys.task(task_id) for task_id, _, _ in moves)]
        reply = self._transition_many(keys=keys, args=argv, client=pipe or self.redis)
        return [] if pipe is not None else self.moved(reply)

    @staticmethod
    def moved(reply: Sequence[Any]) -> list[tuple[str, bool]]:
        """(previous state, moved) per task of a ``transition_many`` reply."""
        return [(str(previous), bool(int(moved))) for previous, moved in reply]

    def finish_queued(
        self,
        job_id: str,
        state: TaskState,
        fields: Mapping[str, Any],
        page: int = 2000,
    ) -> int:
        """Move every still-queued task of a job to ``state`` (cancel, expiry); returns how
        many moved. Tasks already running or finished are left alone."""
        moved = 0
        for ids in _pages(self.job_task_ids(job_id, page), page):
            moves = [(task_id, state, fields) for task_id in ids]
            replies = self.transition_many(moves, only_from=[TaskState.QUEUED])
            moved += sum(1 for _, done in replies if done)
        return moved

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
        self._seal(keys=[self.keys.job(job_id), self.keys.events()], args=[job_id, _now(), lines])

    def request_cancel(self, job_id: str) -> None:
        self.redis.hset(self.keys.job(job_id), "cancel_requested", "1")

    # reads ---------------------------------------------------------------
    def task(self, task_id: str) -> dict[str, str]:
        raw: dict[str, str] = self.redis.hgetall(self.keys.task(task_id))  # type: ignore[assignment]
        return _with_state(raw) if raw else {"state": TaskState.UNKNOWN.value}

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
        return [_with_state(r) if r else {"state": TaskState.UNKNOWN.value} for r in replies]

    def states(self, task_ids: Sequence[str]) -> list[TaskState]:
        return [TaskState(t.get("state") or "unknown") for t in self.tasks(task_ids, ("state",))]

    def job_exists(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.keys.job(job_id)))

    def job(self, job_id: str) -> JobStatus:
        raw: dict[str, str] = self.redis.hgetall(self.keys.job(job_id))  # type: ignore[assignment]
        return JobStatus.from_hash(job_id, raw)

    def job_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        """A job's task ids in submission order, read a page at a time."""
        start = 0
        while True:
            ids: list[str] = self.redis.lrange(  # type: ignore[assignment]
                self.keys.job_tasks(job_id), start, start + page - 1
            )
            if not ids:
                return
            yield from ids
            start += page


def _with_state(fields: dict[str, str]) -> dict[str, str]:
    """A task enqueued by a plain ``send_task`` has a hash (its delivery count) before its
    first transition: it is queued."""
    fields.setdefault("state", TaskState.QUEUED.value)
    return fields


def _fields(names: Iterable[str], values: Sequence[str | None]) -> dict[str, str]:
    out = {n: v for n, v in zip(names, values, strict=True) if v is not None}
    return out if out else {"state": TaskState.UNKNOWN.value}


def _pages(items: Iterator[str], size: int) -> Iterator[list[str]]:
    while page := list(islice(items, size)):
        yield page
