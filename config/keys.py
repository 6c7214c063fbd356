"""Every Redis key vlmq writes, built in one place from one prefix.

Queue lists use the plain queue names so that Celery's kombu transport and vlmq share them
(``send_task(..., queue="vlmq.image")`` lands in the list ``vlmq.image``). Everything else is
``{prefix}:...``. Lua scripts receive the names built here as KEYS or ARGV; where a script must
reach a key it only learns while running (the hash of a task it just pulled), it receives the
prefix from here (``task_prefix``, ``job_prefix``) and appends the id, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JOB_SUFFIXES", "LANES", "Keys"]

# The lanes of each class: interactive is drained before any bulk work.
LANES = ("interactive", "bulk")

# A job's own keys are its hash's name plus one of these. The Lua learns a task's job while it
# runs and appends them itself: vlmq/broker/scripts.py hands it this table (JOB_KEYS), so each
# suffix is spelled here only.
JOB_SUFFIXES = {
    "tasks": ":tasks",
    "claims": ":custom_ids",
    "finished": ":finished",
    "errors": ":errors",
    "usage": ":usage",
}


@dataclass(frozen=True)
class Keys:
    prefix: str = "vlmq"

    # queues ----------------------------------------------------------------
    def queue(self, modality: str, lane: str = "bulk") -> str:
        base = f"{self.prefix}.{modality}"
        return base if lane == "bulk" else f"{base}.{lane}"

    def job_queue(self, modality: str, job_id: str) -> str:
        """A bulk job's own list: workers share out batches fairly across jobs."""
        return f"{self.prefix}.{modality}.job.{job_id}"

    def lane_queue(self, modality: str, lane: str, job_id: str | None = None) -> str:
        """Where a task of ``lane`` goes: its bulk job's own list, else the lane's list."""
        if lane == "bulk" and job_id is not None:
            return self.job_queue(modality, job_id)
        return self.queue(modality, lane)

    # The suffix of a prepared list (vlmq/broker/lua/intake.lua tells them by it).
    PREPARED_SUFFIX = ".prepared"

    def prepared_queue(self, modality: str, lane: str = "bulk") -> str:
        """A lane's prepared list: tasks whose media a prepare worker fetched, decoded and
        stored in the frame store, handed on to the GPU workers (no priority steps: the
        order was decided when they were first pulled). Never a Celery queue."""
        return f"{self.queue(modality, lane)}{self.PREPARED_SUFFIX}"

    def control_queue(self) -> str:
        """The Celery queue a worker's own Celery consumer listens on (``vlmq.ping``)."""
        return f"{self.prefix}.control"

    def active_tenants(self, modality: str) -> str:
        """Sorted set of a class's tenants with job lists that may hold messages (each member
        is that tenant's ``active_jobs`` zset), scored by when each was last served: the pull
        shares a class first across tenants, then across each tenant's jobs."""
        return f"{self.prefix}.{modality}:active"

    def active_jobs(self, modality: str, tenant: str) -> str:
        """Sorted set of one tenant's job lists of a class that may hold messages, scored by
        when each was last served. Always ``active_tenants(modality)`` + ':' + the tenant
        (lua/intake.lua finds the class's set from a tenant's by that rule; tenant names hold no
        ':')."""
        return f"{self.active_tenants(modality)}:{tenant}"

    def job_depth(self) -> str:
        """Hash active-tenants zset -> messages waiting in its job lists (kept by enqueue, pull
        and requeue, so a class's depth costs the same with 10 or 100,000 active jobs)."""
        return f"{self.prefix}:depth"

    # tasks -----------------------------------------------------------------
    def task(self, task_id: str) -> str:
        return f"{self.prefix}:task:{task_id}"

    @property
    def task_prefix(self) -> str:
        """``task(id)`` is this plus the id (for scripts that learn ids as they run)."""
        return self.task("")

    def inflight(self) -> str:
        """Hash task id -> raw message of every message a worker holds."""
        return f"{self.prefix}:inflight"

    def leases(self) -> str:
        """Sorted set task id -> lease deadline (unix seconds)."""
        return f"{self.prefix}:leases"

    def lease_queue(self) -> str:
        """Hash task id -> queue the message came from (for redelivery)."""
        return f"{self.prefix}:inflight:queue"

    def lease_active(self) -> str:
        """Hash task id -> the fair-share set its job list belongs to (job lists only)."""
        return f"{self.prefix}:inflight:active"

    def bookkeeping(self) -> list[str]:
        """KEYS[1..5] of every in-flight script (lua/intake.lua): in-flight messages, leases,
        origin queues, origin fair-share sets, job-list depths."""
        return [
            self.inflight(),
            self.leases(),
            self.lease_queue(),
            self.lease_active(),
            self.job_depth(),
        ]

    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    # jobs ------------------------------------------------------------------
    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    @property
    def job_prefix(self) -> str:
        """``job(id)`` is this plus the id (for scripts that read a task's job id)."""
        return self.job("")

    def job_tasks(self, job_id: str) -> str:
        return self.job(job_id) + JOB_SUFFIXES["tasks"]

    def job_custom_ids(self, job_id: str) -> str:
        """Hash claim (a digest of a custom_id) -> 'submission' while its task lives, then its
        folded record 'submission code[delivery]' (lua/tasks.lua ``fold``): the job's index of
        its fed tasks, and all that is left of a finished one. ``job(id)`` plus its suffix
        (the fold, learning the job from the task, appends it: JOB_SUFFIXES)."""
        return self.job(job_id) + JOB_SUFFIXES["claims"]

    def job_finished(self, job_id: str) -> str:
        """List of the job's task ids in the order they reached a terminal state, each once
        (lua/tasks.lua appends it in the step that ends the task): readers page through it by
        offset to follow a running job. ``job(id)`` plus its suffix; expires with the job."""
        return self.job(job_id) + JOB_SUFFIXES["finished"]

    def job_numbers(self) -> str:
        """Counter giving each job a short number (fed task ids start with it)."""
        return f"{self.prefix}:jobs:number"

    def job_ref(self, number: str) -> str:
        """String job number -> job id."""
        return f"{self.prefix}:jobref:{number}"

    @property
    def job_ref_prefix(self) -> str:
        return self.job_ref("")

    def feeds(self) -> str:
        """Sorted set feed id -> lease deadline of its feeder (0: free): inputs still entering."""
        return f"{self.prefix}:feeds"

    def feed(self, feed_id: str) -> str:
        """Hash of one feed: job, input object, cursor (byte offset), lines left, lane."""
        return f"{self.prefix}:feed:{feed_id}"

    def job_errors(self, job_id: str) -> str:
        """Hash line number -> invalid-line record of a bulk submission."""
        return self.job(job_id) + JOB_SUFFIXES["errors"]

    def jobs_submitting(self) -> str:
        """Sorted set job id -> latest lease of a submitter still adding to it."""
        return f"{self.prefix}:jobs:submitting"

    def job_expiry(self) -> str:
        """Sorted set job id -> completion deadline."""
        return f"{self.prefix}:jobs:expiry"

    def events(self) -> str:
        """List of job-finished events waiting for their webhook."""
        return f"{self.prefix}:events"

    def events_leased(self) -> str:
        """Sorted set job id -> lease deadline of events a webhook sender is delivering."""
        return f"{self.prefix}:events:leased"

    # tenants ---------------------------------------------------------------
    def quota(self, tenant: str) -> str:
        """Hash of a tenant's queued work: 'tasks' (queued, fed or not) and 'tokens' (their
        estimate). Jobs and standalone tasks carry this name ('quota'), so the scripts that
        move tasks keep it without knowing the tenant."""
        return f"{self.prefix}:quota:{tenant}"

    def usage(self, tenant: str) -> str:
        """Hash of a tenant's usage since it began: '<model>|<modality>|<metric>' -> count
        (config/usage.py; bounded by models x modalities x metrics)."""
        return f"{self.usage_prefix}{tenant}"

    @property
    def usage_prefix(self) -> str:
        return f"{self.prefix}:usage:"

    def usage_tenants(self) -> str:
        """Set of the tenants with usage (an admin's view of all)."""
        return f"{self.prefix}:usage-tenants"

    def job_usage(self, job_id: str) -> str:
        """A job's usage, as ``usage`` (``job(id)`` plus its suffix; expires with the job)."""
        return self.job(job_id) + JOB_SUFFIXES["usage"]

    def rate_bucket(self, caller: str) -> str:
        """A caller's request-rate token bucket, shared by every API process (expires idle)."""
        return f"{self.prefix}:rate:{caller}"

    # the HTTP API's OpenAI objects -----------------------------------------
    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def files_index(self, tenant: str | None = None) -> str:
        """Sorted set file id -> creation time (newest-first listing): every tenant's, or
        (``tenant``) one tenant's."""
        base = f"{self.prefix}:files"
        return base if tenant is None else f"{base}:{tenant}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_lock(self, batch_id: str, activity: str) -> str:
        """One API process at a time feeds or finalizes a batch."""
        return f"{self.prefix}:batch:{batch_id}:{activity}"

    def batches_index(self, tenant: str | None = None) -> str:
        """Sorted set batch id -> creation time (newest-first listing): every tenant's, or
        (``tenant``) one tenant's."""
        base = f"{self.prefix}:batches"
        return base if tenant is None else f"{base}:{tenant}"

    # workers ---------------------------------------------------------------
    def workers(self) -> str:
        """Hash worker name -> heartbeat record."""
        return f"{self.prefix}:workers"

    def workers_heard(self) -> str:
        """Sorted set worker name -> Redis's time of its last heartbeat (silent ones' records
        are pruned)."""
        return f"{self.prefix}:workers:heard"

    def finished_channel(self, listener: str) -> str:
        """Pub/sub channel one waiting process listens on: a task whose hash names it
        (``notify``) is published there, by id, when it ends."""
        return f"{self.prefix}:finished:{listener}"

    # calls -----------------------------------------------------------------
    def layout(self) -> str:
        """The task layout in force (absent: 1); a library that cannot read it refuses every
        call (vlmq/broker/layouts.py)."""
        return f"{self.prefix}:layout"

    def libraries(self) -> str:
        """When each version's Lua library was last loaded (vlmq/broker/scripts.py prunes
        the stale ones by it)."""
        return f"{self.prefix}:libraries"

    def call(self, call_id: str) -> str:
        """The reply a call that is not safe to repeat keeps for its retries
        (vlmq/broker/scripts.py)."""
        return f"{self.prefix}:call:{call_id}"
