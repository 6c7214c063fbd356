"""Usage read back from Redis: the per-tenant and per-job usage hashes the settle script
counts (the stored metrics and a task's share are ``config/usage.py``'s), as rows by model
and modality, for ``GET /v1/usage`` and ``vlmq usage``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from redis import Redis

from vlmq.config.cost import cents
from vlmq.config.keys import Keys
from vlmq.config.usage import METRICS

__all__ = ["read_usage", "usage_report"]


def read_usage(redis: Redis, key: str) -> list[dict[str, Any]]:
    """One usage hash as rows {model, modality, prompt_tokens, completion_tokens, requests,
    model_seconds, gpu_us, gpu_seconds, cost_ucents, cost}, sorted by model then modality."""
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
    return [_priced(rows[k]) for k in sorted(rows)]


def _empty(model: str, modality: str) -> dict[str, Any]:
    return {
        "model": model,
        "modality": modality,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "requests": 0,
        "model_seconds": 0.0,
        "gpu_us": 0,
        "cost_ucents": 0,
    }


def _priced(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its GPU seconds and its cost to the cent (from the exact integers)."""
    row["gpu_seconds"] = round(row["gpu_us"] / 1e6, 6)
    row["cost"] = cents(row["cost_ucents"])
    return row


# Summed exactly (integers); model seconds, stored as integer microseconds too, are rounded
# per row on the way out, so their total is the rounded rows' sum.
_SUMMED = ("prompt_tokens", "completion_tokens", "requests", "gpu_us", "cost_ucents")


def _totals(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = dict.fromkeys(_SUMMED, 0)
    seconds = 0.0
    for row in rows:
        for name in _SUMMED:
            totals[name] += row[name]
        seconds += row["model_seconds"]
    return _priced({**totals, "model_seconds": round(seconds, 3)})


def _by_model(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows summed per model (over modalities and tenants)."""
    models: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        models.setdefault(row["model"], []).append(row)
    return [{"model": name, **_totals(models[name])} for name in sorted(models)]


def usage_report(
    redis: Redis,
    keys: Keys,
    tenants: Iterable[str] | None = None,
    job_id: str | None = None,
    currency: str = "USD",
) -> dict[str, Any]:
    """Usage of ``tenants`` (None: every tenant with usage), or of one job: {tenants: [{tenant,
    totals, by: rows, models}], models} or {job_id, totals, by, models}; ``models`` sums per
    model. Costs are in ``currency`` (the fleet's one: VLMQ_COST__CURRENCY)."""
    if job_id is not None:
        rows = read_usage(redis, keys.job_usage(job_id))
        return {
            "object": "usage",
            "currency": currency,
            "job_id": job_id,
            "totals": _totals(rows),
            "by": rows,
            "models": _by_model(rows),
        }
    if tenants is None:
        members: set[str] = redis.smembers(keys.usage_tenants())  # type: ignore[assignment]
        tenants = members
    names = sorted(tenants)
    report = []
    every: list[dict[str, Any]] = []
    for tenant in names:
        rows = read_usage(redis, keys.usage(tenant))
        every += rows
        report.append(
            {"tenant": tenant, "totals": _totals(rows), "by": rows, "models": _by_model(rows)}
        )
    return {
        "object": "usage",
        "currency": currency,
        "tenants": report,
        "models": _by_model(every),
    }
