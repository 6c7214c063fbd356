"""The slow parts of a batch, run off the request thread.

* **submit**: stream the uploaded file through ``submit_jsonl`` into the job.
  A lock refreshed per chunk marks it alive; if the process dies mid-file the
  lock expires and the next read of the batch starts it again, which is safe
  because ``submit_jsonl`` skips custom_ids already enqueued. A cancel asked
  for meanwhile stops it between chunks.
* **finalize**: once the job is finished, write the OpenAI output file
  (succeeded results) and error file (failed, cancelled or expired results and
  invalid lines) in one pass over the results.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmq.config.errors import VlmqError
from vlmq.producers.api.batch_records import BatchRecords
from vlmq.producers.api.files import FileRegistry
from vlmq.producers.bulk import SubmitReport, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.export import (
    iter_line_errors,
    iter_results,
    to_openai_error,
    to_openai_output,
)

__all__ = ["SUBMIT_LOCK_S", "BatchWork", "output_file_ids"]

log = logging.getLogger(__name__)

# A chunk (2000 lines) takes well under this; a holder silent for longer died.
SUBMIT_LOCK_S = 120
FINALIZE_LOCK_S = 900
_LOCK_S = {"submitting": SUBMIT_LOCK_S, "finalizing": FINALIZE_LOCK_S}


class _CancelRequested(Exception):
    """Raised between chunks to stop feeding a cancelled batch."""


def output_file_ids(batch_id: str) -> tuple[str, str]:
    return f"file-{batch_id}-output", f"file-{batch_id}-error"


def _lines(data: bytes) -> Iterator[str]:
    # Undecodable bytes become U+FFFD, so such a line fails alone as invalid JSON.
    for raw in data.splitlines():
        yield raw.decode("utf-8", errors="replace")


def _window_s(window: str) -> float:
    return float(window.removesuffix("h")) * 3600


def _jsonl(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class BatchWork:
    """Runs submissions and finalizations on two small thread pools.

    Separate pools, so a long file being fed in never delays another batch's
    output files. A batch is scheduled at most once per process at a time;
    across processes the Redis locks decide, taken when the work starts (a
    lock taken while waiting in a pool queue could expire before it runs).
    """

    def __init__(self, client: Client, files: FileRegistry, records: BatchRecords) -> None:
        self.client = client
        self.files = files
        self.records = records
        self._pools = {
            "submitting": ThreadPoolExecutor(4, thread_name_prefix="vlmq-batch-submit"),
            "finalizing": ThreadPoolExecutor(2, thread_name_prefix="vlmq-batch-finalize"),
        }
        self._scheduled: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        # Unfinished work resumes on a later read (its lock expires), so don't wait.
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def _schedule(self, batch_id: str, what: str, job: Callable[[str], None]) -> None:
        with self._lock:
            if (batch_id, what) in self._scheduled or self.records.held(batch_id, what):
                return
            self._scheduled.add((batch_id, what))
        self._pools[what].submit(self._run, batch_id, what, job)

    def _run(self, batch_id: str, what: str, job: Callable[[str], None]) -> None:
        try:
            if self.records.acquire(batch_id, what, _LOCK_S[what]):
                try:
                    job(batch_id)
                finally:
                    self.records.release(batch_id, what)
        finally:
            with self._lock:
                self._scheduled.discard((batch_id, what))

    # submission --------------------------------------------------------------
    def start_submission(self, batch_id: str) -> None:
        """Feed the batch's file into its job, unless someone already does."""
        self._schedule(batch_id, "submitting", self._submit_safely)

    def _submit_safely(self, batch_id: str) -> None:
        try:
            self._submit(batch_id)
        except Exception as exc:  # a background thread: record it, never lose it
            log.exception("batch %s: submission failed", batch_id)
            self._fail(batch_id, exc)

    def _submit(self, batch_id: str) -> None:
        record = self.records.get(batch_id)
        if record is None or record.get("submitted_at"):
            return
        data = self.files.content(record["input_file_id"])
        if data is None:
            raise VlmqError("the input file could not be read")
        report = SubmitReport(batch_id)

        def progress(now: SubmitReport) -> None:
            report.lines = now.lines
            self.records.refresh(batch_id, "submitting", SUBMIT_LOCK_S)
            if self.records.has(batch_id, "cancelling_at"):
                raise _CancelRequested

        try:
            if self.records.has(batch_id, "cancelling_at"):
                raise _CancelRequested
            submit_jsonl(
                self.client,
                _lines(data),
                batch_id,
                lane="bulk",
                completion_window_s=_window_s(record["completion_window"]),
                name=f"openai batch of {record['input_file_id']}",
                on_progress=progress,
            )
        except _CancelRequested:
            # The job must be sealed to finish (opened first: it may be cancelled before a
            # line was read); then cancel the last chunk too.
            submission = self.client.open_job(batch_id)
            self.client.seal_job(batch_id, submission, lines=report.lines)
            self.client.cancel(batch_id)
        self.records.mark_once(batch_id, "submitted_at")

    def _fail(self, batch_id: str, exc: Exception) -> None:
        message = exc.message if isinstance(exc, VlmqError) else "the batch could not be submitted"
        code = exc.code if isinstance(exc, VlmqError) else "internal_error"
        self.records.update(batch_id, error_code=code, error_message=message)
        self.records.mark_once(batch_id, "failed_at")
        if self.client.status_db.job_exists(batch_id):
            # (submit_jsonl released its own submitter lease when it failed)
            self.client.seal_job(batch_id, submission="")
            self.client.cancel(batch_id)

    # finalization ------------------------------------------------------------
    def start_finalize(self, batch_id: str) -> None:
        self.records.mark_once(batch_id, "finalizing_at")
        self._schedule(batch_id, "finalizing", self._finalize_safely)

    def finalize_now(self, batch_id: str) -> bool:
        """Write the files on this thread; False when another holder is at it."""
        if not self.records.acquire(batch_id, "finalizing", FINALIZE_LOCK_S):
            return False
        self.records.mark_once(batch_id, "finalizing_at")
        try:
            self._finalize_safely(batch_id)
        finally:
            self.records.release(batch_id, "finalizing")
        return True

    def _finalize_safely(self, batch_id: str) -> None:
        try:
            self._finalize(batch_id)
        except Exception:
            # Left unfinalized: the next read of the batch tries again.
            log.exception("batch %s: writing the output files failed", batch_id)

    def _finalize(self, batch_id: str) -> None:
        if self.records.has(batch_id, "finalized_at"):
            return  # a read scheduled it again just before the last run ended
        output, errors = bytearray(), bytearray()
        n_output = n_errors = 0
        for result in iter_results(self.client, batch_id):
            if result.get("status") == "succeeded":
                output += _jsonl(to_openai_output(result))
                n_output += 1
            else:
                errors += _jsonl(to_openai_error(result))
                n_errors += 1
        for line_error in iter_line_errors(self.client, batch_id):
            errors += _jsonl(to_openai_error(line_error))
            n_errors += 1
        output_id, error_id = output_file_ids(batch_id)
        self.files.create(bytes(output), f"{batch_id}_output.jsonl", "batch_output", output_id)
        self.files.create(bytes(errors), f"{batch_id}_error.jsonl", "batch_output", error_id)
        self.records.update(batch_id, output_count=n_output, error_count=n_errors)
        self.records.update(batch_id, finalized_at=int(time.time()))
