"""Store step: write each result object, then its terminal status and the ack.

Order matters for "nothing is lost": the object is written first, then one
pipeline moves the status to its terminal state and acknowledges the
message. A crash in between leaves the message leased, so it is delivered
again; the deterministic key makes the rewrite replace the same object.
Uploads run in a thread pool so they overlap the next batch; a store outage
is retried with backoff while the worker keeps the lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from config.errors import StoreUnavailable
from config.results import ResultStore, result_key
from config.status import TaskState
from config.statusdb import StatusDB
from workers.intake import Intake

__all__ = ["Settler"]

log = logging.getLogger(__name__)


class Settler:
    """Writes results and finishes tasks, off the batch loop's thread."""

    def __init__(
        self,
        store: ResultStore,
        status: StatusDB,
        intake: Intake,
        release: Callable[[list[str]], None],
        threads: int = 8,
        retry_max_s: float = 30.0,
        on_upload: Callable[[float, str], None] | None = None,
    ) -> None:
        self.on_upload = on_upload
        self.store = store
        self.status = status
        self.intake = intake
        self.release = release
        self.retry_max_s = retry_max_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="settle")
        self._pending: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    @property
    def backlog(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, record: dict[str, Any], state: TaskState, fields: dict[str, Any]) -> None:
        future = self._pool.submit(self._settle, record, state, fields)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)
        if future.exception() is not None:
            log.error("settling a result failed", exc_info=future.exception())

    def _settle(self, record: dict[str, Any], state: TaskState, fields: dict[str, Any]) -> None:
        task_id = record["id"]
        started = time.perf_counter()
        url = self._put_with_retry(result_key(task_id, record.get("job_id")), record)
        if self.on_upload is not None:
            self.on_upload(time.perf_counter() - started, str(record.get("modality") or "unknown"))
        if url is None:
            return  # shutting down: the message stays leased and is redelivered
        self.finish(task_id, state, {**fields, "result_url": url})

    def finish(self, task_id: str, state: TaskState, fields: dict[str, Any]) -> None:
        """Terminal status and acknowledgement in one atomic pipeline (retried
        while Redis is unreachable: the object is already stored)."""
        delay = 0.1
        while True:
            try:
                pipe = self.status.redis.pipeline(transaction=True)
                self.status.transition(task_id, state, fields, client=pipe)
                self.intake.ack([task_id], client=pipe)
                pipe.execute()
                break
            except redis.ConnectionError:
                if self.stopping.is_set():
                    return  # still leased: it is delivered again and rewritten
                log.warning("Redis unreachable while finishing %s; retrying", task_id)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.release([task_id])

    def _put_with_retry(self, key: str, record: dict[str, Any]) -> str | None:
        delay = 0.2
        while True:
            try:
                return self.store.put(key, record)
            except StoreUnavailable:
                if self.stopping.is_set():
                    return None
                log.warning("results store unavailable; retrying in %.1fs", delay)
                time.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every pending upload; True when none is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.backlog:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self.stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
