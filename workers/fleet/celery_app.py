"""The Celery application of the fleet: JSON only, our intake as a worker bootstep.

Celery hosts the worker process (signals, warm shutdown, remote control,
events for Flower, ``celery inspect``); the batched intake of the modality
queues runs as a bootstep, not as Celery's own consumer, because Celery's
per-message consumer cannot ack a batch correctly (docs/design.md). The
Celery consumer itself listens only on a small control queue.
"""

from __future__ import annotations

from typing import Any, ClassVar

from celery import Celery, bootsteps
from celery.worker.control import Panel, control_command, ok

from vlmq.broker.connection import celery_broker
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.config.wire import TASK_NAME

__all__ = ["IntakeStep", "make_app", "revoke"]


def make_app(settings: Settings, service: Any = None) -> Celery:
    keys = Keys(settings.fleet.key_prefix)
    # A Sentinel VLMQ_REDIS_URL becomes kombu's sentinel transport (sentinel://...;... plus
    # master_name); a plain one is used as it is.
    broker, transport = celery_broker(settings)
    app = Celery("vlmq", broker=broker, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        # On SIGTERM the batch loop drains (IntakeStep.stop: workers/fleet/
        # drain.py); Celery's own soft shutdown covers the
        # control queue's tasks, which are bounded by the time limits.
        worker_soft_shutdown_timeout=60.0,
        task_soft_time_limit=240,
        task_time_limit=300,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600, **transport},
        task_default_queue=keys.control_queue(),
        task_routes={TASK_NAME: {"queue": keys.queue("text")}},
    )

    @app.task(name="vlmq.ping")
    def ping() -> str:
        return "pong"

    if service is not None:
        app.vlmq_service = service
        app.steps["worker"].add(IntakeStep)
        _handle_revoke()
    return app


# Celery's own handler: a worker without vlmq's service (none in a vlmq process) keeps it.
_CELERY_REVOKE = Panel.data.get("revoke")


def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kw: Any) -> Any:
    """Celery's ``revoke`` control command, mapped to vlmq's cancel (``WorkerService.revoke``):
    the batched intake never consults Celery's revoked set, so a revoked task is cancelled in
    vlmq's state instead (queued or prefetched: it never runs; running: not stopped)."""
    service = getattr(state.app, "vlmq_service", None)
    if service is None:
        assert _CELERY_REVOKE is not None
        return _CELERY_REVOKE(state, task_id, terminate=terminate, signal=signal, **kw)
    ids = [task_id] if isinstance(task_id, str) else list(task_id or [])
    return ok(service.revoke([str(i) for i in ids]))


def _handle_revoke() -> None:
    """Install :func:`revoke` as the process's ``revoke`` command (Celery keeps one table of
    control commands per process; safe to repeat)."""
    if Panel.data.get("revoke") is not revoke:
        control_command(variadic="task_id", signature="[id1 [id2 [... [idN]]]]")(revoke)


class IntakeStep(bootsteps.StartStopStep):
    """Starts the batch loop with the worker, stops it on warm shutdown."""

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.service = worker.app.vlmq_service

    def start(self, worker: Any) -> None:
        self.service.start()

    def stop(self, worker: Any) -> None:
        self.service.stop()

    def shutdown(self, worker: Any) -> None:
        self.service.stop()
