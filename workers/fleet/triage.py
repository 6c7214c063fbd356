"""Between pull and engine: decode each message and drop what must not run (``admit``, at
pull), then move what runs to ``running`` right before its engine call (``start``).

Any message from any producer either runs or fails alone as ``invalid_request`` with a status
and a result record; nothing about a message can make the worker exit. A task whose holders
died ``max_unstarted_deliveries`` times before starting it, or ``max_deliveries`` times while it
was prepared alone (``suspects.py``: only deaths count), is dead-lettered before its message is
decoded (its headers are read around its body, for a Celery caller). A task past its expiry (on
Redis's clock) is expired; one that ran ``max_deliveries`` times without finishing (its worker
died each time) is dead-lettered, unless its last run was this very live process's (its lease
lapsed while it ran: ``_outlived_here``). ``start`` checks expiry again and moves a micro-batch to
``running`` in one fenced script call, counting each an attempt; a task cancelled or expired
while it waited in the pipeline, or delivered to someone else since, is let go instead.

A redelivered task (token > 1) whose earlier delivery already stored its result object is not
run again: that stored result is settled for this delivery (``_repair``). Its settle was lost: a
Redis failover that did not replicate it (asynchronous replication), or a holder that died
between upload and settle. Only redeliveries pay for the look-up (one store read per earlier
delivery, in parallel across the batch).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from vlmq.broker.state import State
from vlmq.broker.state.intake import Delivery, Pull
from vlmq.broker.state.tasks import ENDED, Move, start_move
from vlmq.config.errors import DeadLettered, Expired, InvalidRequest, PermanentError
from vlmq.config.jsonl import describe_validation_error
from vlmq.config.schemas import Request
from vlmq.config.settings import FleetSettings
from vlmq.config.status import TaskState
from vlmq.config.wire import (
    Envelope,
    TaskMessage,
    WireError,
    decode_envelope,
    decode_message,
    peek_envelope,
)
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import REPAIRED_RESULTS, Settlement, Settler, Stored
from vlmq.workers.fleet.suspects import given_up
from vlmq.workers.fleet.work import Work, failure_settlement

__all__ = [
    "Triage",
    "celery_envelope",
    "expired",
    "parse_delivery",
    "parse_request",
    "read_envelope",
]

# The id the pull gives a message that names no task of its own (lua/intake.lua, identity).
INVALID_PREFIX = "invalid-"
# A dead letter keeps the head of its message (enough to see what it was), not all of it.
DEAD_LETTER_MESSAGE_CHARS = 4096
# Runs of one task, outlived or not, past which it is dead-lettered: OUTLIVED_BOUND x
# max_deliveries.
OUTLIVED_BOUND = 2

# Task ids a worker remembers starting (for ``_outlived_here``): ~10 MB at most.
STARTED_HERE_KEPT = 100_000

log = logging.getLogger(__name__)


class Triage:
    def __init__(
        self,
        state: State,
        held: Held,
        settler: Settler,
        observer: LoopObserver,
        worker: str,
        model: str,
        fleet: FleetSettings,
    ) -> None:
        self.state = state
        self.held = held
        self.settler = settler
        self.observer = observer
        self.worker = worker
        self.model = model
        self.fleet = fleet
        # The tasks this process started lately (bounded; oldest forgotten first).
        self._started_here: OrderedDict[str, None] = OrderedDict()

    def admit(self, pull: Pull) -> list[Work]:
        """The pulled work that may run (still queued); everything else is settled."""
        if pull.dropped:
            self.observer.dropped(pull.dropped)
        read = [self._decode(delivery) for delivery in pull.deliveries]
        # Observers hear of every message read before any of them is settled (a Celery
        # caller's failure needs the message's headers: workers/fleet/celery_results.py).
        envelopes = [item.envelope for item, _ in read if item.envelope is not None]
        if envelopes:
            self.observer.received(envelopes)
        work = []
        for item, error in read:
            if error is None:
                work.append(item)
            elif isinstance(error, DeadLettered):
                self._dead_letter(item, error)
            else:
                self.fail(item, error)
        work = self._repair(work)
        return [item for item in work if self._admit(item, pull.now)]

    # repair ------------------------------------------------------------------
    def _repair(self, work: list[Work]) -> list[Work]:
        """Settle the redeliveries whose earlier delivery stored a result (its settle was
        lost) with that result; returns the rest, which run."""
        again = [item for item in work if item.token > 1]
        if not again:
            return work
        found = self.settler.stored([(i.task_id, i.job_id, i.token) for i in again])
        repaired = [
            settlement
            for item, stored in zip(again, found, strict=True)
            if stored is not None and (settlement := _stored_settlement(item, stored)) is not None
        ]
        if not repaired:
            return work
        log.info(
            "%d redelivered tasks already had a stored result (a lost settle); settling it "
            "instead of running them again: %s",
            len(repaired),
            ", ".join(s.task_id for s in repaired[:10]),
        )
        REPAIRED_RESULTS.inc(len(repaired))
        self.settler.submit_many(repaired)
        done = {s.task_id for s in repaired}
        return [item for item in work if item.task_id not in done]

    # decode ------------------------------------------------------------------
    def _decode(self, delivery: Delivery) -> tuple[Work, PermanentError | None]:
        """The work a delivery is, and why it cannot run (None: it may). A task given up
        (``suspects.given_up``) is dead-lettered before its message is decoded (decoding it
        may be what killed its holders); what a Celery caller needs to hear of its end is
        read around its body (``celery_envelope``), as for a message that cannot be read."""
        item = Work(delivery, status=dict(delivery.status))
        reason = given_up(item, self.fleet)
        if reason:
            item.envelope = celery_envelope(delivery, self.fleet.max_message_bytes)
            return item, DeadLettered(reason)
        try:
            item.envelope = read_envelope(delivery, self.fleet.max_message_bytes)
            item.message, item.request = parse_request(delivery, item.envelope)
        except InvalidRequest as exc:
            if item.envelope is None:
                item.envelope = celery_envelope(delivery, self.fleet.max_message_bytes)
            return item, exc
        return item, None

    # admit -------------------------------------------------------------------
    def _admit(self, item: Work, now: float) -> bool:
        """False (and settled) for work that must not run; ``now`` is Redis's time."""
        if self._expired(item, now):
            self.fail(item, Expired("the task expired before it ran"), TaskState.EXPIRED)
            return False
        limit = self.fleet.max_deliveries
        # Outlived runs are forgiven up to a bound: a request whose runs outlive their leases
        # each time (one that starves its worker's heartbeat) still ends, after 2x the limit.
        if item.attempts >= OUTLIVED_BOUND * limit or (
            item.deaths >= limit and not self._outlived_here(item)
        ):
            reason = (
                f"ran {item.attempts} times without finishing, its worker dying "
                f"{item.deaths} times (limit {limit}; {OUTLIVED_BOUND * limit} runs in all)"
            )
            self._dead_letter(item, DeadLettered(reason))
            return False
        return True

    def _outlived_here(self, item: Work) -> bool:
        """Whether the task's last run was this very process's, which is alive: its lease
        lapsed while it ran (a starved host, a stalled heartbeat), and nothing died. Such a
        run is not evidence of a poison request (issue 38: a valid row dead-lettered on a
        loaded CPU), so the task runs again. A run by another worker, or by an earlier
        process under this name (a supervisor's restart after a crash), still counts."""
        if item.task_id not in self._started_here:
            return False
        (last,) = self.state.tasks.many([item.task_id], ("worker",))
        if last.get("worker") != self.worker:
            return False
        log.warning(
            "task %s ran %d times without finishing, its last run here, this worker alive "
            "(its lease lapsed: a starved host?); running it again, not dead-lettering",
            item.task_id,
            item.attempts,
        )
        return True

    @staticmethod
    def _expired(item: Work, now: float) -> bool:
        return expired(item.message, item.status, now)

    def _dead_letter(self, item: Work, error: DeadLettered) -> None:
        self.observer.dead_lettered(item.task_id)
        raw = item.delivery.raw
        record = {"task_id": item.task_id, "reason": error.message, "at": time.time()}
        record |= {"message": raw[:DEAD_LETTER_MESSAGE_CHARS], "message_chars": len(raw)}
        self.state.tasks.dead_letter(
            json.dumps(record, separators=(",", ":")), self.fleet.max_dead_letters
        )
        self.fail(item, error)

    def fail(self, item: Work, error: PermanentError, state: TaskState = TaskState.FAILED) -> None:
        """End a task before any engine sees it, with a result record and its status."""
        self.settler.submit_many([failure_settlement(item, error, state, self.worker, self.model)])

    # start -------------------------------------------------------------------
    def start(self, work: list[Work]) -> list[Work]:
        """Move a micro-batch to running, right before its engine call, in one fenced script
        call that also counts each an attempt; expired ones are settled, cancelled ones and
        those another holder has now are let go."""
        seconds, micros = self.state.redis.time()
        now = seconds + micros / 1e6
        live = []
        for item in work:
            if self._expired(item, now):
                self.fail(item, Expired("the task expired before it ran"), TaskState.EXPIRED)
            else:
                live.append(item)
        moves = [self._start_move(item) for item in live]
        started_at = f"{time.time():.6f}"
        started, ended = [], {}
        for item, moved in zip(live, self.state.tasks.start(moves), strict=True):
            if moved.moved:
                item.status["started_at"] = started_at
                item.status["attempts"] = str(item.attempts + 1)
                started.append(item)
            elif moved.held or moved.current == ENDED:
                # cancelled (or expired) while it waited: it will not run
                ended[item.task_id] = item.token
            # else: delivered to another holder since; that holder has it now
        self.state.leases.ack(ended)
        running = {item.task_id for item in started}
        for task_id in running:
            self._started_here[task_id] = None
            self._started_here.move_to_end(task_id)
        while len(self._started_here) > STARTED_HERE_KEPT:
            self._started_here.popitem(last=False)
        self.held.release(item.task_id for item in live if item.task_id not in running)
        self.observer.started([item.task_id for item in started])
        return started

    def _start_move(self, item: Work) -> Move:
        assert item.request is not None
        return start_move(
            item.task_id, item.token, self.worker, item.request.modality.value, item.status
        )


