"""The worker's batch loop: pull → triage → run → settle, per modality class.

One loop per worker process, one model. Each turn takes one class's batch: it waits for the
first message, keeps pulling until the class's maximum batch size or maximum wait, hands the
batch to :class:`~vlmq.workers.fleet.triage.Triage` (which drops, expires and dead-letters what
must not run and starts the rest), runs it through the engine (requests delivered more than
once run alone, so a request that crashes the worker cannot take its batch-mates down with it),
then gives each result to the settler. The loop builds none of its collaborators:
:func:`~vlmq.workers.fleet.service.compose_loop` does.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vlmq.config.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.logs import log_context
from vlmq.config.queues import queue_depth
from vlmq.config.schemas import Request, Result
from vlmq.config.settings import BatchPolicy, FleetSettings
from vlmq.config.statusdb import StatusDB
from vlmq.workers.fleet.housekeeping import Housekeeper
from vlmq.workers.fleet.intake import Held, Intake, Leases, Pull
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settler
from vlmq.workers.fleet.triage import Triage
from vlmq.workers.fleet.work import Work, failed_result, result_settlement

__all__ = ["BatchLoop", "EngineLike", "LoopParts"]

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    model_name: str

    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]: ...


@dataclass
class LoopParts:
    """Everything the loop works with, built by ``compose_loop``."""

    engine: EngineLike
    status: StatusDB
    intakes: dict[str, Intake]
    leases: Leases
    held: Held
    settler: Settler
    triage: Triage
    housekeeper: Housekeeper
    observer: LoopObserver


class BatchLoop:
    """Serves some modality classes with one engine until stopped."""

    def __init__(
        self,
        fleet: FleetSettings,
        policies: dict[str, BatchPolicy],
        worker: str,
        parts: LoopParts,
    ) -> None:
        self.fleet = fleet
        self.policies = policies
        self.worker = worker
        self.parts = parts
        self.engine = parts.engine
        self.modalities = list(parts.intakes)
        self.stop_event = threading.Event()
        # When the running engine call began (monotonic); None between calls.
        self.engine_started: float | None = None
        self.batches_done = 0
        self._turn = 0

    # heartbeat ---------------------------------------------------------------
    def heartbeat(self) -> bool:
        """Renew leases unless the running engine call is stuck; False means give up."""
        started = self.engine_started
        if started is not None and time.monotonic() - started > self.fleet.batch_time_limit_s:
            return False
        parts = self.parts
        lost = parts.leases.renew(parts.held.tokens(), self.fleet.lease_s)
        lost = list(parts.held.tokens(lost))  # not those settled meanwhile
        if lost:
            # Reaped or delivered again elsewhere (this worker was cut off past its lease):
            # whatever it still does with them is refused when it settles.
            log.warning("lost the leases of %d tasks", len(lost))
            parts.held.release(lost)
        try:
            depths = queue_depth(parts.status.redis, parts.status.keys, self.modalities)
        except Exception:  # a metric: never a reason to stop renewing
            log.warning("queue depth could not be read", exc_info=True)
        else:
            parts.observer.heartbeat(depths, getattr(self.engine, "stats", None))
        return True

    # the loop ----------------------------------------------------------------
    def run_forever(self) -> None:
        idle = self.fleet.idle_poll_min_s
        outage = 0.1
        while not self.stop_event.is_set():
            try:
                busy = self._turn_once()
            except TRANSIENT_REDIS_ERRORS as exc:
                # Redis restarted, unreachable, loading, read-only or full: what this worker
                # holds stays leased (or is swept back by then); retry until it answers.
                log.warning("Redis %s; retrying in %.1fs", type(exc).__name__, outage)
                self.stop_event.wait(outage)
                outage = min(outage * 2, 2.0)
                continue
            outage = 0.1
            if busy:
                idle = self.fleet.idle_poll_min_s
            else:
                self.stop_event.wait(idle)
                idle = min(idle * 2, self.fleet.idle_poll_max_s)

    def _turn_once(self) -> bool:
        self.parts.housekeeper.tick()
        if self.parts.settler.backlog > self.fleet.max_settle_backlog:
            time.sleep(0.002)  # the store is slow or down: do not pull more
            return True
        return self.run_once() > 0

    def run_once(self) -> int:
        """Pull and serve one batch of one class; returns messages handled."""
        order = self.modalities[self._turn :] + self.modalities[: self._turn]
        self._turn = (self._turn + 1) % len(self.modalities)
        for modality in order:
            pull = self._gather(modality)
            if pull.deliveries or pull.dropped:
                self._serve_or_give_back(modality, pull)
                return len(pull.deliveries) + pull.dropped
        return 0

    def _pull(self, intake: Intake, limit: int) -> Pull:
        pull = intake.pull(limit, self.fleet.lease_s)
        self.parts.held.add(pull.deliveries)
        return pull

    def _gather(self, modality: str) -> Pull:
        policy = self.policies[modality]
        intake = self.parts.intakes[modality]
        first = self._pull(intake, policy.max_batch_size)
        got, dropped, now = list(first.deliveries), first.dropped, first.now
        deadline = time.monotonic() + policy.max_wait_s
        while got and len(got) < policy.max_batch_size and time.monotonic() < deadline:
            more = self._pull(intake, policy.max_batch_size - len(got))
            got += more.deliveries
            dropped, now = dropped + more.dropped, more.now
            if not more.deliveries:
                time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        return Pull(got, now, dropped)

    # one batch ---------------------------------------------------------------
    def _serve_or_give_back(self, modality: str, pull: Pull) -> None:
        """Serve a pulled batch; if anything fails on the way, what it still holds goes back
        (at once, or by its lease lapsing when Redis cannot take it now): nothing pulled is
        held and renewed without being worked on."""
        try:
            self._serve(modality, pull)
        except BaseException:
            ids = [d.task_id for d in pull.deliveries]
            held = self.parts.held.tokens(ids)
            log.warning("giving back %d tasks of a batch that failed", len(held))
            try:
                self.parts.leases.give_back(held)
            except Exception:
                log.warning("could not give them back; their leases will lapse", exc_info=True)
            self.parts.held.release(ids)
            raise

    def _serve(self, modality: str, pull: Pull) -> None:
        runnable = self.parts.triage.runnable(pull)
        if not runnable:
            return
        redelivered = sum(1 for w in runnable if w.token > 1)
        max_size = self.policies[modality].max_batch_size
        self.parts.observer.batch(modality, len(runnable), max_size, redelivered)
        batch_id = uuid.uuid4().hex[:12]
        with log_context(worker=self.worker, batch_id=batch_id):
            log.info("batch %s: %d %s requests", batch_id, len(runnable), modality)
            try:
                self._run_batch(runnable)
            finally:
                self.batches_done += 1

    def _run_batch(self, runnable: list[Work]) -> None:
        # A request that ran before without finishing (its worker died) runs alone,
        # least-tried first, so a request that kills its worker cannot take its batch-mates
        # down with it again.
        fresh = [w for w in runnable if w.first_run]
        suspects = sorted((w for w in runnable if not w.first_run), key=lambda w: w.attempts)
        if fresh:  # their attempt was counted when they started
            self._run_group(fresh)
        for suspect in suspects:
            # Settle everything before each risky run: if it kills the process, the results
            # of its batch-mates are already safe. The wait has its own bound, apart from the
            # engine call's time limit.
            if not self.parts.settler.drain(self.fleet.suspect_drain_timeout_s):
                log.warning("results still unsettled before a suspect run; running it anyway")
            self.parts.triage.count_attempt([suspect])
            self._run_group([suspect])

    def _run_group(self, group: list[Work]) -> None:
        requests = [w.request for w in group if w.request is not None]
        self.engine_started = time.monotonic()
        try:
            results = self.engine.run(
                requests, worker=self.worker, token_budget=self._budget(group)
            )
        except Exception as exc:  # the engine itself broke: fail each, never drop
            log.exception("engine failed on a batch of %d", len(requests))
            results = [failed_result(r, exc, self.engine.model_name) for r in requests]
        finally:
            self.engine_started = None
        settlements = [
            result_settlement(item, result, self.worker)
            for item, result in zip(group, results, strict=True)
        ]
        for settlement in settlements:
            self._report(settlement.record)
        self.parts.settler.submit_many(settlements)

    def _report(self, record: dict[str, Any]) -> None:
        self.parts.observer.result(record)
        with log_context(task_id=record["id"], job_id=record.get("job_id")):
            log.info("task %s %s", record["id"], record["status"])

    def _budget(self, group: list[Work]) -> int | None:
        """The padded-token budget of the group's class (its batch policy)."""
        request = group[0].request if group else None
        policy = self.policies.get(request.modality.value) if request else None
        return policy.token_budget if policy else None

    # shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def shutdown(self, drain_timeout_s: float = 60.0) -> None:
        """After the loop returned: finish uploads, give back what never ran."""
        parts = self.parts
        parts.settler.drain(drain_timeout_s)
        leftover = parts.held.tokens()
        if leftover:
            parts.leases.give_back(leftover)
            parts.held.release(leftover)
        parts.settler.close()
        parts.housekeeper.close()
        parts.observer.close()
