"""Usage per tenant and per job: prompt tokens (visual included), completion tokens,
requests and model seconds, by model and modality.

Counted by the settle script in the step that settles each task (scripts.lua, "usage"), so a
task counts once, when its result becomes the task's; a superseded delivery's counts nothing.
Model seconds are each task's share of its micro-batch's time in the engine (generate time
over batch size). Read here for ``GET /v1/usage`` and ``vlmq usage``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis import Redis

from vlmq.config.keys import Keys

__all__ = ["METRICS", "TaskUsage", "read_usage", "usage_report"]

# The stored metrics, in the order the settle script reads them.
METRICS = ("prompt_tokens", "completion_tokens", "requests", "model_us")


@dataclass(frozen=True)
class TaskUsage:
    """What one settled task used."""

    model: str
    modality: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_s: float = 0.0

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> TaskUsage:
        """From a result record (the object the worker stores)."""
        usage = record.get("usage") or {}
        timings = record.get("timings") or {}
        size = max(1, int(record.get("batch_size") or 1))
        return cls(
            model=_dim(record.get("model")),
            modality=_dim(record.get("modality")),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            model_s=_model_seconds(timings, size),
        )

    def argv(self) -> list[str | int]:
        """The settle script's arguments for this task (read_usage)."""
        dims = f"{self.model}|{self.modality}"
        return [dims, self.prompt_tokens, self.completion_tokens, 1, round(self.model_s * 1e6)]


def _model_seconds(timings: Mapping[str, Any], batch_size: int) -> float:
    """The task's share of its model's time: as the engine apportioned it (``model_s``: the
    decode loop, whose rows come and go), else its micro-batch's time split evenly."""
    if timings.get("model_s") is not None:
        return float(timings["model_s"])
    return float(timings.get("generate_s") or 0.0) / batch_size


def _dim(value: Any) -> str:
    """A label as stored: '|' separates the dimensions, so it never appears in one."""
    text = str(getattr(value, "value", value) or "unknown")
    return text.replace("|", "/")[:200]


def read_usage(redis: Redis, key: str) -> list[dict[str, Any]]:
    """One usage hash as rows {model, modality, prompt_tokens, completion_tokens, requests,
    model_seconds}, sorted by model then modality."""
    raw: dict[str, str] = redis.hgetall(key)  # type: ignore[assignment]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for field, value in raw.items():
        parts = field.split("|")
        if len(parts) != 3 or parts[2] not in METRICS:
            continue
        model, modality, metric = parts
        row = rows.setdefault((model, modality), _empty(model, modality))
        if metric == "model_us":
            row["model_seconds"] = round(int(value) / 1e6, 3)
        else:
            row[metric] = int(value)
    return [rows[k] for k in sorted(rows)]


def _empty(model: str, modality: str) -> dict[str, Any]:
    return {
        "model": model,
        "modality": modality,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "requests": 0,
        "model_seconds": 0.0,
    }


def _totals(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0}
    seconds = 0.0
    for row in rows:
        for name in totals:
            totals[name] += row[name]
        seconds += row["model_seconds"]
    return {**totals, "model_seconds": round(seconds, 3)}


def usage_report(
    redis: Redis, keys: Keys, tenants: Iterable[str] | None = None, job_id: str | None = None
) -> dict[str, Any]:
    """Usage of ``tenants`` (None: every tenant with usage), or of one job: {tenants: [{tenant,
    totals, by: rows}]} or {job_id, totals, by}."""
    if job_id is not None:
        rows = read_usage(redis, keys.job_usage(job_id))
        return {"object": "usage", "job_id": job_id, "totals": _totals(rows), "by": rows}
    if tenants is None:
        members: set[str] = redis.smembers(keys.usage_tenants())  # type: ignore[assignment]
        tenants = members
    names = sorted(tenants)
    report = []
    for tenant in names:
        rows = read_usage(redis, keys.usage(tenant))
        report.append({"tenant": tenant, "totals": _totals(rows), "by": rows})
    return {"object": "usage", "tenants": report}