def _stored_settlement(item: Work, stored: Stored) -> Settlement | None:
    """The settlement of ``item``'s delivery with a result an earlier delivery stored: the
    same record and status fields (worker, batch, error) its own settle would have written;
    the settler stores it under this delivery's key and removes the earlier objects."""
    record = stored.record
    raw_error = record.get("error")
    error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
    if record.get("status") == "succeeded":
        state = TaskState.SUCCEEDED
    elif record.get("status") == "failed":
        state = TaskState.EXPIRED if error.get("code") == Expired.code else TaskState.FAILED
    else:
        return None
    fields = {
        "worker": record.get("worker"),
        "error_code": error.get("code"),
        "error_message": error.get("message"),
    }
    if record.get("batch_id") is not None:
        fields["batch_id"] = record["batch_id"]
    return Settlement(dict(record), state, fields, item.token)


def read_envelope(delivery: Delivery, max_message_bytes: int) -> Envelope:
    """The message's headers, properties and body, or InvalidRequest."""
    if delivery.task_id.startswith(INVALID_PREFIX):
        raise InvalidRequest(
            "the message names no task of its own: its id is not a plain id "
            "([A-Za-z0-9_.-], 1-128, not dots only), or it names a task it is not"
        )
    if len(delivery.raw) > max_message_bytes:
        raise InvalidRequest(f"the message is larger than {max_message_bytes} B")
    try:
        envelope = decode_envelope(delivery.raw)
    except WireError as exc:
        raise InvalidRequest(str(exc)) from None
    except Exception:
        log.exception("message %s could not be decoded", delivery.task_id)
        raise InvalidRequest("the message could not be decoded") from None
    if envelope.task_id != delivery.task_id:
        raise InvalidRequest("the message's header id cannot be read one way")
    return envelope


