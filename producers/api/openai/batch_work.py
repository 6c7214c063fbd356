"""The slow parts of a batch, run off the request thread.

* **submit**: stream the uploaded file through ``submit_jsonl`` into the job.
  A lock refreshed per chunk marks it alive; if the process dies mid-file the
  lock expires and the next read of the batch starts it again, which is safe
  because ``submit_jsonl`` skips custom_ids already enqueued. A cancel asked
  for meanwhile stops it between chunks.
* **finalize**: once the job is finished, write the OpenAI output file
  (succeeded results) and error file (failed, cancelled or expired results and
  invalid lines) in one pass over the results, each record streamed to its
  store writer (a multipart upload on S3) as it comes: memory stays flat
  however many results the batch has.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmq.config.errors import VlmqError
from vlmq.config.tenants import owner_of
from vlmq.producers.api.openai.batch_records import BatchRecords
from vlmq.producers.api.openai.files import FileRegistry
from vlmq.producers.api.openai.mapping import to_openai_error, to_openai_output
from vlmq.producers.bulk import SubmitReport, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.export import iter_line_errors, iter_results
from vlmq.producers.preflight import Preflight
from vlmq.stores.base import BlobWriter

__all__ = ["LOCK_S", "BatchWork", "output_file_ids"]

log = logging.getLogger(__name__)

# A holder renews its lock every third of this while it works, however long its work takes
# (NamedLeases.holding): a lock that lapses is a dead holder's, taken over this long after.
LOCK_S = 60


class _CancelRequested(Exception):
    """Raised between chunks to stop feeding a cancelled batch."""


def output_file_ids(batch_id: str) -> tuple[str, str]:
    return f"file-{batch_id}-output", f"file-{batch_id}-error"


def _decoded(lines: Iterable[tuple[int, bytes]]) -> Iterator[str]:
    # Undecodable bytes become U+FFFD, so such a line fails alone as invalid JSON.
    for _, raw in lines:
        yield raw.removesuffix(b"\r").decode("utf-8", errors="replace")


def _window_s(window: str) -> float:
    return float(window.removesuffix("h")) * 3600


def _preflight_summary(preflight: Preflight) -> dict[str, Any]:
    """What a batch object carries of its estimate (the CLI's --dry-run prints all of it)."""
    report = preflight.report()
    return {
        "lines": report["lines"],
        "invalid_lines": report["invalid_lines"]["count"],
        "modality": report["modality"],
        "prompt_tokens": report["prompt_tokens"]["total"],
        "visual_tokens": report["prompt_tokens"]["visual"],
        "output_tokens": report["output_tokens"]["total"],
        "predicted_failures": report["predicted_failures"]["count"],
    }


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
            with self.records.holding(batch_id, what, LOCK_S) as held:
                if held:
                    job(batch_id)
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
        input_file_id = record["input_file_id"]
        if self.files.size(input_file_id) is None:  # read below as it is fed in
            raise VlmqError("the input file could not be read")
        report = SubmitReport(batch_id)

        def progress(now: SubmitReport) -> None:
            report.lines = now.lines
            if self.records.has(batch_id, "cancelling_at"):
                raise _CancelRequested

        preflight = self._preflight()
        try:
            if self.records.has(batch_id, "cancelling_at"):
                raise _CancelRequested
            submitted = submit_jsonl(
                self.client,
                _decoded(self.files.lines(input_file_id)),
                batch_id,
                lane="bulk",
                completion_window_s=_window_s(record["completion_window"]),
                name=f"openai batch of {record['input_file_id']}",
                on_progress=progress,
                stager=self.client.stager,
                observer=preflight,
                tenant=owner_of(record),
            )
            if preflight is not None:
                self.records.update(batch_id, preflight=json.dumps(_preflight_summary(preflight)))
            if submitted.validation_error:
                self.records.update(
                    batch_id,
                    error_code="validation_failed",
                    error_message=submitted.validation_error,
                )
                self.records.mark_once(batch_id, "failed_at")
        except _CancelRequested:
            # The job must be sealed to finish (opened first: it may be cancelled before a
            # line was read); then cancel the last chunk too.
            submission = self.client.open_job(batch_id, tenant=owner_of(record))
            self.client.seal_job(batch_id, submission, lines=report.lines)
            self.client.cancel(batch_id)
        self.records.mark_once(batch_id, "submitted_at")

    def _preflight(self) -> Preflight | None:
        """The batch's pre-flight estimate, taken in the validation pass (``api.preflight``);
        it opens no local file a line names (the caller is remote)."""
        settings = self.client.settings
        if not settings.api.preflight:
            return None
        return Preflight(settings, local_files=self.client.local_media)

    def _fail(self, batch_id: str, exc: Exception) -> None:
        message = exc.message if isinstance(exc, VlmqError) else "the batch could not be submitted"
        code = exc.code if isinstance(exc, VlmqError) else "internal_error"
        self.records.update(batch_id, error_code=code, error_message=message)
        self.records.mark_once(batch_id, "failed_at")
        if self.client.state.jobs.exists(batch_id):
            # (submit_jsonl released its own submitter lease when it failed)
            self.client.seal_job(batch_id, submission="")
            self.client.cancel(batch_id)

    # finalization ------------------------------------------------------------
    def start_finalize(self, batch_id: str) -> None:
        self.records.mark_once(batch_id, "finalizing_at")
        self._schedule(batch_id, "finalizing", self._finalize_safely)

    def finalize_now(self, batch_id: str) -> bool:
        """Write the files on this thread; False when another holder is at it."""
        with self.records.holding(batch_id, "finalizing", LOCK_S) as held:
            if not held:
                return False
            self.records.mark_once(batch_id, "finalizing_at")
            self._finalize_safely(batch_id)
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
        output_id, error_id = output_file_ids(batch_id)
        with self.files.writer(output_id) as output_blob, self.files.writer(error_id) as error_blob:
            output, errors = _JsonlOut(output_blob), _JsonlOut(error_blob)
            for result in iter_results(self.client, batch_id):
                if result.get("status") == "succeeded":
                    output.add(to_openai_output(result))
                else:
                    errors.add(to_openai_error(result))
            for line_error in iter_line_errors(self.client, batch_id):
                errors.add(to_openai_error(line_error))
        # Listed only once both are complete in the store.
        tenant = owner_of(self.records.get(batch_id) or {})
        for file_id, out, suffix in ((output_id, output, "output"), (error_id, errors, "error")):
            self.files.register(
                file_id, out.bytes, f"{batch_id}_{suffix}.jsonl", "batch_output", tenant
            )
        self.records.update(batch_id, output_count=output.records, error_count=errors.records)
        self.records.update(batch_id, finalized_at=int(time.time()))


class _JsonlOut:
    """One output file being written: each record goes to the store as it comes."""

    def __init__(self, blob: BlobWriter) -> None:
        self.blob = blob
        self.records = 0
        self.bytes = 0

    def add(self, record: dict[str, Any]) -> None:
        line = _jsonl(record)
        self.blob.write(line)
        self.records += 1
        self.bytes += len(line)
