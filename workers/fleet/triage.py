"""Between pull and engine: decode each message, drop what must not run, start the rest.

Decoding failures fail their task alone (``invalid_request``). A task already terminal (a
duplicate delivery) is acknowledged and skipped; one past its expiry is expired; one that ran
``max_deliveries`` times without finishing (its worker died each time) is dead-lettered. What
is left moves to ``running`` in one script call, and a task cancelled or expired since it was
pulled is acknowledged instead.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone

from pydantic import ValidationError

from vlmq.config.errors import DeadLettered, Expired, InvalidRequest, PermanentError
from vlmq.config.jsonl import describe_validation_error
from vlmq.config.schemas import Request
from vlmq.config.status import TERMINAL, TaskState
from vlmq.config.statusdb import StatusDB
from vlmq.config.wire import WireError, decode_message
from vlmq.workers.fleet.intake import Delivery, Held, Leases
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settler
from vlmq.workers.fleet.work import Work, failure_settlement, unique

__all__ = ["Triage"]

log = logging.getLogger(__name__)

_TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


class Triage:
    def __init__(
        self,
        status: StatusDB,
        leases: Leases,
        held: Held,
        settler: Settler,
        observer: LoopObserver,
        worker: str,
        model: str,
        max_deliveries: int,
    ) -> None:
        self.status = status
        self.leases = leases
        self.held = held
        self.settler = settler
        self.observer = observer
        self.worker = worker
        self.model = model
        self.max_deliveries = max_deliveries

    def runnable(self, deliveries: list[Delivery]) -> list[Work]:
        """The pulled work that runs now, moved to running; everything else is settled."""
        work = self._decode(unique(deliveries))
        return self._start([item for item in work if self._admit(item)])

    # decode ------------------------------------------------------------------
    def _decode(self, deliveries: list[Delivery]) -> list[Work]:
        work = []
        for delivery in deliveries:
            item = Work(delivery, status=dict(delivery.status))
            try:
                item.message = decode_message(delivery.raw)
                fields = {**item.message.request, "id": item.message.task_id}
                item.request = Request.model_validate(fields)
            except WireError as exc:
                self.fail(item, InvalidRequest(str(exc)))
                continue
            except ValidationError as exc:
                self.fail(item, InvalidRequest(describe_validation_error(exc)))
                continue
            work.append(item)
        return work

    # admit -------------------------------------------------------------------
    def _admit(self, item: Work) -> bool:
        """False (and settled or acknowledged) for work that must not run."""
        if item.status.get("state", "unknown") in _TERMINAL_STATES:
            self._drop(item)  # a duplicate delivery
            return False
        if self._expired(item):
            self.fail(item, Expired("the task expired before it ran"), TaskState.EXPIRED)
            return False
        if item.attempts >= self.max_deliveries:
            self._dead_letter(item)
            return False
        return True

    def _expired(self, item: Work) -> bool:
        now = datetime.now(timezone.utc)
        if item.message and item.message.expires and item.message.expires <= now:
            return True
        deadline = item.status.get("expires_at")
        try:
            return bool(deadline) and float(deadline or 0) <= time.time()
        except ValueError:
            return False

    def _drop(self, item: Work) -> None:
        self.leases.ack([item.task_id])
        self.held.release([item.task_id])

    def _dead_letter(self, item: Work) -> None:
        reason = (
            f"ran {item.attempts} times without finishing (limit "
            f"{self.max_deliveries}); its worker died each time"
        )
        self.observer.dead_lettered(item.task_id)
        record = {"task_id": item.task_id, "reason": reason, "at": time.time()}
        record["message"] = item.delivery.raw
        self.status.redis.lpush(
            self.status.keys.dead_letters(), json.dumps(record, separators=(",", ":"))
        )
        self.fail(item, DeadLettered(reason))

    def fail(self, item: Work, error: PermanentError, state: TaskState = TaskState.FAILED) -> None:
        """End a task before any engine sees it, with a result record and its status."""
        self.settler.submit_many([failure_settlement(item, error, state, self.worker, self.model)])

    # start -------------------------------------------------------------------
    def _start(self, work: list[Work]) -> list[Work]:
        """Move every admitted request to running in one script call; those cancelled or
        expired since they were pulled are acknowledged."""
        if not work:
            return []
        now = f"{time.time():.6f}"
        moves = []
        for item in work:
            assert item.request is not None
            item.status["started_at"] = now
            fields = {
                "started_at": now,
                "worker": self.worker,
                "modality": item.request.modality.value,
            }
            if not item.status.get("job_id") and item.request.job_id:
                fields["job_id"] = item.request.job_id
            moves.append((item.task_id, TaskState.RUNNING, fields))
        # The start and the first attempt's count share one round trip; requests that ran
        # before are counted when they run alone (BatchLoop._run_suspects).
        pipe = self.status.redis.pipeline(transaction=False)
        self.status.transition_many(moves, pipe=pipe)
        fresh = [item for item in work if item.attempts == 0]
        for item in fresh:
            pipe.hincrby(self.status.keys.task(item.task_id), "attempts", 1)
        replies = pipe.execute()
        for item in fresh:
            item.status["attempts"] = "1"
        started = []
        for item, (_, moved) in zip(work, StatusDB.moved(replies[0]), strict=True):
            if moved:
                started.append(item)
            else:
                self._drop(item)
        self.observer.started([item.task_id for item in started])
        return started

    def count_attempt(self, group: list[Work]) -> None:
        """A request that ran before counts an attempt each time it runs again."""
        pipe = self.status.redis.pipeline(transaction=False)
        for item in group:
            pipe.hincrby(self.status.keys.task(item.task_id), "attempts", 1)
        for item, attempts in zip(group, pipe.execute(), strict=True):
            item.status["attempts"] = str(attempts)
