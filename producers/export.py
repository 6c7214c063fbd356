"""Reading a job back: its summary, its results, its errors, in vlmq or OpenAI form.

Results stream from the store in submission order, fetched by a small thread
pool a window ahead (a GET costs a round trip; one at a time would crawl).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any

from vlmq.broker.feeding import FeedLine
from vlmq.broker.state.usage import usage_report
from vlmq.config.cost import cents, per_thousand
from vlmq.config.status import TERMINAL, JobState
from vlmq.producers.client import Client
from vlmq.stores.base import result_location

__all__ = [
    "fetch_record",
    "iter_errors",
    "iter_line_errors",
    "iter_never_fed",
    "iter_results",
    "job_cost",
    "job_summary",
]

_WINDOW = 256


def job_summary(client: Client, job_id: str) -> dict[str, Any]:
    """A job's state and counts (``JobStatus``), its bad lines, rate and ETA."""
    job = client.state.jobs.get(job_id)
    if job.state is JobState.UNKNOWN:
        return {"job_id": job_id, "state": job.state.value}
    stored = int(client.redis.hlen(client.keys.job_errors(job_id)))
    errors = max(job.line_errors, stored)  # every bad line counted; the first ones stored
    created = job.created_at or time.time()
    elapsed = (job.finished_at or time.time()) - created
    rate = job.done / elapsed if elapsed > 0 else 0.0
    remaining = job.total - job.done
    return {
        **job.as_dict(),
        "created_at": created,
        "errors": errors,
        "rate_per_s": round(rate, 3),
        "eta_s": round(remaining / rate, 1) if rate > 0 and remaining > 0 else None,
        "cost": job_cost(client, job_id),
    }


def job_cost(client: Client, job_id: str) -> dict[str, Any]:
    """What a job's settled results cost so far (its usage counters): GPU seconds, the cost
    (exact micro-cents, and to the cent) and the cost per 1,000 requests."""
    currency = client.settings.cost.currency
    totals = usage_report(client.redis, client.keys, job_id=job_id, currency=currency)["totals"]
    thousand = per_thousand(totals["cost_ucents"], totals["requests"])
    return {
        "currency": currency,
        "requests": totals["requests"],
        "gpu_seconds": totals["gpu_seconds"],
        "cost_ucents": totals["cost_ucents"],
        "cost": totals["cost"],
        "per_1000_requests_ucents": thousand,
        "per_1000_requests": cents(thousand),
    }


_FIELDS = ("state", "result_url", "custom_id", "error_code", "error_message")


def _current_tasks(client: Client, job_id: str) -> Iterator[dict[str, str]]:
    """Each current task of the job, with its status fields: those enqueued by id, then the
    fed ones (one per custom_id; a finished one from its folded record)."""
    jobs, tasks = client.state.jobs, client.state.tasks
    ids = jobs.listed_task_ids(job_id)
    while window := list(islice(ids, 2000)):
        for task_id, status in zip(window, tasks.many(window, _FIELDS), strict=True):
            yield {"id": task_id, **status}
    fed = jobs.fed_tasks(job_id)
    while batch := list(islice(fed, 2000)):
        live = [task_id for task_id, folded in batch if folded.state is None]
        statuses = iter(tasks.many(live, _FIELDS))
        for task_id, folded in batch:
            if folded.state is None:
                yield {"id": task_id, **next(statuses)}
            else:
                yield {"id": task_id, **folded.status(task_id, job_id)}


def fetch_record(client: Client, status: dict[str, str]) -> dict[str, Any]:
    """A finished task's result record from the store, or (none stored) one its status makes."""
    location = result_location(status)
    record = client.store.get(location) if location else None
    if record is not None:
        return record
    # Cancelled or expired before running: no object; the status says why.
    state = status.get("state", "unknown")
    return {
        "id": status["id"],
        "custom_id": status.get("custom_id") or None,
        "status": state,
        "error": {
            "code": status.get("error_code") or state,
            "message": status.get("error_message") or f"the task was {state}",
        },
    }


def iter_results(
    client: Client, job_id: str, terminal_only: bool = True
) -> Iterator[dict[str, Any]]:
    """Result records in submission order (tasks still running are skipped)."""
    terminal = {s.value for s in TERMINAL}
    tasks = (
        t for t in _current_tasks(client, job_id) if not terminal_only or t.get("state") in terminal
    )
    with ThreadPoolExecutor(max_workers=16) as pool:
        while window := list(islice(tasks, _WINDOW)):
            yield from pool.map(lambda t: fetch_record(client, t), window)
    yield from iter_never_fed(client, job_id)


def iter_never_fed(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
    """The lines of feeds dropped by a cancel or the job's expiry before they were fed: read
    from the staged input, where they are (Redis kept only where the rest begins)."""
    fields: dict[str, str] = client.redis.hgetall(client.keys.job(job_id))  # type: ignore[assignment]
    for name, where in fields.items():
        if not name.startswith("dropped:"):
            continue
        key, cursor, state = where.split(" ")
        for _, raw in client.store.lines(key, int(cursor)):
            line = FeedLine.parse(raw)
            yield {
                "id": None,
                "custom_id": line.custom_id,
                "status": state,
                "error": {"code": state, "message": f"the job was {state} before this line ran"},
            }


def iter_line_errors(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
    raw: dict[str, str] = client.redis.hgetall(client.keys.job_errors(job_id))  # type: ignore[assignment]
    for _, value in sorted(raw.items(), key=lambda kv: int(kv[0])):
        yield json.loads(value)


def iter_errors(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
    """Failed, cancelled and expired results, then the invalid input lines."""
    for record in iter_results(client, job_id):
        if record.get("status") != "succeeded":
            yield record
    yield from iter_line_errors(client, job_id)
