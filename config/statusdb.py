"""Task and job status in Redis: one hash per task, one per bulk job.

Writes that change state go through the ``transition`` command of ``scripts.lua``, so a task's
state and its job's counters change together and only forward (``config/status.py`` holds the
table), on Redis's clock. Reads of many tasks are one pipelined round trip. The connection
decodes replies to ``str`` (``config/connection.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import redis as redis_py

from vlmq.config.errors import InvalidRequest
from vlmq.config.jsonl import LineError
from vlmq.config.keys import Keys
from vlmq.config.results import result_key
from vlmq.config.scripts import Scripts
from vlmq.config.status import JobStatus, TaskState, sources_of
from vlmq.config.tenants import DEFAULT_TENANT, check_id, valid_id

__all__ = [
    "QUEUED_FIELDS",
    "Folded",
    "Move",
    "Queued",
    "StatusDB",
    "claim_of",
    "encode_move",
    "fed_task_id",
    "new_submission_id",
]


# The status fields a bulk line's task hash is created with (besides state and the stamps);
# ``claim`` marks a fed task, folded into its job when it ends (scripts.lua ``fold``).
QUEUED_FIELDS = ("job_id", "custom_id", "modality", "queue", "expires_at", "claim", "tenant", "est")

# A folded record's state letter (scripts.lua FOLDED).
_FOLDED_STATES = {"S": "succeeded", "F": "failed", "C": "cancelled", "E": "expired"}
# A fed task's id: its job's number, its claim, its submission.
_FED_ID = re.compile(r"^(\d+)\.([0-9a-f]{20})\.([0-9a-f]+)$")


def new_submission_id() -> str:
    """One submitter's id within its job (its tasks' ids end with it)."""
    return secrets.token_hex(5)


def claim_of(custom_id: str) -> str:
    """A custom_id's claim: a fixed-size digest (80 bits: for 10 million custom_ids in one job
    the chance of any two sharing one is ~4e-11), so a finished task's record is short
    whatever its custom_id's length."""
    return hashlib.sha1(custom_id.encode()).hexdigest()[:20]


def fed_task_id(job_number: str, claim: str, submission: str) -> str:
    return f"{job_number}.{claim}.{submission}"


@dataclass(frozen=True)
class Folded:
    """What a finished fed task leaves: its state, and either the delivery whose result
    object it has (``result_key``) or, without an object, its custom_id."""

    submission: str
    state: str | None  # None: still live (its hash has the status)
    delivery: int | None = None
    custom_id: str | None = None

    @classmethod
    def parse(cls, record: str) -> Folded:
        sub, _, rest = record.partition(" ")
        if not rest:
            return cls(sub, None)
        code, body = rest[0], rest[1:]
        state = _FOLDED_STATES.get(code, "unknown")
        if body.startswith(" "):
            return cls(sub, state, custom_id=body[1:] or None)
        return cls(sub, state, delivery=int(body) if body.isdigit() else None)

    def status(self, task_id: str, job_id: str) -> dict[str, str]:
        out = {"state": str(self.state), "job_id": job_id, "folded": "1"}
        if self.delivery is not None:
            out["deliveries"] = str(self.delivery)
            out["result_key"] = result_key(task_id, job_id, self.delivery)
        if self.custom_id:
            out["custom_id"] = self.custom_id
        return out


@dataclass(frozen=True)
class Queued:
    """One bulk line ready to enqueue: its task, custom_id, class, status fields, message."""

    task_id: str
    custom_id: str | None
    modality: str
    fields: Mapping[str, Any]
    message: str


@dataclass(frozen=True)
class Move:
    """One task's state change; ``token`` fences it to the delivery that holds the task
    (``None``: unfenced, a producer's cancel), ``stamp`` names a field set to Redis's time."""

    task_id: str
    state: TaskState
    fields: Mapping[str, Any] = field(default_factory=dict)
    token: int | None = None
    stamp: str | None = None
    count_attempt: bool = False  # the task is handed to an engine: attempts + 1 if it moves


def _allowed_from(states: Iterable[TaskState | None]) -> str:
    return ",".join("-" if s is None else s.value for s in states)


