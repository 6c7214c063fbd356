"""Usage per tenant and per job: prompt tokens (visual included), completion tokens,
requests, model seconds, GPU microseconds and cost (micro-cents: ``config/cost.py``), by model
and modality.

Counted by the settle script in the step that settles each task (scripts.lua, "usage"), so a
task counts once, when its result becomes the task's; a superseded delivery's counts nothing.
Model seconds are each task's share of its micro-batch's time in the engine (generate time
over batch size). GPU time and cost are the result's ``cost`` field, as its worker charged
it (``workers/fleet/charge.py``), integers so the counters sum exactly. Read by
``vlmq/broker/state/usage.py`` for ``GET /v1/usage`` and ``vlmq usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["METRICS", "TaskUsage", "model_seconds"]

# The stored metrics, in the order the settle script reads them.
METRICS = ("prompt_tokens", "completion_tokens", "requests", "model_us", "gpu_us", "cost_ucents")


@dataclass(frozen=True)
class TaskUsage:
    """What one settled task used."""

    model: str
    modality: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_s: float = 0.0
    gpu_us: int = 0
    cost_ucents: int = 0

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> TaskUsage:
        """From a result record (the object the worker stores)."""
        usage = record.get("usage") or {}
        timings = record.get("timings") or {}
        size = max(1, int(record.get("batch_size") or 1))
        cost = record.get("cost") or {}
        return cls(
            model=_dim(record.get("model")),
            modality=_dim(record.get("modality")),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            model_s=model_seconds(timings, size),
            gpu_us=int(cost.get("gpu_us") or 0),
            cost_ucents=int(cost.get("ucents") or 0),
        )

    def argv(self) -> list[str | int]:
        """The settle script's arguments for this task (read_usage)."""
        dims = f"{self.model}|{self.modality}"
        model_us = round(self.model_s * 1e6)
        counts = [self.prompt_tokens, self.completion_tokens, 1, model_us]
        return [dims, *counts, self.gpu_us, self.cost_ucents]


def model_seconds(timings: Mapping[str, Any], batch_size: int) -> float:
    """The task's share of its model's time: as the engine apportioned it (``model_s``: the
    decode loop, whose rows come and go), else its micro-batch's time split evenly."""
    if timings.get("model_s") is not None:
        return float(timings["model_s"])
    return float(timings.get("generate_s") or 0.0) / batch_size


def _dim(value: Any) -> str:
    """A label as stored: '|' separates the dimensions, so it never appears in one."""
    text = str(getattr(value, "value", value) or "unknown")
    return text.replace("|", "/")[:200]
