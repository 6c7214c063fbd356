"""One worker process: one model, a batch loop thread and a lease heartbeat.

``setup()`` loads the model in this process (never at import and never in a
forked child), ``start()`` starts the loop, ``stop()`` drains it (SIGTERM or a
preemption notice, ``drain.py``): it stops pulling, lets finish what fits the
drain window and hands everything else back for other workers to take at once.
A batch stuck past its time limit makes the heartbeat stop renewing leases
and exit the process, so its messages are redelivered and a supervisor
(docker restart policy, systemd, Kubernetes) starts a fresh worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import is_dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from redis import Redis, RedisError

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS, celery_broker, create_redis
from vlmq.broker.feeding import Feeder
from vlmq.broker.state import State
from vlmq.config.cost import Pricing
from vlmq.config.errors import ConfigError, LayoutUnreadable
from vlmq.config.ids import valid_id
from vlmq.config.keys import Keys
from vlmq.config.settings import FleetSettings, Settings
from vlmq.stores.base import ObjectStore
from vlmq.stores.urls import open_store
from vlmq.workers.engine.interface import as_generation_engine
from vlmq.workers.fleet.clock import StageClock
from vlmq.workers.fleet.events import TaskEvents
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.housekeeping import Housekeeper
from vlmq.workers.fleet.loop import BatchLoop, LoopParts
from vlmq.workers.fleet.metrics import WorkerMetrics
from vlmq.workers.fleet.notices import NoticeWatcher
from vlmq.workers.fleet.observer import LoopObserver, Observers
from vlmq.workers.fleet.prepare_tier import PrepareLoop, PrepareParts, model_targets
from vlmq.workers.fleet.renewals import Renewals, redis_time
from vlmq.workers.fleet.settle import Settler, settle_wait
from vlmq.workers.fleet.triage import Triage
from vlmq.workers.fleet.webhooks import WebhookSender
from vlmq.workers.media.fleet import fleet_loader

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = ["WorkerService", "compose_loop", "compose_prepare_loop", "fleet_state"]

log = logging.getLogger(__name__)

EXIT_STUCK = 70
# A newer task layout is in force than this version reads: an update is the fix, not a restart
# (the exit code of a setting that cannot work, as ``vlmq`` gives it).
EXIT_LAYOUT = 2
# Leases a worker may stay silent before its heartbeat record is pruned.
WORKER_SILENT_LEASES = 5


def fleet_state(redis: Redis, fleet: FleetSettings) -> State:
    """The state layer as a fleet worker uses it: the fleet's key prefix and ttl, and the
    settle's WAIT for replicas when one is asked for."""
    return State(
        redis,
        Keys(fleet.key_prefix),
        ttl_s=fleet.task_ttl_s,
        submitter_lease_s=fleet.submitter_lease_s,
        wait=settle_wait(fleet),
        replay_ttl_s=fleet.replay_ttl_s,
    )


def compose_loop(
    settings: Settings,
    modalities: Sequence[str],
    engine: Any,
    worker: str,
    redis: Redis,
    store: ObjectStore,
    observers: Sequence[LoopObserver] = (),
) -> BatchLoop:
    """Build a batch loop's collaborators and hand them to it (the loop builds nothing)."""
    fleet = settings.fleet
    state = fleet_state(redis, fleet)
    held = Held()
    observer = Observers(observers)
    settler = Settler(
        store,
        state.tasks,
        held,
        observer,
        fleet.upload_threads,
        fleet.store_retry_max_s,
        fleet.store_retry_deadline_s,
    )
    webhooks = WebhookSender(state, settings.webhooks)
    threads = settings.worker.preprocess_workers or max(1, (os.cpu_count() or 2) - 1)
    parts = LoopParts(
        engine=as_generation_engine(engine),
        state=state,
        intakes={m: state.intake(m) for m in modalities},
        held=held,
        settler=settler,
        triage=Triage(state, held, settler, observer, worker, engine.model_name, fleet),
        housekeeper=Housekeeper(state, webhooks, fleet.reap_interval_s),
        observer=observer,
        # Fetching waits on the network and decoding releases the GIL (measured): threads,
        # twice as many for preparing as for collating (each collating thread loads a
        # processor of its own).
        prepare_pool=ThreadPoolExecutor(2 * threads, thread_name_prefix="prepare"),
        collate_pool=ThreadPoolExecutor(threads, thread_name_prefix="collate"),
        clock=StageClock(),
        renewals=Renewals(lambda: redis_time(redis), fleet.lease_s, observer),
        pricing=Pricing.of(settings.cost, _gpu_name()),
    )
    return BatchLoop(fleet, settings.worker, settings.batch, worker, parts)


