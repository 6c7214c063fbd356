"""The state layer: everything vlmq keeps in Redis, one module (and one Lua file) per concern.

=================  ==========================================  ============================
concern            Python                                      Lua (``config/lua/``)
=================  ==========================================  ============================
intake and leases  ``intake.py``: Intake, Leases, WorkerRecords  ``intake.lua``
tasks: moves and   ``tasks.py``: Tasks (transition, settle,     ``tasks.lua``
settle (fencing)   dead letters, reads)
jobs and feeds     ``jobs.py``: Jobs, Feeds                     ``jobs.lua``
tenants            ``tenants.py``: Tenants (quotas, rates)      ``tenants.lua``
events             ``events.py``: Events (webhook events)       ``events.lua``
=================  ==========================================  ============================

Every script runs through one dispatch (``config/scripts.py``, ``lua/dispatch.lua``), every
key name comes from ``config/keys.py``, the task state machine and the job state from
``config/status.py``. What happens to a task, step by step: ``Jobs.submit``/``enqueue`` or a
feed creates it; ``Intake.pull`` delivers it; ``Tasks.moves`` starts it; ``Tasks.settle``
ends it; ``Leases`` renew, give back and reap it in between.

:class:`State` opens them all on one connection.
"""

from __future__ import annotations

import redis as redis_py

from vlmq.config.keys import Keys
from vlmq.config.scripts import REPLAY_TTL_S, Scripts, Wait
from vlmq.config.state.events import Events
from vlmq.config.state.intake import Intake, Leases, NamedLeases, WorkerRecords
from vlmq.config.state.jobs import Feeds, Jobs
from vlmq.config.state.tasks import Tasks
from vlmq.config.state.tenants import Tenants

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

    def intake(self, modality: str, role: str = "gpu") -> Intake:
        """A pull of one modality class's queues, for a GPU or a prepare worker."""
        return Intake(self.redis, self.scripts, self.keys, modality, self.ttl_s, role)
