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
    "iter_errors",
    "iter_results",
    "job_cost",
    "job_summary",
    "to_chat_completion",
    "to_openai_error",
    "to_openai_output",
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


def _fetch(client: Client, status: dict[str, str]) -> dict[str, Any]:
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
            yield from pool.map(lambda t: _fetch(client, t), window)
    yield from _never_fed(client, job_id)


def _never_fed(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
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


def _openai_choices(record: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI ``choices``: every completion when the record has them (n > 1 or logprobs),
    else the one ``output``."""
    completions = record.get("choices") or [
        {"index": 0, "text": record.get("output"), "finish_reason": record.get("finish_reason")}
    ]
    return [
        {
            "index": choice.get("index", index),
            "message": {"role": "assistant", "content": choice.get("text") or ""},
            "finish_reason": choice.get("finish_reason") or "stop",
            "logprobs": choice.get("logprobs"),
        }
        for index, choice in enumerate(completions)
    ]


def to_chat_completion(record: dict[str, Any]) -> dict[str, Any]:
    """A succeeded result record as an OpenAI chat completion body (``chat.completion``)."""
    usage = record.get("usage") or {}
    # Already summed over the choices by the worker.
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    created = int((record.get("timings") or {}).get("finished_at") or time.time())
    return {
        "id": f"chatcmpl-{record['id']}",
        "object": "chat.completion",
        "created": created,
        "model": record.get("model") or "vlmq",
        "choices": _openai_choices(record),
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def to_openai_output(record: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI Batch output file."""
    body = to_chat_completion(record)
    return {
        "id": f"batch_req_{record['id']}",
        "custom_id": record.get("custom_id"),
        "response": {"status_code": 200, "request_id": record["id"], "body": body},
        "error": None,
    }


def to_openai_error(record: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI Batch error file (failed tasks and invalid lines)."""
    error = record.get("error") or {"code": "internal_error", "message": "internal error"}
    task_id = record.get("id") or f"line-{record.get('line')}"
    return {
        "id": f"batch_req_{task_id}",
        "custom_id": record.get("custom_id"),
        "response": None,
        "error": {
            "code": error.get("code"),
            "message": error.get("message"),
            **({"line": record["line"]} if record.get("line") else {}),
        },
    }
