"""What the batch loop reports as it works, to whoever listens (metrics, Celery task events).

The loop calls these hooks and knows nothing of who implements them (as dramatiq's
middleware): :class:`~vlmq.workers.fleet.metrics.WorkerMetrics` turns them into Prometheus
series, :class:`~vlmq.workers.fleet.events.TaskEvents` into the events Flower reads. A hook
must not raise into the loop: :class:`Observers` logs and swallows what one raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from vlmq.config.wire import Envelope

__all__ = ["LoopObserver", "Observers"]

log = logging.getLogger(__name__)


class LoopObserver:
    """Every hook the loop calls; each does nothing unless overridden."""

    def received(self, envelopes: Sequence[Envelope]) -> None:
        """These pulled messages were read (headers, properties, embed), before they are
        admitted, run or failed (those that could not be read at all are not here)."""

    def batch(self, modality: str, size: int, max_size: int, redelivered: int) -> None:
        """A batch of ``size`` requests is about to run."""

    def started(self, task_ids: Sequence[str]) -> None:
        """These tasks moved to running."""

    def result(self, record: Mapping[str, Any]) -> None:
        """A task's result record, before it is stored."""

    def dead_lettered(self, task_id: str) -> None:
        """A task ran too often without finishing and will not run again."""

    def uploaded(self, seconds: float, modality: str) -> None:
        """One result object reached the store."""

    def superseded(self, task_ids: Sequence[str]) -> None:
        """Results of deliveries that no longer held their task were discarded."""

    def settled(self, records: Sequence[Mapping[str, Any]]) -> None:
        """These result records are their tasks' results now: stored and settled (the
        terminal status points at them, ``result_url`` in each, when stored); called once per
        settle, off the loop's thread."""

    def dropped(self, count: int) -> None:
        """A pull dropped copies of tasks already finished or held by a live holder."""

    def heartbeat(self, queue_depths: Mapping[str, Mapping[str, int]], engine_stats: Any) -> None:
        """The heartbeat ran: messages waiting per class and lane, the engine's cumulative
        counters."""

    def pipeline(
        self, depths: Mapping[str, int], wall_s: float, busy_s: Mapping[str, float]
    ) -> None:
        """The heartbeat ran: hand-off depths, seconds since start, busy seconds per stage
        (``generate`` over wall is the model-busy fraction)."""

    def prepare_backlog(self, depths: Mapping[str, int]) -> None:
        """The heartbeat ran: image and video tasks waiting that are not prepared yet."""

    def media_loads(self, modality: str, source: str, count: int) -> None:
        """Media loaded for a task: ``source`` decoded (fetched and decoded here),
        frame_store (read back prepared) or cache (this worker's own media cache)."""

    def renewals_stalled(self, stalled: bool) -> None:
        """This worker's lease renewals stalled (True: it pulls nothing until they resume)
        or resumed (False); ``renewals.py``."""

    def close(self) -> None:
        """The worker stops."""


class Observers(LoopObserver):
    """Fans each hook out to every observer; one that raises never breaks the loop."""

    def __init__(self, observers: Sequence[LoopObserver] = ()) -> None:
        self.observers = list(observers)

    def _each(self, hook: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:
                log.warning("observer %s.%s failed", type(observer).__name__, hook, exc_info=True)

    def received(self, envelopes: Sequence[Envelope]) -> None:
        self._each("received", envelopes)

    def batch(self, modality: str, size: int, max_size: int, redelivered: int) -> None:
        self._each("batch", modality, size, max_size, redelivered)

    def started(self, task_ids: Sequence[str]) -> None:
        self._each("started", task_ids)

    def result(self, record: Mapping[str, Any]) -> None:
        self._each("result", record)

    def dead_lettered(self, task_id: str) -> None:
        self._each("dead_lettered", task_id)

    def uploaded(self, seconds: float, modality: str) -> None:
        self._each("uploaded", seconds, modality)

    def superseded(self, task_ids: Sequence[str]) -> None:
        self._each("superseded", task_ids)

    def settled(self, records: Sequence[Mapping[str, Any]]) -> None:
        self._each("settled", records)

    def dropped(self, count: int) -> None:
        self._each("dropped", count)

    def heartbeat(self, queue_depths: Mapping[str, Mapping[str, int]], engine_stats: Any) -> None:
        self._each("heartbeat", queue_depths, engine_stats)

    def pipeline(
        self, depths: Mapping[str, int], wall_s: float, busy_s: Mapping[str, float]
    ) -> None:
        self._each("pipeline", depths, wall_s, busy_s)

    def prepare_backlog(self, depths: Mapping[str, int]) -> None:
        self._each("prepare_backlog", depths)

    def media_loads(self, modality: str, source: str, count: int) -> None:
        self._each("media_loads", modality, source, count)

    def renewals_stalled(self, stalled: bool) -> None:
        self._each("renewals_stalled", stalled)

    def close(self) -> None:
        self._each("close")
