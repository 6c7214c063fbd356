"""The worker's batch loop: pull → filter → run → settle, per modality class.

One loop per worker process, one model. Each turn takes one class's batch:
it waits for the first message, keeps pulling until the class's maximum batch
size or maximum wait, drops what is already terminal, cancelled or expired,
dead-letters what was delivered too often, runs the rest through the engine
(requests delivered more than once run alone, so a request that crashes the
worker cannot take its batch-mates down with it), then settles each result.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

import redis
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from config.errors import DeadLettered, Expired, InvalidRequest, PermanentError, error_record
from config.jsonl import describe_validation_error
from config.logs import log_context
from config.queues import queue_depth
from config.results import ResultStore
from config.schemas import Request, Result
from config.settings import BatchPolicy, WebhookSettings
from config.status import TERMINAL, Keys, TaskState
from config.statusdb import StatusDB
from config.wire import TaskMessage, WireError, decode_message
from workers.fleet.events import TaskEvents
from workers.fleet.metrics import WorkerMetrics
from workers.fleet.settle import Settlement, Settler
from workers.fleet.webhooks import WebhookSender
from workers.intake import Delivery, Intake

__all__ = ["BatchLoop", "LoopConfig"]

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    model_name: str

    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]: ...


@dataclass
class LoopConfig:
    modalities: list[str]
    policies: dict[str, BatchPolicy]
    worker: str
    lease_s: float = 30.0
    reap_interval_s: float = 5.0
    max_deliveries: int = 3
    batch_time_limit_s: float = 900.0
    idle_sleep_s: tuple[float, float] = (0.002, 0.02)
    upload_threads: int = 8
    store_retry_max_s: float = 10.0
    max_settle_backlog: int = 256
    webhooks: WebhookSettings = field(default_factory=WebhookSettings)


@dataclass
class _Work:
    delivery: Delivery
    message: TaskMessage | None = None
    request: Request | None = None
    status: dict[str, str] = field(default_factory=dict)

    @property
    def attempts(self) -> int:
        """Times this request was handed to an engine without finishing."""
        try:
            return int(self.status.get("attempts") or 0)
        except ValueError:
            return 0


class BatchLoop:
    """Serves some modality classes with one engine until stopped."""

    def __init__(
        self,
        config: LoopConfig,
        engine: EngineLike,
        client: Any,
        store: ResultStore,
        keys: Keys | None = None,
        metrics: WorkerMetrics | None = None,
        events: TaskEvents | None = None,
    ) -> None:
        self.config = config
        self.events = events
        # A private registry unless the process serves /metrics (tests run many loops).
        self.metrics = metrics or WorkerMetrics(CollectorRegistry())
        self.engine = engine
        self.keys = keys or Keys()
        self.status = StatusDB(client, self.keys)
        self.intakes = {
            m: Intake(
                client,
                [self.keys.queue(m, "bulk")],
                self.keys,
                first=[self.keys.queue(m, "interactive")],
                active_jobs=self.keys.active_jobs(m),
            )
            for m in config.modalities
        }
        self.reaper = next(iter(self.intakes.values()))
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        self.settler = Settler(
            store,
            self.status,
            self.reaper,
            self._release,
            threads=config.upload_threads,
            retry_max_s=config.store_retry_max_s,
            on_upload=self.metrics.observe_upload,
        )
        self.webhooks = WebhookSender(client, self.keys, config.webhooks)
        self.stop_event = threading.Event()
        self.batch_started: float | None = None
        self.batches_done = 0
        self._last_reap = 0.0
        self._turn = 0

    # leases ----------------------------------------------------------------
    def _hold(self, ids: Sequence[str]) -> None:
        with self._held_lock:
            self._held.update(ids)

    def _release(self, ids: Sequence[str]) -> None:
        with self._held_lock:
            self._held.difference_update(ids)

    def held(self) -> list[str]:
        with self._held_lock:
            return list(self._held)

    def lease_deadline(self) -> float:
        return time.time() + self.config.lease_s

    def heartbeat(self) -> bool:
        """Renew leases unless the current batch is stuck; False means give up."""
        started = self.batch_started
        if started is not None and time.monotonic() - started > self.config.batch_time_limit_s:
            return False
        self.reaper.renew(self.held(), self.lease_deadline())
        depths = queue_depth(self.status.redis, self.keys, self.config.modalities)
        for modality, depth in depths.items():
            self.metrics.queue_depth.labels(modality).set(depth)
        stats = getattr(self.engine, "stats", None)
        if stats is not None:
            self.metrics.observe_engine(stats)
        return True

    def reap(self) -> None:
        """Housekeeping any worker does: redeliveries, job expiry, webhooks."""
        now = time.time()
        if now - self._last_reap >= self.config.reap_interval_s:
            self._last_reap = now
            moved = self.reaper.reap(now)
            if moved:
                log.warning("requeued %d messages whose worker stopped renewing", moved)
            self.expire_jobs(now)
            self.webhooks.poll()

    def expire_jobs(self, now: float) -> int:
        """Tasks of jobs past their completion window that never started: expired."""
        due = self.status.redis.zrangebyscore(self.keys.job_expiry(), "-inf", now, 0, 10)
        expired = 0
        for raw in due:
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            expired += self._expire_job(job_id)
            self.status.redis.zrem(self.keys.job_expiry(), job_id)
        return expired

    def _expire_job(self, job_id: str) -> int:
        fields = {
            "finished_at": f"{time.time():.6f}",
            "error_code": "expired",
            "error_message": "the job's completion window ended before it ran",
        }
        expired, start, page = 0, 0, 5000
        while ids := self.status.redis.lrange(self.keys.job_tasks(job_id), start, start + page - 1):
            pipe = self.status.redis.pipeline(transaction=False)
            for task_id in ids:
                self.status.transition(
                    _decoded(task_id),
                    TaskState.EXPIRED,
                    fields,
                    client=pipe,
                    only_from=[TaskState.QUEUED],
                )
            expired += sum(1 for _, moved in pipe.execute() if int(moved))
            start += page
        return expired

    # the loop --------------------------------------------------------------
    def run_forever(self) -> None:
        idle = self.config.idle_sleep_s[0]
        outage = 0.1
        while not self.stop_event.is_set():
            try:
                busy = self._turn_once()
            except redis.ConnectionError:
                # Redis restarted or unreachable: what this worker holds stays
                # leased (or is swept back by then); retry until it answers.
                log.warning("Redis unreachable; retrying in %.1fs", outage)
                self.stop_event.wait(outage)
                outage = min(outage * 2, 2.0)
                continue
            outage = 0.1
            if busy:
                idle = self.config.idle_sleep_s[0]
            else:
                self.stop_event.wait(idle)
                idle = min(idle * 2, self.config.idle_sleep_s[1])

    def _turn_once(self) -> bool:
        self.reap()
        if self.settler.backlog > self.config.max_settle_backlog:
            time.sleep(0.002)  # the store is slow or down: do not pull more
            return True
        return self.run_once() > 0

    def run_once(self) -> int:
        """Pull and serve one batch of one class; returns messages handled."""
        order = self.config.modalities[self._turn :] + self.config.modalities[: self._turn]
        self._turn = (self._turn + 1) % len(self.config.modalities)
        for modality in order:
            deliveries = self._gather(modality)
            if deliveries:
                self._serve(modality, deliveries)
                return len(deliveries)
        return 0

    def _gather(self, modality: str) -> list[Delivery]:
        policy = self.config.policies[modality]
        intake = self.intakes[modality]
        got = intake.pull(policy.max_batch_size, self.lease_deadline())
        if not got:
            return []
        self._hold([d.task_id for d in got])
        deadline = time.monotonic() + policy.max_wait_s
        while len(got) < policy.max_batch_size and time.monotonic() < deadline:
            more = intake.pull(policy.max_batch_size - len(got), self.lease_deadline())
            if more:
                self._hold([d.task_id for d in more])
                got += more
            else:
                time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        return got

    # one batch -------------------------------------------------------------
    def _serve(self, modality: str, deliveries: list[Delivery]) -> None:
        work = self._decode(_unique(deliveries))
        for item in work:
            item.status = dict(item.delivery.status)
        runnable = self._start_all([w for w in work if self._admit(w)])
        if not runnable:
            return
        policy = self.config.policies[modality]
        self.metrics.observe_batch(modality, len(runnable), policy.max_batch_size)
        redelivered = sum(1 for w in runnable if w.delivery.deliveries > 1)
        if redelivered:
            self.metrics.redeliveries.inc(redelivered)
        batch_id = uuid.uuid4().hex[:12]
        with log_context(worker=self.config.worker, batch_id=batch_id):
            log.info("batch %s: %d %s requests", batch_id, len(runnable), modality)
            self.batch_started = time.monotonic()
            try:
                self._run_batch(runnable)
            finally:
                self.batch_started = None
                self.batches_done += 1

    def _run_batch(self, runnable: list[_Work]) -> None:
        # A request that ran before without finishing (its worker died) runs
        # alone, least-tried first, so a request that kills its worker cannot
        # take its batch-mates down with it again.
        fresh = [w for w in runnable if _first_run(w)]
        suspects = sorted((w for w in runnable if not _first_run(w)), key=lambda w: w.attempts)
        if fresh:  # their attempt was counted when they started
            self._run_group(fresh)
        for suspect in suspects:
            # Settle everything before each risky run: if it kills the
            # process, the results of its batch-mates are already safe.
            self.settler.drain()
            self._count_attempt([suspect])
            self._run_group([suspect])

    def _decode(self, deliveries: list[Delivery]) -> list[_Work]:
        work = []
        for delivery in deliveries:
            item = _Work(delivery)
            try:
                item.message = decode_message(delivery.raw)
                fields = {**item.message.request, "id": item.message.task_id}
                item.request = Request.model_validate(fields)
            except WireError as exc:
                self._fail_now(item, InvalidRequest(str(exc)))
                continue
            except ValidationError as exc:
                self._fail_now(item, InvalidRequest(describe_validation_error(exc)))
                continue
            work.append(item)
        return work

    def _admit(self, item: _Work) -> bool:
        """False (and acknowledged) for work that must not run."""
        state = item.status.get("state", "unknown")
        if state in {s.value for s in TERMINAL}:
            self.settler.intake.ack([item.delivery.task_id])  # duplicate delivery
            self._release([item.delivery.task_id])
            return False
        if self._expired(item):
            self._fail_now(item, Expired("the task expired before it ran"), TaskState.EXPIRED)
            return False
        if item.attempts >= self.config.max_deliveries:
            self._dead_letter(item)
            return False
        return True

    def _expired(self, item: _Work) -> bool:
        now = datetime.now(timezone.utc)
        if item.message and item.message.expires and item.message.expires <= now:
            return True
        deadline = _float(item.status.get("expires_at"))
        return deadline is not None and deadline <= time.time()

    def _start_all(self, work: list[_Work]) -> list[_Work]:
        """Move every admitted request to running in one script call; those
        cancelled or expired since they were pulled are acknowledged."""
        if not work:
            return []
        now = f"{time.time():.6f}"
        moves = []
        for item in work:
            request = item.request
            assert request is not None
            item.status["started_at"] = now
            fields = {
                "started_at": now,
                "worker": self.config.worker,
                "modality": request.modality.value,
            }
            if not item.status.get("job_id") and request.job_id:
                fields["job_id"] = request.job_id
            moves.append((item.delivery.task_id, TaskState.RUNNING, fields))
        # The start and the first attempt's count share one round trip; requests
        # that ran before are counted when they run alone (see _run_batch).
        pipe = self.status.redis.pipeline(transaction=False)
        self.status.transition_many(moves, client=pipe)
        fresh = [item for item in work if item.attempts == 0]
        for item in fresh:
            pipe.hincrby(self.keys.task(item.delivery.task_id), "attempts", 1)
        replies = pipe.execute()
        for item in fresh:
            item.status["attempts"] = "1"
        started = []
        for item, (_, moved) in zip(work, replies[0], strict=True):
            if int(moved):
                started.append(item)
            else:
                self.settler.intake.ack([item.delivery.task_id])
                self._release([item.delivery.task_id])
        if self.events is not None:
            self.events.started([item.delivery.task_id for item in started])
        return started

    def _count_attempt(self, group: list[_Work]) -> None:
        pipe = self.status.redis.pipeline(transaction=False)
        for item in group:
            pipe.hincrby(self.keys.task(item.delivery.task_id), "attempts", 1)
        for item, attempts in zip(group, pipe.execute(), strict=True):
            item.status["attempts"] = str(attempts)

    def _run_group(self, group: list[_Work]) -> None:
        requests = [w.request for w in group if w.request is not None]
        try:
            results = self.engine.run(
                requests, worker=self.config.worker, token_budget=self._budget(group)
            )
        except Exception as exc:  # the engine itself broke: fail each, never drop
            log.exception("engine failed on a batch of %d", len(requests))
            results = [_failed_result(r, exc, self.engine.model_name) for r in requests]
        self.settler.submit_many(
            [self._settlement(item, result) for item, result in zip(group, results, strict=True)]
        )

    def _budget(self, group: list[_Work]) -> int | None:
        """The padded-token budget of the group's class (its batch policy)."""
        request = group[0].request if group else None
        policy = self.config.policies.get(request.modality.value) if request else None
        return policy.token_budget if policy else None

    def _settlement(self, item: _Work, result: Result) -> Settlement:
        record = result.model_dump(mode="json")
        record["timings"] = {
            **record.get("timings", {}),
            "queued_at": _float(item.status.get("queued_at")),
            "started_at": _float(item.status.get("started_at")),
            "finished_at": time.time(),
        }
        record["attempts"] = item.attempts
        record["deliveries"] = item.delivery.deliveries
        self.metrics.observe_result(record)
        if self.events is not None:
            self.events.finished(record)
        with log_context(task_id=result.id, job_id=result.job_id):
            log.info("task %s %s", result.id, result.status)
        state = TaskState.SUCCEEDED if result.status == "succeeded" else TaskState.FAILED
        fields = {
            "finished_at": f"{time.time():.6f}",
            "batch_id": result.batch_id,
            "error_code": (result.error or {}).get("code"),
            "error_message": (result.error or {}).get("message"),
        }
        return Settlement(record, state, fields)

    def _fail_now(
        self, item: _Work, error: PermanentError, state: TaskState = TaskState.FAILED
    ) -> None:
        request = item.request
        record = {
            "id": item.delivery.task_id,
            "custom_id": request.custom_id if request else None,
            "job_id": (request.job_id if request else None) or item.status.get("job_id") or None,
            "status": "failed",
            "model": self.engine.model_name,
            "error": error.to_dict(),
            "worker": self.config.worker,
            "attempts": item.attempts,
            "deliveries": item.delivery.deliveries,
        }
        fields = {
            "finished_at": f"{time.time():.6f}",
            "error_code": error.code,
            "error_message": error.message,
        }
        self.settler.submit(record, state, fields)

    def _dead_letter(self, item: _Work) -> None:
        reason = (
            f"ran {item.attempts} times without finishing (limit "
            f"{self.config.max_deliveries}); its worker died each time"
        )
        error = DeadLettered(reason)
        self.metrics.dead_letters.inc()
        self.status.redis.lpush(
            self.keys.dead_letters(),
            _json(
                {
                    "task_id": item.delivery.task_id,
                    "reason": reason,
                    "at": time.time(),
                    "message": item.delivery.raw,
                }
            ),
        )
        self._fail_now(item, error)

    # shutdown --------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def shutdown(self, drain_timeout_s: float = 60.0) -> None:
        """After the loop returned: finish uploads, give back what never ran."""
        self.settler.drain(drain_timeout_s)
        leftover = self.held()
        if leftover:
            self.reaper.requeue(leftover)
            self._release(leftover)
        self.settler.close()
        self.webhooks.close()
        if self.events is not None:
            self.events.close()


def _decoded(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_run(item: _Work) -> bool:
    """Never handed to an engine before this delivery (its attempt was counted
    as it started)."""
    return item.delivery.status.get("attempts") is None


def _unique(deliveries: list[Delivery]) -> list[Delivery]:
    seen: dict[str, Delivery] = {}
    for delivery in deliveries:
        seen.setdefault(delivery.task_id, delivery)
    return list(seen.values())


def _failed_result(request: Request, exc: BaseException, model: str) -> Result:
    return Result(
        id=request.id,
        custom_id=request.custom_id,
        job_id=request.job_id,
        status="failed",
        model=model,
        modality=request.modality,
        error=error_record(exc),
    )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))
