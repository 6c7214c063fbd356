"""The state layer: everything vlmq keeps in Redis, one module (and one Lua file) per concern.

=================  ==========================================  ============================
concern            Python                                      Lua (``vlmq/broker/lua/``)
=================  ==========================================  ============================
intake and leases  ``intake.py``: Intake, Leases, WorkerRecords  ``intake.lua``
tasks: moves and   ``tasks.py``: Tasks (transition, settle,     ``tasks.lua``
settle (fencing)   dead letters, reads)
jobs and feeds     ``jobs.py``: Jobs, Feeds                     ``jobs.lua``
tenants            ``tenants.py``: Tenants (quotas, rates)      ``tenants.lua``
events             ``events.py``: Events (webhook events)       ``events.lua``
usage (read back)  ``usage.py``: read_usage, usage_report       counted in ``tasks.lua``
task layouts       ``layouts.py``: Layouts (the switch)         ``layouts.lua``
=================  ==========================================  ============================

Every script runs through one dispatch (``vlmq/broker/scripts.py``, ``lua/dispatch.lua``), every
key name comes from ``config/keys.py``, the task state machine and the job state from
``config/status.py``. What happens to a task, step by step: ``Jobs.submit``/``enqueue`` or a
feed creates it; ``Intake.pull`` delivers it; ``Tasks.moves`` starts it; ``Tasks.settle``
ends it; ``Leases`` renew, give back and reap it in between.

:class:`State` opens them all on one connection.
"""

from __future__ import annotations

import time

import redis as redis_py

from vlmq.broker.scripts import REPLAY_TTL_S, Scripts, Wait
from vlmq.broker.state.events import Events
from vlmq.broker.state.feeds import Feeds
from vlmq.broker.state.intake import Intake, Leases
from vlmq.broker.state.jobs import Jobs
from vlmq.broker.state.layouts import Layouts
from vlmq.broker.state.locks import NamedLeases
from vlmq.broker.state.tasks import Tasks
from vlmq.broker.state.tenants import Tenants
from vlmq.broker.state.workers import WorkerRecords
from vlmq.config.ids import FED_ID
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState

__all__ = ["State"]


class State:
    """The state layer's concerns over one Redis connection (pool) and one key layout."""

    def __init__(
        self,
        redis: redis_py.Redis,
        keys: Keys,
        ttl_s: int = 7 * 86400,
        submitter_lease_s: float = 300.0,
        wait: Wait | None = None,
        replay_ttl_s: int = REPLAY_TTL_S,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.scripts = Scripts(redis, keys, replay_ttl_s)
        self.tasks = Tasks(redis, self.scripts, keys, ttl_s, wait)
        self.jobs = Jobs(redis, self.scripts, keys, self.tasks, ttl_s, submitter_lease_s)
        self.feeds = Feeds(redis, self.scripts, keys, self.jobs)
        self.tenants = Tenants(redis, self.scripts, keys)
        self.events = Events(self.scripts, keys)
        self.leases = Leases(self.scripts, keys)
        self.workers = WorkerRecords(redis, self.scripts, keys)
        self.named = NamedLeases(redis, self.scripts)
        self.layouts = Layouts(redis, self.scripts, keys)

    def intake(self, modality: str, role: str = "gpu") -> Intake:
        """A pull of one modality class's queues, for a GPU or a prepare worker."""
        return Intake(self.redis, self.scripts, self.keys, modality, self.ttl_s, role)

    def cancel(self, task_or_job_id: str, *, unseen: bool = False) -> int:
        """Cancel queued tasks (a job's, or one); returns how many were cancelled. With
        ``unseen``, a task no pull has read yet (a plain ``send_task`` message still in its
        queue, which has no hash) is cancelled too: its hash is made, cancelled, with the task
        ttl, and the pull drops its message (a Celery revoke, docs/celery.md)."""
        fields = {"finished_at": f"{time.time():.6f}", "error_code": "cancelled"}
        if self.jobs.exists(task_or_job_id):
            job_id = task_or_job_id
            self.jobs.request_cancel(job_id)
            # Lines not fed yet are cancelled in one step per feed; the fed ones a page at a
            # time (a feed refuses to feed a job that asked to cancel: none are added meanwhile).
            unfed = sum(
                self.feeds.drop(job_id, feed_id, TaskState.CANCELLED)
                for feed_id in self.feeds.of_job(job_id)
            )
            return unfed + self.jobs.finish_queued(job_id, TaskState.CANCELLED, fields)
        only: list[TaskState | None] = [TaskState.QUEUED]
        # A fed task without a hash was folded into its job: it ended, it is not unseen.
        unseen = unseen and not FED_ID.match(task_or_job_id)
        if unseen:
            only.append(None)
        moved = self.tasks.transition(task_or_job_id, TaskState.CANCELLED, fields, only)
        if unseen:  # every task hash has a ttl; this keeps a made one's (a retry's too)
            self.redis.expire(self.keys.task(task_or_job_id), self.ttl_s, nx=True)
        return int(moved.moved)
