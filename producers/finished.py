"""Reading a job's results in the order its tasks finished, while it runs or after.

The step that ends a task also appends its id to its job's completion list (lua/tasks.lua;
``Keys.job_finished``), once per task however often its settle is retried or fenced. A reader
pages through that list by offset and fetches each result from the store, so a position in
the job's finished lines is one number: a read from position N writes every line that finished
after the first N, once. Once the job has finished, the lines that never became tasks follow
the list (lines a cancel or the job's expiry dropped before they were fed, then the invalid
input lines), so the positions of a finished job cover every line of its result files.

A fed line that failed and was submitted again keeps its failed task's place in the list; the
reader skips that entry (the line's current task is read instead when it finishes).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import Any

from vlmq.producers.client import Client
from vlmq.producers.export import fetch_record, iter_line_errors, iter_never_fed

__all__ = ["Finished", "iter_finished", "lines_to_come"]

# Task ids read per page: one LRANGE, one pipelined status read, a window of store GETs.
PAGE = 1024
_FIELDS = ("state", "result_url", "custom_id", "error_code", "error_message")


@dataclass(frozen=True)
class Finished:
    """One finished line: its position in the job's finished lines (the next read starts
    after it: ``after=position``) and its result record (None: a superseded entry, which
    takes a position but has no line)."""

    position: int
    record: dict[str, Any] | None


def iter_finished(
    client: Client, job_id: str, after: int = 0, until: int | None = None
) -> Iterator[Finished]:
    """The job's finished lines after position ``after``, in the order they finished, up to
    what had finished when each page was read (``until``: no further than that position).
    The lines that never became tasks come last, once the job has finished."""
    # Read first: a job finished now has its whole list written, so the tail may follow it.
    finished = client.state.jobs.get(job_id).finished
    position = after
    for item in _listed(client, job_id, after, until):
        position = item.position
        yield item
    listed = client.redis.llen(client.keys.job_finished(job_id))
    if not finished or position < listed or (until is not None and until <= listed):
        return
    tail = chain(iter_never_fed(client, job_id), iter_line_errors(client, job_id))
    for index, record in enumerate(tail, start=listed + 1):
        if index > after and (until is None or index <= until):
            yield Finished(index, record)


def _listed(client: Client, job_id: str, after: int, until: int | None) -> Iterator[Finished]:
    key = client.keys.job_finished(job_id)
    position = after
    with ThreadPoolExecutor(max_workers=16) as pool:
        while True:
            last = position + PAGE - 1 if until is None else min(position + PAGE, until) - 1
            if last < position:
                return
            ids: list[str] = client.redis.lrange(key, position, last)  # type: ignore[assignment]
            if not ids:
                return
            statuses = client.state.tasks.ended(job_id, ids, _FIELDS)
            found = [{"id": i, **s} for i, s in zip(ids, statuses, strict=True) if s is not None]
            records = iter(pool.map(lambda status: fetch_record(client, status), found))
            for offset, status in enumerate(statuses, start=position + 1):
                yield Finished(offset, next(records) if status is not None else None)
            position += len(ids)


def lines_to_come(client: Client, job_id: str) -> int:
    """How many of the job's tasks have not finished yet."""
    job = client.state.jobs.get(job_id)
    return max(0, job.total - job.done)
