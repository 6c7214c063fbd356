"""Reliable batched intake from the Celery queue lists, with leases.

Why not kombu's own consumer: it acknowledges a batch even when it fails, and its unacked
sweep redelivers only after ``visibility_timeout`` plus a slow restore cycle, while it also
sweeps back messages a live worker merely buffers (see docs/design.md). Here a worker moves up
to N messages atomically from one class's queue lists into an in-flight hash with a lease it
keeps renewing while it works (:class:`Intake`); acknowledging removes them. Any worker's reaper
puts back messages whose lease ran out (their holder died), so a kill -9 is recovered within
``lease_s + reap_interval_s`` (:class:`Leases`). :class:`Held` is what this worker holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from vlmq.config.keys import Keys
from vlmq.config.wire import priority_lists

__all__ = ["Delivery", "Held", "Intake", "Leases"]

# KEYS: inflight hash, leases zset, origin-queue hash, origin-active hash, the class's
# active-jobs set, then its fixed lists: the interactive lane (priority order), then the plain
# bulk queue (priority order). ARGV: max count, lease deadline, task key prefix, number of
# interactive lists.
# The interactive lane is drained first. The rest is shared round robin, one message per member
# per round, between the plain bulk queue and every bulk job's own list, so one million-line job
# cannot starve a second one. A message taken from a job list records the set it belongs to,
# so a requeue can register the list again.
_POP = """
local out = {}
local limit = tonumber(ARGV[1])
local function task_id(raw)
  -- The body is base64, so the only "id" key in clear text is the header's
  -- (Celery writes headers before properties); decode fully only as a fallback.
  local id = string.match(raw, '[{,]%s*"id"%s*:%s*"([^"]+)"')
  if id then return id end
  local ok, msg = pcall(cjson.decode, raw)
  if ok and type(msg) == 'table' and type(msg.headers) == 'table' and msg.headers.id then
    return tostring(msg.headers.id)
  end
  return 'invalid-' .. redis.sha1hex(raw)
end
local function take(list, active)
  local raw = redis.call('RPOP', list)
  if not raw then return false end
  local id = task_id(raw)
  redis.call('HSET', KEYS[1], id, raw)
  redis.call('ZADD', KEYS[2], ARGV[2], id)
  redis.call('HSET', KEYS[3], id, list)
  if active then redis.call('HSET', KEYS[4], id, active) end
  local key = ARGV[3] .. id
  local n = redis.call('HINCRBY', key, 'deliveries', 1)
  -- The status fields the worker decides on, saving it a round trip.
  local status = redis.call('HMGET', key, 'state', 'attempts', 'job_id', 'queued_at',
                            'expires_at')
  out[#out + 1] = {id, raw, n, status}
  return true
end
local first = 6 + tonumber(ARGV[4])
for i = 6, first - 1 do
  while #out < limit and take(KEYS[i], false) do end
end
local plain = {}
for i = first, #KEYS do plain[#plain + 1] = KEYS[i] end
local jobs = redis.call('SMEMBERS', KEYS[5])
local progress = true
while #out < limit and progress do
  progress = false
  for _, list in ipairs(plain) do
    if take(list, false) then progress = true break end
  end
  for _, list in ipairs(jobs) do
    if #out >= limit then break end
    if take(list, KEYS[5]) then
      progress = true
    elseif redis.call('LLEN', list) == 0 then
      redis.call('SREM', KEYS[5], list)
    end
  end
end
return out
"""

# KEYS: inflight, leases, origin-queue, origin-active. ARGV: ids. Forget acknowledged messages.
_ACK = """
for i = 1, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[3], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
end
return #ARGV
"""

# KEYS: inflight, leases, origin-queue, origin-active. ARGV[1] = max deadline ('+inf' for a
# requeue of given ids), ARGV[2] = limit, ARGV[3..] = ids (optional).
# Put messages back at the head of their queue (RPUSH: next to be popped).
_REQUEUE = """
local ids
if #ARGV > 2 then
  ids = {}
  for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
end
local moved = 0
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[1], id)
  local queue = redis.call('HGET', KEYS[3], id)
  if raw and queue then
    redis.call('RPUSH', queue, raw)
    local active = redis.call('HGET', KEYS[4], id)
    if active then redis.call('SADD', active, queue) end
    moved = moved + 1
  end
  redis.call('HDEL', KEYS[1], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('ZREM', KEYS[2], id)
end
return moved
"""

_STATUS_FIELDS = ("state", "attempts", "job_id", "queued_at", "expires_at")


@dataclass(frozen=True)
class Delivery:
    """One message taken from a queue, with how many times it was delivered."""

    task_id: str
    raw: str
    deliveries: int
    status: dict[str, str] = field(default_factory=dict)


def _status(values: Sequence[str | None]) -> dict[str, str]:
    status = {k: v for k, v in zip(_STATUS_FIELDS, values, strict=True) if v}
    # A hash without a state was made by this very pull (a plain send_task).
    status.setdefault("state", "queued")
    return status


def _bookkeeping(keys: Keys) -> list[str]:
    return [keys.inflight(), keys.leases(), keys.lease_queue(), keys.lease_active()]


class Intake:
    """Pulls one modality class's messages into this worker's leases."""

    def __init__(self, redis: Redis, keys: Keys, modality: str) -> None:
        self.modality = modality
        self.keys = keys
        self.first = priority_lists(keys.queue(modality, "interactive"))
        self.lists = [*self.first, *priority_lists(keys.queue(modality, "bulk"))]
        self._pop = redis.register_script(_POP)

    def pull(self, limit: int, lease_until: float) -> list[Delivery]:
        """Atomically move up to ``limit`` messages into this worker's hands."""
        rows: Any = self._pop(
            keys=[*_bookkeeping(self.keys), self.keys.active_jobs(self.modality), *self.lists],
            args=[limit, f"{lease_until:.3f}", self.keys.task_prefix, len(self.first)],
        )
        return [Delivery(str(r[0]), str(r[1]), int(r[2]), _status(r[3])) for r in rows]


class Leases:
    """The in-flight side every class shares: renew, acknowledge, give back, reap."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._ack = redis.register_script(_ACK)
        self._requeue = redis.register_script(_REQUEUE)

    def ack(self, task_ids: Sequence[str], pipe: Any = None) -> None:
        if task_ids:
            self._ack(keys=_bookkeeping(self.keys), args=list(task_ids), client=pipe or self.redis)

    def renew(self, task_ids: Sequence[str], lease_until: float) -> None:
        """Extend the leases this worker still holds (XX: never resurrect one)."""
        if task_ids:
            self.redis.zadd(self.keys.leases(), dict.fromkeys(task_ids, lease_until), xx=True)

    def requeue(self, task_ids: Sequence[str]) -> int:
        """Give messages back at once (shutdown, or not started)."""
        if not task_ids:
            return 0
        return int(self._requeue(keys=_bookkeeping(self.keys), args=["+inf", 0, *task_ids]))

    def reap(self, now: float, limit: int = 1000) -> int:
        """Put back messages whose holder stopped renewing their lease."""
        return int(self._requeue(keys=_bookkeeping(self.keys), args=[f"{now:.3f}", limit]))


class Held:
    """The task ids this worker holds leases on (renewed by its heartbeat)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            self._ids.update(task_ids)

    def release(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            self._ids.difference_update(task_ids)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)
