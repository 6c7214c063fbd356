"""Intake and leases: what a worker pulls, holds, renews, gives back, and what the fleet reaps.

A worker moves up to N messages atomically from one class's queue lists into an in-flight hash
with a lease it keeps renewing while it works (:class:`Intake`, ``lua/intake.lua`` ``pull``);
settling acknowledges them (``Tasks.settle``). Any worker's reaper puts back messages whose
lease ran out, their holder died (:class:`Leases`). Every deadline is computed inside Redis,
and each delivery carries a token (the task's delivery count at pull): renew, start, settle and
give-back are refused for a holder that was superseded, so its result never becomes the
task's. The pull also decides which task a message is (``lua/intake.lua``, identity): the
worker takes that id and reads no other from the message.
Workers' heartbeat records, which renew these leases, are ``workers.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Scripts
from vlmq.config.keys import Keys
from vlmq.config.status import TERMINAL
from vlmq.config.tenants import DEFAULT_TENANT
from vlmq.config.wire import priority_lists

__all__ = [
    "PREPARED_CLASSES",
    "ROLES",
    "Delivery",
    "Intake",
    "Leases",
    "Pull",
    "first_lists",
]

# The status fields of a pulled row (lua/intake.lua row_status): six, and for a redelivery two
# more, how its earlier deliveries ended.
_STATUS_FIELDS = (
    "state",
    "attempts",
    "job_id",
    "queued_at",
    "expires_at",
    "tenant",
    "alone",
    "returns",
    "outlived",
)
_TERMINAL_CSV = ",".join(sorted(s.value for s in TERMINAL))


@dataclass(frozen=True)
class Delivery:
    """One message taken from a queue; ``token`` is its delivery count, the fence;
    ``origin`` the list it came from."""

    task_id: str
    raw: str
    token: int
    status: dict[str, str] = field(default_factory=dict)
    origin: str = ""

    @property
    def prepared(self) -> bool:
        """Handed on by a prepare worker: its media are in the frame store."""
        return self.origin.endswith(Keys.PREPARED_SUFFIX)


@dataclass(frozen=True)
class Pull:
    """What one pull took, Redis's time when it did, and the copies it dropped (already
    finished, or held by a live holder)."""

    deliveries: list[Delivery]
    now: float
    dropped: int = 0


def _status(values: Sequence[str | None]) -> dict[str, str]:
    status = {k: v for k, v in zip(_STATUS_FIELDS, values, strict=False) if v}
    # A hash without a state was made by this very pull (a plain send_task).
    status.setdefault("state", "queued")
    return status


def _deliveries(reply: Sequence[Any]) -> list[Delivery]:
    """A pull's rows from its flat reply (intake.lua, pull): after now, dropped and the row
    count, per row its id, message, token, origin list, a count k and k status fields."""
    deliveries, at = [], 3
    for _ in range(int(reply[2])):
        task_id, raw, token, origin, k = reply[at : at + 5]
        status = _status(reply[at + 5 : at + 5 + int(k)])
        deliveries.append(Delivery(str(task_id), str(raw), int(token), status, str(origin or "")))
        at += 5 + int(k)
    return deliveries


def _pairs(held: Mapping[str, int]) -> list[Any]:
    return [x for task_id, token in held.items() for x in (task_id, token)]


# Who pulls: a GPU worker ("gpu") takes prepared tasks first; a prepare worker ("prepare")
# takes only raw ones, and marks them 'preparing' while it holds them.
ROLES = ("gpu", "prepare")
# Classes whose tasks a prepare worker can prepare (text has no media).
PREPARED_CLASSES = ("image", "video")


def first_lists(keys: Keys, modality: str, role: str) -> list[str]:
    """The lists a pull drains before sharing out the bulk lane: a GPU worker's prepared
    interactive tasks, then raw interactive ones, then prepared bulk ones (fairness across
    tenants and jobs was applied when those were first pulled); a prepare worker's raw
    interactive ones."""
    interactive = priority_lists(keys.queue(modality, "interactive"))
    if role == "prepare" or modality not in PREPARED_CLASSES:
        return interactive
    return [
        keys.prepared_queue(modality, "interactive"),
        *interactive,
        keys.prepared_queue(modality, "bulk"),
    ]


class Intake:
    """Pulls one modality class's messages into this worker's leases."""

    def __init__(
        self,
        redis: redis_py.Redis,
        scripts: Scripts,
        keys: Keys,
        modality: str,
        ttl_s: int,
        role: str = "gpu",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown intake role {role!r}")
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.modality = modality
        self.ttl_s = ttl_s
        self.role = role
        self.first = first_lists(keys, modality, role)
        self.lists = [*self.first, *priority_lists(keys.queue(modality, "bulk"))]
        self._idle = False  # the last pull took nothing: probe before the next one

    def pull(self, limit: int, lease_s: float) -> Pull:
        """Atomically move up to ``limit`` messages into this worker's hands, leased for
        ``lease_s`` seconds of Redis's clock. While idle (the last pull took nothing) a pull
        first asks whether any list it reads has a message: an idle worker polls many times a
        second, and the probe costs Redis a few microseconds where the script's run costs
        ~25x that (bench/README.md, "Idle workers")."""
        if self._idle:
            now = self._now_if_nothing_to_pull()
            if now is not None:
                return Pull([], now)
        pull = self._pull(limit, lease_s)
        self._idle = not pull.deliveries and not pull.dropped
        return pull

    def waiting(self) -> bool:
        """Whether a pull may find something: always for a worker that is not idle; for an
        idle one, the probe's answer (what it found is pulled next without a second probe)."""
        if not self._idle:
            return True
        if self._now_if_nothing_to_pull() is not None:
            return False
        self._idle = False
        return True

    def _now_if_nothing_to_pull(self) -> float | None:
        """Redis's time when none of the lists a pull reads (nor the class's tenants' set of
        job lists) exists; None when one does. Read-only, so safe to repeat; a message that
        arrives right after is taken by the next poll, as it would be after an empty pull."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self.keys.active_tenants(self.modality), *self.lists)
        pipe.time()
        found, (seconds, micros) = pipe.execute()
        return None if found else seconds + micros / 1e6

    def _pull(self, limit: int, lease_s: float) -> Pull:
        keys = [*self.keys.bookkeeping(), self.keys.active_tenants(self.modality), *self.lists]
        args = [limit, lease_s, self.keys.task_prefix, len(self.first), _TERMINAL_CSV]
        args += [self.ttl_s, self.keys.job_ref_prefix, self.keys.job_prefix]
        args += ["preparing" if self.role == "prepare" else "", Keys.PREPARED_SUFFIX]
        reply = self.scripts("pull", keys, args)
        deliveries = _deliveries(reply)
        self._with_tenants(deliveries)
        return Pull(deliveries, float(reply[0]), int(reply[1]))

    def _with_tenants(self, deliveries: Sequence[Delivery]) -> None:
        """Every delivery's status names its tenant: its own, else its job's as the job's
        hash says now, else the default. Read at every pull (one pipelined HGET per job the
        pull's fed tasks came from), never remembered: a job id names another job once its
        hash expired, perhaps another tenant's (docs/tenants-ha.md)."""
        jobless = [d for d in deliveries if "tenant" not in d.status]
        jobs = list({job for d in jobless if (job := d.status.get("job_id"))})
        owners: dict[str, str] = {}
        if jobs:
            pipe = self.redis.pipeline(transaction=False)
            for job in jobs:
                pipe.hget(self.keys.job(job), "tenant")
            owners = dict(zip(jobs, pipe.execute(), strict=True))
        for d in jobless:
            d.status["tenant"] = owners.get(d.status.get("job_id") or "") or DEFAULT_TENANT


class Leases:
    """The in-flight side every class shares: renew, acknowledge, give back, reap. Each is
    safe to repeat (a retry after a lost reply changes nothing more)."""

    def __init__(self, scripts: Scripts, keys: Keys) -> None:
        self.scripts = scripts
        self.keys = keys

    def renew(self, held: Mapping[str, int], lease_s: float) -> list[str]:
        """Extend this holder's leases; returns the ids it no longer holds."""
        if not held:
            return []
        args = [lease_s, self.keys.task_prefix, *_pairs(held)]
        return [str(i) for i in self.scripts("renew", [self.keys.leases()], args)]

    def ack(self, held: Mapping[str, int]) -> int:
        """Forget this holder's messages whose tasks ended while they were held."""
        if not held:
            return 0
        args = [self.keys.task_prefix, *_pairs(held)]
        return int(self.scripts("ack", self.keys.bookkeeping(), args))

    def give_back(self, held: Mapping[str, int]) -> int:
        """Return this holder's messages to their queues now (shutdown, or not started)."""
        if not held:
            return 0
        args = [self.keys.task_prefix, *_pairs(held)]
        return int(self.scripts("give_back", self.keys.bookkeeping(), args))

    def hand_back(self, held: Mapping[str, int]) -> int:
        """A draining worker's return of everything it holds, started or not, in one call
        (``lua/intake.lua`` ``hand_back``): each goes to the head of its queue now, a started
        one's start is undone (its attempt, 'queued' again), and this holder's delivery is
        void (a late settle of it is refused). Returns how many went back."""
        if not held:
            return 0
        args = [self.keys.task_prefix, self.keys.job_prefix, *_pairs(held)]
        return int(self.scripts("hand_back", self.keys.bookkeeping(), args))

    def hand_on(self, prepared_list: str, held: Mapping[str, int]) -> dict[str, str]:
        """Move prepared tasks this holder holds to ``prepared_list`` (``lua/intake.lua``
        ``hand_on``): task id -> 'on', 'ended' or 'lost'."""
        if not held:
            return {}
        args = [self.keys.task_prefix, _TERMINAL_CSV, *_pairs(held)]
        keys = [*self.keys.bookkeeping(), prepared_list]
        words = self.scripts("hand_on", keys, args)
        return {task_id: str(word) for task_id, word in zip(held, words, strict=True)}

    def reap(self, limit: int = 1000) -> int:
        """Put back messages whose holder stopped renewing their lease (by Redis's clock)."""
        args = [limit, self.keys.task_prefix]
        return int(self.scripts("reap", self.keys.bookkeeping(), args))
