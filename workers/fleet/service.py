"""One worker process: one model, a batch loop thread and a lease heartbeat.

``setup()`` loads the model in this process (never at import and never in a
forked child), ``start()`` starts the loop, ``stop()`` lets the current batch
finish, waits for its uploads and gives back whatever was pulled but not run.
A batch stuck past its time limit makes the heartbeat stop renewing leases
and exit the process, so its messages are redelivered and a supervisor
(docker restart policy, systemd, Kubernetes) starts a fresh worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import redis
from prometheus_client import start_http_server

from config.results import open_store
from config.settings import Settings
from config.status import Keys
from workers.fleet.events import TaskEvents
from workers.fleet.loop import BatchLoop, LoopConfig
from workers.fleet.metrics import WorkerMetrics

__all__ = ["WorkerService"]

log = logging.getLogger(__name__)

EXIT_STUCK = 70


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        modalities: list[str],
        engine: Any,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.modalities = modalities
        self.engine = engine
        self.name = name or f"{'+'.join(modalities)}@{socket.gethostname()}:{os.getpid()}"
        self.keys = Keys(settings.fleet.key_prefix)
        self.loop: BatchLoop | None = None
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()

    def setup(self) -> WorkerService:
        self.engine.setup()
        fleet = self.settings.fleet
        client = redis.Redis.from_url(
            self.settings.redis_url,
            socket_timeout=fleet.redis_socket_timeout_s,
            socket_connect_timeout=fleet.redis_socket_timeout_s,
            health_check_interval=10,
            retry_on_timeout=True,
        )
        store = open_store(
            self.settings.results_url, self.settings.s3_endpoint_url, self.settings.s3_region
        )
        config = LoopConfig(
            modalities=self.modalities,
            policies=self.settings.batch,
            worker=self.name,
            lease_s=fleet.lease_s,
            reap_interval_s=fleet.reap_interval_s,
            max_deliveries=fleet.max_deliveries,
            batch_time_limit_s=fleet.batch_time_limit_s,
            upload_threads=fleet.upload_threads,
            store_retry_max_s=fleet.store_retry_max_s,
            webhooks=self.settings.webhooks,
        )
        events = (
            TaskEvents(self.settings.redis_url, self.name.replace(":", "-"))
            if fleet.task_events
            else None
        )
        self.loop = BatchLoop(
            config, self.engine, client, store, self.keys, self._metrics(), events
        )
        return self

    def _metrics(self) -> WorkerMetrics | None:
        """Process-wide metrics, served over HTTP when a port is configured."""
        port = self.settings.metrics.port
        if port is None:
            return None
        metrics = WorkerMetrics()
        start_http_server(port, addr=self.settings.metrics.host)
        log.info("metrics on http://%s:%d/metrics", self.settings.metrics.host, port)
        return metrics

    def start(self) -> None:
        assert self.loop is not None, "setup() first"
        self._announce()
        self._spawn(self._run_loop, "batch-loop")
        self._spawn(self._heartbeat, "heartbeat")
        log.info("worker %s serving %s", self.name, ",".join(self.modalities))

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _run_loop(self) -> None:
        assert self.loop is not None
        try:
            self.loop.run_forever()
        except Exception:
            log.critical("the batch loop crashed; exiting so leases are redelivered", exc_info=True)
            os._exit(EXIT_STUCK)

    def _heartbeat(self) -> None:
        assert self.loop is not None
        interval = max(0.5, self.settings.fleet.lease_s / 3)
        while not self._stopped.wait(interval):
            try:
                alive = self.loop.heartbeat()
                self._announce()
            except redis.RedisError:
                log.warning("heartbeat could not reach Redis", exc_info=True)
                continue
            if not alive:
                log.critical("batch exceeded %ss; exiting", self.settings.fleet.batch_time_limit_s)
                os._exit(EXIT_STUCK)

    def _announce(self) -> None:
        assert self.loop is not None
        info = {
            "modalities": self.modalities,
            "pid": os.getpid(),
            "at": time.time(),
            "batches": self.loop.batches_done,
            "model": self.engine.model_name,
            "engine": _engine_stats(self.engine),
        }
        self.loop.status.redis.hset(self.keys.workers(), self.name, json.dumps(info))

    def stop(self, drain_timeout_s: float = 60.0) -> None:
        if self.loop is None or self._stopped.is_set():
            return
        self.loop.stop()
        for thread in self._threads:
            if thread.name == "batch-loop":
                thread.join(timeout=self.settings.fleet.batch_time_limit_s)
        self.loop.shutdown(drain_timeout_s)
        self._stopped.set()
        with contextlib.suppress(redis.RedisError):
            self.loop.status.redis.hdel(self.keys.workers(), self.name)
        log.info("worker %s stopped", self.name)

    def wait(self) -> None:
        """Block until stopped (used when not hosted by Celery)."""
        self._stopped.wait()


def _engine_stats(engine: Any) -> dict[str, Any]:
    """Counters of a real engine (micro-batches, OOM splits, bisections)."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return {}
    return {k: v for k, v in vars(stats).items() if k != "batch_sizes"}
