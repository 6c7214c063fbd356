"""Bulk submission of a JSONL stream: validated once, staged, then fed a window at a time.

A submission reads its input line by line, never whole, in one pass that validates every
line, gives a line without a ``custom_id`` one from its content (not its line number, so an
edited file resubmits correctly), stages its local and inline media (producers/staging.py:
relative paths against the input's folder and inside it; a remote input's local paths are
never read) and writes the valid lines, normalised, as one object in the store; invalid lines become
error records (the first ``fleet.max_line_errors``; all are counted). A file whose invalid
share passes ``fleet.max_invalid_share`` fails validation as a whole before anything runs.

The job then counts every valid line (``queued`` until it runs) and the staged input becomes
a feed (vlmq/broker/feeding.py): the submitter feeds the first window itself, the fleet's feeders
the rest as tasks finish, so Redis holds at most a window of a job's tasks. Feeding decides
and writes each chunk atomically (one script): submitting the same file again for the same
job, or any number of submitters of one job at once, enqueues only the ``custom_id``s that are
not succeeded or in flight, each once. The job is not finished while a submitter is still
adding (each holds a lease) or a line is still unfed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vlmq.broker.feeding import FeedCounts, Feeder
from vlmq.config.errors import InvalidRequest, QuotaExceeded, StagingRefused
from vlmq.config.ids import check_id, new_submission_id
from vlmq.config.jsonl import LineError, ParsedLine, parse_line
from vlmq.config.schemas import Request
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.producers.preflight.accumulator import Preflight
from vlmq.stores.base import BlobWriter

__all__ = ["Stager", "SubmitReport", "content_id", "submit_jsonl"]

# Lines staged together (their media uploaded in parallel) and sorted by their media before
# they are stored (media affinity: lines about one image or clip next to each other reach one
# worker, whose media cache decodes it once).
_WINDOW = 2000


class Stager(Protocol):
    """Uploads requests' local and inline media and rewrites their references
    (producers/staging.py): each request staged, or the error that fails it alone.
    ``remote_input``: the lines came from a file read from elsewhere, so their local paths
    name no file here and are never read."""

    def stage_all(
        self, requests: Sequence[Request], base_dir: Path | None, *, remote_input: bool = False
    ) -> list[Request | InvalidRequest]: ...


class Observer(Protocol):
    """Anything that looks at each parsed line (the pre-flight estimate)."""

    def add(self, parsed: ParsedLine, base_dir: Path | None) -> object: ...


@dataclass
class SubmitReport:
    job_id: str
    lines: int = 0
    valid: int = 0  # accepted: counted in the job, fed now or later
    enqueued: int = 0  # fed by this submitter (the first window)
    skipped: int = 0
    errors: int = 0
    validation_error: str | None = None
    feed_id: str | None = None
    started: float = 0.0

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.lines / elapsed if elapsed > 0 else 0.0


# The generation fields every digest has held: a field added since counts only when set, so
# a line's content id (the key a resubmitted job is resumed by) survives the upgrade.
_DIGESTED_GENERATION = ("max_new_tokens", "temperature", "top_p", "do_sample", "stop", "seed")


def content_id(request: Request) -> str:
    """A custom_id from what a request asks (messages and generation fields), not from where
    it sits in its file."""
    asked = request.model_dump(mode="json", exclude={"id", "job_id", "custom_id"})
    asked["generation"] = {
        name: value
        for name, value in asked["generation"].items()
        if name in _DIGESTED_GENERATION or value is not None
    }
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
    return f"sha256-{digest[:32]}"


@dataclass
class _Checked:
    """One window of lines validated and staged: what the submitter writes and counts."""

    lines: int
    valid: int
    data: bytes  # the valid lines, normalised, sorted by their media
    errors: list[LineError]
    error_count: int
    refused: str | None = None  # a StagingRefused message: nothing of the file runs


def _windows(lines: Iterable[str]) -> Iterator[list[tuple[int, str]]]:
    """Non-blank lines with their numbers, _WINDOW at a time."""
    window: list[tuple[int, str]] = []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            window.append((number, text))
            if len(window) >= _WINDOW:
                yield window
                window = []
    if window:
        yield window


def _check(
    window: list[tuple[int, str]],
    job_id: str,
    base_dir: Path | None,
    stager: Stager | None,
    cap: int,
    observer: Observer | None = None,
    remote_input: bool = False,
) -> _Checked:
    """Validate a window, stage its media together (in parallel on S3), normalise it."""
    checked = _Checked(len(window), 0, b"", [], 0)

    def error(line_error: LineError) -> None:
        checked.error_count += 1
        if len(checked.errors) < cap:
            checked.errors.append(line_error)

    good: list[ParsedLine] = []
    for number, text in window:
        # (the task id is the feeder's to give: a placeholder saves a uuid per line)
        parsed = parse_line(text, number, job_id, task_id="unfed")
        if observer is not None:
            observer.add(parsed, base_dir)
        if parsed.error is not None:
            error(parsed.error)
        else:
            good.append(parsed)
    requests = [p.request for p in good if p.request is not None]
    accepted: list[tuple[tuple[str, ...], bytes]] = []
    staged = _staged(requests, base_dir, stager, remote_input)
    for parsed, outcome in zip(good, staged, strict=True):
        if isinstance(outcome, StagingRefused):
            checked.refused = outcome.message  # no store can take it, no worker can read it
            return checked
        if isinstance(outcome, InvalidRequest):
            custom_id = parsed.request.custom_id if parsed.request else None
            error(LineError(parsed.line, custom_id, outcome.code, outcome.message))
            continue
        accepted.append(_normalised(parsed.line, outcome))
    # Lines about one image or clip next to each other: one pull takes them to one worker,
    # whose media cache then decodes it once (media affinity).
    accepted.sort(key=lambda line: line[0])
    checked.valid = len(accepted)
    checked.data = b"".join(raw for _, raw in accepted)
    return checked


def _staged(
    requests: list[Request], base_dir: Path | None, stager: Stager | None, remote_input: bool
) -> list[Request | InvalidRequest]:
    if stager is not None:
        return stager.stage_all(requests, base_dir, remote_input=remote_input)
    if base_dir is None:
        return list(requests)
    return [r.resolve_local_paths(base_dir) for r in requests]


# A validating process's own stager (its uploads, its cache), built when it starts.
_PROCESS_STAGER: Stager | None = None


def _start_process(settings: Settings, stage: bool, local_files: bool, outside: bool) -> None:
    global _PROCESS_STAGER
    if stage:
        from vlmq.producers.staging import MediaStager

        _PROCESS_STAGER = MediaStager(settings, local_files=local_files, allow_outside_base=outside)


def _stager_options(stager: Stager | None) -> tuple[bool, bool]:
    """What a validating process's own stager shares with the submitter's: whether it reads
    local files, and whether a relative path may leave the input's folder."""
    return (
        bool(getattr(stager, "local_files", True)),
        bool(getattr(stager, "allow_outside_base", False)),
    )


