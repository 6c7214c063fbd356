"""The pipelined worker: pulling, preparing and collating run ahead of the model's thread.

Two stage threads feed the model thread through bounded hand-offs: the *puller* pulls a batch,
admits it and hands its requests to the prepare pool; the *planner* waits for them, cuts
micro-batches and hands those to the collate pool; the model thread (the loop's own) takes
micro-batches in order and generates. Prefetch is bounded by batches (``prefetch_batches``
pulled and not yet through generate) and by decoded bytes (``prefetch_bytes``): a batch is
pulled only once the bytes of every batch before it are known and under the budget, so the
budget is overrun by one batch at most, and a single batch larger than it still runs, alone.
Everything prefetched stays leased and renewed (it is in ``Held``) and stays ``queued`` until
the model thread starts it, so a cancel of a prefetched task is honoured and shutdown gives
every unstarted task straight back.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.settings import WorkerSettings
from vlmq.workers.fleet.batches import Planned, PulledBatch
from vlmq.workers.fleet.clock import Backoff

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(
        self,
        settings: WorkerSettings,
        admit: Callable[[], PulledBatch | None],
        plan: Callable[[PulledBatch], list[Planned]],
        give_back: Callable[[PulledBatch], None],
        stop_event: threading.Event,
        idle_s: tuple[float, float],
    ) -> None:
        self.settings = settings
        self._admit = admit
        self._plan = plan
        self._give_back = give_back
        self._stop = stop_event
        self._idle_s = idle_s
        self._planning: queue.Queue[PulledBatch] = queue.Queue()
        self._ready: queue.Queue[Planned] = queue.Queue()
        self._slots = threading.Semaphore(settings.prefetch_batches)
        self._bytes = 0
        self._unplanned = 0  # pulled batches whose decoded bytes are not known yet
        self._room = threading.Condition()
        self._threads: list[threading.Thread] = []

    # the model thread's side ---------------------------------------------------
    def start(self) -> Pipeline:
        for target, name in ((self._puller, "pipeline-pull"), (self._planner, "pipeline-plan")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def take(self, timeout_s: float) -> Planned | None:
        """The next micro-batch to generate, in order, or None after ``timeout_s``."""
        try:
            return self._ready.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def done(self, planned: Planned) -> None:
        """One micro-batch went through generate (or was given up)."""
        pulled = planned.pulled
        pulled.left -= 1
        if pulled.left <= 0:
            self._finished(pulled)

    def depths(self) -> dict[str, int]:
        with self._room:
            held = self._bytes
        return {
            "planning": self._planning.qsize(),
            "ready": self._ready.qsize(),
            "prefetch_bytes": held,
        }

    def join(self, timeout_s: float) -> None:
        for thread in self._threads:
            thread.join(timeout_s)

    def join_puller(self, timeout_s: float) -> None:
        """Wait for a pull under way when the loop was stopped (nothing is pulled after)."""
        for thread in self._threads:
            if thread.name == "pipeline-pull":
                thread.join(timeout_s)

    # stage threads ---------------------------------------------------------------
    def _puller(self) -> None:
        backoff = Backoff(self._idle_s)
        while not self._stop.is_set():
            if not self._wait_for_room():
                continue
            try:
                pulled = self._admit()
            except TRANSIENT_REDIS_ERRORS as exc:
                self._slots.release()
                wait = backoff.outage()
                log.warning("pipeline: Redis %s; retrying in %.1fs", type(exc).__name__, wait)
                self._stop.wait(wait)
                continue
            except Exception:
                self._slots.release()
                log.exception("pipeline: pulling failed")
                self._stop.wait(backoff.outage(grow=False))
                continue
            backoff.answered()
            if pulled is None:
                self._slots.release()
                self._stop.wait(backoff.idle())
                continue
            backoff.worked()
            with self._room:
                self._unplanned += 1
            self._planning.put(pulled)

    def _wait_for_room(self) -> bool:
        """A prefetch slot, and the bytes of everything pulled known and under the budget
        (so the budget is overrun by one batch at most; one batch may always run)."""
        if not self._slots.acquire(timeout=0.1):
            return False
        with self._room:
            while (
                self._unplanned or self._bytes >= self.settings.prefetch_bytes
            ) and not self._stop.is_set():
                self._room.wait(0.1)
        if self._stop.is_set():
            self._slots.release()
            return False
        return True

    def _planner(self) -> None:
        while not self._stop.is_set():
            try:
                pulled = self._planning.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                planned = self._plan(pulled)
            except Exception:
                log.exception("pipeline: planning a batch failed; giving it back")
                self._give_back(pulled)
                pulled.media_bytes = 0  # never counted in
                self._planned(pulled)
                self._finished(pulled)
                continue
            self._planned(pulled)
            pulled.left = len(planned)
            if not planned:
                self._finished(pulled)
            for item in planned:
                self._ready.put(item)

    def _planned(self, pulled: PulledBatch) -> None:
        with self._room:
            self._bytes += pulled.media_bytes
            self._unplanned -= 1
            self._room.notify_all()

    def _finished(self, pulled: PulledBatch) -> None:
        with self._room:
            self._bytes -= pulled.media_bytes
            pulled.media_bytes = 0
            self._room.notify_all()
        self._slots.release()
