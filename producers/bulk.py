"""Bulk submission of a JSONL stream: streamed, pipelined, resumable, idempotent.

The file is read line by line and enqueued in chunks, never held in memory. Each chunk is
one script call (``submit`` in config/scripts.lua) that decides and writes it atomically:
claim each line's ``custom_id``, write its status hash and message, count it. Submitting the
same file again for the same job, or any number of submitters of one job at once (the CLI
twice, the CLI and the API), enqueues only the ``custom_id``s that are not succeeded or in
flight (queued / running), each once; a failed, cancelled or expired one gets a fresh task
that replaces the old one in the job's counts. A malformed line becomes an error record
(line, ``custom_id``, code, message) stored with the job. The job is not finished while a
submitter is still adding (each holds a lease its chunks renew).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from vlmq.config.jsonl import LineError, ParsedLine, parse_line
from vlmq.config.schemas import Request, new_task_id
from vlmq.producers.client import Client

__all__ = ["SubmitReport", "submit_jsonl"]


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
    """Lines without a custom_id get one from their content (not their line number), so a
    resubmit of the same file, or of an edited one, recognises them. Two identical lines
    get one id: the second is a duplicate (give each a custom_id to run both)."""
    request = parsed.request
    if request is None or request.custom_id is not None:
        return parsed
    return ParsedLine(
        parsed.line, request=request.model_copy(update={"custom_id": content_id(request)})
    )


def content_id(request: Request) -> str:
    """A custom_id from what a request asks (messages and generation fields), not from where
    it sits in its file."""
    asked = request.model_dump(mode="json", exclude={"id", "job_id", "custom_id"})
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
    return f"sha256-{digest[:32]}"


class _ChunkWriter:
    """Enqueues one chunk of parsed lines for a job: one script call decides and writes it."""

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
        errors = [p.error for p in chunk if p.error is not None]
        # Lines about one image or clip next to each other: one pull takes them to one
        # worker, whose media cache then decodes it once (media affinity, bench/README.md).
        valid = sorted((p for p in chunk if p.request is not None), key=_media_of)
        requests = [self._request(p) for p in valid]
        expires = self.client.expiry_after(self.expires_in_s)
        lines = [self.client.queued(r, self.lane, expires) for r in requests]
        codes = self.client.status_db.submit_chunk(self.job_id, self.submission, lines)
        for parsed, code in zip(valid, codes, strict=True):
            if code == "d":
                errors.append(_duplicate(parsed))
        self._record_errors(errors)
        report.enqueued += codes.count("q")
        report.skipped += codes.count("s")
        report.errors += len(errors)

    def _request(self, parsed: ParsedLine) -> Request:
        assert parsed.request is not None
        # A fresh task id per submission: a retried custom_id is a new task.
        request = parsed.request.model_copy(update={"id": new_task_id()})
        if self.base_dir is not None:
            request = request.resolve_local_paths(self.base_dir)
        return request

    def _record_errors(self, errors: list[LineError]) -> None:
        """Keep the first ``max_line_errors`` records (the job counts them all): a file of
        millions of bad lines must not fill Redis."""
        key = self.keys.job_errors(self.job_id)
        room = self.client.settings.fleet.max_line_errors - int(self.client.redis.hlen(key))
        if not errors or room <= 0:
            return
        records = {
            str(e.line): json.dumps(e.to_record(), separators=(",", ":")) for e in errors[:room]
        }
        pipe = self.client.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=records)  # type: ignore[arg-type]
        pipe.expire(key, self.client.status_db.ttl_s)
        pipe.execute()


def _media_of(parsed: ParsedLine) -> tuple[str, ...]:
    """The sort key that groups a chunk's lines by media (stable: otherwise in file order)."""
    assert parsed.request is not None
    return parsed.request.media_sources()


def _duplicate(parsed: ParsedLine) -> LineError:
    assert parsed.request is not None
    custom_id = str(parsed.request.custom_id)
    return LineError(
        parsed.line,
        custom_id,
        "duplicate_custom_id",
        f"custom_id {custom_id[:80]!r} appears more than once",
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
    submission = client.open_job(
        job_id, name=name, expires_in_s=completion_window_s, webhook_url=webhook_url
    )
    writer = _ChunkWriter(client, job_id, lane, completion_window_s, base_dir, submission)
    parsed = (_with_custom_id(p) for p in _parsed(lines, job_id))
    try:
        while batch := list(islice(parsed, chunk)):
            report.lines += len(batch)
            writer.write(batch, report)
            if on_progress is not None:
                on_progress(report)
    except BaseException:
        client.status_db.release_submitter(job_id, submission)
        raise
    client.seal_job(job_id, submission, lines=report.lines, line_errors=report.errors)
    return report
