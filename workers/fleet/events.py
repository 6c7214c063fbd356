"""Celery task events for the fleet's own intake, so Flower shows the tasks.

vlmq's batched intake consumes the modality queues instead of Celery's
consumer, so Celery would send no task events for them. With
``VLMQ_FLEET__TASK_EVENTS=true`` the worker publishes the standard
``task-received``, ``task-started``, ``task-succeeded`` / ``task-failed``
events itself (JSON, on the broker's event exchange), which Flower and
``celery events`` understand. Off by default: three extra publishes per task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vlmq.config.wire import TASK_NAME
from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["TaskEvents"]

log = logging.getLogger(__name__)


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

    def started(self, task_ids: Sequence[str]) -> None:
        now = time.time()
        for task_id in task_ids:
            self._send(
                "task-received",
                uuid=task_id,
                name=TASK_NAME,
                args="()",
                kwargs="{...}",
                retries=0,
                eta=None,
                timestamp=now,
            )
            self._send("task-started", uuid=task_id, timestamp=now)

    def result(self, record: Mapping[str, Any]) -> None:
        timings = record.get("timings") or {}
        started, finished = timings.get("started_at"), timings.get("finished_at")
        runtime = (finished - started) if started and finished else None
        if record.get("status") == "succeeded":
            self._send(
                "task-succeeded",
                uuid=record["id"],
                result="stored",
                runtime=runtime,
                timestamp=finished or time.time(),
            )
            return
        error = record.get("error") or {}
        self._send(
            "task-failed",
            uuid=record["id"],
            exception=f"{error.get('code')}: {error.get('message')}",
            traceback="",
            timestamp=finished or time.time(),
        )

    def close(self) -> None:
        with self._lock:
            self._dispatcher.close()
            self._connection.close()
