"""Events: finished-job events waiting for their webhook, taken under a lease.

The settle (or a seal, a dropped feed) queues a job id on ``Keys.events()`` exactly once, when
a sealed job's last task turns terminal (``lua/jobs.lua`` ``finish_check``). A sender takes
events under a lease (``Keys.events_leased()``), renews it before each attempt, and marks each
done when delivered or given up; one that stops gives back what it had not started; one that
dies leaves leases that lapse, and any worker's housekeeping puts those events back
(``lua/events.lua``). Taking is the one call not safe to repeat (a retry answers the events its
first run took); the rest are.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmq.broker.scripts import Scripts
from vlmq.config.keys import Keys

__all__ = ["Events"]


class Events:
    def __init__(self, scripts: Scripts, keys: Keys) -> None:
        self.scripts = scripts
        self._keys = [keys.events(), keys.events_leased()]

    def reap(self) -> int:
        """Put back events whose sender died (their lease ran out)."""
        return int(self.scripts("reap_events", self._keys, []))

    def take(self, most: int, lease_s: float) -> list[str]:
        """Up to ``most`` events, leased to the caller for ``lease_s``."""
        return [str(job) for job in self.scripts("take_events", self._keys, [most, lease_s])]

    def renew(self, job_id: str, lease_s: float) -> None:
        self.scripts("renew_event", self._keys, [job_id, lease_s])

    def give_back(self, job_ids: Sequence[str]) -> int:
        """Events taken but not started (the sender is stopping) go back at once."""
        if not job_ids:
            return 0
        return int(self.scripts("return_events", self._keys, list(job_ids)))

    def done(self, job_id: str) -> None:
        """Delivered, or given up (and the job says so)."""
        self.scripts("done_event", self._keys, [job_id])
