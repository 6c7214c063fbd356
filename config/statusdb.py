"""Task and job status in Redis: one hash per task, one per bulk job.

Writes that change state go through the ``transition`` command of ``scripts.lua``, so a task's
state and its job's counters change together and only forward (``config/status.py`` holds the
table), on Redis's clock. Reads of many tasks are one pipelined round trip. The connection
decodes replies to ``str`` (``config/connection.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import redis as redis_py

from vlmq.config.keys import Keys
from vlmq.config.scripts import Scripts
from vlmq.config.status import JobStatus, TaskState, sources_of

__all__ = ["QUEUED_FIELDS", "Move", "Queued", "StatusDB", "encode_move"]


# The status fields a bulk line's task hash is created with (besides state and the stamps).
QUEUED_FIELDS = ("job_id", "custom_id", "modality", "queue", "expires_at")


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
    ) -> int:
        """Move every still-queued task of a job to ``state`` (cancel, expiry); returns how
        many moved. Tasks already running or finished are left alone."""
        moved = 0
        for ids in _pages(self.job_task_ids(job_id, page), page):
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
    ) -> None:
        """Create (or reopen, for a resubmission) a job; unsealed until submitted, and not
        finished while ``submission`` holds its submitter lease. The completion window
        starts at the first submission, on Redis's clock."""
        args = [job_id, name or "", webhook_url or "", expires_in_s or "", self.ttl_s]
        args += [submission, self.submitter_lease_s]
        keys = [self.keys.job(job_id), self.keys.job_expiry(), self.keys.jobs_submitting()]
        self.scripts("open_job", keys, args)

    def seal_job(self, job_id: str, submission: str, lines: int = 0, line_errors: int = 0) -> None:
        """``submission`` is complete: the job may now finish (once no submitter adds)."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, lines, submission, "1", line_errors])

    def release_submitter(self, job_id: str, submission: str) -> None:
        """``submission`` stopped before completing (an error, a cancel): it no longer holds
        the job open, and does not seal it."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, 0, submission, "0", 0])

    def submit_chunk(self, job_id: str, submission: str, lines: Sequence[Queued]) -> list[str]:
        """Enqueue one chunk of a bulk job in one script (see ``submit`` in scripts.lua);
        returns per line 'q' (enqueued), 's' (skipped: its custom_id is live or succeeded)
        or 'd' (its custom_id came earlier in this submission)."""
        if not lines:
            return []
        pairs: dict[str, int] = {}
        keys = [
            self.keys.job(job_id),
            self.keys.job_custom_ids(job_id),
            self.keys.job_tasks(job_id),
            self.keys.jobs_submitting(),
            self.keys.job_depth(),
        ]
        for line in lines:
            if line.modality not in pairs:
                pairs[line.modality] = len(pairs) + 1
                keys += [self.keys.job_queue(line.modality, job_id)]
                keys += [self.keys.active_jobs(line.modality)]
        args: list[Any] = [job_id, self.ttl_s, submission, self.submitter_lease_s]
        args += [self.keys.task_prefix, len(pairs), len(QUEUED_FIELDS), *QUEUED_FIELDS]
        for line in lines:
            keys.append(self.keys.task(line.task_id))
            values = [_as_text(line.fields.get(name)) for name in QUEUED_FIELDS]
            args += [line.custom_id or "", pairs[line.modality], *values, line.message]
        return [str(code) for code in self.scripts("submit", keys, args)]

    def reap_submitters(self, limit: int = 100) -> int:
        """Look again at jobs whose last submitter stopped renewing (crashed before it
        sealed): finished now if everything else is done."""
        keys = [self.keys.jobs_submitting(), self.keys.events()]
        return int(self.scripts("reap_submitters", keys, [self.keys.job_prefix, limit]))

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
