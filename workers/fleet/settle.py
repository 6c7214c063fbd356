"""Store step: write each result object, then the terminal statuses and the acks.

Order matters for "nothing is lost": the objects are written first, then one
transaction moves the statuses to their terminal states and acknowledges the
messages. A crash in between leaves the messages leased, so they are
delivered again; the deterministic key makes the rewrite replace the same
object. A batch's results are settled together (uploads in parallel, one
Redis transaction), off the batch loop's thread so they overlap the next
batch; a store outage is retried with backoff while the leases are kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

from vlmq.config.errors import StoreUnavailable
from vlmq.config.results import ResultStore, result_key
from vlmq.config.status import TaskState
from vlmq.config.statusdb import StatusDB
from vlmq.workers.fleet.intake import Held, Leases
from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["Settlement", "Settler"]

log = logging.getLogger(__name__)


@dataclass
class Settlement:
    """One task's result object and the terminal status it moves to."""

    record: dict[str, Any]
    state: TaskState
    fields: dict[str, Any]

    @property
    def task_id(self) -> str:
        return str(self.record["id"])


class Settler:
    """Writes results and finishes tasks, off the batch loop's thread."""

    def __init__(
        self,
        store: ResultStore,
        status: StatusDB,
        leases: Leases,
        held: Held,
        observer: LoopObserver,
        threads: int,
        retry_max_s: float,
    ) -> None:
        self.store = store
        self.status = status
        self.leases = leases
        self.held = held
        self.observer = observer
        self.retry_max_s = retry_max_s
        # Batches settle one after another (two in flight), their uploads in parallel.
        self._batches = ThreadPoolExecutor(max_workers=2, thread_name_prefix="settle")
        self._uploads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="upload")
        self._pending = 0
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    @property
    def backlog(self) -> int:
        """Tasks whose results are not settled yet."""
        with self._lock:
            return self._pending

    def submit(self, record: dict[str, Any], state: TaskState, fields: dict[str, Any]) -> None:
        self.submit_many([Settlement(record, state, fields)])

    def submit_many(self, settlements: Sequence[Settlement]) -> None:
        if not settlements:
            return
        with self._lock:
            self._pending += len(settlements)
        future = self._batches.submit(self._settle, list(settlements))
        future.add_done_callback(partial(self._done, count=len(settlements)))

    def _done(self, future: Future[Any], *, count: int) -> None:
        with self._lock:
            self._pending -= count
        if future.exception() is not None:
            log.error("settling results failed", exc_info=future.exception())

    def _settle(self, settlements: list[Settlement]) -> None:
        if self.store.parallel_uploads and len(settlements) > 1:
            urls = list(self._uploads.map(self._upload, settlements))
        else:
            urls = [self._upload(s) for s in settlements]
        stored = []
        for settlement, url in zip(settlements, urls, strict=True):
            if url is not None:  # None: shutting down; it stays leased and comes back
                settlement.fields["result_url"] = url
                stored.append(settlement)
        self.finish_many(stored)

    def _upload(self, settlement: Settlement) -> str | None:
        record = settlement.record
        started = time.perf_counter()
        url = self._put_with_retry(result_key(settlement.task_id, record.get("job_id")), record)
        self.observer.uploaded(
            time.perf_counter() - started, str(record.get("modality") or "unknown")
        )
        return url

    def finish_many(self, settlements: Sequence[Settlement]) -> None:
        """Terminal statuses and acknowledgements in one transaction (retried
        while Redis is unreachable: the objects are already stored)."""
        if not settlements:
            return
        delay = 0.1
        ids = [s.task_id for s in settlements]
        while True:
            try:
                pipe = self.status.redis.pipeline(transaction=True)
                moves = [(s.task_id, s.state, s.fields) for s in settlements]
                self.status.transition_many(moves, pipe=pipe)
                self.leases.ack(ids, pipe=pipe)
                pipe.execute()
                break
            except redis.ConnectionError:
                if self.stopping.is_set():
                    return  # still leased: delivered again and rewritten
                log.warning("Redis unreachable while finishing %d tasks; retrying", len(ids))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.held.release(ids)

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
        """Wait for every pending settlement; True when none is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.backlog:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self.stopping.set()
        self._batches.shutdown(wait=True, cancel_futures=True)
        self._uploads.shutdown(wait=True, cancel_futures=True)
