"""Store step: write each result object, then the terminal statuses and the acks, fenced.

Order matters for "nothing is lost": the objects are written first, then one script moves the
statuses to their terminal states and acknowledges the messages, for the holder whose delivery
token is still the task's (``Leases.settle``). A crash in between leaves the messages leased, so
they are delivered again. Each delivery writes its own object (``result_key(..., token)``), and
the status hash points at the winner's only: a superseded holder's object is never the task's
result, and no object is ever overwritten. A batch's results are settled together (uploads in
parallel, one script call), off the batch loop's thread so they overlap the next batch. A store
outage and transient Redis errors are retried with backoff while the leases are kept, a store
outage for at most ``store_retry_deadline_s`` a batch: then each task still without its object
fails alone (``store_unavailable``, retryable), so a store that never takes a write (a full
volume) cannot leave tasks running with their leases held. Any other failure releases the
batch, so its leases lapse and it is redelivered within ``lease_s + reap_interval_s`` (never
held and renewed forever).

With ``VLMQ_FLEET__SETTLE_WAIT_REPLICAS`` each settle is followed by ``WAIT`` (:func:`settle_wait`),
so a result acknowledged here is on a replica too. Without it (or when WAIT times out), a Redis
failover can lose a settle that was acknowledged: its object is stored but the new master still
has the task running; the lease lapses, the task is delivered again, and :meth:`Settler.stored`
finds the earlier delivery's object, which Triage settles instead of running the model again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from prometheus_client import Counter

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.broker.scripts import Wait
from vlmq.broker.state.tasks import Move, Tasks
from vlmq.config.errors import ResultNotStored, StoreUnavailable, VlmqError
from vlmq.config.settings import FleetSettings
from vlmq.config.status import TaskState
from vlmq.config.usage import TaskUsage
from vlmq.stores.base import ObjectStore, result_key
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver

__all__ = [
    "REPAIRED_RESULTS",
    "SETTLE_WAIT_SHORT",
    "Settlement",
    "Settler",
    "Stored",
    "settle_wait",
]

log = logging.getLogger(__name__)

# Process-wide (the default registry: on a worker's /metrics when VLMQ_METRICS__PORT is set).
SETTLE_WAIT_SHORT = Counter(
    "vlmq_settle_wait_short",
    "Settles whose WAIT saw fewer replicas than VLMQ_FLEET__SETTLE_WAIT_REPLICAS in time",
)
REPAIRED_RESULTS = Counter(
    "vlmq_repaired_results",
    "Redelivered tasks settled with the result an earlier delivery stored (its settle was lost)",
)


def settle_wait(fleet: FleetSettings) -> Wait | None:
    """The WAIT that follows each settle, or None when it is off. Its timeout stays below the
    socket timeout: a WAIT the socket gave up on would read as a failed settle, and be retried
    (and time out) for as long as no replica answers."""
    if fleet.settle_wait_replicas <= 0:
        return None
    timeout_ms = fleet.settle_wait_timeout_ms
    ceiling = max(1, int(fleet.redis_socket_timeout_s * 1000 * 0.8))
    if timeout_ms > ceiling:
        log.warning(
            "VLMQ_FLEET__SETTLE_WAIT_TIMEOUT_MS=%d is not below the Redis socket timeout "
            "(%.1f s); waiting %d ms instead",
            timeout_ms,
            fleet.redis_socket_timeout_s,
            ceiling,
        )
        timeout_ms = ceiling
    return Wait(
        fleet.settle_wait_replicas, timeout_ms, on_short=lambda _acked: SETTLE_WAIT_SHORT.inc()
    )


@dataclass
class Settlement:
    """One task's result object and the terminal status it moves to, for delivery ``token``."""

    record: dict[str, Any]
    state: TaskState
    fields: dict[str, Any]
    token: int
    ran: bool = False  # an engine ran it in this delivery (its attempt was counted)

    @property
    def task_id(self) -> str:
        return str(self.record["id"])

    @property
    def usage(self) -> TaskUsage:
        """What the task used, counted for its tenant and job when it settles."""
        return TaskUsage.of(self.record)

    @property
    def key(self) -> str:
        return result_key(self.task_id, self.record.get("job_id"), self.token)

    def settled_record(self) -> dict[str, Any]:
        """The record as the ``settled`` hook hears of it: with its ``result_url`` once
        stored."""
        url = self.fields.get("result_url")
        return self.record if url is None else {**self.record, "result_url": url}

    def unstored(self, reason: str, error_type: type[VlmqError] = ResultNotStored) -> Settlement:
        """This settlement as a failure without a result object (the store refused it, for
        good or for longer than the settle waits)."""
        error = error_type(f"the result could not be stored: {reason}"[:500])
        fields = {
            **{k: v for k, v in self.fields.items() if k in ("worker", "batch_id")},
            "error_code": error.code,
            "error_message": error.message,
        }
        record = {**self.record, "status": "failed", "error": error.to_dict(), "output": None}
        return Settlement(record, TaskState.FAILED, fields, self.token)


