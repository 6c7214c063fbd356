"""Store step: write each result object, then the terminal statuses and the acks, fenced.

Order matters for "nothing is lost": the objects are written first, then one script moves the
statuses to their terminal states and acknowledges the messages, for the holder whose delivery
token is still the task's (``Leases.settle``). A crash in between leaves the messages leased, so
they are delivered again. Each delivery writes its own object (``result_key(..., token)``), and
the status hash points at the winner's only: a superseded holder's object is never the task's
result, and no object is ever overwritten. A batch's results are settled together (uploads in
parallel, one script call), off the batch loop's thread so they overlap the next batch. A store
outage and transient Redis errors are retried with backoff while the leases are kept; any other
failure releases the batch, so its leases lapse and it is redelivered within ``lease_s +
reap_interval_s`` (never held and renewed forever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vlmq.config.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.errors import StoreUnavailable
from vlmq.config.results import ResultStore, result_key
from vlmq.config.status import TaskState
from vlmq.config.statusdb import Move
from vlmq.workers.fleet.intake import Held, Leases
from vlmq.workers.fleet.observer import LoopObserver

__all__ = ["Settlement", "Settler"]

log = logging.getLogger(__name__)


@dataclass
class Settlement:
    """One task's result object and the terminal status it moves to, for delivery ``token``."""

    record: dict[str, Any]
    state: TaskState
    fields: dict[str, Any]
    token: int

    @property
    def task_id(self) -> str:
        return str(self.record["id"])

    @property
    def key(self) -> str:
        return result_key(self.task_id, self.record.get("job_id"), self.token)


class Settler:
    """Writes results and finishes tasks, off the batch loop's thread."""

    def __init__(
        self,
        store: ResultStore,
        leases: Leases,
        held: Held,
        observer: LoopObserver,
        threads: int,
        retry_max_s: float,
        injected_errors: int = 0,
    ) -> None:
        self.store = store
        self._injected_errors = injected_errors  # testing only: FaultInjection.settle_errors
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

    def submit_many(self, settlements: Sequence[Settlement]) -> None:
        if not settlements:
            return
        with self._lock:
            self._pending += len(settlements)
        self._batches.submit(self._settle_counted, list(settlements))

    def _settle_counted(self, settlements: list[Settlement]) -> None:
        try:
            self._settle(settlements)
        finally:
            with self._lock:
                self._pending -= len(settlements)

    def _settle(self, settlements: list[Settlement]) -> None:
        try:
            if self._injected_errors > 0:
                self._injected_errors -= 1
                raise RuntimeError("injected settle error")
            stored = self._store_all(settlements)
            self.finish_many(stored)
        except Exception:
            if self.stopping.is_set():
                return  # still held: shutdown gives it back
            ids = [s.task_id for s in settlements]
            log.exception("settling %d results failed; releasing them for redelivery", len(ids))
            self.held.release(ids)

    def _store_all(self, settlements: list[Settlement]) -> list[Settlement]:
        """Upload every object; those that shutdown interrupted are left out (still held)."""
        if self.store.parallel_uploads and len(settlements) > 1:
            urls = list(self._uploads.map(self._upload, settlements))
        else:
            urls = [self._upload(s) for s in settlements]
        stored = []
        for settlement, url in zip(settlements, urls, strict=True):
            if url is not None:
                settlement.fields["result_url"] = url
                stored.append(settlement)
        return stored

    def _upload(self, settlement: Settlement) -> str | None:
        started = time.perf_counter()
        url = self._put_with_retry(settlement.key, settlement.record)
        modality = str(settlement.record.get("modality") or "unknown")
        self.observer.uploaded(time.perf_counter() - started, modality)
        return url

    def finish_many(self, settlements: Sequence[Settlement]) -> None:
        """Terminal statuses and acknowledgements in one fenced script (retried while Redis
        is unreachable or busy: the objects are already stored)."""
        if not settlements:
            return
        moves = [
            Move(s.task_id, s.state, s.fields, token=s.token, stamp="finished_at")
            for s in settlements
        ]
        delay = 0.1
        while True:
            try:
                settled = self.leases.settle(moves)
                break
            except TRANSIENT_REDIS_ERRORS as exc:
                if self.stopping.is_set():
                    return  # still held: delivered again
                log.warning("Redis %s while finishing %d tasks; retrying", _name(exc), len(moves))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.held.release(s.task_id for s in settlements)
        won = [s for s, done in zip(settlements, settled, strict=True) if done.held]
        lost = [s for s, done in zip(settlements, settled, strict=True) if not done.held]
        if lost:
            log.warning("%d results of superseded deliveries discarded", len(lost))
            self.observer.superseded([s.task_id for s in lost])
        # One object per task: a superseded holder removes its own, a redelivered winner what
        # earlier deliveries may have left (a holder killed between upload and settle).
        self._remove([s.key for s in lost])
        self._remove(
            [
                result_key(s.task_id, s.record.get("job_id"), delivery)
                for s in won
                for delivery in range(1, s.token)
            ]
        )

    def _remove(self, keys: Iterable[str]) -> None:
        """Best effort: an object left behind is never read (the status names the winner's)."""
        for key in keys:
            try:
                self.store.delete(key)
            except StoreUnavailable:
                log.warning("could not remove %s; it stays, unread", key)

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


def _name(exc: BaseException) -> str:
    return type(exc).__name__
