"""Engines that do no inference, behind ``vlmq worker --engine noop|simulated``: for queue
benchmarks, fault tests and the pipeline's simulated accelerator.

:class:`NoopEngine` has only the Engine's ``run`` (the loop adapts it to the generation
interface with ``RunOnlyEngine``); it answers every request with an empty output and can
sleep per batch to stand in for generation time. :class:`SimulatedAccelerator` does the
real CPU work (it prepares and collates with a real Engine: fetch, decode, the processor)
and replaces only ``generate`` with a sleep of a configured time per batch, per prompt token
(visual tokens included, so video prefill is never free) and per decode step, so the pipeline
can be measured against a fast accelerator on a machine that has none (sleeping uses no CPU).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vlmq.config.schemas import FinishReason, Request, Result, Usage
from vlmq.workers.engine.interface import Collated, OneSlot
from vlmq.workers.engine.prepare import Prepared

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = ["NoopEngine", "SimulatedAccelerator", "parse_simulate", "simulated_seconds"]


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

    def __init__(self, batch_delay_s: float = 0.0) -> None:
        self.batch_delay_s = batch_delay_s

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
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
        return [_empty_result(r, self.model_name, len(requests), worker) for r in requests]


# H200-like defaults for a 2-3B VLM (Qwen2.5-VL-3B), bf16, one GPU:
# * prefill, per prompt token: ~2 x 3e9 = 6 GFLOP a token through the language model; the ViT
#   (~0.67B) adds about as much per visual token (4 patches a token, 2 x 0.67e9 x 4 = 5.4
#   GFLOP). An H200 gives 989 TFLOP/s dense bf16; at ~35% MFU a text token costs 17 us and a
#   visual token ~33 us: 20 us a token is the blend for image-heavy prompts (~50k tok/s).
# * per micro-batch: 5 ms of launches, the vision tower's own passes and the first step's
#   sampling (a text-only batch of 32 short prompts prefills in well under 10 ms).
# * per decode step: 6 GB of weights read at 4.8 TB/s is 1.25 ms; with HF generate's per-step
#   Python and small-batch kernels, ~4 ms a step (batch <= 32, short contexts).
PREFILL_BASE_S = 0.005
PREFILL_TOKEN_S = 0.00002
DECODE_STEP_S = 0.004
SIMULATE_DEFAULT = f"{PREFILL_BASE_S},{DECODE_STEP_S},{PREFILL_TOKEN_S}"


def simulated_seconds(
    items: Sequence[Prepared], prefill_s: float, step_s: float, token_s: float
) -> float:
    """What one micro-batch costs the simulated accelerator: ``prefill_s`` plus ``token_s``
    per prompt token of every row (visual tokens included: the prepared estimate), plus
    ``step_s`` per decode step (its longest ``max_new_tokens``)."""
    if not items:
        return 0.0
    tokens = sum(item.prompt_tokens * item.rows for item in items)
    steps = max(item.max_new_tokens for item in items)
    return prefill_s + token_s * tokens + step_s * steps


def parse_simulate(spec: str) -> tuple[float, float, float]:
    """``--simulate``: ``prefill,step[,per_token]`` seconds; the two-number form (before
    prompt tokens were charged) means a per-token cost of 0."""
    values = [float(x) for x in spec.split(",")]
    if len(values) == 2:
        values.append(0.0)
    if len(values) != 3 or any(v < 0 for v in values):
        raise ValueError("--simulate takes prefill,step[,per_token] seconds, none negative")
    return values[0], values[1], values[2]


class SimulatedAccelerator(OneSlot):
    """A real Engine's prepare, plan and collate; generate sleeps ``prefill_s`` per
    micro-batch plus ``token_s`` per prompt token (visual ones included) plus ``step_s``
    per decode step (its longest ``max_new_tokens``): ``simulated_seconds``."""

    stats: EngineStats  # the real engine's

    def __init__(
        self,
        engine: Any,
        prefill_s: float,
        step_s: float,
        token_s: float = PREFILL_TOKEN_S,
        processor_on_device: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = f"simulated({engine.model_name})"
        self.prefill_s = prefill_s
        self.step_s = step_s
        self.token_s = token_s
        # On a GPU the processor resizes and normalises on the device (processor_device
        # auto): the simulated device is ``meta``, whose tensors cost no host CPU.
        self.processor_on_device = processor_on_device
        self.stats = engine.stats

    def setup(self) -> SimulatedAccelerator:
        self.engine.setup()
        if self.processor_on_device:
            self.engine.set_processor_device("meta")
        return self

    def close(self) -> None:
        self.engine.close()

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        prepared: Prepared = self.engine.prepare(request, tenant, prepared_media)
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
        seconds = simulated_seconds(collated.items, self.prefill_s, self.step_s, self.token_s)
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
