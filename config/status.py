"""Task states and the Redis key layout, in one place.

State moves only forward::

    queued ──> running ──> succeeded | failed | cancelled | expired
       └───────────────────────────> cancelled | expired

A redelivered task may go ``running`` again; a terminal state never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LANES", "TERMINAL", "Keys", "TaskState"]

# The lanes of each class: interactive is drained before any bulk work.
LANES = ("interactive", "bulk")


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
COUNTED = (
    TaskState.QUEUED,
    TaskState.RUNNING,
    TaskState.SUCCEEDED,
    TaskState.FAILED,
    TaskState.CANCELLED,
    TaskState.EXPIRED,
)


@dataclass(frozen=True)
class Keys:
    """Every Redis key vlmq writes, derived from one prefix.

    Queue lists use the plain queue names so that Celery's kombu transport
    and vlmq share them (``send_task(..., queue="vlmq.image")`` lands in the
    list ``vlmq.image``).
    """

    prefix: str = "vlmq"

    def queue(self, modality: str, lane: str = "bulk") -> str:
        base = f"{self.prefix}.{modality}"
        return base if lane == "bulk" else f"{base}.{lane}"

    def job_queue(self, modality: str, job_id: str) -> str:
        """A bulk job's own list: workers share out batches fairly across jobs."""
        return f"{self.prefix}.{modality}.job.{job_id}"

    def active_jobs(self, modality: str) -> str:
        """Set of a class's job lists that may hold messages (fair-share members)."""
        return f"{self.prefix}.{modality}:active"

    def job_errors(self, job_id: str) -> str:
        """Hash line number -> invalid-line record of a bulk submission."""
        return f"{self.prefix}:job:{job_id}:errors"

    def job_expiry(self) -> str:
        """Sorted set job id -> completion deadline."""
        return f"{self.prefix}:jobs:expiry"

    def events(self) -> str:
        """List of job-finished events waiting for their webhook."""
        return f"{self.prefix}:events"

    def events_processing(self) -> str:
        return f"{self.prefix}:events:processing"

    def files(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}:task:{task_id}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def job_tasks(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:tasks"

    def job_custom_ids(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:custom_ids"

    def inflight(self) -> str:
        """Hash task id -> raw message of every message a worker holds."""
        return f"{self.prefix}:inflight"

    def leases(self) -> str:
        """Sorted set task id -> lease deadline (unix seconds)."""
        return f"{self.prefix}:leases"

    def lease_queue(self) -> str:
        """Hash task id -> queue the message came from (for redelivery)."""
        return f"{self.prefix}:inflight:queue"

    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    def workers(self) -> str:
        return f"{self.prefix}:workers"
