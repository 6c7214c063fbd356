"""The chores any worker does for the whole fleet, every ``reap_interval_s``.

Put back messages whose holder stopped renewing their lease (it died), expire the queued tasks
of jobs past their completion window, finish jobs whose last submitter crashed before sealing,
and take finished-job events for their webhooks.
"""

from __future__ import annotations

import logging
import time

from vlmq.broker.state import State
from vlmq.config.status import TaskState
from vlmq.workers.fleet.webhooks import WebhookSender

__all__ = ["Housekeeper"]

log = logging.getLogger(__name__)

_EXPIRED = {
    "error_code": "expired",
    "error_message": "the job's completion window ended before it ran",
}


class Housekeeper:
    def __init__(
        self,
        state: State,
        webhooks: WebhookSender,
        interval_s: float,
    ) -> None:
        self.state = state
        self.webhooks = webhooks
        self.interval_s = interval_s
        self._last = float("-inf")

    def tick(self) -> None:
        """Do the chores if ``interval_s`` passed since the last time (this worker's own
        monotonic clock paces them; every deadline they judge is on Redis's clock)."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        moved = self.state.leases.reap()
        if moved:
            log.warning("requeued %d messages whose worker stopped renewing", moved)
        self.expire_jobs()
        self.state.jobs.reap_submitters()
        self.webhooks.poll()

    def expire_jobs(self) -> int:
        """Tasks of jobs past their completion window that never started: expired."""
        redis, keys, jobs = self.state.redis, self.state.keys, self.state.jobs
        seconds, micros = redis.time()
        due: list[str] = redis.zrangebyscore(  # type: ignore[assignment]
            keys.job_expiry(), "-inf", seconds + micros / 1e6, 0, 10
        )
        expired = 0
        for job_id in due:
            # The rest of its input in one step per feed; its queued fed tasks (a window at
            # most) expire as they are pulled, so a 10-million-line job costs this loop no more
            # than a small one.
            for feed_id in self.state.feeds.of_job(job_id):
                expired += self.state.feeds.drop(job_id, feed_id, TaskState.EXPIRED)
            expired += jobs.finish_queued(job_id, TaskState.EXPIRED, _EXPIRED, fed=False)
            redis.zrem(keys.job_expiry(), job_id)
        return expired

    def close(self) -> None:
        self.webhooks.close()
