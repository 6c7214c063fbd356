"""Celery task events for the fleet's own intake, so Flower shows the tasks.

vlmq's batched intake consumes the modality queues instead of Celery's
consumer, so Celery would send no task events for them. With
``VLMQ_FLEET__TASK_EVENTS=true`` the worker publishes the standard
``task-received`` (a message read), ``task-started``, and once the outcome is
the task's (settled) ``task-succeeded`` with the result a Celery caller gets,
``task-failed`` with its exception or ``task-revoked`` (expired) itself (JSON, on
the broker's event exchange), which Flower and ``celery events`` understand.
Off by default: three extra publishes per task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

# Imported whole here, at start-up, not lazily by ``app.events`` in whichever thread first asks
# for a dispatcher or a receiver: two threads importing it at once deadlock on its import locks
# (the package imports .receiver while a thread importing the receiver waits on the package;
# seen with a receiver thread beside a dispatcher being made, tests/integration/
# test_observability.py).
import celery.events  # noqa: F401
from celery.utils.saferepr import saferepr

from vlmq.config.wire import TASK_NAME, Envelope
from vlmq.workers.fleet.celery_results import outcome
from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["TaskEvents"]

log = logging.getLogger(__name__)

# Flower shows a result's repr: as Celery's worker cuts it (resultrepr_maxsize).
RESULT_REPR_CHARS = 1024


class TaskEvents(LoopObserver):
    def __init__(
        self, broker_url: str, hostname: str, transport_options: Mapping[str, Any] | None = None
    ) -> None:
        from celery import Celery

        self._app = Celery("vlmq-events", broker=broker_url, set_as_current=False)
        self._app.conf.update(
            event_serializer="json",
            accept_content=["json"],
            # A Sentinel broker's master_name (config.connection.celery_broker).
            broker_transport_options=dict(transport_options or {}),
        )
        self._connection = self._app.connection_for_write()
        self._dispatcher = self._app.events.Dispatcher(
            self._connection, hostname=hostname, enabled=True, buffer_while_offline=False
        )
        self._lock = threading.Lock()  # the dispatcher's producer is not thread-safe

    def _send(self, kind: str, **fields: Any) -> None:
        try:
            with self._lock:
                self._dispatcher.send(kind, **fields)
        except Exception:  # events are best effort: never break the batch loop
            log.warning("could not publish a %s event", kind, exc_info=True)

    def received(self, envelopes: Sequence[Envelope]) -> None:
        now = time.time()
        for envelope in envelopes:
            headers = envelope.headers
            self._send(
                "task-received",
                uuid=envelope.task_id,
                name=str(headers.get("task") or TASK_NAME),
                args="()",
                kwargs="{...}",  # never the request: it may hold media
                retries=0,
                eta=None,
                root_id=headers.get("root_id"),
                parent_id=headers.get("parent_id"),
                timestamp=now,
            )

    def started(self, task_ids: Sequence[str]) -> None:
        now = time.time()
        for task_id in task_ids:
            self._send("task-started", uuid=task_id, timestamp=now)

    def settled(self, records: Sequence[Mapping[str, Any]]) -> None:
        """The outcome once it is the task's (a superseded delivery's never is), with the
        result or exception a Celery caller gets (workers/fleet/celery_results.py)."""
        for record in records:
            self._outcome(record)

    def _outcome(self, record: Mapping[str, Any]) -> None:
        timings = record.get("timings") or {}
        started, finished = timings.get("started_at"), timings.get("finished_at")
        runtime = (finished - started) if started and finished else None
        timestamp = finished or time.time()
        state, value = outcome(record)
        if state == "SUCCESS":
            result = saferepr(value, RESULT_REPR_CHARS)
            self._send(
                "task-succeeded",
                uuid=record["id"],
                result=result,
                runtime=runtime,
                timestamp=timestamp,
            )
        elif state == "REVOKED":
            self._send(
                "task-revoked",
                uuid=record["id"],
                expired=True,
                terminated=False,
                signum=None,
                timestamp=timestamp,
            )
        else:
            self._send(
                "task-failed",
                uuid=record["id"],
                exception=repr(value),
                traceback="",
                timestamp=timestamp,
            )

    def close(self) -> None:
        with self._lock:
            self._dispatcher.close()
            self._connection.close()