def _check_in_process(
    window: list[tuple[int, str]],
    job_id: str,
    base_dir: Path | None,
    cap: int,
    remote_input: bool,
) -> _Checked:
    return _check(window, job_id, base_dir, _PROCESS_STAGER, cap, remote_input=remote_input)


class _Validation:
    """The one pass over a submission's input: validate, stage, name, store, count; on
    ``processes`` > 1 the windows are checked by that many processes, in order, a few
    windows ahead (the file is never read further ahead than that)."""

    def __init__(
        self,
        client: Client,
        job_id: str,
        base_dir: Path | None,
        stager: Stager | None,
        observer: Observer | None,
        processes: int = 1,
        remote_input: bool = False,
    ) -> None:
        if processes > 1 and observer is not None:
            raise ValueError("an observer sees every line in this process: processes=1")
        self.client = client
        self.job_id = job_id
        self.base_dir = base_dir
        self.stager = stager
        self.observer = observer
        self.processes = processes
        self.remote_input = remote_input
        self.errors: list[LineError] = []
        self.cap = client.settings.fleet.max_line_errors

    def run(
        self,
        lines: Iterable[str],
        out: BlobWriter,
        report: SubmitReport,
        on_progress: Callable[[SubmitReport], None] | None,
    ) -> int:
        """Writes the valid lines to ``out``; returns the bytes written. Raises
        StagingRefused (nothing was fed) when media could reach no worker."""
        size = 0
        for checked in self._checked(_windows(lines)):
            if checked.refused is not None:
                raise StagingRefused(checked.refused)
            report.lines += checked.lines
            report.valid += checked.valid
            report.errors += checked.error_count
            self.errors += checked.errors[: max(0, self.cap - len(self.errors))]
            if checked.data:
                out.write(checked.data)
                size += len(checked.data)
            if on_progress is not None:
                on_progress(report)
        return size

    def _checked(self, windows: Iterator[list[tuple[int, str]]]) -> Iterator[_Checked]:
        args = (self.job_id, self.base_dir)
        if self.processes <= 1:
            for window in windows:
                yield _check(window, *args, self.stager, self.cap, self.observer, self.remote_input)
            return
        context = multiprocessing.get_context("spawn")  # nothing inherited: no fork hazards
        start = (self.client.settings, self.stager is not None, *_stager_options(self.stager))
        with ProcessPoolExecutor(
            self.processes, context, initializer=_start_process, initargs=start
        ) as pool:
            pending: deque[Future[_Checked]] = deque()
            for window in windows:
                pending.append(
                    pool.submit(_check_in_process, window, *args, self.cap, self.remote_input)
                )
                if len(pending) >= 2 * self.processes:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()


