"""The model thread's step with a static engine (HF): one micro-batch in, all of it out.

Serial (no pipeline, ``worker.pipeline`` off), a step takes one pulled batch through every
stage on this thread; pipelined, it takes the next micro-batch the pipeline made ready. Either
way each micro-batch is started right before its engine call, handed to the engine and
waited for whole, then settled. A continuous engine (vLLM) served serially is drained per
micro-batch: polled until this micro-batch is through.
"""

from __future__ import annotations

import logging
import time

from vlmq.config.logs import log_context
from vlmq.config.schemas import Result
from vlmq.workers.engine.interface import Collated, EngineDied
from vlmq.workers.fleet.batches import Planned
from vlmq.workers.fleet.pipeline import Pipeline
from vlmq.workers.fleet.stages import Stages
from vlmq.workers.fleet.work import Work

__all__ = ["StaticDriver"]

log = logging.getLogger(__name__)


class StaticDriver:
    def __init__(self, stages: Stages, pipeline: Pipeline | None = None) -> None:
        self.stages = stages
        self.pipeline = pipeline
        self.engine = stages.engine
        self.batches_done = 0

    def step(self) -> bool:
        """One step; False when it found nothing to do (the loop backs off)."""
        return self._turn() if self.pipeline is None else self._generate_next()

    def _turn(self) -> bool:
        """One batch through every stage, here (the serial loop)."""
        stages = self.stages
        if stages.backed_up():
            time.sleep(0.002)
            return True
        pulled = stages.pull_next()
        if pulled is None:
            return False
        try:
            planned = stages.plan(pulled)
        except BaseException:
            stages.give_back_batch(pulled)
            raise
        for item in planned:
            self._generate_or_give_back(item)
        return True

    def _generate_next(self) -> bool:
        """The next micro-batch the pipeline made ready, if one comes within 50 ms (the
        wait is the pipelined loop's idle pause)."""
        assert self.pipeline is not None
        planned = self.pipeline.take(timeout_s=0.05)
        if planned is not None:
            try:
                self._generate_or_give_back(planned)
            finally:
                self.pipeline.done(planned)
        return True

    def _generate_or_give_back(self, planned: Planned) -> None:
        try:
            self._generate(planned)
        except BaseException:
            self.stages.give_back([w.task_id for w in planned.works])
            raise

    def _generate(self, planned: Planned) -> None:
        stages = self.stages
        begun = stages.begin(planned)
        if begun is None:
            return
        with log_context(worker=stages.worker, batch_id=begun.batch_id):
            log.info("batch %s: %d %s requests", begun.batch_id, len(begun.works), begun.modality)
            results = self._run_engine(begun.collated, begun.works)
        stages.settle(begun, results)
        self.batches_done += 1

    def _run_engine(self, collated: Collated, started: list[Work]) -> list[Result]:
        """Hand the micro-batch to the engine and collect its results; an engine that
        raises fails each request (never drops one)."""
        engine, worker = self.engine, self.stages.worker
        try:
            with self.stages.clock.timing("generate"):
                engine.submit(collated)
                results = engine.poll(worker)
                # An engine that returns requests as they finish (a continuous one) is polled
                # until this micro-batch is through.
                while len(results) < len(started) and engine.pending > 0:
                    results += engine.poll(worker)
                return results
        except EngineDied:
            raise  # out of the loop: the worker exits, its leases are redelivered
        except Exception as exc:
            log.exception("engine failed on a batch of %d", len(started))
            return self.stages.failed(started, exc)
