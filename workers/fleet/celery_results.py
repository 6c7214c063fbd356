"""Celery results, canvas and progress for tasks that arrived through Celery (docs/celery.md).

A web app that only has Celery sends ``vlmq.generate`` with ``send_task``, ``delay`` or a
canvas and waits on ``AsyncResult.get()``. vlmq's batched intake bypasses Celery's own
consumer, so nothing of Celery's would record those results: this observer does, through
Celery's backend API (``store_result``, ``mark_as_done``, ``mark_as_failure``,
``mark_as_revoked``), so every backend Celery supports works and the meta is Celery's own:

* ``received``: a message that asks for a result (its ``ignore_result`` header false) or
  carries callbacks, errbacks, a chain or a chord is remembered as a Celery request context
  (headers, embed, reply_to; never its request, which may hold media);
* ``started``: ``STARTED`` with the worker's pid and hostname (Celery's ``track_started``);
* ``settled``: once per task, after its settle won (a redelivered or superseded delivery never
  writes): links and the next chain step are sent, then ``SUCCESS`` with a small dict (see
  :func:`success_value`), ``FAILURE`` with :class:`vlmq.celery.TaskFailed` (code, message),
  which a client rebuilds without vlmq installed, or ``REVOKED`` for an expired task; a chord
  header's part is returned (``on_chord_part_return``) and errbacks are sent as Celery sends
  those its worker does not know (with the failed task's id);
* a task of a job that asked for results (``vlmq.celery.submit_many``) updates the job's own
  meta: ``PROGRESS`` with done/total, ``SUCCESS`` with the counts once the job finished.

Every write runs on one thread of its own, in order (never on the batch loop's); a backend
that fails is logged, never a reason to fail a task. A worker killed between a task's settle
and its backend write leaves that task's meta unwritten (its vlmq status and stored result
are final): the window is one Redis round trip.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from celery import Celery, group, signature
from celery.app.task import Context
from celery.backends.redis import RedisBackend
from celery.exceptions import TaskRevokedError
from celery.result import GroupResult
from celery.states import READY_STATES

from vlmq.broker.connection import celery_broker
from vlmq.broker.state import State
from vlmq.celery import PROGRESS, TaskFailed
from vlmq.config.errors import Expired
from vlmq.config.settings import Settings
from vlmq.config.status import JobState, TaskState
from vlmq.config.wire import Envelope
from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["CeleryResults", "celery_context", "outcome", "results_app", "success_value"]

log = logging.getLogger(__name__)

SUCCESS, FAILURE, STARTED, REVOKED = "SUCCESS", "FAILURE", "STARTED", "REVOKED"
# What a Celery worker reads of a message's embed (protocol 2's third body element).
_EMBED = ("callbacks", "errbacks", "chain", "chord")
# Headers a context does not keep: the arguments' reprs (the request's, up to 1 kB each).
_NOT_KEPT = frozenset({"argsrepr", "kwargsrepr"})
# Contexts of pulled tasks kept for their settle: far above what one worker holds at once
# (its pulls and prefetch); an older one is only one whose task went back to the queue.
MAX_CONTEXTS = 16384
# The result fields a Celery caller gets (never media, never the stored record whole).
_RESULT_FIELDS = ("id", "output", "finish_reason", "usage", "result_url")
_PRESENT_FIELDS = ("choices", "parsed")


def results_app(settings: Settings) -> Celery:
    """The Celery app results and callbacks go through: the fleet's broker (callbacks go to
    the app's own queues there), the configured backend (the fleet's Redis by default),
    JSON only."""
    broker, transport = celery_broker(settings)
    conf = settings.celery
    app = Celery(
        "vlmq-results", broker=broker, backend=conf.result_backend or broker, set_as_current=False
    )
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_accept_content=["json"],
        result_expires=conf.result_expires_s,
        # A backend that does not answer is retried a bounded number of times (never holds
        # the writer thread for ever).
        result_backend_always_retry=True,
        result_backend_max_retries=5,
        task_default_queue=conf.default_queue,
        broker_transport_options=dict(transport),
        # The fleet's Redis as the backend: a Sentinel one's master_name too.
        result_backend_transport_options={} if conf.result_backend else dict(transport),
        broker_connection_retry_on_startup=True,
    )
    return app


def celery_context(envelope: Envelope) -> Context | None:
    """The Celery request context of a message, as a Celery worker builds it (headers, embed,
    reply_to, correlation_id), without the task's arguments; None when the message asks for
    nothing Celery records (a result ignored, no callbacks, no chain, no chord)."""
    headers, embed = envelope.headers, envelope.embed
    canvas = {k: embed.get(k) for k in _EMBED if embed.get(k)}
    ignore_result = bool(headers.get("ignore_result", False))
    if ignore_result and not canvas:
        return None
    properties = envelope.properties
    fields = {k: v for k, v in headers.items() if k not in _NOT_KEPT and not k.startswith("_")}
    fields.update(canvas)
    fields.update(
        id=envelope.task_id,
        ignore_result=ignore_result,
        reply_to=properties.get("reply_to") or None,
        correlation_id=properties.get("correlation_id") or envelope.task_id,
        delivery_info={"priority": properties.get("priority")},
        args=None,
        kwargs=None,
    )
    return Context(fields)


def success_value(record: Mapping[str, Any]) -> dict[str, Any]:
    """What ``AsyncResult.get()`` returns for a task that succeeded: its id, output,
    finish_reason, usage and ``result_url`` (the stored record's location), with ``choices``
    and ``parsed`` where the request asked for them."""
    value = {k: record.get(k) for k in _RESULT_FIELDS}
    value.update({k: record[k] for k in _PRESENT_FIELDS if record.get(k) is not None})
    return value


def outcome(record: Mapping[str, Any]) -> tuple[str, Any]:
    """The Celery state a settled record ends its task in, and its result: SUCCESS and
    :func:`success_value`, FAILURE and :class:`TaskFailed`, REVOKED and the reason (an
    expired task, as Celery's worker records one)."""
    if record.get("status") == "succeeded":
        return SUCCESS, success_value(record)
    raw_error = record.get("error")
    error: Mapping[str, Any] = raw_error if isinstance(raw_error, dict) else {}
    code = str(error.get("code") or "internal_error")
    if code == Expired.code:
        return REVOKED, "expired"
    return FAILURE, TaskFailed(code, str(error.get("message") or ""))


class CeleryResults(LoopObserver):
    """Records Celery results, canvas and job progress for the tasks that ask for them."""

    def __init__(
        self, app: Celery, state: State | None, hostname: str, track_started: bool = True
    ) -> None:
        self.app = app
        self.state = state
        self.hostname = hostname
        self.track_started = track_started
        self._contexts: OrderedDict[str, Context] = OrderedDict()
        self._lock = threading.Lock()
        # One writer, in order: a task's STARTED is never written after its SUCCESS.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery-results")

    @classmethod
    def for_settings(cls, settings: Settings, hostname: str, state: State) -> CeleryResults:
        return cls(results_app(settings), state, hostname, settings.celery.track_started)

    # hooks ---------------------------------------------------------------------------------
    def received(self, envelopes: Sequence[Envelope]) -> None:
        contexts = [(e.task_id, c) for e in envelopes if (c := celery_context(e)) is not None]
        if not contexts:
            return
        with self._lock:
            for task_id, context in contexts:
                self._contexts[task_id] = context
                self._contexts.move_to_end(task_id)
            while len(self._contexts) > MAX_CONTEXTS:
                self._contexts.popitem(last=False)

    def started(self, task_ids: Sequence[str]) -> None:
        if not self.track_started:
            return
        with self._lock:
            started = [(i, c) for i in task_ids if (c := self._contexts.get(i)) is not None]
        if started:
            self._write(self._started, started)

    def settled(self, records: Sequence[Mapping[str, Any]]) -> None:
        with self._lock:
            ended = [
                (r, c) for r in records if (c := self._contexts.pop(str(r["id"]), None)) is not None
            ]
        if ended:
            self._write(self._settled, ended)

    def superseded(self, task_ids: Sequence[str]) -> None:
        self._forget(task_ids)

    def close(self) -> None:
        self._writer.shutdown(wait=True)  # what was settled is written before the exit

    # revoke --------------------------------------------------------------------------------
    def revoked(self, task_ids: Iterable[str]) -> None:
        """These tasks were cancelled by a Celery revoke before they ran: REVOKED (with the
        chord part returned when this worker had read the message)."""
        with self._lock:
            revoked = [(i, self._contexts.pop(i, None)) for i in task_ids]
        if revoked:
            self._write(self._revoked, revoked)

    def revoked_job(self, job_id: str) -> None:
        """A job revoked by its id: its tasks the cancel ended are REVOKED (when the job was
        submitted with a group view, ``vlmq.celery.submit_many``), its meta the counts."""
        self._write(self._revoked_job, job_id)

    # writes (the writer thread) ------------------------------------------------------------
    def _write(self, fn: Any, *args: Any) -> None:
        try:
            self._writer.submit(self._guarded, fn, *args)
        except RuntimeError:  # closed: the worker is stopping
            log.warning("Celery results not written: the worker is stopping")

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.warning("writing Celery results failed", exc_info=True)

    def _started(self, started: list[tuple[str, Context]]) -> None:
        meta = {"pid": os.getpid(), "hostname": self.hostname}
        items = [(i, meta, STARTED, c) for i, c in started if not c.ignore_result]
        self._store_many(items, unless_ended=True)

    def _settled(self, ended: list[tuple[Mapping[str, Any], Context]]) -> None:
        plain, jobs = [], set()
        for record, context in ended:
            state, value = outcome(record)
            if _canvas(context, state):
                self._guarded(self._end, record, context)
            elif not context.ignore_result:
                if state == REVOKED:
                    value = TaskRevokedError(value)
                plain.append((str(record["id"]), value, state, context))
            if record.get("job_id") and not context.ignore_result:
                jobs.add(str(record["job_id"]))
        self._guarded(self._store_many, plain)
        for job_id in jobs:
            self._guarded(self._progress, job_id)

    def _store_many(
        self, items: list[tuple[str, Any, str, Context]], unless_ended: bool = False
    ) -> None:
        """Celery's meta for tasks without canvas work: through ``store_result`` one by one,
        or, for Celery's Redis backend, the very same keys and values in one pipeline (SET
        with the expiry and PUBLISH per task: what its ``set`` does per call). The settle
        ends a task once, so its end needs no read-before-write; a STARTED is written
        ``unless_ended`` (a delivery that started late, on a worker cut off from its lease,
        never hides the end another delivery recorded: a terminal state never changes)."""
        backend = self.app.backend
        if not items:
            return
        if not _pipelinable(backend):
            for task_id, result, state, context in items:
                if not (unless_ended and backend.get_state(task_id) in READY_STATES):
                    backend.store_result(task_id, result, state, request=context)
            return
        done_at = datetime.now(timezone.utc).isoformat()
        values = [
            (backend.get_key_for_task(task_id), _meta_json(backend, task_id, r, state, c, done_at))
            for task_id, r, state, c in items
        ]
        backend.ensure(_pipelined, (backend, values, unless_ended))

    def _end(self, record: Mapping[str, Any], context: Context) -> None:
        task_id = str(record["id"])
        backend = self.app.backend
        state, value = outcome(record)
        if state == SUCCESS:
            # As Celery's worker: links and the next chain step first, then the result (and
            # the chord part, in mark_as_done).
            self._send_callbacks(context, value)
            backend.mark_as_done(task_id, value, request=context)
        elif state == REVOKED:
            backend.mark_as_revoked(
                task_id, value, request=context, store_result=not context.ignore_result
            )
        else:
            backend.mark_as_failure(
                task_id,
                value,
                traceback=None,
                request=context,
                store_result=not context.ignore_result,
                call_errbacks=True,
            )

    def _send_callbacks(self, context: Context, value: Any) -> None:
        """Celery's worker's dispatch (celery/app/trace.py): the links with the result, one
        group for several; then the chain's next step, with the rest of the chain."""
        app, parent = self.app, context.id
        root = context.root_id or parent
        callbacks = context.callbacks or []
        if len(callbacks) == 1:
            signature(callbacks[0], app=app).apply_async((value,), parent_id=parent, root_id=root)
        elif callbacks:
            sigs = [signature(s, app=app) for s in callbacks]
            for one in (s for s in sigs if isinstance(s, group)):
                one.apply_async((value,), parent_id=parent, root_id=root)
            plain = [s for s in sigs if not isinstance(s, group)]
            if plain:
                group(plain, app=app).apply_async((value,), parent_id=parent, root_id=root)
        chain = context.chain
        if chain:
            following = signature(chain[-1], app=app)
            following.apply_async((value,), chain=chain[:-1], parent_id=parent, root_id=root)

    def _revoked(self, revoked: list[tuple[str, Context | None]]) -> None:
        for task_id, context in revoked:
            store = context is None or not context.ignore_result
            self.app.backend.mark_as_revoked(
                task_id, "revoked", request=context, store_result=store
            )

    def _revoked_job(self, job_id: str) -> None:
        assert self.state is not None
        view = GroupResult.restore(job_id, app=self.app)
        if view is not None:
            ids = [child.id for child in view.results]
            states = self.state.tasks.states(ids)
            cancelled = [i for i, s in zip(ids, states, strict=True) if s is TaskState.CANCELLED]
            self._revoked([(i, None) for i in cancelled if self._pending(i)])
        self._progress(job_id)

    def _pending(self, task_id: str) -> bool:
        return bool(self.app.backend.get_state(task_id) == "PENDING")

    # job progress --------------------------------------------------------------------------
    def _progress(self, job_id: str) -> None:
        """The job's meta: PROGRESS (done, total) until it finished, then SUCCESS with its
        counts. Read again after a PROGRESS write: a settle elsewhere that finished the job
        may have read its counts before this write, and its SUCCESS must still be last
        (Celery's backend never overwrites a SUCCESS)."""
        assert self.state is not None
        status = self.state.jobs.get(job_id)
        if status.state is JobState.UNKNOWN:
            return
        if not self._store_progress(job_id, status):
            self._store_progress(job_id, self.state.jobs.get(job_id))

    def _store_progress(self, job_id: str, status: Any) -> bool:
        """Store a job's meta; True when it is the final one."""
        meta = {
            "done": status.done,
            "total": status.total,
            "state": status.state.value,
            "counts": dict(status.counts),
        }
        final = bool(status.finished)
        self.app.backend.store_result(job_id, meta, SUCCESS if final else PROGRESS)
        return final

    def _forget(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            for task_id in task_ids:
                self._contexts.pop(task_id, None)


def _canvas(context: Context, state: str) -> bool:
    """Whether a task's end has canvas work (links, the next chain step, a chord part,
    errbacks): Celery's own ``mark_as_*`` then runs it."""
    errbacks = state == FAILURE and context.errbacks
    return bool(context.callbacks or context.chain or context.chord or errbacks)


def _pipelinable(backend: Any) -> bool:
    """Celery's Redis backend with JSON and plain (not extended) meta."""
    extended = backend.app.conf.find_value_for_key("extended", "result")
    return isinstance(backend, RedisBackend) and backend.serializer == "json" and not extended


def _meta_json(
    backend: RedisBackend, task_id: str, result: Any, state: str, context: Context, done_at: str
) -> str:
    """Celery's result meta as its backend writes it (``_get_result_meta`` and the JSON
    serializer: the same keys, in its order), built here without its per-call config and
    clock look-ups (a third of a results thread's time per task, measured)."""
    if isinstance(result, BaseException):
        result = backend.prepare_exception(result)
    meta: dict[str, Any] = {
        "status": state,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": done_at if state in READY_STATES else None,
    }
    if context.group:
        meta["group_id"] = context.group
    if context.parent_id:
        meta["parent_id"] = context.parent_id
    meta["task_id"] = task_id
    return json.dumps(meta)


def _pipelined(backend: RedisBackend, values: list[tuple[bytes, str]], unless_ended: bool) -> None:
    client = backend.client
    if unless_ended:
        current = client.mget([key for key, _ in values])
        values = [kv for kv, raw in zip(values, current, strict=True) if not _ended(raw)]
    with client.pipeline(transaction=False) as pipe:
        for key, value in values:
            pipe.set(key, value, ex=backend.expires or None)
            pipe.publish(key, value)
        pipe.execute()


def _ended(raw: bytes | str | None) -> bool:
    return raw is not None and json.loads(raw).get("status") in READY_STATES
