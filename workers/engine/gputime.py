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
from typing import Any

import torch

__all__ = ["DeviceTimer", "device_name"]


class DeviceTimer:
    def __init__(self, device: str, pool: int = 256) -> None:
        self.cuda = device.startswith("cuda")
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._open: deque[tuple[str, Any, Any]] = deque()
        self._spare: list[Any] = []
        self._pool = pool

    def start(self, kind: str) -> Any:
        if not self.cuda:
            return (kind, time.perf_counter())
        event = self._event()
        event.record()
        return (kind, event)

    def stop(self, mark: Any) -> None:
        kind, begun = mark
        if not self.cuda:
            self.seconds[kind] += time.perf_counter() - begun
            self.counts[kind] += 1
            return
        end = self._event()
        end.record()
        self._open.append((kind, begun, end))
        if len(self._open) > self._pool:
            self.collect(wait=True)

    def collect(self, wait: bool = False) -> None:
        """Add the spans whose events completed (all of them, waiting, with ``wait``)."""
        while self._open:
            kind, begun, end = self._open[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._open.popleft()
            self.seconds[kind] += begun.elapsed_time(end) / 1000.0
            self.counts[kind] += 1
            self._spare += [begun, end]

    def _event(self) -> Any:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def total(self, *kinds: str) -> float:
        return sum(self.seconds.get(k, 0.0) for k in kinds)


def device_name() -> str:
    """The GPU's name (the first CUDA device's), or 'cpu' when there is none."""
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "cpu"
