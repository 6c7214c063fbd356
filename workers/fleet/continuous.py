"""The model thread's step for an engine that takes requests while others decode (vLLM).

With a static engine (HF) the model thread hands over one micro-batch and waits for all of it.
A continuous engine is kept full instead: every step starts the micro-batches the pipeline
has ready while the engine has room (``capacity``), steps the engine once (``poll``) and
settles each request that finished, so a slow row never holds back the next batch. Each
request is started (running, fenced, one attempt) right before it goes into the engine and
stays held, its lease renewed by the heartbeat, until its result is settled: leases and
fencing cover requests inside the engine as they cover a static batch.

A suspect (a request delivered before, which may be what killed a worker) still runs alone:
the driver stops taking work, lets the engine empty, runs it by itself, then goes on.
"""

from __future__ import annotations

import logging
import time

from vlmq.config.schemas import Result
from vlmq.workers.engine.interface import EngineDied
from vlmq.workers.fleet.batches import Begun, Planned
from vlmq.workers.fleet.pipeline import Pipeline
from vlmq.workers.fleet.stages import Stages
from vlmq.workers.fleet.work import Work

__all__ = ["ContinuousDriver"]

log = logging.getLogger(__name__)


class ContinuousDriver:
    def __init__(self, stages: Stages, pipeline: Pipeline) -> None:
        self.stages = stages
        self.pipeline = pipeline
        self.engine = stages.engine
        self.batches_done = 0
        self._open: dict[str, Begun] = {}  # task id -> the started micro-batch it is in
        self._left: dict[int, int] = {}  # id(begun) -> its requests not settled yet
        self._suspect: Planned | None = None  # waiting for the engine to empty
        self._waiting: Planned | None = None  # taken, waiting for room in the engine
        self._alone = False  # a suspect is in the engine

    @property
    def open(self) -> int:
        """Requests inside the engine."""
        return len(self._open)

    def step(self) -> bool:
        """One step: fill the engine, step it once; always busy (it waits in ``_take``)."""
        self._fill()
        if self._open:
            self._poll()
        return True

    def finish(self, task_ids: set[str], deadline: float) -> None:
        """A drain's end: step the engine, taking nothing new, until the requests it lets
        finish are settled or ``deadline`` (monotonic) passed (what else is inside was
        handed back: its settle is refused)."""
        while task_ids & self._open.keys() and time.monotonic() < deadline:
            self._poll()

    # taking work -----------------------------------------------------------------
    def _fill(self) -> None:
        while not self._alone:
            if self._suspect is not None:
                if self._open:
                    return  # it runs alone: let the engine empty first
                suspect, self._suspect = self._suspect, None
                self._alone = self._submit(suspect)
                return
            planned = self._waiting or self._take()
            self._waiting = None
            if planned is None:
                return
            if planned.suspect:
                self._suspect = planned
                continue
            if len(planned.works) > self.engine.capacity() and self._open:
                self._waiting = planned  # goes in once enough of what is inside came out
                return
            self._submit(planned)

    def _take(self) -> Planned | None:
        """The pipeline's next micro-batch: idle, wait a little for one (the loop's idle
        pause); busy, only one that is ready."""
        if self.engine.capacity() <= 0:
            return None
        return self.pipeline.take(timeout_s=0.0 if self._open else 0.05)

    def _submit(self, planned: Planned) -> bool:
        """Start a micro-batch and hand it to the engine; True when it went in. Either way
        the pipeline gets its prefetch slot back now: what is inside the engine is bounded by
        the engine's capacity, not by the prefetch."""
        try:
            begun = self.stages.begin(planned)
        except BaseException:
            self.stages.give_back([w.task_id for w in planned.works])
            self.pipeline.done(planned)
            raise
        if begun is None:
            self.pipeline.done(planned)
            return False
        try:
            self.engine.submit(begun.collated)
        except EngineDied:
            raise
        except Exception as exc:
            log.exception("the engine refused a micro-batch of %d", len(begun.works))
            self._left[id(begun)] = len(begun.works)
            self._fail(begun, begun.works, exc)
            return False
        finally:
            self.pipeline.done(planned)
        for work in begun.works:
            self._open[work.task_id] = begun
        self._left[id(begun)] = len(begun.works)
        log.info("batch %s: %d %s requests in", begun.batch_id, len(begun.works), begun.modality)
        return True

    # collecting results -------------------------------------------------------------
    def _poll(self) -> None:
        stages = self.stages
        try:
            with stages.clock.timing("generate"):
                results = self.engine.poll(stages.worker)
        except EngineDied:
            raise  # out of the loop: the worker exits, its leases are redelivered
        except Exception as exc:
            log.exception("the engine failed with %d requests inside", len(self._open))
            for begun in {id(b): b for b in self._open.values()}.values():
                self._fail(begun, [w for w in begun.works if w.task_id in self._open], exc)
            return
        finished: dict[int, tuple[Begun, list[Result]]] = {}
        for result in results:
            holder = self._open.get(result.id)
            if holder is not None:
                finished.setdefault(id(holder), (holder, []))[1].append(result)
        for begun, batch_results in finished.values():
            settled = stages.settle(begun, batch_results, every=False)
            self._close(begun, settled)

    def _fail(self, begun: Begun, works: list[Work], exc: Exception) -> None:
        results = self.stages.failed(works, exc)
        self._close(begun, self.stages.settle(begun, results, every=False))

    def _close(self, begun: Begun, settled: list[Work]) -> None:
        for work in settled:
            self._open.pop(work.task_id, None)
        left = self._left.get(id(begun), len(begun.works)) - len(settled)
        if left > 0:
            self._left[id(begun)] = left
            return
        self._left.pop(id(begun), None)
        if begun.planned.suspect:
            self._alone = False
        self.batches_done += 1
