"""The stages a pulled batch goes through, shared by the serial loop and the pipeline.

admit (decode messages, drop what must not run) → prepare (per request, on the prepare pool:
fetch, decode, estimate) → plan (micro-batches; requests that ran before each alone, last) →
collate (per micro-batch, on the collate pool) → generate (the model's thread: start them,
hand them to the engine, settle the results). ``StageClock`` records how long each stage is
busy and what it is working on now, for the model-busy fraction and stuck-stage detection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from vlmq.workers.engine.interface import Collated
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.fleet.work import Work

__all__ = ["Backoff", "Job", "Planned", "StageClock"]


@dataclass
class Job:
    """One pulled batch on its way through the stages."""

    modality: str
    works: list[Work]
    prepared: list[Future[Prepared]]
    alone: list[Work] = field(default_factory=list)  # prepared alone, later (Planned.unprepared)
    media_bytes: int = 0
    left: int = 0  # micro-batches not yet through generate


@dataclass
class Planned:
    """One micro-batch: its work, its collated inputs (being made), whether it is a request
    that ran before (run alone, after its batch-mates are settled)."""

    job: Job
    works: list[Work]
    collated: Future[Collated]
    suspect: bool = False
    items: list[Prepared] = field(default_factory=list)  # what ``collated`` is made of
    ready_at: float = field(default_factory=time.monotonic)
    # Not prepared yet: a request whose holders died before it started, prepared on the
    # model's thread once its batch-mates are settled (``BatchLoop.begin``).
    unprepared: bool = False


class Backoff:
    """The pauses of a polling loop: while it finds nothing, from ``idle_s[0]`` doubling to
    ``idle_s[1]``; while Redis does not answer, from 0.1 s doubling to 2 s. Each starts over
    once work (``worked``) or an answer (``answered``) comes."""

    OUTAGE_S = (0.1, 2.0)

    def __init__(self, idle_s: tuple[float, float]) -> None:
        self.idle_s = idle_s
        self._idle = idle_s[0]
        self._outage = self.OUTAGE_S[0]

    def worked(self) -> None:
        self._idle = self.idle_s[0]

    def answered(self) -> None:
        self._outage = self.OUTAGE_S[0]

    def idle(self) -> float:
        """How long to pause now that nothing was found (the next pause is longer)."""
        wait, self._idle = self._idle, min(self._idle * 2, self.idle_s[1])
        return wait

    def outage(self, grow: bool = True) -> float:
        """How long to pause after an error (the next one longer, for Redis outages)."""
        wait = self._outage
        if grow:
            self._outage = min(wait * 2, self.OUTAGE_S[1])
        return wait


class StageClock:
    """Busy seconds per stage since start, and since when each busy thread's current item
    runs (a stage stuck on one item is detected like a stuck engine call)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.busy: dict[str, float] = {}
        self._current: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        began = time.monotonic()
        slot = (stage, threading.get_ident())
        with self._lock:
            self._current[slot] = began
        try:
            yield
        finally:
            ended = time.monotonic()
            with self._lock:
                self._current.pop(slot, None)
                self.busy[stage] = self.busy.get(stage, 0.0) + ended - began

    def longest_running(self, stage: str | None = None) -> tuple[str, float] | None:
        """The stage whose current item has run longest, and for how long."""
        now = time.monotonic()
        with self._lock:
            running = [
                (name, now - began)
                for (name, _), began in self._current.items()
                if stage is None or name == stage
            ]
        return max(running, key=lambda r: r[1]) if running else None

    def snapshot(self) -> tuple[float, dict[str, float]]:
        """Wall seconds since start, busy seconds per stage."""
        with self._lock:
            return time.monotonic() - self.started, dict(self.busy)
