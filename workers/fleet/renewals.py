"""Whether this worker's lease renewals keep up, judged on Redis's clock.

The heartbeat thread renews every lease the worker holds. When that thread stalls (the host
starved of CPU, a clock that jumped so a timed wait never returns: libfaketime with the
monotonic clock shifted, measured in issue 38), the worker's leases lapse and what it holds is
delivered again elsewhere, while its batch loop would go on pulling work it cannot hold. So the
loop asks here before it pulls and before it starts a micro-batch: the age of the last renewal,
both ends read from Redis (``TIME``), never from this host's clock or a timed wait. Past
``stall_after_s`` the worker is stalled: it pulls nothing, gives back what it has not started
(a clean return, not a death), and lets what runs finish (its settle is fenced). The first
renewal that lands ends the stall.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis

from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["Renewals", "redis_time"]

log = logging.getLogger(__name__)

# A renewal older than this share of the lease is a stall: the heartbeat renews every third of
# a lease, so this is half a beat late; nothing is pulled then.
STALL_SHARE = 1 / 2
# A micro-batch starts only while its leases have this share of a lease left (they run from
# its pull or from the last renewal, whichever is later); otherwise it is given back. A third:
# a heartbeat merely late on a loaded host (a beat missed) gives nothing back.
START_SHARE = 1 / 3


def redis_time(redis: Redis) -> float:
    """Redis's clock, in seconds."""
    seconds, micros = redis.time()
    return float(seconds) + micros / 1e6


class Renewals:
    """The Redis time of the worker's last completed renewal, and the stall it makes."""

    def __init__(
        self,
        clock: Callable[[], float],
        lease_s: float,
        observer: LoopObserver,
    ) -> None:
        self.clock = clock
        self.lease_s = lease_s
        self.stall_after_s = lease_s * STALL_SHARE
        self.observer = observer
        self._renewed_at: float | None = None
        self._confirmed = False  # a renewal has landed since this worker started
        self._stalled = False
        self._lock = threading.Lock()

    def renewing(self) -> float:
        """Redis's time as a renewal begins (pass it to :meth:`renewed` once it is done):
        what the renewal extends is held from then on."""
        return self.clock()

    def renewed(self, at: float) -> None:
        """A renewal that began at ``at`` (Redis's time) is done."""
        with self._lock:
            if self._renewed_at is not None and at <= self._renewed_at:
                return
            self._renewed_at = at
            self._confirmed = True
            was_stalled, self._stalled = self._stalled, False
        if was_stalled:
            log.warning("lease renewals resumed; pulling again")
            self.observer.renewals_stalled(False)

    def stalled(self) -> bool:
        """Whether the last renewal is older than ``stall_after_s`` by Redis's clock (the
        first call starts the count: a worker that just started has renewed nothing yet)."""
        now = self.clock()
        with self._lock:
            if self._renewed_at is None:
                self._renewed_at = now
            age = now - self._renewed_at
            stalled = age > self.stall_after_s
            began, self._stalled = stalled and not self._stalled, stalled or self._stalled
        if began:
            log.warning(
                "lease renewals stalled: the last one was %.1fs ago (a lease is %.1fs); "
                "pulling nothing and giving back what has not started until they resume",
                age,
                self.lease_s,
            )
            self.observer.renewals_stalled(True)
        return stalled

    def may_pull(self, holding: bool) -> bool:
        """Whether to pull more: renewals keep up, and, until the first one has landed,
        nothing is held yet (a worker whose heartbeat never ran prefetches nothing it
        would have to give back)."""
        if holding and not self._confirmed:
            return False
        return not self.stalled()

    def holds(self, pulled_at: float) -> bool:
        """Whether work pulled at ``pulled_at`` (Redis's time) may start: renewals keep up,
        or its leases (from its pull, or the last renewal if later) still have
        ``START_SHARE`` of a lease left."""
        if not self.stalled():
            return True
        with self._lock:
            renewed_at = self._renewed_at or pulled_at
        left = max(pulled_at, renewed_at) + self.lease_s - self.clock()
        return left >= self.lease_s * START_SHARE
