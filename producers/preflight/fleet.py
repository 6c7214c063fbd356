"""The fleet's measured rate, from the workers' heartbeat records, and an ETA from it.

Each worker writes ``Keys.workers()[name] = {"modalities", "at", "engine": {...}, ...}``
every ``lease_s / 3`` (``workers/fleet/service._announce``; ``producers/healthcheck.py``
reads the same hash). ``engine`` carries the engine's cumulative counters since it started,
among them ``rows`` (requests generated) and ``generate_s`` (seconds inside generate), so
``rows / generate_s`` is the worker's measured throughput while its model is busy: tasks/s
for the mix of its classes it has served. That is the rate used here. It is optimistic
where the model waits on media decoding or an empty queue (only generate time counts) and
it ignores other jobs already queued (fair share splits the fleet between them).

A worker serving several classes spends its time on each in turn, so the ETA is the
longest, over the workers, of the time each needs for its share: every class's tasks are
spread over the workers serving it in proportion to their rates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.healthcheck import heartbeat_max_age_s, worker_beats

__all__ = ["FleetRates", "WorkerRate", "estimate_eta", "read_fleet_rates"]


@dataclass(frozen=True)
class WorkerRate:
    name: str
    modalities: tuple[str, ...]
    tasks_per_s: float
    prompt_tokens_per_s: float


@dataclass
class FleetRates:
    """Fresh workers with a measured rate, and why there is none when there is none."""

    workers: list[WorkerRate] = field(default_factory=list)
    fresh: int = 0  # fresh heartbeats, with or without a measured rate
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        per_class: dict[str, float] = {}
        for worker in self.workers:
            for modality in worker.modalities:
                per_class[modality] = per_class.get(modality, 0.0) + worker.tasks_per_s
        return {
            "workers": self.fresh,
            "measured": len(self.workers),
            "tasks_per_s": {k: round(v, 3) for k, v in sorted(per_class.items())},
            "source": "engine rows / generate_s of each fresh worker heartbeat",
            **({"reason": self.reason} if self.reason else {}),
        }


def _worker_rate(name: str, info: Mapping[str, Any]) -> WorkerRate | None:
    engine = info.get("engine") or {}
    try:
        rows, busy = float(engine.get("rows", 0)), float(engine.get("generate_s", 0.0))
        prompt = float(engine.get("real_prompt_tokens", 0))
    except (TypeError, ValueError):
        return None
    modalities = info.get("modalities")
    if rows <= 0 or busy <= 0 or not isinstance(modalities, list):
        return None
    return WorkerRate(name, tuple(str(m) for m in modalities), rows / busy, prompt / busy)


def rates_from_entries(entries: Mapping[str, str], max_age_s: float, now: float) -> FleetRates:
    """The rates in a ``Keys.workers()`` hash's entries; stale beats are left out."""
    fresh = [b for b in worker_beats(dict(entries)) if now - b.at <= max_age_s]
    rates = [r for b in fresh if (r := _worker_rate(b.name, b.info)) is not None]
    reason = ""
    if not fresh:
        reason = "no worker has sent a heartbeat recently (no workers running?)"
    elif not rates:
        reason = f"{len(fresh)} worker(s) running, none has generated yet: no measured rate"
    return FleetRates(rates, len(fresh), reason)


def read_fleet_rates(redis: Any, settings: Settings, now: float | None = None) -> FleetRates:
    """One ``HGETALL`` of the heartbeat hash (a read only)."""
    entries = redis.hgetall(Keys(settings.fleet.key_prefix).workers())
    max_age = heartbeat_max_age_s(settings.fleet.lease_s)
    return rates_from_entries(entries, max_age, time.time() if now is None else now)


def estimate_eta(tasks: Mapping[str, int], rates: FleetRates | None) -> dict[str, Any]:
    """Seconds to run ``tasks`` (per class) on the measured fleet, or None and why."""
    if rates is None:
        return {"seconds": None, "reason": "the fleet's rate was not read"}
    wanted = {m: n for m, n in tasks.items() if n > 0}
    if not wanted:
        return {"seconds": 0.0, "reason": "nothing to run"}
    if not rates.workers:
        return {"seconds": None, "reason": rates.reason}
    capacity = {m: sum(w.tasks_per_s for w in rates.workers if m in w.modalities) for m in wanted}
    unserved = sorted(m for m, c in capacity.items() if c <= 0)
    if unserved:
        return {"seconds": None, "reason": f"no measured worker serves {', '.join(unserved)}"}
    # Each worker's share of a class is in proportion to its rate, so its time on the class
    # is tasks / capacity whatever its rate; a worker's classes run one after another.
    per_class = {m: wanted[m] / capacity[m] for m in wanted}
    seconds = max(sum(per_class[m] for m in wanted if m in w.modalities) for w in rates.workers)
    return {
        "seconds": round(seconds, 1),
        "per_class_s": {m: round(s, 1) for m, s in sorted(per_class.items())},
        "reason": "at the fleet's measured rate, with the fleet to this job alone",
    }
