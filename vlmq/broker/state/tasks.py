"""Tasks: their status, their state moves (fenced by delivery) and the settle that ends them.

Every state change goes through ``lua/tasks.lua``: ``transition`` (a producer's cancel, the
worker's start) and ``settle`` (terminal moves, acknowledgements and usage in one step), so a
task's state and its job's counters change together and only forward (``config/status.py``
holds the table), on Redis's clock. A move carries its delivery's token: a holder that was
superseded changes nothing. Reads of many tasks are one pipelined round trip.

A task has one hash while it lives (``Keys.task``); a fed task's hash is folded into its job
when it ends (``Folded``, read through its job's claims).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Call, Scripts, Wait
from vlmq.broker.state.layouts import check_readable
from vlmq.config.ids import FED_ID, valid_id
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState, sources_of
from vlmq.config.usage import TaskUsage, usage_argv
from vlmq.stores.base import result_key

__all__ = [
    "ENDED",
    "Folded",
    "Move",
    "Moved",
    "Tasks",
    "encode_moves",
    "start_move",
    "with_state",
]

# A folded record's state letter (lua/tasks.lua FOLDED).
_FOLDED_STATES = {"S": "succeeded", "F": "failed", "C": "cancelled", "E": "expired"}
# What a move's reply says of a task that ended and was folded without this delivery's result.
ENDED = "ended"


@dataclass(frozen=True)
class Folded:
    """What a finished fed task leaves: its state, and either the delivery whose result
    object it has (``result_key``) or, without an object, its custom_id."""

    submission: str
    state: str | None  # None: still live (its hash has the status)
    delivery: int | None = None
    custom_id: str | None = None

    @classmethod
    def parse(cls, record: str) -> Folded:
        sub, _, rest = record.partition(" ")
        if not rest:
            return cls(sub, None)
        code, body = rest[0], rest[1:]
        state = _FOLDED_STATES.get(code, "unknown")
        if body.startswith(" "):
            return cls(sub, state, custom_id=body[1:] or None)
        return cls(sub, state, delivery=int(body) if body.isdigit() else None)

    def status(self, task_id: str, job_id: str) -> dict[str, str]:
        out = {"state": str(self.state), "job_id": job_id, "folded": "1"}
        if self.delivery is not None:
            out["deliveries"] = str(self.delivery)
            out["result_key"] = result_key(task_id, job_id, self.delivery)
        if self.custom_id:
            out["custom_id"] = self.custom_id
        return out


@dataclass(frozen=True)
class Move:
    """One task's state change; ``token`` fences it to the delivery that holds the task
    (``None``: unfenced, a producer's cancel), ``stamp`` names a field set to Redis's time.
    A move never sets a task's job (only the producer that counted it in its job does)."""

    task_id: str
    state: TaskState
    fields: Mapping[str, Any] = field(default_factory=dict)
    token: int | None = None
    stamp: str | None = None
    count_attempt: bool = False  # the task is handed to an engine: attempts + 1 if it moves


@dataclass(frozen=True)
class Moved:
    """One task's move as it was applied: its state before, whether it moved, whether the
    mover held it (its token was the task's), the task's delivery count now ('' unknown;
    ``ENDED``: the task ended and was folded without this delivery's result), and the
    mover's token."""

    task_id: str
    previous: str
    moved: bool
    held: bool
    current: str = ""
    token: int = 0

    @property
    def superseded(self) -> bool:
        """Another delivery has the task, or it ended without this one: what this holder
        made is not the task's. (A count below this holder's token is a pull that a Redis
        failover lost: this same token is delivered again and writes the same object, which
        is then not someone else's.)"""
        if self.held:
            return False
        if self.current == ENDED:
            return True
        return self.current.isdigit() and int(self.current) > self.token


def _allowed_from(states: Iterable[TaskState | None]) -> str:
    return ",".join("-" if s is None else s.value for s in states)


def encode_moves(
    moves: Sequence[Move], only_from: Iterable[TaskState | None] | None = None
) -> tuple[list[Any], list[list[Any]]]:
    """Moves as ``lua/tasks.lua`` takes them from ARGV (read_templates, read_move): what the
    moves share once per call, as templates (new state, allowed from-states, stamp field,
    whether it counts an attempt, and the fields every move of that kind sets to the same
    value: a batch's worker, modality, batch id), then per move its template, token and own
    fields. A start of 32 tasks then sends each task's id and token, not its move whole: each
    argument costs the script a string. A field whose value is None is not written (a
    success's error fields): every reader takes a field that is absent as unset, and each
    field costs the hash a scan."""
    kinds: dict[tuple[str, str, str, str], list[int]] = {}
    for index, move in enumerate(moves):
        allowed = _allowed_from(only_from if only_from is not None else sources_of(move.state))
        kind = (move.state.value, allowed, move.stamp or "", "1" if move.count_attempt else "0")
        kinds.setdefault(kind, []).append(index)
    header: list[Any] = [len(kinds)]
    per_move: list[list[Any]] = [[] for _ in moves]
    for number, (kind, members) in enumerate(kinds.items(), start=1):
        own = [_set_fields(moves[i]) for i in members]
        shared = dict(set.intersection(*(set(fields.items()) for fields in own)))
        header += [*kind, len(shared), *(x for pair in sorted(shared.items()) for x in pair)]
        for i, fields in zip(members, own, strict=True):
            rest = [x for k, v in fields.items() if k not in shared for x in (k, v)]
            token = moves[i].token
            per_move[i] = [number, "" if token is None else str(token), len(rest) // 2, *rest]
    return header, per_move


def start_move(
    task_id: str, token: int, worker: str, modality: str, status: Mapping[str, str]
) -> Move:
    """The move of a held task to running right before its engine call: one attempt, its
    worker, its start on Redis's clock. ``status``: the task's status as its pull read it. A
    task a vlmq producer created (its hash has ``queued_at``) was given its modality then;
    only a message that came without one (any Celery producer's) gets it here: each field a
    start writes costs Redis ~4,500 instructions a task."""
    fields = {"worker": worker}
    if not status.get("queued_at"):
        fields["modality"] = modality
    return Move(task_id, TaskState.RUNNING, fields, token, "started_at", True)


def _set_fields(move: Move) -> dict[str, str]:
    return {k: _as_text(v) for k, v in move.fields.items() if v is not None}


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


class Tasks:
    """Task status: moves, the settle, dead letters, and reads."""

    def __init__(
        self, redis: redis_py.Redis, scripts: Scripts, keys: Keys, ttl_s: int, wait: Wait | None
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.ttl_s = ttl_s
        self.wait = wait  # each settle then WAITs for replicas (VLMQ_FLEET__SETTLE_WAIT_*)

    # moves -----------------------------------------------------------------
    def transition(
        self,
        task_id: str,
        new_state: TaskState,
        fields: Mapping[str, Any] | None = None,
        only_from: Iterable[TaskState | None] | None = None,
    ) -> Moved:
        """Move one task forward (unfenced: a producer's); ``only_from`` narrows the states it
        may leave (cancel: queued only)."""
        move = Move(task_id, new_state, fields or {}, stamp="finished_at")
        return self.moves([move], only_from=only_from)[0]

    def moves(
        self,
        moves: Sequence[Move],
        only_from: Iterable[TaskState | None] | None = None,
        call: Call | None = None,
    ) -> list[Moved]:
        """Apply many moves in one script call (``transition``), each fenced by its token."""
        return self._moves("transition", moves, only_from, call)

    def _moves(
        self,
        command: str,
        moves: Sequence[Move],
        only_from: Iterable[TaskState | None] | None,
        call: Call | None,
    ) -> list[Moved]:
        if not moves:
            return []
        header, per_move = encode_moves(moves, only_from)
        argv: list[Any] = [self.keys.job_prefix, self.keys.job_ref_prefix, self.ttl_s, *header]
        for move, encoded in zip(moves, per_move, strict=True):
            argv += [move.task_id, *encoded]
        keys = [self.keys.events(), *(self.keys.task(m.task_id) for m in moves)]
        reply = self.scripts(command, keys, argv, call=call)
        return _moved(moves, reply)

    def start(self, moves: Sequence[Move]) -> list[Moved]:
        """The worker's start of held tasks (to running, one attempt each), fenced by each
        move's token; safe to repeat: a start this delivery made counts once."""
        return self._moves("start", moves, None, None)

    def settle(
        self, moves: Sequence[Move], usage: Sequence[TaskUsage | None] | None = None
    ) -> list[Moved]:
        """Terminal moves and acknowledgements of held tasks in one step, fenced by each
        move's token, with what each task used counted for its tenant and job (``usage``,
        aligned with ``moves``); runs while Redis is over maxmemory. Safe to repeat: a task
        it already ended reads as held by this delivery, moved no further, counted once."""
        if not moves:
            return []
        groups, per_task = usage_argv(usage or [None] * len(moves))
        header, per_move = encode_moves(moves)
        args: list[Any] = [self.keys.job_prefix, self.keys.job_ref_prefix, self.ttl_s]
        args += [self.keys.usage_prefix, self.keys.usage_tenants(), *groups, *header]
        for move, encoded, used in zip(moves, per_move, per_task, strict=True):
            args += [move.task_id, *encoded, *used]
        keys = [*self.keys.bookkeeping(), self.keys.events(), *map(self.keys.task, _ids(moves))]
        reply = self.scripts("settle", keys, args, wait=self.wait)
        return _moved(moves, reply)

    def mark_alone(self, task_id: str, token: int) -> int:
        """Count that this delivery of a task that never started is prepared alone (once per
        delivery); returns the count."""
        return int(self.scripts("mark_alone", [self.keys.task(task_id)], [token]))

    def outlived(self, tokens: Mapping[str, int]) -> int:
        """Count, once per delivery, the runs of these deliveries (task id -> token) as
        outlived, not died: their holder ran them, is alive, and was superseded (its lease
        lapsed while it ran). Returns how many it counted."""
        if not tokens:
            return 0
        keys = [self.keys.task(task_id) for task_id in tokens]
        return int(self.scripts("outlived", keys, list(tokens.values())))

    def dead_letter(self, record: str, cap: int) -> None:
        """Keep why a task was given up (the newest ``cap`` records)."""
        self.scripts("dead_letter", [self.keys.dead_letters()], [record, cap])

    # reads -----------------------------------------------------------------
    def get(self, task_id: str) -> dict[str, str]:
        """A task's status ({"state": "unknown"} for an id Redis has never seen)."""
        if not valid_id(task_id):
            return {"state": TaskState.UNKNOWN.value}
        pipe = self._reads()
        pipe.hgetall(self.keys.task(task_id))
        (raw,) = self._replies(pipe)
        if raw:
            return with_state(raw)
        return self.folded(task_id) or {"state": TaskState.UNKNOWN.value}

    def _reads(self) -> Any:
        """A pipeline of reads whose first reply is the layout in force (:meth:`_replies`
        checks it): a process of an older version must not misread a newer layout's tasks."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.layout())
        return pipe

    def _replies(self, pipe: Any) -> list[Any]:
        """The replies of a :meth:`_reads` pipeline, once this version reads the layout."""
        in_force, *replies = pipe.execute()
        check_readable(in_force, self.scripts.newest)
        return replies

    def folded(self, task_id: str) -> dict[str, str] | None:
        """A finished fed task's status, from its job's claims (its id names both)."""
        match = FED_ID.match(task_id)
        if match is None:
            return None
        number, claim, submission = match.groups()
        job_id: str | None = self.redis.get(self.keys.job_ref(number))  # type: ignore[assignment]
        if job_id is None:
            return None
        record: str | None = self.redis.hget(self.keys.job_custom_ids(job_id), claim)  # type: ignore[assignment]
        if record is None:
            return None
        folded = Folded.parse(record)
        if folded.submission != submission or folded.state is None:
            return None  # superseded by a later submission's task (or mid-fold)
        return folded.status(task_id, job_id)

    def many(self, task_ids: Sequence[str], fields: Sequence[str] = ()) -> list[dict[str, str]]:
        """Status of many tasks in one pipelined round trip (``fields``: only those)."""
        pipe = self._reads()
        for task_id in task_ids:
            key = self.keys.task(task_id)
            if fields:
                pipe.hmget(key, list(fields))
            else:
                pipe.hgetall(key)
        replies = self._replies(pipe)
        if fields:
            return [_fields(fields, values) for values in replies]
        return [with_state(r) if r else {"state": TaskState.UNKNOWN.value} for r in replies]

    def ended(
        self, job_id: str, task_ids: Sequence[str], fields: Sequence[str]
    ) -> list[dict[str, str] | None]:
        """The status ``fields`` of tasks of ``job_id`` that ended, in one pipelined round
        trip: a fed task's from its folded record (it was folded as it ended), another's from
        its hash. None for one that is gone (a fed task superseded by a later submission's,
        or expired)."""
        pipe = self._reads()
        claims = self.keys.job_custom_ids(job_id)
        fed = [FED_ID.match(task_id) for task_id in task_ids]
        for task_id, match in zip(task_ids, fed, strict=True):
            if match is not None:
                pipe.hget(claims, match.group(2))
            else:
                pipe.hmget(self.keys.task(task_id), list(fields))
        found: list[dict[str, str] | None] = []
        for task_id, match, reply in zip(task_ids, fed, self._replies(pipe), strict=True):
            if match is None:
                status = _fields(fields, reply)
                found.append(status if status["state"] != TaskState.UNKNOWN.value else None)
                continue
            folded = Folded.parse(str(reply)) if reply else None
            if folded is None or folded.submission != match.group(3) or folded.state is None:
                found.append(None)
            else:
                found.append(folded.status(task_id, job_id))
        return found

    def states(self, task_ids: Sequence[str]) -> list[TaskState]:
        """Each task's state, in one pipelined round trip (a second one for finished fed
        tasks, whose state their job keeps)."""
        pipe = self._reads()
        for task_id in task_ids:
            pipe.hget(self.keys.task(task_id), "state")
        states = [_STATES.get(value, TaskState.UNKNOWN) for value in self._replies(pipe)]
        unknown = [i for i, s in enumerate(states) if s is TaskState.UNKNOWN]
        fed = [i for i in unknown if FED_ID.match(task_ids[i])]
        for index, folded in zip(fed, self._folded_many([task_ids[i] for i in fed]), strict=True):
            if folded is not None:
                states[index] = _STATES.get(folded.state, TaskState.UNKNOWN)
        return states

    def _folded_many(self, task_ids: Sequence[str]) -> list[Folded | None]:
        """The folded records of finished fed tasks: their jobs, then their records."""
        if not task_ids:
            return []
        parts = [FED_ID.match(t).groups() for t in task_ids]  # type: ignore[union-attr]
        numbers = sorted({number for number, _, _ in parts})
        pipe = self.redis.pipeline(transaction=False)
        for number in numbers:
            pipe.get(self.keys.job_ref(number))
        jobs = dict(zip(numbers, pipe.execute(), strict=True))
        pipe = self.redis.pipeline(transaction=False)
        for number, claim, _ in parts:
            pipe.hget(self.keys.job_custom_ids(jobs[number] or "-"), claim)
        records = pipe.execute()
        found: list[Folded | None] = []
        for (_, _, submission), record in zip(parts, records, strict=True):
            folded = Folded.parse(str(record)) if record else None
            ok = folded is not None and folded.submission == submission and folded.state
            found.append(folded if ok else None)
        return found


# A hash without a state was made by the pull of a plain send_task message: it is queued.
_STATES: dict[str | None, TaskState] = {s.value: s for s in TaskState}


def with_state(fields: dict[str, str]) -> dict[str, str]:
    """A task enqueued by a plain ``send_task`` has a hash (its delivery count) before its
    first transition: it is queued."""
    fields.setdefault("state", TaskState.QUEUED.value)
    return fields


def _ids(moves: Sequence[Move]) -> list[str]:
    return [m.task_id for m in moves]


def _moved(moves: Sequence[Move], reply: Sequence[Any]) -> list[Moved]:
    """Each move's outcome from the script's flat reply: previous state, moved, held and
    current delivery, four values a move (tasks.lua, reply_row)."""
    rows = [reply[at : at + 4] for at in range(0, len(reply), 4)]
    return [
        Moved(m.task_id, str(r[0]), bool(int(r[1])), bool(int(r[2])), str(r[3] or ""), m.token or 0)
        for m, r in zip(moves, rows, strict=True)
    ]


def _fields(names: Iterable[str], values: Sequence[str | None]) -> dict[str, str]:
    out = {n: v for n, v in zip(names, values, strict=True) if v is not None}
    return out if out else {"state": TaskState.UNKNOWN.value}
