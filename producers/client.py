"""The producer client: validate, enqueue (pipelined), read status and results.

Never imports torch. Every message it writes is a Celery protocol-2 JSON
message in the modality class's queue, the same bytes ``send_task`` writes.

>>> client = Client(Settings())
>>> task_id = client.submit([{"role": "user", "content": "hi"}], max_new_tokens=16)
>>> client.result(task_id, wait=60)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from itertools import islice
from typing import Any

from pydantic import ValidationError
from redis import Redis

from vlmq.config.connection import create_redis
from vlmq.config.errors import InvalidRequest
from vlmq.config.jsonl import describe_validation_error
from vlmq.config.keys import Keys
from vlmq.config.results import ResultStore, open_store
from vlmq.config.schemas import Request
from vlmq.config.settings import Settings
from vlmq.config.status import TERMINAL, TaskState
from vlmq.config.statusdb import StatusDB
from vlmq.config.wire import encode_message, list_for_priority

__all__ = ["Client", "as_request"]

_TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


def as_request(item: Any, **overrides: Any) -> Request:
    """A Request from a Request, a conversation list or a request dict; raises
    InvalidRequest naming the offending field."""
    if isinstance(item, Request):
        return item.model_copy(update=overrides) if overrides else item
    fields = {"messages": item} if isinstance(item, list) else dict(item)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Request.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


class Client:
    def __init__(
        self,
        settings: Settings,
        redis: Redis | None = None,
        store: ResultStore | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis or create_redis(settings)
        self.keys = Keys(settings.fleet.key_prefix)
        self.status_db = StatusDB(self.redis, self.keys, ttl_s=settings.fleet.task_ttl_s)
        self._store = store

    @property
    def store(self) -> ResultStore:
        if self._store is None:
            s = self.settings
            self._store = open_store(s.results_url, s.s3_endpoint_url, s.s3_region)
        return self._store

    # enqueue -------------------------------------------------------------
    def enqueue(
        self,
        pipe: Any,
        requests: list[Request],
        lane: str = "bulk",
        expires: datetime | None = None,
    ) -> None:
        """Write status hashes, job counters and messages for ``requests`` into
        the caller's pipeline: two commands per task, the rest per chunk."""
        pushes: dict[str, list[str]] = {}
        active: dict[str, set[str]] = {}
        jobs: dict[str, int] = {}
        for request in requests:
            queue, per_job = self._queue_for(request, lane)
            fields = {
                "job_id": request.job_id,
                "custom_id": request.custom_id,
                "modality": request.modality.value,
                "queue": queue,
                "expires_at": f"{expires.timestamp():.3f}" if expires else None,
            }
            self.status_db.add_queued(pipe, request.id, fields, count_job=False)
            wire = request.model_dump_json(exclude_none=True)
            message = encode_message(wire, request.id, queue, expires=expires)
            pushes.setdefault(list_for_priority(queue, 0), []).append(message)
            if per_job:
                active.setdefault(self.keys.active_jobs(request.modality.value), set()).add(queue)
            if request.job_id:
                jobs[request.job_id] = jobs.get(request.job_id, 0) + 1
        for job_id, count in jobs.items():
            self.status_db.count_queued(pipe, job_id, count)
        for name, messages in pushes.items():
            pipe.lpush(name, *messages)
        # After the pushes, in the same transaction: a worker that finds a job
        # list empty removes it from the set, so the order matters.
        for key, queues in active.items():
            pipe.sadd(key, *queues)

    def _queue_for(self, request: Request, lane: str) -> tuple[str, bool]:
        modality = request.modality.value
        if lane == "bulk" and request.job_id is not None:
            return self.keys.job_queue(modality, request.job_id), True
        return self.keys.queue(modality, lane), False

    def submit(
        self,
        conversation: Any,
        *,
        lane: str = "interactive",
        expires_in_s: float | None = None,
        **fields: Any,
    ) -> str:
        """Validate and enqueue one conversation; returns its task id."""
        request = as_request(conversation, **fields)
        self._refuse_known_ids([request])
        expires = self.expiry_after(expires_in_s)
        pipe = self.redis.pipeline(transaction=True)
        self.enqueue(pipe, [request], lane, expires)
        pipe.execute()
        return request.id

    def submit_many(
        self,
        items: Iterable[Any],
        job_id: str | None = None,
        *,
        lane: str = "bulk",
        expires_in_s: float | None = None,
        chunk: int = 2000,
        name: str | None = None,
    ) -> str:
        """Validate all, then enqueue in pipelined chunks; returns the job id.

        Every item is validated before anything is enqueued, so a bad item
        raises InvalidRequest (naming the item and field) and enqueues nothing.
        """
        job_id = job_id or uuid.uuid4().hex
        requests = [_validated(item, index, job_id) for index, item in enumerate(items)]
        self._refuse_known_ids(requests)
        self.open_job(job_id, name=name, expires_in_s=expires_in_s)
        expires = self.expiry_after(expires_in_s)
        for batch in _chunked(iter(requests), chunk):
            pipe = self.redis.pipeline(transaction=True)
            self.enqueue(pipe, batch, lane, expires)
            pipe.rpush(self.keys.job_tasks(job_id), *[r.id for r in batch])
            pipe.execute()
        self.seal_job(job_id, lines=len(requests))
        return job_id

    def _refuse_known_ids(self, requests: list[Request], chunk: int = 5000) -> None:
        """A task id names one task forever: re-enqueueing one that exists would
        reset its status, so it is refused before anything is written."""
        for start in range(0, len(requests), chunk):
            window = requests[start : start + chunk]
            pipe = self.redis.pipeline(transaction=False)
            for request in window:
                pipe.exists(self.keys.task(request.id))
            for index, exists in enumerate(pipe.execute()):
                if exists:
                    raise InvalidRequest(
                        f"item {start + index}: task id {window[index].id[:64]!r} already exists"
                    )

    def expiry_after(self, expires_in_s: float | None) -> datetime | None:
        """The absolute expiry of a task enqueued now, on Redis's clock (the one every
        deadline is judged by), or None for no expiry."""
        if not expires_in_s:
            return None
        seconds, micros = self.redis.time()
        return datetime.fromtimestamp(seconds + micros / 1e6 + expires_in_s, tz=timezone.utc)

    def open_job(
        self,
        job_id: str,
        name: str | None = None,
        expires_in_s: float | None = None,
        webhook_url: str | None = None,
    ) -> None:
        self.status_db.open_job(job_id, name, expires_in_s, webhook_url)

    def seal_job(self, job_id: str, lines: int = 0) -> None:
        self.status_db.seal_job(job_id, lines)

    # status ----------------------------------------------------------------
    def status(self, task_or_job_id: str) -> dict[str, Any]:
        if self.status_db.job_exists(task_or_job_id):
            return {"kind": "job", **self.status_db.job(task_or_job_id).as_dict()}
        return {"kind": "task", "id": task_or_job_id, **self.status_db.task(task_or_job_id)}

    def statuses(self, task_ids: list[str]) -> list[TaskState]:
        return self.status_db.states(task_ids)

    def job_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        return self.status_db.job_task_ids(job_id, page)

    # results ---------------------------------------------------------------
    def result(self, task_id: str, wait: float | None = None, poll_s: float = 0.1) -> Any:
        """The stored result object, waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + (wait or 0)
        while True:
            status = self.status_db.task(task_id)
            if status.get("state") in _TERMINAL_STATES:
                url = status.get("result_url")
                return self.store.get(url) if url else {"id": task_id, **status}
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    # cancel ----------------------------------------------------------------
    def cancel(self, task_or_job_id: str) -> int:
        """Cancel queued tasks (a job's, or one); returns how many were cancelled."""
        fields = {"finished_at": f"{time.time():.6f}", "error_code": "cancelled"}
        if self.status_db.job_exists(task_or_job_id):
            self.status_db.request_cancel(task_or_job_id)
            return self.status_db.finish_queued(task_or_job_id, TaskState.CANCELLED, fields)
        only = [TaskState.QUEUED]
        _, moved = self.status_db.transition(task_or_job_id, TaskState.CANCELLED, fields, only)
        return int(moved)


def _validated(item: Any, index: int, job_id: str) -> Request:
    try:
        return as_request(item, job_id=job_id)
    except InvalidRequest as exc:
        raise InvalidRequest(f"item {index}: {exc.message}") from None


def _chunked(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while chunk := list(islice(items, size)):
        yield chunk
