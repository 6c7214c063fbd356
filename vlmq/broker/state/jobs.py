"""Jobs: a job's life (open, seal, finish, cancel, expire) and how its tasks enter.

A job is one hash (``Keys.job``) with a counter per task state, kept by every script that
moves one of its tasks (``lua/tasks.lua``); ``JobStatus.from_hash`` derives its state once.
Tasks enter three ways, each one script, all or nothing, safe to retry:

* ``Jobs.submit``: a job's tasks whose ids the caller chose (``Client.submit_many``), into
  the job's own list per class;
* ``Jobs.enqueue``: tasks outside any job's own list (``Client.submit``, the interactive
  lane);
* ``Feeds`` (``feeds.py``): a bulk submission's staged input, fed a window at a time
  (vlmq/broker/feeding.py).

Every task's hash records its message's tag (``config/ids.py``), so the pull knows which
task a message is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Scripts
from vlmq.broker.state.tasks import Folded, Move, Tasks
from vlmq.config.errors import InvalidRequest
from vlmq.config.ids import check_id, fed_task_id, message_tag, valid_id
from vlmq.config.jsonl import LineError
from vlmq.config.keys import Keys
from vlmq.config.status import JobStatus, TaskState
from vlmq.config.tenants import DEFAULT_TENANT

__all__ = ["QUEUED_FIELDS", "Jobs", "Queued", "class_pairs", "status_layout"]

# The status fields a new task's hash is created with (besides state and the stamps):
# ``claim`` marks a fed task, folded into its job when it ends (lua/tasks.lua ``fold``);
# ``quota`` a task that counts in its tenant's quota itself; ``notify`` the channel told when
# it ends (a waiting API process's: Keys.finished_channel); ``tag`` its message's.
QUEUED_FIELDS = (
    "job_id",
    "custom_id",
    "modality",
    "queue",
    "expires_at",
    "claim",
    "tenant",
    "est",
    "quota",
    "notify",
    "tag",
)
# The fields a producer gives; the tag is read from the message.
_GIVEN_FIELDS = QUEUED_FIELDS[:-1]
# The fields a call's tasks may share, sent once when they do ('est' stays per task: the
# scripts sum it).
_SHAREABLE = frozenset({"job_id", "modality", "queue", "expires_at", "tenant", "quota", "notify"})


@dataclass(frozen=True)
class Queued:
    """One task ready to enqueue: its id, custom_id, class, status fields and message."""

    task_id: str
    custom_id: str | None
    modality: str
    fields: Mapping[str, Any]
    message: str

    def values(self) -> list[str]:
        """Its status fields as the scripts take them (QUEUED_FIELDS order, '' unset; the
        tag, last, its message's)."""
        fields = self.fields
        values = [_as_text(fields.get(name)) for name in _GIVEN_FIELDS]
        values.append(message_tag(self.message))
        return values


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


def status_layout(lines: Sequence[Queued]) -> tuple[list[Any], list[list[str]]]:
    """The status fields as the enqueueing scripts read them (common.lua read_names): the
    names each task sends a value for, then the name/value pairs all of the call's tasks
    share (a chunk's job, class and expiry: sent once, not once a task, and an empty one not
    at all); and each task's values for those names. Each argument costs the script a string."""
    values = [line.values() for line in lines]
    same = {
        i
        for i, name in enumerate(QUEUED_FIELDS)
        if name in _SHAREABLE and len({v[i] for v in values}) == 1
    }
    own = [i for i in range(len(QUEUED_FIELDS)) if i not in same]
    pairs = [x for i in sorted(same) if values[0][i] for x in (QUEUED_FIELDS[i], values[0][i])]
    header = [len(own), *(QUEUED_FIELDS[i] for i in own), len(pairs) // 2, *pairs]
    return header, [[v[i] for i in own] for v in values]


class Jobs:
    """Jobs: open, seal, enqueue into, cancel or expire their queued tasks, and read."""

    def __init__(
        self,
        redis: redis_py.Redis,
        scripts: Scripts,
        keys: Keys,
        tasks: Tasks,
        ttl_s: int,
        submitter_lease_s: float,
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.tasks = tasks
        self.ttl_s = ttl_s
        self.submitter_lease_s = submitter_lease_s

    # a job's life ----------------------------------------------------------
    def open(
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
            return str(self.scripts("open_job", keys, args))
        except redis_py.ResponseError as exc:
            if "OWNED" not in str(exc):
                raise
            raise InvalidRequest(f"job id {job_id!r} is in use by another tenant") from None

    def seal(self, job_id: str, submission: str, lines: int = 0, line_errors: int = 0) -> None:
        """``submission`` is complete: the job may now finish (once no submitter adds)."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, lines, submission, "1", line_errors])

    def release_submitter(self, job_id: str, submission: str) -> None:
        """``submission`` stopped before completing (an error, a cancel): it no longer holds
        the job open, and does not seal it."""
        keys = [self.keys.job(job_id), self.keys.events()]
        self.scripts("seal", keys, [job_id, 0, submission, "0", 0])

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
        ids = self.live_task_ids(job_id, page) if fed else self.listed_task_ids(job_id, page)
        for chunk in _pages(ids, page):
            moves = [Move(task_id, state, fields, stamp="finished_at") for task_id in chunk]
            replies = self.tasks.moves(moves, only_from=[TaskState.QUEUED])
            moved += sum(1 for r in replies if r.moved)
        return moved

    def record_line_errors(self, job_id: str, errors: Sequence[LineError], cap: int) -> None:
        """Keep the first ``cap`` invalid-line records of a job (the job counts them all): a
        file of millions of bad lines must not fill Redis. (Safe to repeat: the same fields.)"""
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

    # enqueue ---------------------------------------------------------------
    def submit(self, job_id: str, submission: str, lines: Sequence[Queued]) -> int:
        """Enqueue tasks of a job whose ids are the caller's, in one script (``submit``)."""
        if not lines:
            return 0
        keys = [
            self.keys.job(job_id),
            self.keys.job_tasks(job_id),
            self.keys.jobs_submitting(),
            self.keys.job_depth(),
        ]
        pairs = class_pairs(self.keys, keys, job_id, lines, "bulk", self.tenant(job_id))
        args: list[Any] = [job_id, self.ttl_s, submission, self.submitter_lease_s]
        args += [self.keys.task_prefix, len(pairs), self.keys.job_ref_prefix]
        header, values = status_layout(lines)
        args += header
        for line, own in zip(lines, values, strict=True):
            keys.append(self.keys.task(line.task_id))
            args += [pairs[line.modality], *own, line.message]
        return int(self.scripts("submit", keys, args))

    def enqueue(self, tenant: str, lines: Sequence[Queued]) -> int:
        """Enqueue tasks outside any job's own list, in one script (``enqueue``): each in the
        list its ``queue`` field names, counted in its tenant's quota itself, and in its job
        (if any) and the job's task list."""
        if not lines:
            return 0
        lists: dict[str, int] = {}
        jobs: dict[str, int] = {}
        for line in lines:
            lists.setdefault(str(line.fields["queue"]), len(lists) + 1)
            job_id = line.fields.get("job_id")
            if job_id:
                jobs.setdefault(str(job_id), len(jobs) + 1)
        keys = [self.keys.quota(tenant), *lists]
        for job_id in jobs:
            keys += [self.keys.job(job_id), self.keys.job_tasks(job_id)]
        args: list[Any] = [self.ttl_s, self.keys.task_prefix, self.keys.job_ref_prefix]
        header, values = status_layout(lines)
        args += [len(lists), len(jobs), *header]
        for line, own in zip(lines, values, strict=True):
            keys.append(self.keys.task(line.task_id))
            pair = jobs.get(str(line.fields.get("job_id") or ""), 0)
            args += [lists[str(line.fields["queue"])], pair, *own, line.message]
        return int(self.scripts("enqueue", keys, args))

    # reads -----------------------------------------------------------------
    # Reads take ids from callers: one that is not an id never forms a key (``J:custom_ids``
    # would name a job's claims hash, millions of fields read in one blocking call).
    def exists(self, job_id: str) -> bool:
        return valid_id(job_id) and bool(self.redis.exists(self.keys.job(job_id)))

    def get(self, job_id: str) -> JobStatus:
        if not valid_id(job_id):
            return JobStatus.unknown(job_id)
        raw: dict[str, str] = self.redis.hgetall(self.keys.job(job_id))  # type: ignore[assignment]
        return JobStatus.from_hash(job_id, raw)

    def tenant(self, job_id: str) -> str:
        """The tenant a job belongs to."""
        if not valid_id(job_id):
            return DEFAULT_TENANT
        stored: str | None = self.redis.hget(self.keys.job(job_id), "tenant")  # type: ignore[assignment]
        return stored or DEFAULT_TENANT

    def task_tenant(self, status: Mapping[str, str]) -> str:
        """The tenant of a task from its status: its own field, else its job's (a fed task
        carries none: its job's is the one)."""
        if status.get("tenant"):
            return status["tenant"]
        job_id = status.get("job_id")
        return self.tenant(job_id) if job_id else DEFAULT_TENANT

    def task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
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


def class_pairs(
    keys: Keys, out: list[str], job_id: str, lines: Sequence[Queued], lane: str, tenant: str
) -> dict[str, int]:
    """Appends each class's list and its tenant's active zset to ``out`` (the script's KEYS);
    returns class -> its pair number."""
    pairs: dict[str, int] = {}
    for line in lines:
        if line.modality not in pairs:
            pairs[line.modality] = len(pairs) + 1
            out += [
                keys.lane_queue(line.modality, lane, job_id),
                keys.active_jobs(line.modality, tenant),
            ]
    return pairs


def _pages(items: Iterator[str], size: int) -> Iterator[list[str]]:
    while page := list(islice(items, size)):
        yield page
