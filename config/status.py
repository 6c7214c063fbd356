"""The task state machine and the job state, each derived in one place.

A task moves only forward::

    queued ──> running ──> succeeded | failed | cancelled | expired
       └───────────────────────────> cancelled | expired

A redelivered task may go ``running`` again; a terminal state never changes. ``TRANSITIONS``
is the whole table; ``lua/tasks.lua`` enforces it inside Redis.

A job's state is read from its counters and flags by :meth:`JobStatus.from_hash`; every reader
(the CLI, the client, webhooks, the OpenAI batch mapping) takes ``JobStatus.state`` from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["COUNTED", "TERMINAL", "TRANSITIONS", "JobState", "JobStatus", "TaskState"]


class TaskState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    UNKNOWN = "unknown"  # reported for ids Redis has never seen (never "pending")

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED}
)
# The states a job keeps a counter for, in display order.
COUNTED = (
    TaskState.QUEUED,
    TaskState.RUNNING,
    TaskState.SUCCEEDED,
    TaskState.FAILED,
    TaskState.CANCELLED,
    TaskState.EXPIRED,
)

# state -> the states it may move to; None is a task with no state yet (a hash created by the
# pull of a plain ``send_task`` message, or no hash at all). A terminal state never moves.
TRANSITIONS: dict[TaskState | None, frozenset[TaskState]] = {
    None: frozenset({TaskState.QUEUED, TaskState.RUNNING, *TERMINAL}),
    TaskState.QUEUED: frozenset({TaskState.RUNNING, *TERMINAL}),
    TaskState.RUNNING: frozenset({TaskState.RUNNING, *TERMINAL}),
}


def sources_of(state: TaskState) -> list[TaskState | None]:
    """The states a task may be in to move to ``state``."""
    return [src for src, targets in TRANSITIONS.items() if state in targets]


class JobState(str, Enum):
    """A bulk job's state (OpenAI batch words where they exist)."""

    VALIDATING = "validating"  # its submission is still adding lines
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"  # cancel asked for; running tasks finish
    COMPLETED = "completed"
    FAILED = "failed"  # finished with no valid line at all
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its completion window ended with tasks not run
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        return self in _JOB_FINISHED


_JOB_FINISHED = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED}
)


def _number(value: Any, kind: type[int] | type[float] = int) -> Any:
    try:
        return kind(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class JobStatus:
    """A job's counters and milestones, and the state they add up to."""

    job_id: str
    state: JobState
    total: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    sealed: bool = False
    cancel_requested: bool = False
    lines: int = 0
    line_errors: int = 0  # invalid lines of the last complete submission (records: capped)
    validation_error: str | None = None  # why a submission failed validation as a whole
    name: str | None = None
    webhook_url: str | None = None
    tenant: str = "default"
    created_at: float | None = None
    finished_at: float | None = None
    expires_at: float | None = None

    @property
    def done(self) -> int:
        return sum(self.counts.get(s.value, 0) for s in TERMINAL)

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @classmethod
    def unknown(cls, job_id: str) -> JobStatus:
        return cls(job_id, JobState.UNKNOWN)

    @classmethod
    def from_hash(cls, job_id: str, raw: Mapping[str, str]) -> JobStatus:
        """A job hash as Redis holds it (``{}`` when there is none)."""
        if not raw:
            return cls.unknown(job_id)
        counts = {s.value: _number(raw.get(s.value)) or 0 for s in COUNTED}
        fields: dict[str, Any] = {
            "total": _number(raw.get("total")) or 0,
            "counts": counts,
            "sealed": raw.get("sealed") == "1",
            "cancel_requested": raw.get("cancel_requested") == "1",
            "lines": _number(raw.get("lines")) or 0,
            "line_errors": _number(raw.get("line_errors")) or 0,
            "validation_error": raw.get("validation_error") or None,
            "name": raw.get("name") or None,
            "webhook_url": raw.get("webhook_url") or None,
            "tenant": raw.get("tenant") or "default",
            "created_at": _number(raw.get("created_at"), float),
            "finished_at": _number(raw.get("finished_at"), float),
            "expires_at": _number(raw.get("expires_at"), float),
        }
        return cls(job_id, _job_state(fields), **fields)

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state.value,
            "total": self.total,
            "done": self.done,
            "counts": dict(self.counts),
            "finished": self.finished,
            "sealed": self.sealed,
            "lines": self.lines,
            "line_errors": self.line_errors,
            "validation_error": self.validation_error,
            "name": self.name,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "expires_at": self.expires_at,
        }


def _job_state(fields: Mapping[str, Any]) -> JobState:
    """validating → in_progress (→ cancelling) → completed | failed | cancelled | expired."""
    if not fields["sealed"]:
        return JobState.VALIDATING
    if fields["finished_at"] is None:
        return JobState.CANCELLING if fields["cancel_requested"] else JobState.IN_PROGRESS
    if fields["cancel_requested"]:
        return JobState.CANCELLED
    if fields["counts"].get(TaskState.EXPIRED.value):
        return JobState.EXPIRED
    if fields["total"] == 0:
        return JobState.FAILED  # no valid line at all
    return JobState.COMPLETED
