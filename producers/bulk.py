"""Bulk submission of a JSONL stream: streamed, pipelined, resumable, idempotent.

The file is read line by line and enqueued in pipelined chunks, never held in
memory. Each chunk costs three round trips: look up the chunk's ``custom_id``s
already known to the job, read their states, then one transaction that writes
status hashes, job counters and messages. Submitting the same file again for
the same job enqueues only the ``custom_id``s that are not succeeded or in
flight (queued / running); a failed, cancelled or expired one gets a fresh
task that replaces the old one in the job's counts. A malformed line becomes
an error record (line, ``custom_id``, code, message) stored with the job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from vlmq.config.jsonl import LineError, ParsedLine, parse_line
from vlmq.config.schemas import Request, new_task_id
from vlmq.config.status import TaskState
from vlmq.producers.client import Client

__all__ = ["SubmitReport", "submit_jsonl"]

_IN_FLIGHT_OR_DONE = {TaskState.QUEUED.value, TaskState.RUNNING.value, TaskState.SUCCEEDED.value}


@dataclass
class SubmitReport:
    job_id: str
    lines: int = 0
    enqueued: int = 0
    skipped: int = 0
    errors: int = 0
    started: float = 0.0

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.enqueued / elapsed if elapsed > 0 else 0.0


def _parsed(lines: Iterable[str], job_id: str) -> Iterator[ParsedLine]:
    for number, text in enumerate(lines, start=1):
        if text.strip():
            yield parse_line(text, number, job_id)


def _with_custom_id(parsed: ParsedLine) -> ParsedLine:
    """Lines without a custom_id get one from their line number, so a resubmit
    of the same file recognises them."""
    request = parsed.request
    if request is None or request.custom_id is not None:
        return parsed
    return ParsedLine(
        parsed.line, request=request.model_copy(update={"custom_id": f"line-{parsed.line}"})
    )


class _ChunkWriter:
    """Enqueues one chunk of parsed lines for a job."""

    def __init__(
        self,
        client: Client,
        job_id: str,
        lane: str,
        expires_in_s: float | None,
        base_dir: Path | None,
        submission: str,
    ) -> None:
        self.client = client
        self.keys = client.keys
        self.job_id = job_id
        self.lane = lane
        self.expires_in_s = expires_in_s
        self.base_dir = base_dir
        self.submission = submission

    def write(self, chunk: list[ParsedLine], report: SubmitReport) -> None:
        requests, errors = self._split(chunk)
        existing = self._existing(requests)
        pipe = self.client.redis.pipeline(transaction=True)
        for error in errors:
            self._record_error(pipe, error)
        fresh: list[Request] = []
        for request in requests:
            previous = existing.get(str(request.custom_id))
            if previous is not None and previous[1] in _IN_FLIGHT_OR_DONE:
                report.skipped += 1
                continue
            if previous is not None:
                self._supersede(pipe, *previous)
            fresh.append(request)
        if fresh:
            self.client.enqueue(pipe, fresh, self.lane, self.client.expiry_after(self.expires_in_s))
            mapping = {str(r.custom_id): f"{r.id}:{self.submission}" for r in fresh}
            pipe.hset(self.keys.job_custom_ids(self.job_id), mapping=mapping)  # type: ignore[arg-type]
            pipe.rpush(self.keys.job_tasks(self.job_id), *[r.id for r in fresh])
        pipe.execute()
        report.enqueued += len(fresh)
        report.errors += len(errors)

    def _split(self, chunk: list[ParsedLine]) -> tuple[list[Request], list[LineError]]:
        requests: list[Request] = []
        errors: list[LineError] = []
        seen: set[str] = set()
        known = self._submitted_now([p.request for p in chunk if p.request])
        for parsed in chunk:
            if parsed.error is not None:
                errors.append(parsed.error)
                continue
            assert parsed.request is not None
            custom_id = str(parsed.request.custom_id)
            if custom_id in seen or custom_id in known:
                errors.append(
                    LineError(
                        parsed.line,
                        custom_id,
                        "duplicate_custom_id",
                        f"custom_id {custom_id[:80]!r} appears more than once",
                    )
                )
                continue
            seen.add(custom_id)
            # A fresh task id per submission: a retried custom_id is a new task.
            request = parsed.request.model_copy(update={"id": new_task_id()})
            if self.base_dir is not None:
                request = request.resolve_local_paths(self.base_dir)
            requests.append(request)
        return requests, errors

    def _submitted_now(self, requests: list[Request | None]) -> set[str]:
        """custom_ids already enqueued earlier in this same submission (duplicates)."""
        ids = [str(r.custom_id) for r in requests if r is not None]
        if not ids:
            return set()
        values: list[str | None] = self.client.redis.hmget(  # type: ignore[assignment]
            self.keys.job_custom_ids(self.job_id), ids
        )
        return {
            cid
            for cid, v in zip(ids, values, strict=True)
            if v is not None and v.endswith(f":{self.submission}")
        }

    def _existing(self, requests: list[Request]) -> dict[str, tuple[str, str]]:
        """custom_id -> (task id, state) for ids a previous submission enqueued."""
        ids = [str(r.custom_id) for r in requests]
        if not ids:
            return {}
        values: list[str | None] = self.client.redis.hmget(  # type: ignore[assignment]
            self.keys.job_custom_ids(self.job_id), ids
        )
        known = {cid: v.split(":")[0] for cid, v in zip(ids, values, strict=True) if v}
        states = self.client.status_db.tasks(list(known.values()), ("state",))
        return {
            cid: (task, s.get("state", "unknown"))
            for (cid, task), s in zip(known.items(), states, strict=True)
        }

    def _supersede(self, pipe: Any, task_id: str, state: str) -> None:
        """The old task of a resubmitted custom_id leaves the job's counts."""
        job = self.keys.job(self.job_id)
        pipe.hincrby(job, "total", -1)
        if state in {s.value for s in TaskState} and state != TaskState.UNKNOWN.value:
            pipe.hincrby(job, state, -1)
        pipe.hset(self.keys.task(task_id), "superseded", "1")

    def _record_error(self, pipe: Any, error: LineError) -> None:
        pipe.hset(
            self.keys.job_errors(self.job_id),
            str(error.line),
            json.dumps(error.to_record(), separators=(",", ":")),
        )


def submit_jsonl(
    client: Client,
    lines: Iterable[str],
    job_id: str,
    *,
    lane: str = "bulk",
    completion_window_s: float | None = None,
    webhook_url: str | None = None,
    name: str | None = None,
    base_dir: Path | None = None,
    chunk: int = 2000,
    on_progress: Callable[[SubmitReport], None] | None = None,
) -> SubmitReport:
    """Stream ``lines`` into job ``job_id``; safe to call again with the same file."""
    report = SubmitReport(job_id, started=time.monotonic())
    client.open_job(job_id, name=name, expires_in_s=completion_window_s, webhook_url=webhook_url)
    writer = _ChunkWriter(client, job_id, lane, completion_window_s, base_dir, new_task_id()[:12])
    parsed = (_with_custom_id(p) for p in _parsed(lines, job_id))
    while batch := list(islice(parsed, chunk)):
        report.lines += len(batch)
        writer.write(batch, report)
        if on_progress is not None:
            on_progress(report)
    client.seal_job(job_id, lines=report.lines)
    return report