def _gpu_name() -> str:
    """The GPU's name for the worker record (imported here: a prepare worker runs without
    torch, and only a model worker prices its time). A worker whose engine never imported torch
    (the noop engine) runs nothing on a device: 'cpu', as on a host without CUDA, and it does
    not import torch only to say so (~3 s of CPU a start)."""
    if sys.modules.get("torch") is None:
        return "cpu"
    from vlmq.workers.engine.gputime import device_name

    return device_name()


def compose_prepare_loop(
    settings: Settings,
    modalities: Sequence[str],
    worker: str,
    redis: Redis,
    observers: Sequence[LoopObserver] = (),
) -> PrepareLoop:
    """A prepare worker's loop: no model, the fleet's media loader and frame store, the
    model's decode targets from its config files (``prepare_tier.model_targets``)."""
    loader = fleet_loader(settings)
    if loader.frames is None:
        raise ConfigError(
            "the prepare tier needs the frame store (VLMQ_MEDIA__FRAME_STORE__ENABLED=true)"
        )
    fleet = settings.fleet
    state = fleet_state(redis, fleet)
    threads = settings.worker.preprocess_workers or max(1, (os.cpu_count() or 2) - 1)
    parts = PrepareParts(
        state=state,
        intakes={m: state.intake(m, role="prepare") for m in modalities},
        held=Held(),
        loader=loader,
        targets=model_targets(settings.model, settings.media.downscale_at_decode),
        # Decoding releases the GIL and fetching waits on the network: threads.
        pool=ThreadPoolExecutor(2 * threads, thread_name_prefix="prepare"),
        observer=Observers(observers),
        clock=StageClock(),
        housekeeper=Housekeeper(
            state, WebhookSender(state, settings.webhooks), fleet.reap_interval_s
        ),
    )
    # One pull keeps every thread busy once: a small holding, so a worker that dies sends
    # little back, and several prepare workers share a burst.
    return PrepareLoop(fleet, settings.worker.stage_time_limit_s, worker, parts, 2 * threads)


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        modalities: list[str],
        engine: Any,
        name: str | None = None,
        role: str = "gpu",
    ) -> None:
        self.settings = settings
        self.modalities = modalities
        self.engine = engine
        self.role = role
        serves = ("prepare-" if role == "prepare" else "") + "+".join(modalities)
        self.name = name or f"{serves}@{socket.gethostname()}:{os.getpid()}"
        self.keys = Keys(settings.fleet.key_prefix)
        self.redis = create_redis(settings)  # a pool: connects on first use
        self.loop: BatchLoop | PrepareLoop | None = None
        self.feeder: Feeder | None = None
        state = fleet_state(self.redis, settings.fleet)
        self.records = state.workers
        self.layouts = state.layouts
        self.celery_results: Any = None  # CeleryResults, when results are recorded
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self.notices = NoticeWatcher(settings.drain)

    def setup(self) -> WorkerService:
        self.layouts.check()  # before the model loads: a process that cannot read it stops
        if self.role == "prepare":
            return self._setup_prepare()
        self.engine.setup()
        settings = self.settings
        if not settings.webhooks.secret:
            log.warning("VLMQ_WEBHOOKS__SECRET is empty: this worker sends no webhooks")
        store = open_store(settings.results_url, settings.s3_endpoint_url, settings.s3_region)
        observers: list[LoopObserver] = [self._metrics()]
        if settings.fleet.task_events:
            broker, transport = celery_broker(settings)
            observers.append(TaskEvents(broker, self.name.replace(":", "-"), transport))
        observers += self._celery_results()
        self.loop = compose_loop(
            settings, self.modalities, self.engine, self.name, self.redis, store, observers
        )
        self.feeder = self._feeder(store)
        return self

    def _setup_prepare(self) -> WorkerService:
        settings = self.settings
        # A prepare worker hears Celery revokes as every worker does: it records REVOKED for
        # the tasks its cancel moves.
        observers: list[LoopObserver] = [self._metrics(), *self._celery_results()]
        self.loop = compose_prepare_loop(
            settings, self.modalities, self.name, self.redis, observers
        )
        store = open_store(settings.results_url, settings.s3_endpoint_url, settings.s3_region)
        self.feeder = self._feeder(store)
        return self

    def _celery_results(self) -> list[LoopObserver]:
        """The recorder of Celery results (``celery_results.py``), when they are recorded;
        the service's revoke writes through it too."""
        settings = self.settings
        if not settings.celery.enabled:
            return []
        from vlmq.workers.fleet.celery_results import CeleryResults

        state = fleet_state(self.redis, settings.fleet)
        self.celery_results = CeleryResults.for_settings(settings, self.hostname, state)
        return [self.celery_results]

    def _feeder(self, store: ObjectStore) -> Feeder:
        """The feeder every worker runs for bulk jobs, on a connection of its own: a feed's
        script never waits behind the loop's."""
        fleet = self.settings.fleet
        return Feeder.for_fleet(fleet_state(create_redis(self.settings), fleet), store, fleet)

    @property
    def hostname(self) -> str:
        """This worker's name as Celery shows it (no colons)."""
        return self.name.replace(":", "-")

    def revoke(self, task_ids: Sequence[str]) -> dict[str, str]:
        """A Celery revoke (``AsyncResult.revoke()``, ``app.control.revoke``), through vlmq's
        cancel: a queued task, or one pulled but not started (prefetched), never runs and is
        REVOKED; a job's id cancels the job's queued tasks. A running task is not stopped.
        Every worker hears the broadcast; the first one's cancel moves the task (safe to
        repeat). Returns what happened to each id."""
        state = fleet_state(self.redis, self.settings.fleet)
        done: dict[str, str] = {}
        cancelled = []
        for task_id in task_ids:
            if not valid_id(task_id):
                done[task_id] = "not a vlmq id"
            elif state.jobs.exists(task_id):
                done[task_id] = f"job: {state.cancel(task_id)} queued tasks cancelled"
                if self.celery_results is not None:
                    self.celery_results.revoked_job(task_id)
            elif state.cancel(task_id, unseen=True):
                done[task_id] = "cancelled"
                cancelled.append(task_id)
            else:
                done[task_id] = "not queued (running or ended): not stopped"
        if cancelled and self.celery_results is not None:
            self.celery_results.revoked(cancelled)
        return done

    def _metrics(self) -> WorkerMetrics:
        """Process-wide metrics, served over HTTP when a port is configured (a private
        registry otherwise: nothing reads it, and tests run many workers in one process)."""
        port = self.settings.metrics.port
        if port is None:
            return WorkerMetrics(CollectorRegistry())
        metrics = WorkerMetrics()
        start_http_server(port, addr=self.settings.metrics.host)
        log.info("metrics on http://%s:%d/metrics", self.settings.metrics.host, port)
        return metrics

    def start(self) -> None:
        assert self.loop is not None, "setup() first"
        self._announce()
        self._spawn(self._run_loop, "batch-loop")
        self._spawn(self._heartbeat, "heartbeat")
        self._spawn(self._feed, "feeder")
        self.notices.start()  # a preemption notice drains it as SIGTERM does
        log.info("worker %s serving %s", self.name, ",".join(self.modalities))

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _run_loop(self) -> None:
        assert self.loop is not None
        try:
            self.loop.run_forever()
        except LayoutUnreadable as exc:
            _exit_unreadable(exc)
        except Exception:
            log.critical("the batch loop crashed; exiting so leases are redelivered", exc_info=True)
            os._exit(EXIT_STUCK)

    def _heartbeat(self) -> None:
        """Renew leases every lease_s / 3. Redis being unreachable or full is waited out (the
        leases lapse if it lasts, and a fenced settle refuses what this worker then finishes);
        anything else ends the process, so its leases lapse and its work is redelivered,
        instead of leaving a live worker that silently stopped renewing."""
        assert self.loop is not None
        interval = max(0.5, self.settings.fleet.lease_s / 3)
        while not self._stopped.wait(interval):
            try:
                alive = self.loop.heartbeat()
            except TRANSIENT_REDIS_ERRORS as exc:
                log.warning("heartbeat: Redis %s; retrying", type(exc).__name__)
                continue
            except LayoutUnreadable as exc:
                _exit_unreadable(exc)
            except BaseException:
                log.critical("the heartbeat failed; exiting so leases lapse", exc_info=True)
                os._exit(EXIT_STUCK)
            if not alive:
                log.critical("%s; exiting", self.loop.stuck() or "stuck")
                os._exit(EXIT_STUCK)
            self._announce()

    def _feed(self) -> None:
        """Top bulk jobs up to their window from their staged inputs (vlmq/broker/feeding.py), on a
        thread and a connection of its own: never on the batch loop's."""
        assert self.feeder is not None
        while not self._stopped.wait(self.settings.fleet.feed_interval_s):
            try:
                self.feeder.run_once()
            except TRANSIENT_REDIS_ERRORS as exc:
                log.warning("feeder: Redis %s; retrying", type(exc).__name__)
            except LayoutUnreadable as exc:
                _exit_unreadable(exc)
            except Exception:
                # A feed it could not read (the store is down): its lease lapses and any
                # feeder, this one included, resumes it from its cursor.
                log.exception("feeding failed; retrying")

    def _announce(self) -> None:
        """The heartbeat record (``vlmq healthcheck worker``): optional, so a full or
        unreachable Redis skips it."""
        assert self.loop is not None
        info = {
            "role": self.role,
            "modalities": self.modalities,
            "pid": os.getpid(),
            "at": time.time(),
            "batches": self.loop.batches_done,
            # Tasks this worker holds (running, prefetched, settling) and the pipeline's
            # hand-offs: what a kill of this worker would send back to the queue.
            "held": len(self.loop.parts.held),
            "pipeline": self.loop.pipeline.depths() if self.loop.pipeline else None,
            # A prepare worker serves no model: it prepares media for this one's workers.
            "model": self.engine.model_name if self.engine is not None else None,
            "prepares_for": self.settings.model if self.engine is None else None,
            "engine": _engine_stats(self.loop.engine.stats)
            if isinstance(self.loop, BatchLoop)
            else {},
            # Its GPU and what an hour of it costs (each result's cost is priced with it).
            "cost": self.loop.parts.pricing.record() if isinstance(self.loop, BatchLoop) else None,
            # The task layouts it reads: a newer one is raised only once every record lists it.
            "layouts": list(self.layouts.reads),
        }
        # A worker silent for this many leases died without a clean stop (its work was
        # redelivered after one): its record goes.
        forget_after_s = WORKER_SILENT_LEASES * self.settings.fleet.lease_s
        try:
            pruned = self.records.announce(self.name, info, forget_after_s)
        except TRANSIENT_REDIS_ERRORS as exc:
            log.warning("heartbeat record skipped: Redis %s", type(exc).__name__)
        except LayoutUnreadable as exc:
            _exit_unreadable(exc)
        else:
            if pruned:
                log.info("forgot %d records of workers silent for %.0fs", pruned, forget_after_s)

    def stop(self) -> None:
        """Drain and stop (SIGTERM, a preemption notice, Celery's warm shutdown): stop
        pulling at once, hand back everything but what fits the drain window
        (``VLMQ_DRAIN__WINDOW_S``, ``drain.py``), let that finish and settle, hand back
        whatever is left. A micro-batch handed back may still be inside the engine: it is not
        waited for (its delivery is void; the process exits with it)."""
        with self._stop_lock:
            if self.loop is None or self._stopping:
                return
            self._stopping = True
        self.notices.stop()
        window_s = self.settings.drain.window_s
        if isinstance(self.loop, BatchLoop):
            report = self.loop.drain(window_s)
            for thread in self._threads:
                if thread.name == "batch-loop":
                    thread.join(timeout=_left(report.deadline) if report.finishing else 0.5)
            self.loop.shutdown(max(1.0, _left(report.deadline)))
        else:
            self.loop.drain()
        self._stopped.set()
        with contextlib.suppress(RedisError):
            self.records.retire(self.name)
        log.info("worker %s stopped", self.name)

    def wait(self) -> None:
        """Block until stopped (used when not hosted by Celery)."""
        self._stopped.wait()


def _exit_unreadable(exc: LayoutUnreadable) -> None:
    """Ends the process: every call of its library is refused, so it can neither take nor
    give back work (what it holds is reaped by a worker of the new version)."""
    log.critical("%s; exiting", exc.message)
    os._exit(EXIT_LAYOUT)


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), none below zero."""
    return max(0.0, deadline - time.monotonic())


def _engine_stats(stats: EngineStats | None) -> dict[str, Any]:
    """An engine's counters (micro-batches, OOM splits, bisections), as JSON."""
    if stats is None:
        return {}
    return {
        k: vars(v) if is_dataclass(v) else v  # the media cache's counters
        for k, v in vars(stats).items()
        if k != "batch_sizes"
    }
