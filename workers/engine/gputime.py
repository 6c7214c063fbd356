"""The device's own time for the work a worker gives it, beside the wall time it took.

Wall time inside ``generate`` is not GPU time: a decode step bound by the host keeps the GPU idle
most of the step. On CUDA, ``DeviceTimer`` brackets each piece of work (a prefill, a decode step)
with a pair of CUDA events and reads their elapsed time once they have completed (at the decode
loop's sync points, never forcing a sync of its own). Between the events of a replayed CUDA graph
the GPU runs the graph's kernels back to back, so that span is kernel time; around an eager step
it also holds the gaps where the GPU waited for the host to launch the next kernel, so eager
spans are an upper bound and are kept apart (``eager`` in the kind). On the CPU the device is
the host: a span is the wall time of the work.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeviceTimer", "RowShares", "device_name"]


class DeviceTimer:
    def __init__(self, device: str, pool: int = 256) -> None:
        self.cuda = device.startswith("cuda")
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._open: deque[tuple[str, Any, Any, Any]] = deque()
        # Spans stopped with a tag, once measured, in the order they ran (RowShares reads them).
        self.tagged: deque[tuple[float, Any]] = deque()
        self._spare: list[Any] = []
        self._pool = pool

    def start(self, kind: str) -> Any:
        if not self.cuda:
            return (kind, time.perf_counter())
        event = self._event()
        event.record()
        return (kind, event)

    def stop(self, mark: Any, tag: Any = None) -> None:
        kind, begun = mark
        if not self.cuda:
            seconds = time.perf_counter() - begun
            self.seconds[kind] += seconds
            self.counts[kind] += 1
            if tag is not None:
                self.tagged.append((seconds, tag))
            return
        end = self._event()
        end.record()
        self._open.append((kind, begun, end, tag))
        if len(self._open) > self._pool:
            self.collect(wait=True)

    def collect(self, wait: bool = False) -> None:
        """Add the spans whose events completed (all of them, waiting, with ``wait``)."""
        while self._open:
            kind, begun, end, tag = self._open[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._open.popleft()
            seconds = begun.elapsed_time(end) / 1000.0
            self.seconds[kind] += seconds
            self.counts[kind] += 1
            if tag is not None:
                self.tagged.append((seconds, tag))
            self._spare += [begun, end]

    def _event(self) -> Any:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def total(self, *kinds: str) -> float:
        return sum(self.seconds.get(k, 0.0) for k in kinds)


class RowShares:
    """Each request's share of the device's own time in the decode loop, for its cost: a
    prefill's span split over its rows by prompt tokens, a decode step's span evenly over the
    rows busy in it (as the loop apportions its wall time into ``model_s``). Step shares are a
    running sum per step; a row's decode share is the sum's growth between its admission and
    its release, read once the steps' spans are measured (:meth:`catch_up`)."""

    _KEEP = 1 << 16  # running-sum entries kept before the ones no live row needs are dropped

    def __init__(self, timer: DeviceTimer) -> None:
        self.timer = timer
        self.steps = 0  # decode steps stopped
        self._sums = [0.0]  # per-row share of steps [base, base + i)
        self._base = 0

    def stop_step(self, mark: Any, rows: int) -> None:
        self.timer.stop(mark, ("step", max(1, rows)))
        self.steps += 1

    def stop_prefill(self, mark: Any, weights: list[tuple[Any, float]]) -> None:
        """``weights``: (request entry, its fraction) per row; filled by the caller before the
        span is read (the entries are made after the prefill)."""
        self.timer.stop(mark, ("prefill", weights))

    def catch_up(self, wait: bool = True) -> None:
        """Read every span measured so far into the shares (``wait``: all of them)."""
        self.timer.collect(wait=wait)
        tagged = self.timer.tagged
        while tagged:
            seconds, (kind, of) = tagged.popleft()
            if kind == "step":
                self._sums.append(self._sums[-1] + seconds / of)
            else:
                for entry, fraction in of:
                    entry.gpu_s += seconds * fraction

    def since(self, step: int) -> float:
        """A row's share of the steps from ``step`` (its admission) to now (after catch_up)."""
        end = min(self.steps, self._base + len(self._sums) - 1)
        return self._sums[end - self._base] - self._sums[max(step, self._base) - self._base]

    def prune(self, live_from: Iterable[int]) -> None:
        """Drop the running sum before the oldest live row's admission (bounded memory)."""
        if len(self._sums) <= self._KEEP:
            return
        low = min(live_from, default=self.steps)
        low = min(max(low, self._base), self._base + len(self._sums) - 1)
        del self._sums[: low - self._base]
        self._base = low


def device_name() -> str:
    """The GPU's name (the first CUDA device's), or 'cpu' when there is none."""
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "cpu"
