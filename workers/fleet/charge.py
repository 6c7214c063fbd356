"""Each result's GPU time and cost, charged as its micro-batch's results are settled.

A micro-batch's GPU time is the device's own time where the engine measured it (``gpu_s`` in
each result's timings: the HF decode loop's CUDA events), else its model seconds (the
engine's wall time in the model, ``config/usage.py``). That total, in integer microseconds,
is split over the micro-batch's results by their tokens (prompt + generated), so the shares
sum to the total exactly, and each share is priced once (``config/cost.py``): the settle
script adds the same integers to the usage counters. Results settled together that share a
``batch_id`` are one micro-batch; the continuous loop settles a micro-batch's rows as they
finish, so its shares are split among the rows finished together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vlmq.config.cost import Pricing, apportion
from vlmq.config.usage import model_seconds

__all__ = ["charge", "tokens"]


def charge(records: Sequence[dict[str, Any]], pricing: Pricing) -> None:
    """Set each record's ``cost`` (its share of its micro-batch's GPU time, priced)."""
    batches: dict[str, list[dict[str, Any]]] = {}
    for index, record in enumerate(records):
        batches.setdefault(str(record.get("batch_id") or f"alone-{index}"), []).append(record)
    for batch in batches.values():
        measured = all(_timings(r).get("gpu_s") is not None for r in batch)
        # Rounded once per batch: rows' even shares (4687.5 µs each) would each round up.
        total_us = round(sum(_seconds(r, measured) for r in batch) * 1e6)
        shares = apportion(total_us, [tokens(r) for r in batch])
        for record, gpu_us in zip(batch, shares, strict=True):
            record["cost"] = pricing.charge(gpu_us, "device" if measured else "model")


def tokens(record: Mapping[str, Any]) -> int:
    """A result's tokens: prompt (visual included) plus generated."""
    usage = record.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


def _timings(record: Mapping[str, Any]) -> Mapping[str, Any]:
    return record.get("timings") or {}


def _seconds(record: Mapping[str, Any], measured: bool) -> float:
    timings = _timings(record)
    if measured:
        return max(0.0, float(timings["gpu_s"]))
    size = max(1, int(record.get("batch_size") or 1))
    return max(0.0, model_seconds(timings, size))