def encode_move(move: Move, only_from: Iterable[TaskState] | None = None) -> list[Any]:
    """A move as ``scripts.lua``'s ``read_move`` takes it from ARGV."""
    allowed = _allowed_from(only_from if only_from is not None else sources_of(move.state))
    pairs = [x for k, v in move.fields.items() for x in (k, _as_text(v))]
    token = "" if move.token is None else str(move.token)
    attempt = "1" if move.count_attempt else "0"
    return [move.state.value, allowed, token, move.stamp or "", attempt, len(pairs) // 2, *pairs]


def _now() -> str:
    return f"{time.time():.6f}"


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


class StatusDB:
    """Status reads and writes for tasks and jobs (both producers and workers use it)."""

    def __init__(
        self,
        redis: redis_py.Redis,
        keys: Keys,
        ttl_s: int = 7 * 86400,
        submitter_lease_s: float = 300.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.submitter_lease_s = submitter_lease_s
        self.scripts = Scripts(redis)

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
        move = Move(task_id, new_state, fields or {}, stamp="finished_at")
        return self.transition_many([move], only_from=only_from)[0]

    def transition_many(
        self, moves: Sequence[Move], only_from: Iterable[TaskState] | None = None
    ) -> list[tuple[str, bool]]:
        """Move many tasks forward in one script call; (previous state, moved) per task."""
        return [(previous, moved) for previous, moved, _ in self.fenced_moves(moves, only_from)]

    def fenced_moves(
        self, moves: Sequence[Move], only_from: Iterable[TaskState] | None = None
    ) -> list[tuple[str, bool, bool]]:
        """As ``transition_many``, with whether each move's token still held its task."""
        if not moves:
            return []
        argv: list[Any] = [self.keys.job_prefix]
        for move in moves:
            argv += encode_move(move, only_from)
        keys = [self.keys.events(), *(self.keys.task(m.task_id) for m in moves)]
        reply = self.scripts("transition", keys, argv)
        return [(str(r[0]), bool(int(r[1])), bool(int(r[2]))) for r in reply]

    def finish_queued(
        self,
        job_id: str,
        state: TaskState,
        fields: Mapping[str, Any],
        page: int = 2000,
        fed: bool = True,
    ) -> int:
        """Move every still-queued task of a job to ``state`` (cancel, expiry); returns how
        many moved. Tasks already running or finished are left alone. ``fed=False`` leaves the
        fed tasks (reaching them scans the job's claims: a window of live ones among millions
        of folded ones) to the check each pull makes."""
        moved = 0
        tasks = self.live_task_ids(job_id, page) if fed else self.listed_task_ids(job_id, page)
        for ids in _pages(tasks, page):
            moves = [Move(task_id, state, fields, stamp="finished_at") for task_id in ids]
            replies = self.transition_many(moves, only_from=[TaskState.QUEUED])
            moved += sum(1 for _, done in replies if done)
        return moved

    def open_job(
        self,
        job_id: str,
        submission: str,
        name: str | None = None,
        expires_in_s: float | None = None,
        webhook_url: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        """Create (or reopen, for a resubmission) a job of ``tenant``; unsealed until
        submitted, and not finished while ``submission`` holds its submitter lease. The
        completion window starts at the first submission, on Redis's clock. Returns the job's
        number. A job of another tenant is not reopened (InvalidRequest)."""
        check_id("job id", job_id)
        args = [job_id, name or "", webhook_url or "", expires_in_s or "", self.ttl_s]
        args += [submission, self.submitter_lease_s, self.keys.job_ref_prefix]
        args += [tenant, self.keys.quota(tenant)]
        keys = [self.keys.job(job_id), self.keys.job_expiry(), self.keys.jobs_submitting()]
        keys.append(self.keys.job_numbers())
        try:
            number = str(self.scripts("open_job", keys, args))
        except redis_py.ResponseError as exc:
            if "OWNED" not in str(exc):
                raise
            raise InvalidRequest(f"job id {job_id!r} is in use by another tenant") from None
        return number

    def job_tenant(self, job_id: str) -> str:
        """The tenant a job belongs to (the default for a job from before tenants)."""
        if not valid_id(job_id):
            return DEFAULT_TENANT
        stored: str | None = self.redis.hget(self.keys.job(job_id), "tenant")  # type: ignore[assignment]
        return stored or DEFAULT_TENANT

    def seal_job(self, job_id: str, submission: str, lines: int = 0, line_errors: int = 0) -> None:
        """``submission`` is complete: the job may now finish (once no submitter adds)."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, lines, submission, "1", line_errors])

    def release_submitter(self, job_id: str, submission: str) -> None:
        """``submission`` stopped before completing (an error, a cancel): it no longer holds
        the job open, and does not seal it."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, 0, submission, "0", 0])

    def submit_tasks(self, job_id: str, submission: str, lines: Sequence[Queued]) -> int:
        """Enqueue tasks of a job whose ids are the caller's, in one script (``submit``)."""
        if not lines:
            return 0
        keys = [
            self.keys.job(job_id),
            self.keys.job_tasks(job_id),
            self.keys.jobs_submitting(),
            self.keys.job_depth(),
        ]
        pairs = self._class_pairs(keys, job_id, lines, "bulk")
        args: list[Any] = [job_id, self.ttl_s, submission, self.submitter_lease_s]
        args += [self.keys.task_prefix, len(pairs), len(QUEUED_FIELDS), *QUEUED_FIELDS]
        for line in lines:
            keys.append(self.keys.task(line.task_id))
            args += [pairs[line.modality], *_values(line), line.message]
        return int(self.scripts("submit", keys, args))

    def _class_pairs(
        self, keys: list[str], job_id: str, lines: Sequence[Queued], lane: str
    ) -> dict[str, int]:
        """Appends each class's list and active zset to ``keys``; class -> its pair number."""
        pairs: dict[str, int] = {}
        tenant = self.job_tenant(job_id) if lane == "bulk" else DEFAULT_TENANT
        for line in lines:
            if line.modality not in pairs:
                pairs[line.modality] = len(pairs) + 1
                queue = self.keys.lane_queue(line.modality, lane, job_id)
                keys += [queue, self.keys.active_jobs(line.modality, tenant)]
        return pairs

    # feeds -----------------------------------------------------------------
    def register_feed(
        self,
        job_id: str,
        feed_id: str,
        input_key: str,
        lines: int,
        lane: str,
        size: int,
        lease_s: float,
        tokens: int = 0,
    ) -> None:
        """Count a staged input's ``lines`` (``tokens`` their estimate, 0 when not estimated)
        in its job and its tenant's quota and make it a feed, leased to the caller for
        ``lease_s`` (``release_feed`` offers it to the fleet's feeders)."""
        keys = [self.keys.job(job_id), self.keys.feed(feed_id), self.keys.feeds()]
        args = [job_id, feed_id, input_key, lines, lane, self.ttl_s, size, lease_s, tokens]
        self.scripts("register_feed", keys, args)

    def take_feeds(self, lease_s: float, limit: int = 16) -> list[str]:
        return [str(f) for f in self.scripts("take_feeds", [self.keys.feeds()], [lease_s, limit])]

    def release_feed(self, feed_id: str) -> None:
        self.scripts("release_feed", [self.keys.feeds()], [feed_id])

    def feed_state(self, feed_id: str) -> dict[str, str]:
        raw: dict[str, str] = self.redis.hgetall(self.keys.feed(feed_id))  # type: ignore[assignment]
        return raw

    def feeds_of(self, job_id: str) -> list[str]:
        fields: list[str] = self.redis.hkeys(self.keys.job(job_id))  # type: ignore[assignment]
        return [f.removeprefix("feed:") for f in fields if f.startswith("feed:")]

    def drop_feed(self, job_id: str, feed_id: str, state: TaskState) -> int:
        """The rest of a feed will not run (``state``: cancelled or expired)."""
        keys = [self.keys.job(job_id), self.keys.feed(feed_id), self.keys.feeds()]
        keys.append(self.keys.events())
        return int(self.scripts("drop_feed", keys, [job_id, feed_id, state.value]))

    def feed(
        self,
        job_id: str,
        feed_id: str,
        cursor: tuple[str, str],
        consumed: int,
        lines: Sequence[Queued],
        lane: str = "bulk",
    ) -> tuple[str, list[str]]:
        """Feed one chunk (``feed`` in scripts.lua): applied only if the feed's cursor is still
        ``cursor[0]``, which becomes ``cursor[1]``. Returns the outcome ('fed', 'stale',
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
        pairs = self._class_pairs(keys, job_id, lines, lane)
        args: list[Any] = [job_id, self.ttl_s, submission, feed_id, self.keys.task_prefix]
        args += [*cursor, consumed, len(pairs), "1" if lane == "bulk" else "0"]
        args += [len(QUEUED_FIELDS), *QUEUED_FIELDS]
        for line in lines:
            keys.append(self.keys.task(line.task_id))
            claim = str(line.fields.get("claim") or "")
            args += [claim, pairs[line.modality], *_values(line), line.message]
        outcome, codes = self.scripts("feed", keys, args)
        return str(outcome), [str(c) for c in codes]

    def record_line_errors(self, job_id: str, errors: Sequence[LineError], cap: int) -> None:
        """Keep the first ``cap`` invalid-line records of a job (the job counts them all): a
        file of millions of bad lines must not fill Redis."""
        key = self.keys.job_errors(job_id)
        room = cap - int(self.redis.hlen(key))
        if not errors or room <= 0:
            return
        records = {
            str(e.line): json.dumps(e.to_record(), separators=(",", ":")) for e in errors[:room]
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=records)  # type: ignore[arg-type]
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def reap_submitters(self, limit: int = 100) -> int:
        """Look again at jobs whose last submitter stopped renewing (crashed before it
        sealed): finished now if everything else is done."""
        keys = [self.keys.jobs_submitting(), self.keys.events()]
        return int(self.scripts("reap_submitters", keys, [self.keys.job_prefix, limit]))

    def fail_validation(self, job_id: str, message: str) -> None:
        """A submission failed validation as a whole: nothing of it runs, and the job says why
        (``JobStatus.validation_error``)."""
        self.redis.hset(self.keys.job(job_id), "validation_error", message)

    def request_cancel(self, job_id: str) -> None:
        self.redis.hset(self.keys.job(job_id), "cancel_requested", "1")

    # reads ---------------------------------------------------------------
    def task(self, task_id: str) -> dict[str, str]:
        if not valid_id(task_id):
            return {"state": TaskState.UNKNOWN.value}
        raw: dict[str, str] = self.redis.hgetall(self.keys.task(task_id))  # type: ignore[assignment]
        if raw:
            return _with_state(raw)
        return self.folded_task(task_id) or {"state": TaskState.UNKNOWN.value}

    def task_tenant(self, status: Mapping[str, str]) -> str:
        """The tenant of a task from its status: its own field, else its job's (a fed task
        carries none: its job's is the one)."""
        if status.get("tenant"):
            return status["tenant"]
        job_id = status.get("job_id")
        return self.job_tenant(job_id) if job_id else DEFAULT_TENANT

    def folded_task(self, task_id: str) -> dict[str, str] | None:
        """A finished fed task's status, from its job's claims (its id names both)."""
        match = _FED_ID.match(task_id)
        if match is None:
            return None
        number, claim, submission = match.groups()
        job_id: str | None = self.redis.get(self.keys.job_ref(number))  # type: ignore[assignment]
        if job_id is None:
            return None
        record: str | None = self.redis.hget(self.keys.job_custom_ids(job_id), claim)  # type: ignore[assignment]
        if record is None:
            return None
        folded = Folded.parse(record)
        if folded.submission != submission or folded.state is None:
            return None  # superseded by a later submission's task (or mid-fold)
        return folded.status(task_id, job_id)

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

    # Reads take ids from callers: one that is not an id never forms a key (``J:custom_ids``
    # would name a job's claims hash, millions of fields read in one blocking call).
    def job_exists(self, job_id: str) -> bool:
        return valid_id(job_id) and bool(self.redis.exists(self.keys.job(job_id)))

    def job(self, job_id: str) -> JobStatus:
        if not valid_id(job_id):
            return JobStatus.unknown(job_id)
        raw: dict[str, str] = self.redis.hgetall(self.keys.job(job_id))  # type: ignore[assignment]
        return JobStatus.from_hash(job_id, raw)

    def job_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        """A job's current task ids: those enqueued by id (submit_many) in submission order,
        then its fed tasks (one per custom_id: a superseded task is not listed), a page at a
        time."""
        yield from self.listed_task_ids(job_id, page)
        for task_id, _ in self.fed_tasks(job_id, page):
            yield task_id

    def live_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        """The job's tasks that may not have ended: every task enqueued by id, and the fed
        tasks not folded yet."""
        yield from self.listed_task_ids(job_id, page)
        yield from (task_id for task_id, f in self.fed_tasks(job_id, page) if f.state is None)

    def listed_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        """The job's task list: tasks enqueued by id (submit_many), in submission order."""
        start = 0
        while ids := self.redis.lrange(self.keys.job_tasks(job_id), start, start + page - 1):
            yield from ids  # type: ignore[misc]
            start += page

    def fed_tasks(self, job_id: str, page: int = 10_000) -> Iterator[tuple[str, Folded]]:
        """(task id, its record) of each current fed task of a job; a live one's record has
        no state (its hash has it)."""
        number: str | None = self.redis.hget(self.keys.job(job_id), "seq")  # type: ignore[assignment]
        if number is None:
            return
        claims = self.keys.job_custom_ids(job_id)
        for claim, record in self.redis.hscan_iter(claims, count=page):
            folded = Folded.parse(str(record))
            yield fed_task_id(number, str(claim), folded.submission), folded


def _values(line: Queued) -> list[str]:
    return [_as_text(line.fields.get(name)) for name in QUEUED_FIELDS]


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
