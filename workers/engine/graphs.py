"""Decode steps run eagerly or replayed as CUDA graphs, one graph per bucket.

A step is a function of no arguments that reads and writes only tensors that outlive it (the
slot cache, the slot state, the logits buffer), so the same function can be run (eager) or
captured once and replayed (a CUDA graph: the whole step is one launch from the host, which is
what takes the host out of a decode step). Graphs are captured per key (rows bucket, cache
length bucket; or rows bucket and control features) the first time the key is used, sharing one
memory pool. A step that must run before its capture (the forward pass's warm-up, which cuBLAS
and the attention kernels need) must be safe to run twice: the forward step only writes what
its replay writes again.

``StepRunner`` decides: ``graphs`` on, a capture that fails turns graphs off for the worker's
life with one log line, and the step runs eagerly from then on (``eager_steps`` counts them).
``graph_factory`` is where tests put a stand-in for ``torch.cuda.CUDAGraph`` (this project's
machines have no GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["CudaGraphs", "GraphStats", "StepRunner", "cuda_graphs_wanted"]

log = logging.getLogger(__name__)

Step = Callable[[], None]


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """How graphs are made: CUDA's, or a test's stand-in."""

    def capture(self, step: Step, warm_up: bool) -> Graph: ...


def cuda_graphs_wanted(setting: str, device: str) -> bool:
    """``auto``: on for CUDA; ``on``: also elsewhere only through a test's backend; ``off``."""
    if setting == "off":
        return False
    return setting == "on" or device.startswith("cuda")


class CudaGraphs:
    """torch.cuda.CUDAGraph capture on a side stream, all graphs sharing one memory pool."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Step, warm_up: bool) -> Graph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if warm_up:
                for _ in range(2):
                    step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        context: AbstractContextManager[Any] = torch.cuda.graph(graph, pool=self.pool)
        with context:
            step()
        return graph


@dataclass
class GraphStats:
    captured: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager_steps: int = 0
    failed: str | None = None
    keys: list[Hashable] = field(default_factory=list)


class StepRunner:
    """Runs decode steps by key, replaying a captured graph when graphs are on."""

    def __init__(self, backend: GraphBackend | None) -> None:
        self.backend = backend
        self.graphs: dict[Hashable, Graph] = {}
        self.stats = GraphStats()

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def run(self, key: Hashable, make: Callable[[], Step], warm_up: bool = False) -> None:
        """Run the step ``make()`` builds for ``key``: its graph's replay (captured now if this
        is the key's first use), or eagerly."""
        graph = self.graphs.get(key)
        if graph is None and self.backend is not None:
            graph = self._capture(key, make(), warm_up)
        if graph is not None:
            graph.replay()
            self.stats.replays += 1
            return
        make()()
        self.stats.eager_steps += 1

    def _capture(self, key: Hashable, step: Step, warm_up: bool) -> Graph | None:
        assert self.backend is not None
        started = time.perf_counter()
        try:
            graph = self.backend.capture(step, warm_up)
        except Exception as exc:  # any failure: the worker goes on eagerly, and says so once
            self.stats.failed = f"{type(exc).__name__}: {exc}"[:300]
            log.warning(
                "CUDA graph capture failed for %s (%s); decoding eagerly from now on",
                key,
                self.stats.failed,
            )
            self.backend = None
            self.graphs.clear()
            return None
        self.stats.captured += 1
        self.stats.capture_s += time.perf_counter() - started
        self.stats.keys.append(key)
        self.graphs[key] = graph
        return graph

    def reset(self) -> None:
        """Forget every graph (the storage they captured was replaced: the cache grew)."""
        self.graphs.clear()
