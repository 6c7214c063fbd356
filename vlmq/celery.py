"""vlmq from a Celery app: a signature for ``vlmq.generate`` and a job as a ``GroupResult``.

For apps that install vlmq's base package (no torch); an app without vlmq sends
``send_task("vlmq.generate", kwargs={"request": {...}}, queue="vlmq.text.interactive")``
and gets the same results (docs/celery.md)::

    from vlmq.celery import generate

    result = generate.delay({"messages": [{"role": "user", "content": "hi"}]})
    result.get(timeout=60)["output"]
    (generate.s(request) | postprocess.s()).delay()

The request is validated here (``InvalidRequest`` names the field) and its modality class
picks the queue. A worker records the result in the app's result backend (the fleet's Redis
unless ``VLMQ_CELERY__RESULT_BACKEND`` names another): a dict with ``id``, ``output``,
``finish_reason``, ``usage``, ``result_url`` (and ``choices``, ``parsed`` where asked for), or
:class:`TaskFailed` with the task's stable error code and message.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from celery import current_app
from celery.canvas import Signature
from celery.result import AsyncResult, GroupResult

from vlmq.config.keys import Keys
from vlmq.config.wire import TASK_NAME

if TYPE_CHECKING:
    from celery import Celery

    from vlmq.config.schemas import Request
    from vlmq.producers.client import Client

__all__ = [
    "PROGRESS",
    "TASK_NAME",
    "Generate",
    "TaskFailed",
    "generate",
    "job_result",
    "submit_many",
]

# The state of a job's own meta until it finishes (AsyncResult(job_id).info: done, total).
PROGRESS = "PROGRESS"


class TaskFailed(Exception):
    """A vlmq task that failed, as ``AsyncResult.get()`` raises it: ``args`` are its stable
    error code and message (``invalid_request``, ``media_fetch_failed``, ...). A client
    without vlmq gets an exception of this name from Celery with the same ``args``."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class Generate:
    """``vlmq.generate`` as a Celery app calls it: ``s``, ``si``, ``delay``, ``apply_async``.
    ``key_prefix`` is the fleet's ``VLMQ_FLEET__KEY_PREFIX``; ``lane`` ``interactive`` (served
    first) or ``bulk``."""

    name = TASK_NAME

    def __init__(
        self, key_prefix: str = "vlmq", lane: str = "interactive", app: Celery | None = None
    ) -> None:
        if lane not in ("interactive", "bulk"):
            raise ValueError("lane: interactive or bulk")
        self.keys = Keys(key_prefix)
        self.lane = lane
        self.app = app

    def s(self, request: Any = None, /, **fields: Any) -> Signature:
        """A signature of one request (a dict, a conversation list or a ``Request``; or its
        fields as keywords); its task id is the request's id, its queue its modality's."""
        return self._signature(request, fields, immutable=False)

    def si(self, request: Any = None, /, **fields: Any) -> Signature:
        """An immutable signature: in a chain it does not take the previous result."""
        return self._signature(request, fields, immutable=True)

    def delay(self, request: Any = None, /, **fields: Any) -> AsyncResult:
        return self.s(request, **fields).delay()

    def apply_async(
        self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **options: Any
    ) -> AsyncResult:
        request = (kwargs or {}).get("request", args[0] if args else None)
        return self.s(request).apply_async(**options)

    def queue(self, request: Request) -> str:
        """The Redis list of a request's modality class on this lane."""
        return self.keys.queue(request.modality.value, self.lane)

    def _signature(self, request: Any, fields: dict[str, Any], immutable: bool) -> Signature:
        validated = _request(request, fields)
        wire = validated.model_dump(mode="json", exclude_none=True)
        options = {"queue": self.queue(validated), "task_id": validated.id}
        return Signature(
            TASK_NAME,
            kwargs={"request": wire},
            options=options,
            immutable=immutable,
            app=self.app,
        )


generate = Generate()


def _request(request: Any, fields: dict[str, Any]) -> Request:
    from vlmq.producers.client import as_request  # validation only: no Redis, no torch

    if request is None:
        return as_request(fields)
    return as_request(request, **fields)


def job_result(job_id: str, task_ids: Iterable[str], app: Celery | None = None) -> GroupResult:
    """A job's tasks as a ``GroupResult`` (its id is the job's): ``get()`` returns their
    results in this order; ``AsyncResult(job_id).info`` is the job's progress."""
    app = app or current_app
    return GroupResult(job_id, [AsyncResult(t, app=app) for t in task_ids], app=app)


def submit_many(
    client: Client,
    items: Iterable[Any],
    *,
    app: Celery | None = None,
    job_id: str | None = None,
    **options: Any,
) -> GroupResult:
    """``client.submit_many`` with every task's result recorded in the Celery result backend
    and the job seen as a ``GroupResult`` (saved: ``GroupResult.restore(job_id)`` finds it;
    ``revoke`` of the job's id cancels its queued tasks). ``AsyncResult(job_id).info`` is
    ``{"done", "total", "state", "counts"}``: ``PROGRESS`` until the job finished, then
    ``SUCCESS``. ``options`` are ``submit_many``'s (lane, name, expires_in_s, ...)."""
    from vlmq.producers.client import as_request

    app = app or current_app
    requests = [as_request(item) for item in items]
    job_id = job_id or uuid.uuid4().hex
    view = job_result(job_id, [r.id for r in requests], app)
    # Before any task can finish, so a worker's PROGRESS is never older than this one.
    app.backend.store_result(job_id, {"done": 0, "total": len(requests)}, PROGRESS)
    view.save()
    try:
        client.submit_many(requests, job_id, results=True, **options)
    except BaseException:
        view.delete()
        app.backend.forget(job_id)
        raise
    return view
