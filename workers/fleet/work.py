"""One pulled message on its way through the loop, and the settlements it ends in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vlmq.broker.state.intake import Delivery
from vlmq.config.errors import PermanentError, error_record
from vlmq.config.schemas import Request, Result
from vlmq.config.status import TaskState
from vlmq.config.tenants import DEFAULT_TENANT
from vlmq.config.wire import Envelope, TaskMessage
from vlmq.workers.fleet.settle import Settlement

__all__ = ["Work", "failed_result", "failure_settlement", "result_settlement"]


@dataclass
class Work:
    delivery: Delivery
    envelope: Envelope | None = None  # the message's headers, properties and body, once read
    message: TaskMessage | None = None
    request: Request | None = None
    status: dict[str, str] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return self.delivery.task_id

    @property
    def token(self) -> int:
        return self.delivery.token

    @property
    def requested(self) -> Request:
        """The decoded request (every admitted item has one)."""
        if self.request is None:
            raise ValueError(f"task {self.task_id} was not decoded")
        return self.request

    @property
    def tenant(self) -> str:
        """Who the task belongs to (the pull resolved a fed task's from its job)."""
        return self.status.get("tenant") or self.delivery.status.get("tenant") or DEFAULT_TENANT

    @property
    def attempts(self) -> int:
        """Times this request was handed to an engine without finishing."""
        try:
            return int(self.status.get("attempts") or 0)
        except ValueError:
            return 0

    @property
    def deaths(self) -> int:
        """Runs that ended without finishing because their holder died: attempts less those
        whose holder outlived them (alive, its lease lapsed while it ran: ``outlived``)."""
        outlived = self.delivery.status.get("outlived") or "0"
        return self.attempts - (int(outlived) if outlived.isdigit() else 0)

    @property
    def first_run(self) -> bool:
        """Never handed to an engine before this delivery (its attempt was counted as it
        started)."""
        return self.delivery.status.get("attempts") is None

    @property
    def alone_before(self) -> int:
        """Times it was prepared alone and its worker died (a delivery alone that was given
        back or handed on is not counted: ``lua/intake.lua`` returned)."""
        value = self.delivery.status.get("alone") or "0"
        return int(value) if value.isdigit() else 0

    @property
    def prestart_deaths(self) -> int:
        """Earlier deliveries whose holder died before starting it (perhaps because of it: a
        native decoder crash, an OOM kill while decoding): neither started (``attempts``)
        nor returned (``returns``: given back, or handed on by a prepare worker)."""
        returns = self.delivery.status.get("returns") or "0"
        return self.token - 1 - self.attempts - (int(returns) if returns.isdigit() else 0)

    @property
    def job_id(self) -> str | None:
        # Only the job that counted the task (its hash names it), never one a message asks for.
        return self.status.get("job_id") or None


def failed_result(request: Request, exc: BaseException, model: str) -> Result:
    return Result(
        id=request.id,
        custom_id=request.custom_id,
        job_id=request.job_id,
        status="failed",
        model=model,
        modality=request.modality,
        error=error_record(exc),
    )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def result_settlement(item: Work, result: Result, worker: str) -> Settlement:
    """What an engine answered, with the fleet's timings and counts. The status gets the
    same worker as the object (and Redis's time as ``finished_at``, when it settles)."""
    record = result.model_dump(mode="json")
    record["timings"] = {
        **record.get("timings", {}),
        "queued_at": _float(item.status.get("queued_at")),
        "started_at": _float(item.status.get("started_at")),
        "finished_at": time.time(),
    }
    record["attempts"] = item.attempts
    record["deliveries"] = item.delivery.token
    record["worker"] = worker
    record["tenant"] = item.tenant
    state = TaskState.SUCCEEDED if result.status == "succeeded" else TaskState.FAILED
    error = result.error or {}
    fields = {
        "worker": worker,
        "batch_id": result.batch_id,
        "error_code": error.get("code"),
        "error_message": error.get("message"),
    }
    return Settlement(record, state, fields, item.token, ran="started_at" in item.status)


def failure_settlement(
    item: Work, error: PermanentError, state: TaskState, worker: str, model: str
) -> Settlement:
    """A task that ends before any engine sees it (invalid, expired, dead-lettered)."""
    request = item.request
    record: dict[str, Any] = {
        "id": item.task_id,
        "custom_id": request.custom_id if request else None,
        "job_id": item.job_id,
        "status": "failed",
        "model": model,
        "error": error.to_dict(),
        "worker": worker,
        "attempts": item.attempts,
        "deliveries": item.delivery.token,
        "tenant": item.tenant,
    }
    fields = {"worker": worker, "error_code": error.code, "error_message": error.message}
    return Settlement(record, state, fields, item.token)
