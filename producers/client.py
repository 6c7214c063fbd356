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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError
from redis import Redis

from vlmq.broker.connection import create_redis
from vlmq.broker.state import State
from vlmq.broker.state.jobs import Queued
from vlmq.config.errors import InvalidRequest, RequestTooLarge
from vlmq.config.ids import check_id, new_submission_id
from vlmq.config.jsonl import describe_validation_error
from vlmq.config.keys import Keys
from vlmq.config.schemas import Request
from vlmq.config.settings import Settings
from vlmq.config.status import TERMINAL, TaskState
from vlmq.config.wire import encode_message, largest_request
from vlmq.producers.preflight.accumulator import Preflight
from vlmq.producers.staging import MediaStager
from vlmq.stores.base import ObjectStore, result_location
from vlmq.stores.urls import open_store

__all__ = ["Client", "Outcome", "as_request"]

_TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


@dataclass(frozen=True)
class Outcome:
    """A task that ended (or whose status is gone: state ``unknown``): its status hash and,
    where its status names one, the stored record (None when that object is missing)."""

    task_id: str
    state: str
    status: dict[str, str]
    record: dict[str, Any] | None
    stored: bool

    @property
    def ended(self) -> bool:
        return self.state in _TERMINAL_STATES


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
        store: ObjectStore | None = None,
        *,
        local_media: bool = True,
        tenant: str | None = None,
    ) -> None:
        """``local_media`` False: media paths are never read from this machine's disk (they go
        as they are, for the workers' own allowlist): for a server acting for remote callers.
        ``tenant`` (default ``settings.tenant``) owns what this client submits; the API passes
        each caller's tenant per call instead."""
        self.settings = settings
        self.tenant = tenant or settings.tenant
        self._preflight: Preflight | None = None
        self.redis = redis or create_redis(settings)
        self.keys = Keys(settings.fleet.key_prefix)
        self.state = State(
            self.redis,
            self.keys,
            ttl_s=settings.fleet.task_ttl_s,
            submitter_lease_s=settings.fleet.submitter_lease_s,
            replay_ttl_s=settings.fleet.replay_ttl_s,
        )
        self._store = store
        self.local_media = local_media
        self._stager: MediaStager | None = None

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            s = self.settings
            self._store = open_store(s.results_url, s.s3_endpoint_url, s.s3_region)
        return self._store

    @property
    def stager(self) -> MediaStager:
        """Uploads local media and data: URIs before they are enqueued (producers/staging.py)."""
        if self._stager is None:
            self._stager = MediaStager(self.settings, self._store, local_files=self.local_media)
        return self._stager

    # quotas --------------------------------------------------------------
    def estimates(
        self, requests: list[Request], tenant: str, base_dir: Path | None = None
    ) -> list[int] | None:
        """Each request's estimated tokens (prompt incl. visual tokens, plus its output
        tokens), the worker's own arithmetic; None when the tenant has no token quota (the
        estimate reads image headers: it is not paid for where nothing limits tokens). With
        ``local_media`` False no local file is opened: its size is unknown to the estimate."""
        if self.settings.tenants.quota(tenant).max_queued_tokens is None:
            return None
        if self._preflight is None:
            self._preflight = Preflight(self.settings, local_files=self.local_media)
        estimates = (self._preflight.estimate(r, base_dir) for r in requests)
        return [e.prompt_tokens + e.output_tokens for e in estimates]

    def check_quota(self, tenant: str, tasks: int, tokens: int = 0) -> None:
        """QuotaExceeded when ``tasks`` more (``tokens`` their estimate) would pass the
        tenant's quota; nothing is enqueued then."""
        quota = self.settings.tenants.quota(tenant)
        self.state.tenants.check_quota(tenant, quota, tasks, tokens)

    # enqueue -------------------------------------------------------------
    def wire(self, request: Request) -> str:
        """``request``'s JSON as its message carries it; RequestTooLarge when that message
        would be larger than the workers take (``fleet.max_message_bytes``: each fails such
        a message unread), so it is refused before anything is enqueued."""
        wire = request.model_dump_json(exclude_none=True)
        size = len(wire) if wire.isascii() else len(wire.encode())
        limit = largest_request(self.settings.fleet.max_message_bytes)
        if size > limit:
            raise RequestTooLarge(
                f"the request is {size:,} bytes once staged; a worker takes messages of at "
                f"most {self.settings.fleet.max_message_bytes:,} bytes, requests of at most "
                f"{limit:,}"
            )
        return wire

    def queued(
        self,
        request: Request,
        lane: str = "bulk",
        expires: datetime | None = None,
        tenant: str | None = None,
        est: int | None = None,
        results: bool = False,
        wire: str | None = None,
    ) -> Queued:
        """``request`` as it is enqueued: its queue, status fields and Celery message (with
        ``results``, one that asks for a Celery result too: docs/celery.md). ``wire``: its
        JSON, if ``wire()`` gave it already. RequestTooLarge past what workers take."""
        queue = self.keys.lane_queue(request.modality.value, lane, request.job_id)
        fields = {
            "job_id": request.job_id,
            "custom_id": request.custom_id,
            "modality": request.modality.value,
            "queue": queue,
            "expires_at": f"{expires.timestamp():.3f}" if expires else None,
            "tenant": tenant or self.tenant,
            "est": est,
        }
        message = encode_message(
            wire or self.wire(request),
            request.id,
            queue,
            expires=expires,
            ignore_result=not results,
        )
        return Queued(request.id, request.custom_id, request.modality.value, fields, message)

    def enqueue(
        self,
        requests: list[Request],
        lane: str = "interactive",
        expires: datetime | None = None,
        tenant: str | None = None,
        estimates: list[int] | None = None,
        results: bool = False,
        notify: str | None = None,
        wires: Mapping[str, str] | None = None,
    ) -> None:
        """Enqueue requests outside any bulk job's own list (a lane's own list), all or
        nothing, in one script call: each with its status hash, counted in its tenant's quota
        itself (its 'quota' field) and in its job, if it names one. A bulk job's tasks go
        through ``Jobs.submit`` or a feed instead. ``notify``: a pub/sub channel told each
        task's id when it ends (``Keys.finished_channel``: a process waiting for them).
        ``wires``: their JSON by task id, if ``wire()`` gave it already."""
        tenant = tenant or self.tenant
        quota = self.keys.quota(tenant)
        lines = []
        for index, request in enumerate(requests):
            if request.job_id is not None and lane == "bulk":
                raise InvalidRequest(
                    "a bulk job's tasks are submitted with submit_many or vlmq submit"
                )
            est = estimates[index] if estimates else None
            wire = wires.get(request.id) if wires else None
            line = self.queued(request, lane, expires, tenant, est, results, wire)
            lines.append(replace(line, fields={**line.fields, "quota": quota, "notify": notify}))
        self.state.jobs.enqueue(tenant, lines)

    def submit(
        self,
        conversation: Any,
        *,
        lane: str = "interactive",
        expires_in_s: float | None = None,
        base_dir: Path | None = None,
        tenant: str | None = None,
        notify: str | None = None,
        **fields: Any,
    ) -> str:
        """Validate, stage its media and enqueue one conversation; returns its task id.
        Relative media paths resolve against ``base_dir`` (default: the working directory).
        Raises QuotaExceeded (nothing enqueued) past the tenant's quota. ``notify``: the
        channel told the task's id when it ends (see ``enqueue``)."""
        tenant = tenant or self.tenant
        request = as_request(conversation, **fields)
        self._refuse_known_ids([request])
        estimates = self.estimates([request], tenant, base_dir)
        self.check_quota(tenant, 1, sum(estimates or ()))
        request = self.stager.stage(request, base_dir)
        expires = self.expiry_after(expires_in_s)
        self.enqueue([request], lane, expires, tenant, estimates, notify=notify)
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
        webhook_url: str | None = None,
        base_dir: Path | None = None,
        tenant: str | None = None,
        results: bool = False,
    ) -> str:
        """Validate all, stage their media, then enqueue in pipelined chunks; returns the job id.

        Every item is validated and its media staged before anything is enqueued, so a bad
        item raises InvalidRequest (naming the item and field; StagingRefused when its media
        can reach no worker, RequestTooLarge when its message would be larger than a worker
        takes) and enqueues nothing; past the tenant's quota QuotaExceeded.
        With ``results`` each task's result is recorded in the Celery result backend too
        (``vlmq.celery.submit_many``).
        """
        tenant = tenant or self.tenant
        job_id = check_id("job id", job_id or uuid.uuid4().hex)
        requests = [_validated(item, index, job_id) for index, item in enumerate(items)]
        self._refuse_known_ids(requests)
        estimates = self.estimates(requests, tenant, base_dir)
        self.check_quota(tenant, len(requests), sum(estimates or ()))
        est = dict(zip((r.id for r in requests), estimates or (), strict=False))
        requests = self._staged(requests, base_dir)
        wires = self._wires(requests)
        submission = self.open_job(job_id, name, expires_in_s, webhook_url, tenant)
        expires = self.expiry_after(expires_in_s)
        for batch in _chunked(iter(requests), chunk):
            # Requests about one image or clip next to each other: one pull takes them to
            # one worker, whose media cache decodes it once (bench/README.md, affinity).
            batch.sort(key=Request.media_sources)
            if lane == "bulk":
                # Every item is a new task (no custom_id claims: ids are the caller's).
                lines = [
                    replace(
                        self.queued(r, lane, expires, tenant, est.get(r.id), results, wires[r.id]),
                        custom_id=None,
                    )
                    for r in batch
                ]
                self.state.jobs.submit(job_id, submission, lines)
            else:
                estimated = [est[r.id] for r in batch] if est else None
                self.enqueue(batch, lane, expires, tenant, estimated, results, wires=wires)
        self.seal_job(job_id, submission, lines=len(requests))
        return job_id

    def _staged(self, requests: list[Request], base_dir: Path | None) -> list[Request]:
        """Every request with its media staged, or the first failure, naming its item."""
        staged = self.stager.stage_all(requests, base_dir)
        for index, outcome in enumerate(staged):
            if isinstance(outcome, InvalidRequest):
                raise type(outcome)(f"item {index}: {outcome.message}") from None
        return cast(list[Request], staged)

    def _wires(self, requests: list[Request]) -> dict[str, str]:
        """Every request's JSON by id, or the first that is too large, naming its item."""
        wires = {}
        for index, request in enumerate(requests):
            try:
                wires[request.id] = self.wire(request)
            except RequestTooLarge as exc:
                raise RequestTooLarge(f"item {index}: {exc.message}") from None
        return wires

    def _refuse_known_ids(self, requests: list[Request], chunk: int = 5000) -> None:
        """A task id names one task forever: re-enqueueing one that exists would
        reset its status, so it is refused before anything is written (one EXISTS of many
        keys per chunk; which one exists is looked up only when one does)."""
        for start in range(0, len(requests), chunk):
            window = requests[start : start + chunk]
            keys = [self.keys.task(request.id) for request in window]
            if not self.redis.exists(*keys):
                continue
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
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
        tenant: str | None = None,
    ) -> str:
        """Open (or reopen) a job of ``tenant`` for one submitter; returns its submission id,
        which ``seal_job`` takes when that submitter is done adding."""
        submission = new_submission_id()
        tenant = tenant or self.tenant
        self.state.jobs.open(job_id, submission, name, expires_in_s, webhook_url, tenant)
        return submission

    def seal_job(self, job_id: str, submission: str, lines: int = 0, line_errors: int = 0) -> None:
        self.state.jobs.seal(job_id, submission, lines, line_errors)

    # status ----------------------------------------------------------------
    def status(self, task_or_job_id: str) -> dict[str, Any]:
        if self.state.jobs.exists(task_or_job_id):
            return {"kind": "job", **self.state.jobs.get(task_or_job_id).as_dict()}
        return {"kind": "task", "id": task_or_job_id, **self.state.tasks.get(task_or_job_id)}

    def statuses(self, task_ids: list[str]) -> list[TaskState]:
        return self.state.tasks.states(task_ids)

    def job_task_ids(self, job_id: str, page: int = 10_000) -> Iterator[str]:
        return self.state.jobs.task_ids(job_id, page)

    # results ---------------------------------------------------------------
    def outcome(self, task_id: str) -> Outcome | None:
        """The task's outcome once it ended, else None: the one read of status, then the
        location it names, then the stored object (``result`` and the API's chat route)."""
        status = self.state.tasks.get(task_id)
        state = status.get("state", TaskState.UNKNOWN.value)
        if state not in _TERMINAL_STATES and state != TaskState.UNKNOWN.value:
            return None
        location = result_location(status)
        record = self.store.get(location) if location else None
        return Outcome(task_id, state, status, record, stored=location is not None)

    def result(self, task_id: str, wait: float | None = None, poll_s: float = 0.1) -> Any:
        """The stored result object, waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + (wait or 0)
        while True:
            outcome = self.outcome(task_id)
            if outcome is not None and outcome.ended:
                return outcome.record if outcome.stored else {"id": task_id, **outcome.status}
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    # cancel ----------------------------------------------------------------
    def cancel(self, task_or_job_id: str) -> int:
        """Cancel queued tasks (a job's, or one); returns how many were cancelled."""
        return self.state.cancel(check_id("job or task id", task_or_job_id))


def _validated(item: Any, index: int, job_id: str) -> Request:
    try:
        return as_request(item, job_id=job_id)
    except InvalidRequest as exc:
        raise InvalidRequest(f"item {index}: {exc.message}") from None


def _chunked(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while chunk := list(islice(items, size)):
        yield chunk
