"""Usage per tenant and per job: prompt tokens (visual included), completion tokens,
requests, model seconds, GPU microseconds and cost (micro-cents: ``config/cost.py``), by model
and modality.

Counted by the settle script in the step that settles each task (lua/tenants.lua, "usage"), so a
task counts once, when its result becomes the task's; a superseded delivery's counts nothing.
Model seconds are each task's share of its micro-batch's time in the engine (generate time
over batch size). GPU time and cost are the result's ``cost`` field, as its worker charged
it (``workers/fleet/charge.py``), integers so the counters sum exactly. Read by
``vlmq/broker/state/usage.py`` for ``GET /v1/usage`` and ``vlmq usage``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["METRICS", "TaskUsage", "model_seconds", "usage_argv"]

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
    # The job the worker read for the task: only groups a settle's usage (usage_argv); the
    # settle script counts under the job the task's hash names.
    job_id: str | None = field(default=None, compare=False)

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
            job_id=str(record["job_id"]) if record.get("job_id") else None,
        )

    @property
    def dims(self) -> str:
        return f"{self.model}|{self.modality}"

    def values(self) -> list[int]:
        """The metrics as stored, in METRICS order: integers, so sums are exact."""
        model_us = round(self.model_s * 1e6)
        counts = [self.prompt_tokens, self.completion_tokens, 1, model_us]
        return [*counts, self.gpu_us, self.cost_ucents]


def usage_argv(usage: Sequence[TaskUsage | None]) -> tuple[list[str | int], list[list[str]]]:
    """A settle's usage as the settle script reads it (tenants.lua, read_usage_groups): the
    tasks grouped by model, modality and job, each group's sums once, then per task its group
    (1-based, 0: none) and its own values as one string. The script adds a group's sums when
    all of its tasks moved under the one job and tenant, and each task's own values otherwise
    (a superseded holder, a job the worker read wrong): the sums are the same, and a batch of
    one job costs the script no parsing per task."""
    groups: dict[tuple[str, str | None], int] = {}
    sums: list[list[int]] = []
    dims: list[str] = []
    counts: list[int] = []
    per_task: list[list[str]] = []
    for used in usage:
        if used is None:
            per_task.append(["0", ""])
            continue
        values = used.values()
        index = groups.setdefault((used.dims, used.job_id), len(groups))
        if index == len(sums):
            sums.append([0] * len(values))
            dims.append(used.dims)
            counts.append(0)
        sums[index] = [a + b for a, b in zip(sums[index], values, strict=True)]
        counts[index] += 1
        per_task.append([str(index + 1), " ".join(map(str, values))])
    header: list[str | int] = [len(sums)]
    for index, group_sums in enumerate(sums):
        header += [dims[index], counts[index], *group_sums]
    return header, per_task


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
