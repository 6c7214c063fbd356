"""Reliable batched intake from the Celery queue lists, with fenced leases on Redis's clock.

Why not kombu's own consumer: it acknowledges a batch even when it fails, and its unacked
sweep redelivers only after ``visibility_timeout`` plus a slow restore cycle, while it also
sweeps back messages a live worker merely buffers (see docs/design.md). Here a worker moves up
to N messages atomically from one class's queue lists into an in-flight hash with a lease it
keeps renewing while it works (:class:`Intake`); settling acknowledges them. Any worker's
reaper puts back messages whose lease ran out (their holder died), so a kill -9 is recovered
within ``lease_s + reap_interval_s`` (:class:`Leases`). :class:`Held` is what this worker holds.

Every deadline is computed inside Redis (``scripts.lua``), and each delivery carries a token
(the task's delivery count at pull): renew, start, settle and give-back are refused for a
holder that was superseded, so its result never becomes the task's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmq.config.keys import Keys
from vlmq.config.scripts import Scripts, Wait
from vlmq.config.status import TERMINAL
from vlmq.config.statusdb import Move, encode_move
from vlmq.config.tenants import DEFAULT_TENANT
from vlmq.config.usage import TaskUsage
from vlmq.config.wire import priority_lists

__all__ = ["Delivery", "Held", "Intake", "Leases", "Pull", "Settled", "bookkeeping_keys"]

_STATUS_FIELDS = ("state", "attempts", "job_id", "queued_at", "expires_at", "tenant")
# Jobs whose tenant this worker remembers (a fed task's hash carries none: its job's it is).
_JOB_TENANTS_KEPT = 4096
_TERMINAL_CSV = ",".join(sorted(s.value for s in TERMINAL))


@dataclass(frozen=True)
class Delivery:
    """One message taken from a queue; ``token`` is its delivery count, the fence."""

    task_id: str
    raw: str
    token: int
    status: dict[str, str] = field(default_factory=dict)

    @property
    def deliveries(self) -> int:
        return self.token


@dataclass(frozen=True)
class Pull:
    """What one pull took, Redis's time when it did, and the copies it dropped (already
    finished, or held by a live holder)."""

    deliveries: list[Delivery]
    now: float
    dropped: int = 0


@dataclass(frozen=True)
class Settled:
    """One task's settle: its state before, whether it moved, whether this holder held it."""

    task_id: str
    previous: str
    moved: bool
    held: bool


def _status(values: Sequence[str | None]) -> dict[str, str]:
    status = {k: v for k, v in zip(_STATUS_FIELDS, values, strict=True) if v}
    # A hash without a state was made by this very pull (a plain send_task).
    status.setdefault("state", "queued")
    return status


def bookkeeping_keys(keys: Keys) -> list[str]:
    """KEYS[1..5] of every in-flight script (scripts.lua, "in flight")."""
    return [
        keys.inflight(),
        keys.leases(),
        keys.lease_queue(),
        keys.lease_active(),
        keys.job_depth(),
    ]


def _pairs(held: Mapping[str, int]) -> list[Any]:
    return [x for task_id, token in held.items() for x in (task_id, token)]


class Intake:
    """Pulls one modality class's messages into this worker's leases."""

    def __init__(
        self, scripts: Scripts, keys: Keys, modality: str, task_ttl_s: int = 7 * 86400
    ) -> None:
        self.modality = modality
        self.task_ttl_s = task_ttl_s
        self.keys = keys
        self.scripts = scripts
        self.first = priority_lists(keys.queue(modality, "interactive"))
        self.lists = [*self.first, *priority_lists(keys.queue(modality, "bulk"))]
        self._job_tenants: OrderedDict[str, str] = OrderedDict()

    def pull(self, limit: int, lease_s: float) -> Pull:
        """Atomically move up to ``limit`` messages into this worker's hands, leased for
        ``lease_s`` seconds of Redis's clock."""
        keys = [*bookkeeping_keys(self.keys), self.keys.active_tenants(self.modality), *self.lists]
        args = [limit, lease_s, self.keys.task_prefix, len(self.first), _TERMINAL_CSV]
        args.append(self.task_ttl_s)
        now, dropped, rows = self.scripts("pull", keys, args)
        deliveries = [Delivery(str(r[0]), str(r[1]), int(r[2]), _status(r[3])) for r in rows]
        self._with_tenants(deliveries)
        return Pull(deliveries, float(now), int(dropped))

    def _with_tenants(self, deliveries: Sequence[Delivery]) -> None:
        """Every delivery's status names its tenant: its own, else its job's (one pipelined
        read for the jobs this worker has not seen), else the default."""
        jobless = [d for d in deliveries if "tenant" not in d.status]
        unknown = {
            job for d in jobless if (job := d.status.get("job_id")) and job not in self._job_tenants
        }
        if unknown:
            pipe = self.scripts.redis.pipeline(transaction=False)
            for job in unknown:
                pipe.hget(self.keys.job(job), "tenant")
            for job, stored in zip(unknown, pipe.execute(), strict=True):
                self._job_tenants[job] = stored or DEFAULT_TENANT
                while len(self._job_tenants) > _JOB_TENANTS_KEPT:
                    self._job_tenants.popitem(last=False)
        for d in jobless:
            d.status["tenant"] = self._job_tenants.get(d.status.get("job_id") or "", DEFAULT_TENANT)