def celery_envelope(delivery: Delivery, max_message_bytes: int) -> Envelope | None:
    """What a Celery caller needs of a message that is not read whole (over the size limit,
    not a readable protocol-2 message, a dead letter) to hear how its task ended: its headers
    and properties, read around its body (``wire.peek_envelope``), or failing that its task id
    alone (its end is then recorded as for a message that asks for a result: a record nobody
    reads expires, a caller never hearing of it would wait for ever). None for a message that
    names no task of its own: the id it carries may be another task's."""
    if delivery.task_id.startswith(INVALID_PREFIX):
        return None
    return peek_envelope(delivery.raw, delivery.task_id, max_message_bytes)


def parse_request(delivery: Delivery, envelope: Envelope) -> tuple[TaskMessage, Request]:
    """The message and its request, or InvalidRequest saying what is wrong. The task is
    the one the pull named (``lua/intake.lua``, identity); nothing read here names
    another. A message's request joins only the job its task's hash names (the job that
    counted it): a plain message that names a job in its request joins none."""
    try:
        message = decode_message(delivery.raw, envelope)
        fields = {**message.request, "id": delivery.task_id}
        fields["job_id"] = delivery.status.get("job_id")
        request = Request.model_validate(fields)
    except WireError as exc:
        raise InvalidRequest(str(exc)) from None
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None
    except Exception:
        # A shape nothing above foresaw: this message fails, the worker goes on.
        log.exception("message %s could not be decoded", delivery.task_id)
        raise InvalidRequest("the message could not be decoded") from None
    return message, request


def parse_delivery(delivery: Delivery, max_message_bytes: int) -> tuple[TaskMessage, Request]:
    """``read_envelope`` then ``parse_request``: a delivery's request, or InvalidRequest (the
    prepare tier reads requests the same way the GPU worker's triage does)."""
    return parse_request(delivery, read_envelope(delivery, max_message_bytes))


def expired(message: TaskMessage | None, status: Mapping[str, str], now: float) -> bool:
    """Past its message's Celery ``expires`` or its status's ``expires_at`` (``now``: Redis's
    time): such a task must not run (the GPU worker settles it expired; the prepare tier does
    not prepare it)."""
    expires = message.expires if message else None
    if expires is not None and expires.timestamp() <= now:
        return True
    try:
        deadline = float(status.get("expires_at") or "inf")
    except ValueError:
        return False
    return deadline <= now
