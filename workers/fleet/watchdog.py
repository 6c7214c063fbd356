"""The worker's watchdog: while nothing is stuck, renew the leases of what the worker holds and
report the queues, the engine's counters and the stages; once something is stuck, stop.

An engine call past ``fleet.batch_time_limit_s``, or a stage busy on one item past
``worker.stage_time_limit_s``, is stuck (read from the ``StageClock``, which times every
stage, the engine call as ``generate``): the heartbeat then stops renewing, so the worker
exits for its supervisor and its leases lapse and are redelivered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from vlmq.broker.queues import waiting
from vlmq.config.settings import FleetSettings, WorkerSettings
from vlmq.workers.fleet.stages import LoopParts

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, fleet: FleetSettings, worker: WorkerSettings, parts: LoopParts) -> None:
        self.fleet = fleet
        self.worker_settings = worker
        self.parts = parts
        self.modalities = list(parts.intakes)

    def stuck(self) -> str | None:
        """What is stuck past its time limit (an engine call, or a stage on one item)."""
        clock = self.parts.clock
        engine_call = clock.longest_running("generate")
        if engine_call is not None and engine_call[1] > self.fleet.batch_time_limit_s:
            return f"an engine call exceeded {self.fleet.batch_time_limit_s}s"
        longest = clock.longest_running()
        limit_s = self.worker_settings.stage_time_limit_s
        if longest and longest[0] != "generate" and longest[1] > limit_s:
            return f"the {longest[0]} stage exceeded {limit_s}s"
        return None

    def heartbeat(self, handoffs: Mapping[str, int]) -> bool:
        """Renew leases unless something is stuck; False means give up. ``handoffs``: the
        pipeline's hand-off depths (none without one)."""
        if self.stuck() is not None:
            return False
        parts = self.parts
        began = parts.renewals.renewing()
        lost = parts.held.renew(parts.state.leases, self.fleet.lease_s)
        parts.renewals.renewed(began)
        if lost:
            log.warning("lost the leases of %d tasks", lost)
        try:
            depths, backlog = waiting(parts.state.redis, parts.state.keys, self.modalities)
        except Exception:  # a metric: never a reason to stop renewing
            log.warning("queue depth could not be read", exc_info=True)
        else:
            parts.observer.heartbeat(depths, parts.engine.stats)
            parts.observer.prepare_backlog(backlog)
        parts.observer.pipeline(handoffs, *parts.clock.snapshot())
        return True