class Leases:
    """The in-flight side every class shares: renew, settle, give back, reap."""

    def __init__(
        self, scripts: Scripts, keys: Keys, wait: Wait | None = None, ttl_s: int = 7 * 86400
    ) -> None:
        self.scripts = scripts
        self.keys = keys
        self.ttl_s = ttl_s  # of a job's usage hash (a job's own ttl)
        self.wait = wait  # each settle then WAITs for replicas (VLMQ_FLEET__SETTLE_WAIT_*)

    def renew(self, held: Mapping[str, int], lease_s: float) -> list[str]:
        """Extend this holder's leases; returns the ids it no longer holds."""
        if not held:
            return []
        args = [lease_s, self.keys.task_prefix, *_pairs(held)]
        return [str(i) for i in self.scripts("renew", [self.keys.leases()], args)]

    def settle(
        self, moves: Sequence[Move], usage: Sequence[TaskUsage | None] | None = None
    ) -> list[Settled]:
        """Terminal transitions and acknowledgements in one step, fenced by each move's
        token, with what each task used counted for its tenant and job (``usage``, aligned
        with ``moves``); runs while Redis is over maxmemory."""
        if not moves:
            return []
        args: list[Any] = [self.keys.job_prefix, self.keys.usage_prefix]
        args += [self.keys.usage_tenants(), self.ttl_s]
        for index, move in enumerate(moves):
            used = usage[index] if usage else None
            args += [move.task_id, *encode_move(move), *(used.argv() if used else [""])]
        keys = [
            *bookkeeping_keys(self.keys),
            self.keys.events(),
            *(self.keys.task(m.task_id) for m in moves),
        ]
        reply = self.scripts("settle", keys, args, wait=self.wait)
        return [
            Settled(m.task_id, str(r[0]), bool(int(r[1])), bool(int(r[2])))
            for m, r in zip(moves, reply, strict=True)
        ]

    def ack(self, held: Mapping[str, int]) -> int:
        """Forget this holder's messages whose tasks ended while they were held."""
        if not held:
            return 0
        args = [self.keys.task_prefix, *_pairs(held)]
        return int(self.scripts("ack", bookkeeping_keys(self.keys), args))

    def give_back(self, held: Mapping[str, int]) -> int:
        """Return this holder's messages to their queues now (shutdown, or not started)."""
        if not held:
            return 0
        args = [self.keys.task_prefix, *_pairs(held)]
        return int(self.scripts("give_back", bookkeeping_keys(self.keys), args))

    def reap(self, limit: int = 1000) -> int:
        """Put back messages whose holder stopped renewing their lease (by Redis's clock)."""
        return int(self.scripts("reap", bookkeeping_keys(self.keys), [limit]))


class Held:
    """The deliveries this worker holds leases on (task id -> token), renewed by its
    heartbeat until they are settled, given back or found lost."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, deliveries: Iterable[Delivery]) -> None:
        with self._lock:
            self._tokens.update((d.task_id, d.token) for d in deliveries)

    def release(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            for task_id in task_ids:
                self._tokens.pop(task_id, None)

    def tokens(self, task_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Held ids and their tokens (all, or those of ``task_ids`` still held)."""
        with self._lock:
            if task_ids is None:
                return dict(self._tokens)
            return {i: self._tokens[i] for i in task_ids if i in self._tokens}

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)
