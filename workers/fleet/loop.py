"""The worker's batch loop: pull → admit → prepare → plan → collate → generate → settle.

One loop per worker process, one model. A turn pulls one class's batch (waiting for the first
message, then until the class's maximum batch size or maximum wait), admits it (``Triage``:
drop, expire, dead-letter), prepares its requests on the prepare pool, cuts micro-batches
(requests delivered more than once run alone, last, after their batch-mates' results are
safe, so a request that crashes the worker cannot take them down with it), collates them, and
generates each on this thread, starting it (→ running) right before its engine call. With
``worker.pipeline`` on (the default) pulling, preparing and collating run ahead in their own
threads (``Pipeline``) while this thread generates; off, every stage runs in turn here. The
loop builds none of its collaborators: :func:`~vlmq.workers.fleet.service.compose_loop` does.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vlmq.config.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.errors import GenerationFailed
from vlmq.config.logs import log_context
from vlmq.config.queues import lane_depths, prepare_backlog
from vlmq.config.schemas import Result
from vlmq.config.settings import BatchPolicy, FleetSettings, WorkerSettings
from vlmq.config.state import State
from vlmq.config.state.intake import Intake, Pull
from vlmq.workers.engine.interface import Collated, EngineDied, GenerationEngine
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.housekeeping import Housekeeper
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.pipeline import Pipeline
from vlmq.workers.fleet.settle import Settler
from vlmq.workers.fleet.stages import Backoff, Job, Planned, StageClock
from vlmq.workers.fleet.triage import Triage
from vlmq.workers.fleet.work import Work, failed_result, result_settlement

__all__ = ["BatchLoop", "Begun", "LoopParts"]

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


@dataclass
class Begun:
    """A micro-batch started (its works running) and handed to the engine."""

    planned: Planned
    works: list[Work]
    collated: Collated
    batch_id: str
    modality: str
    waited: float


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
        # When the running engine call began (monotonic); None between calls.
        self.engine_started: float | None = None
        self.batches_done = 0
        self.pipeline: Pipeline | None = None
        self._turn = 0

    # heartbeat ---------------------------------------------------------------
    def stuck(self) -> str | None:
        """What is stuck past its time limit (an engine call, or a stage on one item)."""
        started = self.engine_started
        if started is not None and time.monotonic() - started > self.fleet.batch_time_limit_s:
            return f"an engine call exceeded {self.fleet.batch_time_limit_s}s"
        longest = self.parts.clock.longest_running()
        if (
            longest
            and longest[0] != "generate"
            and longest[1] > self.worker_settings.stage_time_limit_s
        ):
            return f"the {longest[0]} stage exceeded {self.worker_settings.stage_time_limit_s}s"
        return None

    def heartbeat(self) -> bool:
        """Renew leases unless something is stuck; False means give up."""
        if self.stuck() is not None:
            return False
        parts = self.parts
        lost = parts.state.leases.renew(parts.held.tokens(), self.fleet.lease_s)
        lost = list(parts.held.tokens(lost))  # not those settled meanwhile
        if lost:
            # Reaped or delivered again elsewhere (this worker was cut off past its lease):
            # whatever it still does with them is refused when it settles.
            log.warning("lost the leases of %d tasks", len(lost))
            parts.held.release(lost)
        try:
            depths = lane_depths(parts.state.redis, parts.state.keys, self.modalities)
            backlog = prepare_backlog(parts.state.redis, parts.state.keys, self.modalities)
        except Exception:  # a metric: never a reason to stop renewing
            log.warning("queue depth could not be read", exc_info=True)
        else:
            parts.observer.heartbeat(depths, getattr(self.engine, "stats", None))
            parts.observer.prepare_backlog(backlog)
        parts.observer.pipeline(
            self.pipeline.depths() if self.pipeline else {}, *parts.clock.snapshot()
        )
        return True

    # the loop ----------------------------------------------------------------
    def run_forever(self) -> None:
        if self.worker_settings.pipeline:
            self._run_pipelined()
        else:
            self._run_serial()

    def _run_serial(self) -> None:
        self._repeat(self._turn_once)

    def _run_pipelined(self) -> None:
        # Process-wide, on purpose: every stage thread must hand the GIL back to this one fast.
        sys.setswitchinterval(self.worker_settings.gil_switch_interval_s)
        idle = (self.fleet.idle_poll_min_s, self.fleet.idle_poll_max_s)
        self.pipeline = Pipeline(
            self.worker_settings,
            self._admit_when_room,
            self._plan,
            self._give_back_job,
            self.stop_event,
            idle,
        ).start()
        if getattr(self.engine, "continuous", False):
            # An engine that takes requests while others decode is kept full (vLLM).
            from vlmq.workers.fleet.continuous import ContinuousFeed

            self._repeat(ContinuousFeed(self, self.pipeline).step)
        else:
            self._repeat(self._generate_next)

    def _repeat(self, step: Callable[[], bool]) -> None:
        """Run ``step`` until stopped, backing off while it finds nothing to do."""
        backoff = Backoff((self.fleet.idle_poll_min_s, self.fleet.idle_poll_max_s))
        while not self.stop_event.is_set():
            try:
                busy = step()
            except TRANSIENT_REDIS_ERRORS as exc:
                # Redis restarted, unreachable, loading, read-only or full: what this worker
                # holds stays leased (or is swept back by then); retry until it answers.
                wait = backoff.outage()
                log.warning("Redis %s; retrying in %.1fs", type(exc).__name__, wait)
                self.stop_event.wait(wait)
                continue
            backoff.answered()
            if busy:
                backoff.worked()
            else:
                self.stop_event.wait(backoff.idle())

    def _turn_once(self) -> bool:
        """One batch through every stage, here (the serial loop)."""
        self.parts.housekeeper.tick()
        if self._store_backed_up():
            time.sleep(0.002)
            return True
        job = self._admit_next()
        if job is None:
            return False
        for planned in self._plan_or_give_back(job):
            self._generate_or_give_back(planned)
        return True

    def _generate_next(self) -> bool:
        """The next micro-batch the pipeline made ready, if one comes within 50 ms (the
        wait is the pipelined loop's idle pause)."""
        self.parts.housekeeper.tick()
        assert self.pipeline is not None
        planned = self.pipeline.take(timeout_s=0.05)
        if planned is not None:
            try:
                self._generate_or_give_back(planned)
            finally:
                self.pipeline.done(planned)
        return True

    def _admit_when_room(self) -> Job | None:
        return None if self._store_backed_up() else self._admit_next()

    def _store_backed_up(self) -> bool:
        """The store is slow or down: results wait to be settled, so pull no more."""
        return self.parts.settler.backlog > self.fleet.max_settle_backlog

    # pull and admit ------------------------------------------------------------
    def _admit_next(self) -> Job | None:
        """Pull the next class's batch (classes take turns), admit it and hand its requests
        to the prepare pool; None when every class is empty."""
        order = self.modalities[self._turn :] + self.modalities[: self._turn]
        self._turn = (self._turn + 1) % len(self.modalities)
        for modality in order:
            pull = self._gather(modality)
            if pull.deliveries or pull.dropped:
                return self._admit(modality, pull)
        return None

    def _admit(self, modality: str, pull: Pull) -> Job:
        try:
            with self.parts.clock.timing("admit"):
                works = self.parts.triage.admit(pull)
        except BaseException:
            self._give_back([d.task_id for d in pull.deliveries])
            raise
        # A request whose holders died before starting it, more than once, is prepared alone
        # (after a single death, its whole prefetch window would be: the next holder works as
        # usual, and only what dies with it again is isolated).
        limit = self.fleet.isolate_after_prestart_deaths
        fresh = [w for w in works if w.prestart_deaths < limit]
        alone = sorted(
            (w for w in works if w.prestart_deaths >= limit), key=lambda w: w.alone_before
        )
        futures = [self.parts.prepare_pool.submit(self._prepare, w) for w in fresh]
        return Job(modality, fresh, futures, alone=alone)

    def _prepare(self, work: Work) -> Prepared:
        assert work.request is not None
        with self.parts.clock.timing("prepare"):
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
        got, dropped, now = list(first.deliveries), first.dropped, first.now
        deadline = time.monotonic() + policy.max_wait_s
        while got and len(got) < policy.max_batch_size and time.monotonic() < deadline:
            more = self._pull(intake, policy.max_batch_size - len(got))
            got += more.deliveries
            dropped, now = dropped + more.dropped, more.now
            if not more.deliveries:
                time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        return Pull(got, now, dropped)

    # plan and collate ----------------------------------------------------------
    def _plan_or_give_back(self, job: Job) -> list[Planned]:
        try:
            return self._plan(job)
        except BaseException:
            self._give_back_job(job)
            raise

    def _plan(self, job: Job) -> list[Planned]:
        """Wait for the batch's requests to be prepared, settle those that failed, cut the
        rest into micro-batches (requests that ran before alone, least-tried first, last)
        and hand them to the collate pool."""
        prepared = [future.result() for future in job.prepared]
        with self.parts.clock.timing("plan"):
            ready: list[tuple[Work, Prepared]] = []
            failed = []
            for work, item in zip(job.works, prepared, strict=True):
                if item.error is None:
                    ready.append((work, item))
                else:
                    failed.append(result_settlement(work, self._rejected(item), self.worker))
            for settlement in failed:
                self._report(settlement.record)
            self.parts.settler.submit_many(failed)
            work_of = {id(item): work for work, item in ready}
            fresh = [item for work, item in ready if work.first_run]
            suspects = sorted(
                (p for w, p in ready if not w.first_run), key=lambda p: work_of[id(p)].attempts
            )
            budget = self.policies[job.modality].token_budget
            batches = [(batch, False) for batch in self.engine.plan(fresh, budget)]
            batches += [([item], True) for item in suspects]
        planned = [
            Planned(
                job,
                [work_of[id(p)] for p in batch],
                self._collate_later(batch, budget),
                suspect,
                items=batch,
            )
            for batch, suspect in batches
        ]
        planned += [
            Planned(job, [work], _unprepared(), True, unprepared=True) for work in job.alone
        ]
        job.media_bytes = sum(item.media_bytes for _, item in ready)
        return planned

    def _rejected(self, item: Prepared) -> Result:
        try:
            return self.engine.reject(item, self.worker)
        except Exception as exc:  # an engine without rejections of its own
            return failed_result(item.request, item.error or exc, self.engine.model_name)

    def _collate_later(self, batch: list[Prepared], budget: int) -> Future[Collated]:
        return self.parts.collate_pool.submit(self._collate, batch, budget)

    def _collate(self, items: list[Prepared], budget: int) -> Collated:
        """A micro-batch's inputs, with the class's token budget for the engine call."""
        with self.parts.clock.timing("collate"):
            collated = self.engine.collate(items)
        collated.token_budget = budget
        return collated

    # generate --------------------------------------------------------------------
    def _generate_or_give_back(self, planned: Planned) -> None:
        try:
            self._generate(planned)
        except BaseException:
            self._give_back([w.task_id for w in planned.works])
            raise

    def _generate(self, planned: Planned) -> None:
        begun = self.begin(planned)
        if begun is None:
            return
        with log_context(worker=self.worker, batch_id=begun.batch_id):
            log.info("batch %s: %d %s requests", begun.batch_id, len(begun.works), begun.modality)
            results = self._run_engine(begun.collated, begun.works)
        self.settle(begun, results)
        self.batches_done += 1

    def begin(self, planned: Planned) -> Begun | None:
        """Start a micro-batch (→ running, fenced; one attempt each) right before it goes into
        the engine; None when none of it is still to run."""
        parts = self.parts
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
            collated = self._collate(kept, self.policies[planned.job.modality].token_budget)
        modality = planned.job.modality
        redelivered = sum(1 for w in started if w.token > 1)
        max_size = self.policies[modality].max_batch_size
        parts.observer.batch(modality, len(started), max_size, redelivered)
        # From planned to generating: collation and the wait for the model.
        waited = round(time.monotonic() - planned.ready_at, 4)
        return Begun(planned, started, collated, uuid.uuid4().hex[:12], modality, waited)

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
            self._report(settlement.record)
            self.parts.settler.submit_many([settlement])
            return False
        budget = self.policies[planned.job.modality].token_budget
        planned.items = [prepared]
        planned.collated = self._collate_later([prepared], budget)
        return True

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
            self._report(settlement.record)
        self.parts.settler.submit_many(settlements)
        return done

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
            return self._collate(items, self.policies[planned.job.modality].token_budget)
        except Exception:
            log.exception("collating a micro-batch failed again")
            return Collated(items, None, 0.0)

    def _run_engine(self, collated: Collated, started: list[Work]) -> list[Result]:
        """Hand the micro-batch to the engine and collect its results; an engine that
        raises fails each request (never drops one)."""
        self.engine_started = time.monotonic()
        try:
            with self.parts.clock.timing("generate"):
                self.engine.submit(collated)
                results = self.engine.poll(self.worker)
                # An engine that returns requests as they finish (vLLM) is polled until this
                # micro-batch is through.
                while len(results) < len(started) and _pending(self.engine) > 0:
                    results += self.engine.poll(self.worker)
                return results
        except EngineDied:
            raise  # out of the loop: the worker exits, its leases are redelivered
        except Exception as exc:
            log.exception("engine failed on a batch of %d", len(started))
            return [failed_result(w.requested, exc, self.engine.model_name) for w in started]
        finally:
            self.engine_started = None

    def _report(self, record: dict[str, Any]) -> None:
        self.parts.observer.result(record)
        with log_context(task_id=record["id"], job_id=record.get("job_id")):
            log.info("task %s %s", record["id"], record["status"])

    # giving back -----------------------------------------------------------------
    def _give_back(self, task_ids: list[str]) -> None:
        """What failed on its way goes back at once, or, when Redis cannot take even that,
        by its lease lapsing: nothing pulled is held and renewed without being worked on."""
        held = self.parts.held.tokens(task_ids)
        if held:
            log.warning("giving back %d tasks", len(held))
            try:
                self.parts.state.leases.give_back(held)
            except Exception:
                log.warning("could not give them back; their leases will lapse", exc_info=True)
        self.parts.held.release(task_ids)

    def _give_back_job(self, job: Job) -> None:
        self._give_back([w.task_id for w in [*job.works, *job.alone]])

    # shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def shutdown(self, drain_timeout_s: float = 60.0) -> None:
        """After the loop returned: stop the stages, finish uploads, give back what never
        ran (everything prefetched is still queued)."""
        parts = self.parts
        if self.pipeline is not None:
            self.pipeline.join(timeout_s=5.0)
        for pool in (parts.prepare_pool, parts.collate_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        parts.settler.drain(drain_timeout_s)
        leftover = parts.held.tokens()
        if leftover:
            parts.state.leases.give_back(leftover)
            parts.held.release(leftover)
        parts.settler.close()
        parts.housekeeper.close()
        parts.observer.close()


def _unprepared() -> Future[Collated]:
    """The collated inputs of a request not prepared yet (``_prepare_alone`` makes them)."""
    future: Future[Collated] = Future()
    future.set_exception(RuntimeError("prepared alone, on the model's thread"))
    return future


def _pending(engine: Any) -> int:
    """Requests a continuous engine (vLLM) still holds; 0 for engines that return a whole
    micro-batch from one poll."""
    return int(getattr(engine, "pending", 0))
