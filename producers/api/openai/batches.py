"""OpenAI batches on top of vlmq jobs: create, read, cancel, list.

A batch is a vlmq job with the same id. Its OpenAI status is read from the
job summary each time, plus the batch record's own milestones: the file is
still being fed in (``validating``), output files are being written
(``finalizing``), or a cancel was asked for (``cancelling``).
"""

from __future__ import annotations

import json
import time
from itertools import islice
from typing import Any

from vlmq.config.tenants import Caller
from vlmq.producers.api.errors import ApiError
from vlmq.producers.api.openai.batch_records import BatchRecords, new_batch_id
from vlmq.producers.api.openai.batch_work import BatchWork, output_file_ids
from vlmq.producers.api.openai.files import FileRegistry, newest_first
from vlmq.producers.api.openai.objects import (
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchStatus,
    RequestCounts,
)
from vlmq.producers.api.openai.partial_output import batch_of_partial, partial_file_id
from vlmq.producers.client import Client
from vlmq.producers.export import iter_line_errors, job_summary

__all__ = ["BatchService"]

_FINISHED = {"completed", "failed", "cancelled", "expired"}
_MAX_METADATA = 16


def _int(value: Any) -> int | None:
    try:
        return int(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


class BatchService:
    def __init__(self, client: Client, files: FileRegistry) -> None:
        self.client = client
        self.files = files
        self.records = BatchRecords(client)
        self.work = BatchWork(client, files, self.records)

    # create ------------------------------------------------------------------
    def create(self, body: BatchCreate, caller: Caller) -> BatchObject:
        _check_body(body)
        source = self.files.get(body.input_file_id, caller)
        if source is None:
            raise ApiError(404, "not_found", "input_file_id: no such file")
        if source.purpose != "batch":
            raise ApiError(422, "invalid_request", "input_file_id: the file's purpose is not batch")
        # A tenant already at its quota is refused now (429), not after its file was read.
        self.client.check_quota(caller.tenant, 0)
        batch_id = new_batch_id()
        fields = {
            "id": batch_id,
            "input_file_id": body.input_file_id,
            "endpoint": body.endpoint,
            "completion_window": body.completion_window,
            "created_at": str(int(time.time())),
            "metadata": json.dumps(body.metadata or {}),
            "tenant": caller.tenant,
        }
        self.records.create(batch_id, fields)
        self.work.start_submission(batch_id)
        return self.get(batch_id)

    # read --------------------------------------------------------------------
    def get(self, batch_id: str, caller: Caller | None = None) -> BatchObject:
        """The batch; 404 for no such batch or (``caller``) another tenant's."""
        record = self.records.get(batch_id, caller)
        if record is None:
            raise ApiError(404, "not_found", "no such batch")
        return self._object(batch_id, record)

    def _object(self, batch_id: str, record: dict[str, str]) -> BatchObject:
        summary = job_summary(self.client, batch_id)
        status = self._status(batch_id, record, summary)
        created = int(record["created_at"])
        window = int(record["completion_window"].removesuffix("h")) * 3600
        metadata = json.loads(record.get("metadata") or "{}")
        return BatchObject(
            id=batch_id,
            endpoint=record["endpoint"],
            input_file_id=record["input_file_id"],
            completion_window=record["completion_window"],
            status=status,
            created_at=created,
            expires_at=created + window,
            in_progress_at=_int(summary.get("created_at")),
            cancelling_at=_int(record.get("cancelling_at")),
            finalizing_at=_int(record.get("finalizing_at")),
            **_closing_times(status, record),
            **self._file_ids(batch_id, record),
            vlmq_partial_output_file_id=_partial_of(batch_id, status),
            request_counts=_counts(summary),
            errors=self._errors(batch_id, status, record),
            metadata=metadata or None,
            preflight=json.loads(record["preflight"]) if record.get("preflight") else None,
        )

    def _status(
        self, batch_id: str, record: dict[str, str], summary: dict[str, Any]
    ) -> BatchStatus:
        if record.get("failed_at"):
            return "failed"
        state = summary.get("state", "unknown")
        cancelling = bool(record.get("cancelling_at"))
        if state in ("unknown", "validating"):
            if not record.get("submitted_at"):
                self.work.start_submission(batch_id)  # resumes it if its feeder died
            if cancelling:
                return "cancelling"
            return "in_progress" if summary.get("total") else "validating"
        if state not in _FINISHED:
            return "cancelling" if cancelling or state == "cancelling" else "in_progress"
        if record.get("finalized_at"):
            return "cancelled" if cancelling else _finished(state)
        self.work.start_finalize(batch_id)
        return "cancelling" if cancelling else "finalizing"

    def _file_ids(self, batch_id: str, record: dict[str, str]) -> dict[str, str | None]:
        output_id, error_id = output_file_ids(batch_id)
        return {
            "output_file_id": output_id if _int(record.get("output_count")) else None,
            "error_file_id": error_id if _int(record.get("error_count")) else None,
        }

    def _errors(self, batch_id: str, status: str, record: dict[str, str]) -> BatchErrors | None:
        """Why a batch failed: its submission error, or its first invalid lines."""
        if status != "failed":
            return None
        if record.get("error_code"):
            first = BatchError(code=record["error_code"], message=record.get("error_message"))
            return BatchErrors(data=[first])
        lines = islice(iter_line_errors(self.client, batch_id), 10)
        data = [
            BatchError(
                code=(e.get("error") or {}).get("code"),
                message=(e.get("error") or {}).get("message"),
                line=e.get("line"),
            )
            for e in lines
        ]
        return BatchErrors(data=data)

    def list(self, limit: int, after: str | None, caller: Caller) -> tuple[list[BatchObject], bool]:
        """Newest first: the caller's tenant's batches (an admin's: all)."""

        def load(batch_id: str) -> BatchObject | None:
            record = self.records.get(batch_id, caller)
            return self._object(batch_id, record) if record else None

        index = self.records.index
        if not caller.admin:
            index = self.client.keys.batches_index(caller.tenant)
        return newest_first(self.client, index, load, limit, after)

    # cancel --------------------------------------------------------------------
    def cancel(self, batch_id: str, caller: Caller) -> BatchObject:
        """Queued requests never run; running ones finish; the batch ends cancelled."""
        batch = self.get(batch_id, caller)
        if batch.status in _FINISHED:
            return batch
        self.records.mark_once(batch_id, "cancelling_at")
        if self.client.state.jobs.exists(batch_id):
            self.client.cancel(batch_id)
        return self.get(batch_id)

    # generated files -----------------------------------------------------------
    def partial_batch(self, file_id: str, caller: Caller | None = None) -> str | None:
        """The batch whose partial output file ``file_id`` is (404 when there is no such
        batch, it is another tenant's, or it has no lines to offer yet); None when
        ``file_id`` is not a partial file."""
        batch_id = batch_of_partial(file_id)
        if batch_id is None:
            return None
        record = self.records.get(batch_id, caller)
        if record is None or not self.client.state.jobs.exists(batch_id):
            raise ApiError(404, "not_found", "no such file")
        return batch_id

    def ensure_output(self, file_id: str, caller: Caller | None = None) -> bool:
        """Write a finished batch's output files now if they are asked for first.

        Returns False when ``file_id`` is not a batch output file (or, ``caller``, one of
        another tenant's batches: it is then not found); raises 409 when its batch has not
        finished (or another process is writing them).
        """
        batch_id = _batch_of_output(file_id)
        if batch_id is None or self.records.get(batch_id, caller) is None:
            return False
        if self.files.get(file_id) is not None:
            return True
        record = self.records.get(batch_id) or {}
        summary = job_summary(self.client, batch_id)
        if summary.get("state") not in _FINISHED or record.get("failed_at"):
            raise ApiError(409, "not_finished", "the batch has not finished yet")
        if not self.work.finalize_now(batch_id) or self.files.get(file_id) is None:
            raise ApiError(409, "not_finished", "the batch's files are being written")
        return True


def _partial_of(batch_id: str, status: BatchStatus) -> str | None:
    """A batch offers its finished lines from when it runs until its job expires."""
    return None if status in ("validating", "failed") else partial_file_id(batch_id)


def _check_body(body: BatchCreate) -> None:
    """What the schema does not say (the endpoint and window are checked there)."""
    metadata = body.metadata or {}
    if len(metadata) > _MAX_METADATA or any(
        len(k) > 64 or len(v) > 512 for k, v in metadata.items()
    ):
        raise ApiError(422, "invalid_request", "metadata: at most 16 pairs, keys ≤ 64 chars")


def _finished(state: str) -> BatchStatus:
    """A finished job state as an OpenAI status (the same words)."""
    mapping: dict[str, BatchStatus] = {
        "completed": "completed",
        "failed": "failed",
        "cancelled": "cancelled",
        "expired": "expired",
    }
    return mapping[state]


def _closing_times(status: str, record: dict[str, str]) -> dict[str, int | None]:
    """The one closing timestamp that matches the final status."""
    done = _int(record.get("finalized_at") or record.get("failed_at"))
    names = {
        "completed": "completed_at",
        "failed": "failed_at",
        "cancelled": "cancelled_at",
        "expired": "expired_at",
    }
    return {names[status]: done} if status in names else {}


def _counts(summary: dict[str, Any]) -> RequestCounts:
    counts = summary.get("counts") or {}
    invalid = int(summary.get("errors") or 0)
    return RequestCounts(
        total=int(summary.get("total") or 0) + invalid,
        completed=int(counts.get("succeeded", 0)),
        failed=int(counts.get("failed", 0)) + int(counts.get("expired", 0)) + invalid,
    )


def _batch_of_output(file_id: str) -> str | None:
    for suffix in ("-output", "-error"):
        if file_id.startswith("file-batch_") and file_id.endswith(suffix):
            return file_id.removeprefix("file-").removesuffix(suffix)
    return None
