"""The time of the worker's stages: how long each is busy (``StageClock``) and how long a
polling loop pauses (``Backoff``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Backoff", "StageClock"]


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