@dataclass(frozen=True)
class Refused:
    """The store did not take this object: never will (its key or its record), or refused
    every write until the batch's deadline (``error_type`` StoreUnavailable)."""

    reason: str
    error_type: type[VlmqError] = ResultNotStored


@dataclass(frozen=True)
class Stored:
    """A result object an earlier delivery of a task wrote."""

    delivery: int
    record: dict[str, Any]


class Settler:
    """Writes results and finishes tasks, off the batch loop's thread."""

    def __init__(
        self,
        store: ObjectStore,
        tasks: Tasks,
        held: Held,
        observer: LoopObserver,
        threads: int,
        retry_max_s: float,
        retry_deadline_s: float = 300.0,
    ) -> None:
        self.store = store
        self.tasks = tasks
        self.held = held
        self.observer = observer
        self.retry_max_s = retry_max_s
        self.retry_deadline_s = retry_deadline_s
        # Batches settle one after another (two in flight), their uploads in parallel.
        self._batches = ThreadPoolExecutor(max_workers=2, thread_name_prefix="settle")
        self._uploads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="upload")
        self._pending = 0
        self._pending_ids: dict[str, int] = {}  # task id -> its settlements in flight
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
            for s in settlements:
                self._pending_ids[s.task_id] = self._pending_ids.get(s.task_id, 0) + 1
        self._batches.submit(self._settle_counted, list(settlements))

    def _settle_counted(self, settlements: list[Settlement]) -> None:
        try:
            self._settle(settlements)
        finally:
            with self._lock:
                self._pending -= len(settlements)
                for s in settlements:
                    left = self._pending_ids.pop(s.task_id, 1) - 1
                    if left > 0:
                        self._pending_ids[s.task_id] = left

    def pending_ids(self) -> set[str]:
        """Tasks whose results are being settled (a drain keeps them: they are done)."""
        with self._lock:
            return set(self._pending_ids)

    def _settle(self, settlements: list[Settlement]) -> None:
        try:
            stored = self._store_all(settlements)
            self.finish_many(stored)
        except Exception:
            if self.stopping.is_set():
                return  # still held: shutdown gives it back
            ids = [s.task_id for s in settlements]
            log.exception("settling %d results failed; releasing them for redelivery", len(ids))
            self.held.release(ids)

    def _store_all(self, settlements: list[Settlement]) -> list[Settlement]:
        """Upload every object; those that shutdown interrupted are left out (still held).
        An object the store refuses for good (a key it will not take), or that it has not
        taken by the batch's deadline (one for the whole batch: uploads one after another
        do not each wait it out), fails that task alone, without an object: its batch-mates
        settle as they are."""
        upload = partial(self._upload, give_up_at=time.monotonic() + self.retry_deadline_s)
        if self.store.parallel_uploads and len(settlements) > 1:
            urls = list(self._uploads.map(upload, settlements))
        else:
            urls = [upload(s) for s in settlements]
        stored = []
        for settlement, url in zip(settlements, urls, strict=True):
            if isinstance(url, Refused):
                stored.append(settlement.unstored(url.reason, url.error_type))
            elif url is not None:
                settlement.fields["result_url"] = url
                stored.append(settlement)
        return stored

    def _upload(self, settlement: Settlement, give_up_at: float) -> str | Refused | None:
        started = time.perf_counter()
        try:
            url = self._put_with_retry(settlement.key, settlement.record, give_up_at)
        except StoreUnavailable:  # still refused at the deadline
            waited = f"the results store refused it for {self.retry_deadline_s:g} s"
            log.error("task %s: its result could not be stored: %s", settlement.task_id, waited)
            return Refused(waited, StoreUnavailable)
        except VlmqError as exc:  # the store refuses this key or record for good
            log.error("task %s: its result could not be stored: %s", settlement.task_id, exc)
            return Refused(str(exc))
        modality = str(settlement.record.get("modality") or "unknown")
        self.observer.uploaded(time.perf_counter() - started, modality)
        return url

    def finish_many(self, settlements: Sequence[Settlement]) -> None:
        """Terminal statuses and acknowledgements in one fenced script (retried while Redis
        is unreachable or busy: the objects are already stored, and a settle that did apply
        reads, retried, as this holder's)."""
        if not settlements:
            return
        moves = [
            Move(s.task_id, s.state, s.fields, token=s.token, stamp="finished_at")
            for s in settlements
        ]
        delay = 0.1
        while True:
            try:
                settled = self.tasks.settle(moves, [s.usage for s in settlements])
                break
            except TRANSIENT_REDIS_ERRORS as exc:
                if self.stopping.is_set():
                    return  # still held: delivered again
                log.warning("Redis %s while finishing %d tasks; retrying", _name(exc), len(moves))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.held.release(s.task_id for s in settlements)
        won = [s for s, done in zip(settlements, settled, strict=True) if done.held]
        lost = [(s, done) for s, done in zip(settlements, settled, strict=True) if not done.held]
        if won:
            self.observer.settled([s.settled_record() for s in won])
        # One object per task: a superseded holder removes its own (only when another delivery
        # has the task, or it ended without this one), a redelivered winner what earlier
        # deliveries may have left (a holder killed between upload and settle).
        self._remove([s.key for s, done in lost if done.superseded and "result_url" in s.fields])
        if lost:
            # Logged once its objects are gone, so the line reports a finished discard.
            log.warning("%d results of superseded deliveries discarded", len(lost))
            self.observer.superseded([s.task_id for s, _ in lost])
            self._outlived({s.task_id: s.token for s, done in lost if s.ran and done.superseded})
        self._remove(
            [
                result_key(s.task_id, s.record.get("job_id"), delivery)
                for s in won
                for delivery in range(1, s.token)
            ]
        )

    def _outlived(self, tokens: dict[str, int]) -> None:
        """Runs this live worker finished after another holder took their task (its leases
        lapsed while they ran: a starved host) are not deaths: said once, so the task's
        poison verdict does not count them. Best effort: unsaid, a run counts as a death."""
        if not tokens:
            return
        try:
            counted = self.tasks.outlived(tokens)
        except TRANSIENT_REDIS_ERRORS as exc:
            log.warning("Redis %s: %d outlived runs not counted", _name(exc), len(tokens))
            return
        log.warning("%d runs outlived their leases here (counted as not died)", counted)

    def stored(self, wanted: Sequence[tuple[str, str | None, int]]) -> list[Stored | None]:
        """Per (task id, job id, token): the newest result an earlier delivery of that task
        stored (its delivery and record), or None. Read in parallel; a store that cannot be
        read counts as nothing stored (the task then runs again, which is always safe)."""
        if len(wanted) > 1:
            return list(self._uploads.map(lambda w: self._stored_one(*w), wanted))
        return [self._stored_one(*w) for w in wanted]

    def _stored_one(self, task_id: str, job_id: str | None, token: int) -> Stored | None:
        for delivery in range(token - 1, 0, -1):
            key = result_key(task_id, job_id, delivery)
            try:
                record = self.store.get(key)
            except Exception:
                log.warning("could not read %s; task %s runs again", key, task_id, exc_info=True)
                return None
            if isinstance(record, dict) and record.get("id") == task_id:
                return Stored(delivery, record)
        return None

    def _remove(self, keys: Iterable[str]) -> None:
        """Best effort: an object left behind is never read (the status names the winner's)."""
        for key in keys:
            try:
                self.store.delete(key)
            except StoreUnavailable:
                log.warning("could not remove %s; it stays, unread", key)

    def _put_with_retry(self, key: str, record: dict[str, Any], give_up_at: float) -> str | None:
        """The object's URL; None when shutdown interrupted the retries (still held);
        StoreUnavailable when the store still refused it at ``give_up_at``."""
        delay = 0.2
        while True:
            try:
                return self.store.put(key, record)
            except StoreUnavailable:
                if self.stopping.is_set():
                    return None
                left = give_up_at - time.monotonic()
                if left <= 0:
                    raise
                pause = min(delay, left)
                log.warning("results store unavailable; retrying in %.1fs", pause)
                time.sleep(pause)
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
