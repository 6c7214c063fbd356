"""The stages a pulled batch goes through, whichever driver runs them and on which thread.

pull (one class's batch; classes take turns) → admit (decode messages, drop what must not
run) → prepare (per request, on the prepare pool: fetch, decode, estimate) → plan
(micro-batches; requests that ran before each alone, last) → collate (per micro-batch, on
the collate pool) → begin (start them, right before the engine call) → settle (the results,
on the upload threads). ``Stages`` does each; a driver (``workers/fleet/static.py``,
``continuous.py``) decides when, and hands the micro-batches to the engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vlmq.broker.state import State
from vlmq.broker.state.intake import Intake, Pull
from vlmq.config.cost import Pricing
from vlmq.config.errors import GenerationFailed
from vlmq.config.logs import log_context
from vlmq.config.schemas import Result
from vlmq.config.settings import BatchPolicy, FleetSettings
from vlmq.workers.engine.interface import Collated, GenerationEngine
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.fleet.batches import Begun, Planned, PulledBatch
from vlmq.workers.fleet.charge import charge
from vlmq.workers.fleet.clock import StageClock
from vlmq.workers.fleet.drain import EngineWatch
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.housekeeping import Housekeeper
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.renewals import Renewals
from vlmq.workers.fleet.settle import Settler
from vlmq.workers.fleet.suspects import isolate
from vlmq.workers.fleet.triage import Triage
from vlmq.workers.fleet.work import Work, failed_result, result_settlement

__all__ = ["LoopParts", "Stages"]

log = logging.getLogger(__name__)


@dataclass
class LoopParts:
    """Everything the loop works with, built by ``compose_loop``."""

    engine: GenerationEngine
    state: State
    intakes: dict[str, Intake]
    held: Held
    settler: Settler
    triage: Triage
    housekeeper: Housekeeper
    observer: LoopObserver
    prepare_pool: ThreadPoolExecutor
    collate_pool: ThreadPoolExecutor
    clock: StageClock
    renewals: Renewals
    pricing: Pricing = field(default_factory=Pricing)  # what its GPU time costs
    # What is inside the engine and for how long (a drain's plan: drain.py).
    watch: EngineWatch = field(default_factory=EngineWatch)


class Stages:
    """What each stage does to a pulled batch and its micro-batches."""

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
        self.clock = parts.clock
        self.modalities = list(parts.intakes)
        self._turn = 0

    # pull and admit ------------------------------------------------------------
    def backed_up(self) -> bool:
        """The store is slow or down: results wait to be settled, so pull no more."""
        return self.parts.settler.backlog > self.fleet.max_settle_backlog

    def pull_next(self) -> PulledBatch | None:
        """Pull the next class's batch (classes take turns), admit it and hand its requests
        to the prepare pool; None when every class is empty, or while this worker's lease
        renewals are stalled (it could not hold what it pulled: ``renewals.py``; until its
        first renewal lands, it pulls only while it holds nothing). An idle worker asks first
        whether anything waits (one round trip a poll): with nothing to pull, whether its
        renewals keep up does not matter. Each class is probed once a poll: one found empty is
        not pulled."""
        order = self.modalities[self._turn :] + self.modalities[: self._turn]
        ready = [m for m in order if self.parts.intakes[m].waiting()]
        if not ready:
            return None
        if not self.parts.renewals.may_pull(holding=len(self.parts.held) > 0):
            return None
        self._turn = (self._turn + 1) % len(self.modalities)
        for modality in ready:
            pull = self._gather(modality)
            if pull.deliveries or pull.dropped:
                return self._admit(modality, pull)
        return None

    def _admit(self, modality: str, pull: Pull) -> PulledBatch:
        try:
            with self.clock.timing("admit"):
                works = self.parts.triage.admit(pull)
        except BaseException:
            self.give_back([d.task_id for d in pull.deliveries])
            raise
        # A request whose holders died before starting it, more than once, is prepared alone
        # (suspects.py), on the model's thread, after its batch-mates are settled.
        fresh, alone = isolate(works, self.fleet)
        futures = [self.parts.prepare_pool.submit(self._prepare, w) for w in fresh]
        return PulledBatch(modality, fresh, futures, alone=alone, pulled_at=pull.now)

    def _prepare(self, work: Work) -> Prepared:
        assert work.request is not None
        with self.clock.timing("prepare"):
            try:
                return self.engine.prepare(work.request, work.tenant, work.delivery.prepared)
            except Exception:  # an engine that broke its never-raises contract: this one fails
                log.exception("preparing task %s failed", work.task_id)
                error = GenerationFailed("preparing this request failed")
                return Prepared(work.request, 0, error=error)

    def _pull(self, intake: Intake, limit: int) -> Pull:
        pull = intake.pull(limit, self.fleet.lease_s)
        self.parts.held.add(pull.deliveries)
        return pull

    def _gather(self, modality: str) -> Pull:
        policy = self.policies[modality]
        intake = self.parts.intakes[modality]
        first = self._pull(intake, policy.max_batch_size)
        # Redis's time at the first pull: what the batch holds is leased from then at least.
        got, dropped, now = list(first.deliveries), first.dropped, first.now
        deadline = time.monotonic() + policy.max_wait_s
        while got and len(got) < policy.max_batch_size and time.monotonic() < deadline:
            more = self._pull(intake, policy.max_batch_size - len(got))
            got += more.deliveries
            dropped = dropped + more.dropped
            if not more.deliveries:
                time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        return Pull(got, now, dropped)

    # plan and collate ----------------------------------------------------------
    def plan(self, pulled: PulledBatch) -> list[Planned]:
        """Wait for the batch's requests to be prepared, settle those that failed, cut the
        rest into micro-batches (requests that ran before alone, least-tried first, last)
        and hand them to the collate pool."""
        prepared = [future.result() for future in pulled.prepared]
        with self.clock.timing("plan"):
            ready: list[tuple[Work, Prepared]] = []
            failed = []
            for work, item in zip(pulled.works, prepared, strict=True):
                if item.error is None:
                    ready.append((work, item))
                else:
                    failed.append(result_settlement(work, self._rejected(item), self.worker))
            charge([s.record for s in failed], self.parts.pricing)  # nothing ran: 0
            for settlement in failed:
                self._report(settlement.record)
            self.parts.settler.submit_many(failed)
            work_of = {id(item): work for work, item in ready}
            fresh = [item for work, item in ready if work.first_run]
            suspects = sorted(
                (p for w, p in ready if not w.first_run), key=lambda p: work_of[id(p)].attempts
            )
            budget = self._budget(pulled)
            batches = [(batch, False) for batch in self.engine.plan(fresh, budget)]
            batches += [([item], True) for item in suspects]
        planned = [
            Planned(
                pulled,
                [work_of[id(p)] for p in batch],
                self._collate_later(batch, budget),
                suspect,
                items=batch,
            )
            for batch, suspect in batches
        ]
        planned += [
            Planned(pulled, [work], _unprepared(), True, unprepared=True) for work in pulled.alone
        ]
        pulled.media_bytes = sum(item.media_bytes for _, item in ready)
        return planned

    def _budget(self, pulled: PulledBatch) -> int:
        """The class's token budget for one engine call."""
        return self.policies[pulled.modality].token_budget

    def _rejected(self, item: Prepared) -> Result:
        try:
            return self.engine.reject(item, self.worker)
        except Exception as exc:  # an engine without rejections of its own
            return failed_result(item.request, item.error or exc, self.engine.model_name)

    def _collate_later(self, batch: list[Prepared], budget: int) -> Future[Collated]:
        return self.parts.collate_pool.submit(self._collate, batch, budget)

    def _collate(self, items: list[Prepared], budget: int) -> Collated:
        """A micro-batch's inputs, with the class's token budget for the engine call."""
        with self.clock.timing("collate"):
            collated = self.engine.collate(items)
        collated.token_budget = budget
        return collated

    # begin and settle ------------------------------------------------------------
    def begin(self, planned: Planned) -> Begun | None:
        """Start a micro-batch (→ running, fenced; one attempt each) right before it goes into
        the engine; None when none of it is still to run."""
        parts = self.parts
        if not parts.renewals.holds(planned.pulled.pulled_at):
            # Renewals stalled and its leases lapse soon: back to the queue, for a worker
            # that renews (a clean return, not a death).
            self.give_back([w.task_id for w in planned.works])
            return None
        if planned.suspect and not parts.settler.drain(self.fleet.suspect_drain_timeout_s):
            # Settle batch-mates before a risky run; the wait has its own bound, apart from
            # the engine call's time limit.
            log.warning("results still unsettled before a suspect run; running it anyway")
        if planned.unprepared and not self._prepare_alone(planned):
            return None
        collated = self._collated(planned)
        started = parts.triage.start(planned.works)
        if not started:
            return None
        if len(started) < len(planned.works):  # some were cancelled while they waited
            running = {w.task_id for w in started}
            kept = [
                p
                for p, w in zip(collated.items, planned.works, strict=True)
                if w.task_id in running
            ]
            collated = self._collate(kept, self._budget(planned.pulled))
        modality = planned.pulled.modality
        redelivered = sum(1 for w in started if w.token > 1)
        max_size = self.policies[modality].max_batch_size
        parts.observer.batch(modality, len(started), max_size, redelivered)
        # From planned to generating: collation and the wait for the model.
        waited = round(time.monotonic() - planned.ready_at, 4)
        begun = Begun(planned, started, collated, uuid.uuid4().hex[:12], modality, waited)
        parts.watch.began(id(begun), (w.task_id for w in started))
        return begun

    def _prepare_alone(self, planned: Planned) -> bool:
        """Prepare a request whose holders died before it started, here, with nothing else in
        hand (its batch-mates are settled): if it kills this worker too, it alone is delivered
        again, and after ``max_deliveries`` such deaths it alone is dead-lettered. False when
        it failed to prepare (settled as such)."""
        (work,) = planned.works
        self.parts.state.tasks.mark_alone(work.task_id, work.token)
        prepared = self._prepare(work)
        if prepared.error is not None:
            settlement = result_settlement(work, self._rejected(prepared), self.worker)
            charge([settlement.record], self.parts.pricing)  # nothing ran: 0
            self._report(settlement.record)
            self.parts.settler.submit_many([settlement])
            return False
        planned.items = [prepared]
        planned.collated = self._collate_later([prepared], self._budget(planned.pulled))
        return True

    def _collated(self, planned: Planned) -> Collated:
        """The micro-batch's collated inputs; when collating raised (the HF engine never
        does: it leaves a failed collation for generate to isolate), once more here, and
        failing that the bare items, for the engine call to fail request by request."""
        try:
            return planned.collated.result()
        except Exception:
            log.warning("collating a micro-batch failed; retrying here", exc_info=True)
        items = planned.items
        try:
            return self._collate(items, self._budget(planned.pulled))
        except Exception:
            log.exception("collating a micro-batch failed again")
            return Collated(items, None, 0.0)

    def failed(self, works: list[Work], exc: BaseException) -> list[Result]:
        """Failed results for requests the engine call failed on."""
        return [failed_result(w.requested, exc, self.engine.model_name) for w in works]

    def settle(self, begun: Begun, results: list[Result], every: bool = True) -> list[Work]:
        """Settle the results of a begun micro-batch; with ``every``, the works without a
        result fail (the engine lost them). The works settled."""
        by_id = {r.id: r for r in results}
        settlements = []
        done = []
        for work in begun.works:
            result = by_id.get(work.task_id)
            if result is None:
                if not every:
                    continue
                missing = RuntimeError("the engine returned no result")
                result = failed_result(work.requested, missing, self.engine.model_name)
            settlement = result_settlement(work, result, self.worker)
            settlement.record["timings"]["wait_s"] = begun.waited
            settlements.append(settlement)
            done.append(work)
        charge([s.record for s in settlements], self.parts.pricing)
        for settlement in settlements:
            self._report(settlement.record)
        self.parts.settler.submit_many(settlements)
        self.parts.watch.settled(id(begun), (w.task_id for w in done))
        return done

    def _report(self, record: dict[str, Any]) -> None:
        self.parts.observer.result(record)
        with log_context(task_id=record["id"], job_id=record.get("job_id")):
            log.info("task %s %s", record["id"], record["status"])

    # giving back -----------------------------------------------------------------
    def give_back(self, task_ids: list[str]) -> None:
        """What failed on its way goes back (``Held.give_back``)."""
        self.parts.watch.forget(task_ids)
        self.parts.held.give_back(self.parts.state.leases, task_ids)

    def give_back_batch(self, pulled: PulledBatch) -> None:
        self.give_back([w.task_id for w in [*pulled.works, *pulled.alone]])


def _unprepared() -> Future[Collated]:
    """The collated inputs of a request not prepared yet (``_prepare_alone`` makes them)."""
    future: Future[Collated] = Future()
    future.set_exception(RuntimeError("prepared alone, on the model's thread"))
    return future
