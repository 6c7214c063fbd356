"""The worker's batch loop: pull → admit → prepare → plan → collate → generate → settle.

One loop per worker process, one model. It is made of parts, each using the others' public
methods: ``Stages`` does what each stage does to a pulled batch (workers/fleet/stages.py);
a driver runs them on the model's thread: ``StaticDriver`` hands the engine one micro-batch
and waits for all of it (static.py), ``ContinuousDriver`` keeps an engine whose
``capabilities`` say ``continuous`` full (continuous.py); the ``Watchdog`` renews leases
while nothing is stuck (watchdog.py). With ``worker.pipeline`` on (the default) pulling,
preparing and collating run ahead in their own threads (``Pipeline``) while this thread
generates; off, every stage runs in turn here. The loop builds none of its collaborators:
:func:`~vlmq.workers.fleet.service.compose_loop` does.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

from vlmq.config.settings import BatchPolicy, FleetSettings, WorkerSettings
from vlmq.workers.fleet.batches import PulledBatch
from vlmq.workers.fleet.continuous import ContinuousDriver
from vlmq.workers.fleet.drain import Drain, DrainReport
from vlmq.workers.fleet.pipeline import Pipeline
from vlmq.workers.fleet.polling import poll_until_stopped
from vlmq.workers.fleet.stages import LoopParts, Stages
from vlmq.workers.fleet.static import StaticDriver
from vlmq.workers.fleet.watchdog import Watchdog

__all__ = ["BatchLoop", "LoopParts"]

log = logging.getLogger(__name__)


class BatchLoop:
    """Serves some modality classes with one engine until stopped."""

    def __init__(
        self,
        fleet: FleetSettings,
        worker_settings: WorkerSettings,
        policies: dict[str, BatchPolicy],
        worker: str,
        parts: LoopParts,
    ) -> None:
        self.fleet = fleet
        self.worker_settings = worker_settings
        self.policies = policies
        self.worker = worker
        self.parts = parts
        self.engine = parts.engine
        self.modalities = list(parts.intakes)
        self.stop_event = threading.Event()
        self.stages = Stages(fleet, policies, worker, parts)
        self.watchdog = Watchdog(fleet, worker_settings, parts)
        self.pipeline: Pipeline | None = None
        self.driver: StaticDriver | ContinuousDriver | None = None
        self.drained: DrainReport | None = None  # set by drain(): what is let finish

    @property
    def batches_done(self) -> int:
        """Micro-batches through the engine (the heartbeat record's count)."""
        return self.driver.batches_done if self.driver is not None else 0

    # heartbeat ---------------------------------------------------------------
    def stuck(self) -> str | None:
        """What is stuck past its time limit (an engine call, or a stage on one item)."""
        return self.watchdog.stuck()

    def heartbeat(self) -> bool:
        """Renew leases unless something is stuck; False means give up."""
        return self.watchdog.heartbeat(self.pipeline.depths() if self.pipeline else {})

    # the loop ----------------------------------------------------------------
    def run_forever(self) -> None:
        self.driver = self._driver()
        self._repeat(self.driver.step)
        drained = self.drained
        if drained is not None and isinstance(self.driver, ContinuousDriver):
            # Stopped by a drain: keep stepping the engine for what it lets finish.
            self.driver.finish(drained.finishing, drained.deadline)

    def _driver(self) -> StaticDriver | ContinuousDriver:
        """Serial: every stage in turn on this thread. Pipelined: stage threads run ahead,
        and this thread feeds the engine as its capabilities say."""
        if not self.worker_settings.pipeline:
            return StaticDriver(self.stages)
        # Process-wide, on purpose: every stage thread must hand the GIL back to this one fast.
        sys.setswitchinterval(self.worker_settings.gil_switch_interval_s)
        idle = (self.fleet.idle_poll_min_s, self.fleet.idle_poll_max_s)
        self.pipeline = Pipeline(
            self.worker_settings,
            self._pull_when_room,
            self.stages.plan,
            self.stages.give_back_batch,
            self.stop_event,
            idle,
        ).start()
        if self.engine.capabilities.continuous:
            # An engine that takes requests while others decode is kept full (vLLM).
            return ContinuousDriver(self.stages, self.pipeline)
        return StaticDriver(self.stages, self.pipeline)

    def _pull_when_room(self) -> PulledBatch | None:
        return None if self.stages.backed_up() else self.stages.pull_next()

    def _repeat(self, step: Callable[[], bool]) -> None:
        """Run ``step`` until stopped, riding Redis outages out (``polling.py``)."""
        idle = (self.fleet.idle_poll_min_s, self.fleet.idle_poll_max_s)
        poll_until_stopped(step, self.parts.housekeeper, self.stop_event, idle)

    # shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def drain(self, window_s: float) -> DrainReport:
        """Stop pulling now; hand back, in one call, everything held but the micro-batches
        expected to finish within ``window_s`` (``drain.py``), then once more what a pull
        that was under way when it began brought in. The model thread finishes the rest."""
        self.stop_event.set()
        drain = self._drain(window_s)
        report = drain.hand_back()
        self.drained = report
        if self.pipeline is not None:
            self.pipeline.join_puller(timeout_s=2.0)
        report.handed_back += drain.hand_back_rest(report.finishing)
        return report

    def _drain(self, window_s: float) -> Drain:
        parts = self.parts
        return Drain(window_s, parts.held, parts.state.leases, parts.watch, parts.settler)

    def shutdown(self, drain_timeout_s: float = 60.0) -> None:
        """After the loop returned (or, draining, gave up on it): stop the stages, finish
        uploads, hand back what is still held (what never ran, what did not finish in time)."""
        parts = self.parts
        if self.pipeline is not None:
            self.pipeline.join(timeout_s=5.0 if self.drained is None else 0.5)
        for pool in (parts.prepare_pool, parts.collate_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        parts.settler.drain(drain_timeout_s)
        self._drain(0.0).give(parts.held.tokens())
        parts.settler.close()
        parts.housekeeper.close()
        parts.observer.close()
