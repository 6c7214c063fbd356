"""Engines that do no inference: for queue benchmarks, fault tests and the pipeline's
simulated accelerator.

:class:`NoopEngine` has only the Engine's ``run`` (the loop adapts it to the generation
interface with ``RunOnlyEngine``); it answers every request with an empty output and can
sleep per batch to stand in for generation time. :class:`SimulatedAccelerator` does the
real CPU work (it prepares and collates with a real Engine: fetch, decode, the processor)
and replaces only ``generate`` with a sleep of a configured time per batch and per decode
step, so the pipeline can be measured against a fast accelerator on a machine that has none
(sleeping uses no CPU).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vlmq.config.schemas import FinishReason, Request, Result, Usage
from vlmq.config.settings import EXIT_INJECTED_CRASH
from vlmq.workers.engine.interface import Collated, OneSlot, RunOnlyEngine
from vlmq.workers.engine.prepare import Prepared

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = ["NoopEngine", "PrepareCrash", "SimulatedAccelerator"]


def _text(request: Request) -> str:
    return " ".join(getattr(p, "text", "") for m in request.messages for p in m.content)


def _empty_result(request: Request, model: str, size: int, worker: str | None) -> Result:
    return Result(
        id=request.id,
        custom_id=request.custom_id,
        job_id=request.job_id,
        status="succeeded",
        model=model,
        modality=request.modality,
        output="",
        finish_reason=FinishReason.STOP,
        usage=Usage(),
        batch_size=size,
        worker=worker,
    )


class NoopEngine:
    model_name = "noop"

    def __init__(self, batch_delay_s: float = 0.0, crash_marker: str | None = None) -> None:
        self.batch_delay_s = batch_delay_s
        self.crash_marker = crash_marker

    def setup(self) -> NoopEngine:
        return self

    def close(self) -> None:
        pass

    # all at once ---------------------------------------------------------------
    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]:
        if self.crash_marker and any(self.crash_marker in _text(r) for r in requests):
            os._exit(EXIT_INJECTED_CRASH)  # stands in for a segfault or an OOM kill
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
        return [_empty_result(r, self.model_name, len(requests), worker) for r in requests]


class PrepareCrash(RunOnlyEngine):
    """A run-only engine whose prepare exits the process for a request holding ``marker``
    (a native decoder crash, an OOM kill while decoding: its holder dies before it starts)."""

    def __init__(self, engine: Any, marker: str) -> None:
        super().__init__(engine)
        self.marker = marker

    def prepare(self, request: Request) -> Prepared:
        if self.marker in _text(request):
            os._exit(EXIT_INJECTED_CRASH)
        return super().prepare(request)


class SimulatedAccelerator(OneSlot):
    """A real Engine's prepare, plan and collate; generate sleeps ``prefill_s`` per
    micro-batch plus ``step_s`` per decode step (its longest ``max_new_tokens``)."""

    stats: EngineStats  # the real engine's

    def __init__(self, engine: Any, prefill_s: float, step_s: float) -> None:
        self.engine = engine
        self.model_name = f"simulated({engine.model_name})"
        self.prefill_s = prefill_s
        self.step_s = step_s
        self.stats = engine.stats

    def setup(self) -> SimulatedAccelerator:
        self.engine.setup()
        return self

    def close(self) -> None:
        self.engine.close()

    def prepare(self, request: Request) -> Prepared:
        prepared: Prepared = self.engine.prepare(request)
        return prepared

    def plan(
        self, prepared: Sequence[Prepared], token_budget: int | None = None
    ) -> list[list[Prepared]]:
        batches: list[list[Prepared]] = self.engine.plan(prepared, token_budget)
        return batches

    def collate(self, items: Sequence[Prepared]) -> Collated:
        collated: Collated = self.engine.collate(items)
        return collated

    def poll(self, worker: str) -> list[Result]:
        collated = self._take()
        if collated is None:
            return []
        steps = max(item.max_new_tokens for item in collated.items)
        seconds = self.prefill_s + self.step_s * steps
        time.sleep(seconds)
        self.stats.generate_s += seconds
        batch_id = uuid.uuid4().hex[:12]
        results = []
        for item in collated.items:
            result = _empty_result(item.request, self.model_name, collated.rows, worker)
            timings = {**item.timings, "collate_s": round(collated.collate_s, 4)}
            update = {"timings": {**timings, "generate_s": seconds}, "batch_id": batch_id}
            results.append(result.model_copy(update=update))
        return results

    def reject(self, prepared: Prepared, worker: str) -> Result:
        result: Result = self.engine.reject(prepared, worker)
        return result