def _normalised(number: int, request: Request) -> tuple[tuple[str, ...], bytes]:
    """One stored line (vlmq/broker/feeding.py ``FeedLine``): its line number, custom_id (given,
    or from its content: two identical lines get one, and the second is a duplicate when
    fed), class and request fields; with its media, the sort key."""
    custom_id = request.custom_id or content_id(request)
    body = request.model_dump_json(exclude_none=True, exclude={"id", "job_id", "custom_id"})
    head = json.dumps(
        {"n": number, "c": custom_id, "m": request.modality.value},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return request.media_sources(), f'{head[:-1]},"r":{body}}}\n'.encode()


def input_key(job_id: str, submission: str) -> str:
    """Where a submission's validated, normalised input is stored."""
    return f"inputs/{job_id}/{submission}.jsonl"


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
    stager: Stager | None = None,
    observer: Observer | None = None,
    feed_first_window: bool = True,
    processes: int = 1,
    tenant: str | None = None,
    remote_input: bool = False,
) -> SubmitReport:
    """Validate and stage ``lines`` into job ``job_id`` of ``tenant`` (default: the client's)
    and feed its first window (or leave all of it to the fleet's feeders); safe to call again
    with the same file (only what did not succeed and is not in flight runs). Raises
    QuotaExceeded, feeding nothing, when its valid lines would pass the tenant's quota.
    ``remote_input``: ``lines`` come from a file read from elsewhere (an S3 object): no local
    path they name is read, by the stager or the estimate; each such line fails alone unless
    workers read it in place."""
    tenant = tenant or client.tenant
    check_id("job id", job_id)
    client.check_quota(tenant, 0)  # already over it: refused before reading the input
    report = SubmitReport(job_id, started=time.monotonic())
    fleet = client.settings.fleet
    if observer is None and client.settings.tenants.quota(tenant).max_queued_tokens is not None:
        # The token quota counts the estimate, taken in the validation pass (one process); it
        # opens local files only where the stager may (a local caller, a local input).
        observer = Preflight(
            client.settings,
            local_files=client.local_media and not remote_input,
            allow_outside_base=bool(getattr(stager, "allow_outside_base", False)),
        )
        processes = 1
    submission = new_submission_id()
    number = client.state.jobs.open(
        job_id, submission, name, completion_window_s, webhook_url, tenant
    )
    validation = _Validation(
        client, job_id, base_dir, stager, observer, processes, remote_input=remote_input
    )
    key = input_key(job_id, submission)
    try:
        try:
            with client.store.writer(key, "application/jsonl") as out:
                size = validation.run(lines, out, report, on_progress)
            report.validation_error = _validation_error(client, report)
        except StagingRefused as exc:
            # No store can take the media and no worker can read it: nothing runs, and the
            # message names the setting that fixes it.
            report.validation_error, size = exc.message, 0
        client.state.jobs.record_line_errors(job_id, validation.errors, validation.cap)
        if report.validation_error is None and report.valid:
            tokens = observer.estimated_tokens if isinstance(observer, Preflight) else 0
            try:
                client.check_quota(tenant, report.valid, tokens)
            except QuotaExceeded:
                client.store.delete(key)
                raise
            report.feed_id = f"{number}.{submission}"
            client.state.feeds.register(
                job_id,
                report.feed_id,
                key,
                report.valid,
                lane,
                size,
                fleet.feed_lease_s,
                tokens,
                read=(report.lines, report.errors),
            )
            _feed_first_window(client, report.feed_id, chunk, report, feed_first_window)
        else:
            client.store.delete(key)
            if report.validation_error:
                client.state.jobs.fail_validation(job_id, report.validation_error)
    except BaseException:
        client.state.jobs.release_submitter(job_id, submission)
        raise
    client.seal_job(job_id, submission, lines=report.lines, line_errors=report.errors)
    return report


def _validation_error(client: Client, report: SubmitReport) -> str | None:
    """Why the whole file fails validation (too many invalid lines), or None."""
    threshold = client.settings.fleet.max_invalid_share
    if not report.lines or report.errors / report.lines <= threshold:
        return None
    return (
        f"{report.errors:,} of {report.lines:,} lines are invalid (more than "
        f"{threshold:.0%}, VLMQ_FLEET__MAX_INVALID_SHARE): nothing was run; the error "
        "records name the first ones"
    )


def _feed_first_window(
    client: Client, feed_id: str, chunk: int, report: SubmitReport, feed: bool
) -> None:
    """The submitter registered the feed leased to itself: it feeds up to the window, then
    leaves the rest to the fleet's feeders."""
    try:
        counts = feeder_for(client, chunk).feed(feed_id) if feed else FeedCounts()
    finally:
        client.state.feeds.release(feed_id)
    report.enqueued += counts.enqueued
    report.skipped += counts.skipped
    report.errors += counts.duplicates


def feeder_for(client: Client, chunk: int = 2000) -> Feeder:
    return Feeder.for_fleet(client.state, client.store, client.settings.fleet, chunk)
