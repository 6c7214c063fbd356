"""Leaving in time: what a worker finishes and what it hands back when it is told to go.

A spot GPU is taken away 30-120 s after its notice, and a worker that waits for its leases to
lapse leaves its work idle for a lease plus a reap. On SIGTERM or a preemption notice
(``notices.py``) a worker drains instead: it stops pulling at once; of the micro-batches inside
the engine it finishes only those whose expected remaining engine time fits the drain window
(``VLMQ_DRAIN__WINDOW_S``); everything else it holds, prefetched and running alike, goes back
to the head of its queues in one script call (``lua/intake.lua`` ``hand_back``), so an idle
worker takes it at once. A handed-back task is a return, not a death (it never counts toward a
dead letter, and a started one's attempt is taken back), and the delivery it had here is void:
whatever this worker still does with it is refused when it starts or settles, so nothing runs
to a result twice.

:class:`EngineWatch` knows what is inside the engine and since when, and how long a micro-batch
takes (a moving average of those that went through); :func:`plan` decides; :class:`Drain`
hands back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmq.broker.state.intake import Leases
    from vlmq.workers.fleet.held import Held
    from vlmq.workers.fleet.settle import Settler

__all__ = ["Drain", "DrainReport", "EngineWatch", "InEngine", "fits", "plan"]

log = logging.getLogger(__name__)

# Weight of the newest micro-batch in the moving average of engine time.
EWMA_WEIGHT = 0.3


@dataclass
class InEngine:
    """One micro-batch inside the engine: its requests not settled yet, when it went in
    (monotonic) and how long a micro-batch was expected to take then (None: none finished
    yet, so nothing is known)."""

    task_ids: set[str]
    began: float
    expected_s: float | None
    size: int = 0

    def remaining_s(self, now: float) -> float | None:
        if self.expected_s is None:
            return None
        return max(0.0, self.began + self.expected_s - now)


def fits(batch: InEngine, window_s: float, now: float) -> bool:
    """Whether ``batch`` is expected to finish within ``window_s`` of ``now``. One whose
    time is unknown does not: handing it back loses at most its time so far, waiting for it
    may lose the whole window (and the machine with it)."""
    remaining = batch.remaining_s(now)
    return remaining is not None and remaining <= window_s


def plan(
    running: Sequence[InEngine], window_s: float, now: float
) -> tuple[list[InEngine], list[InEngine]]:
    """The micro-batches to finish and those to hand back."""
    finish = [b for b in running if fits(b, window_s, now)]
    back = [b for b in running if not fits(b, window_s, now)]
    return finish, back


class EngineWatch:
    """The micro-batches inside the engine (``Stages.begin`` to their last settle) and the
    moving average of their engine time. Thread-safe: the model thread writes it, a drain
    reads it from the signal's thread."""

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        self.weight = weight
        self.expected_s: float | None = None
        self._open: dict[int, InEngine] = {}
        self._lock = threading.Lock()

    def began(self, key: int, task_ids: Iterable[str], now: float | None = None) -> None:
        ids = set(task_ids)
        at = time.monotonic() if now is None else now
        with self._lock:
            self._open[key] = InEngine(ids, at, self.expected_s, len(ids))

    def settled(self, key: int, task_ids: Iterable[str], now: float | None = None) -> None:
        """Some of a micro-batch's requests are through; the last one closes it and counts
        its time."""
        at = time.monotonic() if now is None else now
        with self._lock:
            batch = self._open.get(key)
            if batch is None:
                return
            batch.task_ids.difference_update(task_ids)
            if batch.task_ids:
                return
            del self._open[key]
            took = at - batch.began
            previous = self.expected_s
            self.expected_s = (
                took if previous is None else self.weight * took + (1 - self.weight) * previous
            )

    def forget(self, task_ids: Iterable[str]) -> None:
        """Requests given back on a failure path: no longer inside (their time not counted)."""
        gone = set(task_ids)
        with self._lock:
            for key in [k for k, b in self._open.items() if b.task_ids & gone]:
                self._open[key].task_ids -= gone
                if not self._open[key].task_ids:
                    del self._open[key]

    def running(self) -> list[InEngine]:
        with self._lock:
            return [
                InEngine(set(b.task_ids), b.began, b.expected_s, b.size)
                for b in self._open.values()
            ]


@dataclass
class DrainReport:
    """What a drain did: the requests it lets finish (and by when, monotonic), how many
    it handed back."""

    finishing: set[str] = field(default_factory=set)
    handed_back: int = 0
    deadline: float = 0.0


class Drain:
    """Hands back what a stopping worker will not finish, in one call."""

    def __init__(
        self, window_s: float, held: Held, leases: Leases, watch: EngineWatch, settler: Settler
    ) -> None:
        self.window_s = window_s
        self.held = held
        self.leases = leases
        self.watch = watch
        self.settler = settler

    def hand_back(self, now: float | None = None) -> DrainReport:
        """Keep what fits the window (and the results already being settled); hand the
        rest back now. Call after pulling stopped."""
        at = time.monotonic() if now is None else now
        finish, back = plan(self.watch.running(), self.window_s, at)
        finishing = {task for batch in finish for task in batch.task_ids}
        keep = finishing | self.settler.pending_ids()
        tokens = {t: n for t, n in self.held.tokens().items() if t not in keep}
        report = DrainReport(finishing, 0, at + self.window_s)
        report.handed_back = self.give(tokens)
        log.warning(
            "draining: %d requests in %d micro-batches finish within %.0fs; %d handed back "
            "(%d of them inside the engine)",
            len(finishing),
            len(finish),
            self.window_s,
            report.handed_back,
            sum(len(b.task_ids) for b in back),
        )
        return report

    def hand_back_rest(self, finishing: set[str]) -> int:
        """Hand back what is held now besides ``finishing`` and the results being settled
        (what a pull under way when the drain began brought in)."""
        keep = finishing | self.settler.pending_ids()
        rest = {t: n for t, n in self.held.tokens().items() if t not in keep}
        if rest:
            log.warning("draining: %d more tasks handed back (a pull under way)", len(rest))
        return self.give(rest)

    def give(self, tokens: dict[str, int]) -> int:
        """Hand ``tokens`` back in one script call; a Redis that cannot take it leaves them to
        their leases (nothing is held and renewed without being worked on)."""
        if not tokens:
            return 0
        try:
            moved = self.leases.hand_back(tokens)
        except Exception:
            log.warning("could not hand %d tasks back; their leases will lapse", len(tokens))
            moved = 0
        self.held.release(tokens)
        return moved
