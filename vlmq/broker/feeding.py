"""Feeding a job's staged input into Redis, a window at a time, exactly once.

A bulk submission validates its input once (producers/bulk.py) and stores the valid lines,
normalised, as one object in the store; the job counts them all from the start (a line not
yet fed reads ``queued``). A ``Feeder`` then turns lines into tasks only while the job has
fewer than ``window`` tasks in Redis, so a 10-million-line job holds a window of messages and
status hashes, not 10 million, and refills as tasks finish.

Exactly once: a chunk is applied by one script (``feed``) only if the feed's cursor (a byte
offset into the input) is still where this feeder read from, and the cursor moves in the same
step. A feeder that dies mid-chunk changed nothing; the next one (any worker, after the feed's
lease lapses) reads the same lines again from the same offset. Two feeders racing on one feed
apply each chunk once: the loser's script sees a moved cursor ('stale') and stops.

The submitter feeds the first window itself (a small job is all in Redis when ``vlmq
submit`` returns); every worker runs a ``Feeder`` on a thread of its own for the rest
(docs/design.md says why there and not in a process of its own).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.broker.memory import MemoryGauge
from vlmq.broker.state import State
from vlmq.broker.state.jobs import Queued
from vlmq.config.ids import claim_of, fed_task_id
from vlmq.config.jsonl import LineError
from vlmq.config.settings import FleetSettings
from vlmq.config.status import TaskState
from vlmq.config.wire import encode_message
from vlmq.stores.base import ObjectStore

__all__ = ["FeedCounts", "FeedLine", "Feeder"]

log = logging.getLogger(__name__)


_BODY = b',"r":'


@dataclass(frozen=True)
class FeedLine:
    """One line of a staged input (producers/bulk.py ``_normalised``): its line number,
    custom_id, class, and the request's fields as the JSON object text they were stored as."""

    number: int
    custom_id: str
    modality: str
    body: str

    @classmethod
    def parse(cls, raw: bytes) -> FeedLine:
        # The request is spliced into its message as stored, not parsed and dumped again: the
        # head before it is all that is read (a key in a JSON string has its quotes escaped,
        # so the first ',"r":' is the key).
        at = raw.find(_BODY)
        if at < 0 or not raw.endswith(b"}"):
            record = json.loads(raw)
            body = json.dumps(record["r"], ensure_ascii=False, separators=(",", ":"))
        else:
            record = json.loads(raw[:at] + b"}")
            body = raw[at + len(_BODY) : -1].decode()
        if not body.startswith("{"):
            raise ValueError("the request is not an object")
        return cls(int(record["n"]), str(record["c"]), str(record["m"]), body)

    def request_json(self, task_id: str, job_id: str) -> str:
        """The request as it is enqueued: its stored fields plus its task, job and custom_id."""
        named = json.dumps(
            {"id": task_id, "job_id": job_id, "custom_id": self.custom_id},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        rest = self.body[1:]
        return named[:-1] + ("," + rest if rest != "}" else "}")


@dataclass
class FeedCounts:
    enqueued: int = 0
    skipped: int = 0
    duplicates: int = 0

    def add(self, codes: list[str]) -> None:
        self.enqueued += codes.count("q")
        self.skipped += codes.count("s")
        self.duplicates += codes.count("d")


@dataclass
class _Job:
    """What feeding a job needs to know, read once per feed call."""

    job_id: str
    number: str
    expires: datetime | None
    live: int  # its tasks in Redis that have not ended
    live_bytes: int = 0  # about what their messages take


@dataclass
class Room:
    """What a job's window has left this turn: lines and message bytes."""

    lines: int
    bytes: int


class Feeder:
    """Feeds jobs from their staged inputs while each job's Redis share has room: at most
    ``window`` live tasks and about ``window_bytes`` of their messages (a job whose lines
    carry inline media fills its window by bytes long before by count), and nothing while
    Redis is over ``max_memory_share`` of its ``maxmemory`` (``memory``)."""

    def __init__(
        self,
        state: State,
        store: ObjectStore,
        window: int,
        chunk: int = 2000,
        lease_s: float = 60.0,
        max_line_errors: int = 1000,
        window_bytes: int = 256 * 2**20,
        memory: MemoryGauge | None = None,
        max_memory_share: float = 0.8,
    ) -> None:
        self.state = state
        self.keys = state.keys
        self.store = store
        self.window = window
        self.window_bytes = window_bytes
        self.chunk = chunk
        self.lease_s = lease_s
        self.max_line_errors = max_line_errors
        self.memory = memory or MemoryGauge()
        self.max_memory_share = max_memory_share

    @classmethod
    def for_fleet(
        cls, state: State, store: ObjectStore, fleet: FleetSettings, chunk: int = 2000
    ) -> Feeder:
        """A feeder with the fleet's windows, lease, error cap and memory share (submitters
        and workers)."""
        return cls(
            state,
            store,
            fleet.feed_window,
            chunk,
            fleet.feed_lease_s,
            fleet.max_line_errors,
            fleet.feed_window_bytes,
            max_memory_share=fleet.feed_max_memory_share,
        )

    # the fleet's loop ------------------------------------------------------
    def run_once(self, limit: int = 16) -> int:
        """Lease feeds nobody is feeding, top each job up to its window; lines fed."""
        fed = 0
        for feed_id in self.state.feeds.take(self.lease_s, limit):
            try:
                fed += self.feed(feed_id).enqueued
            finally:
                self.state.feeds.release(feed_id)
        return fed

    # one feed --------------------------------------------------------------
    def feed(self, feed_id: str, most: int | None = None) -> FeedCounts:
        """Feed ``feed_id`` until its job's window is full (by count or bytes), its input
        ends, Redis is too full, or another feeder moved it on; at most ``most`` lines."""
        counts = FeedCounts()
        state = self.state.feeds.state(feed_id)
        job = self._job(state["job"]) if state else None
        if job is None:
            return counts
        room = Room(self.window - job.live, self.window_bytes - job.live_bytes)
        if most is not None:
            room.lines = min(room.lines, most)
        cursor, lane = int(state["cursor"]), state.get("lane") or "bulk"
        lines = self.store.lines(state["input"], cursor)
        while room.lines > 0 and room.bytes > 0 and not self._redis_full():
            chunk = list(islice(lines, min(room.lines, self.chunk)))
            if not chunk:
                if counts.enqueued + counts.skipped + counts.duplicates == 0:
                    self._lost_input(job.job_id, feed_id, state)
                break
            outcome, codes, taken = self._apply(job, feed_id, lane, cursor, chunk, room)
            if outcome != "fed":
                break
            counts.add(codes)
            cursor = taken
            if taken != chunk[-1][0]:
                break  # the byte window is full: the rest of the chunk is read again next time
        return counts

    def _redis_full(self) -> bool:
        """Redis is over the share of maxmemory feeding leaves to the rest of the fleet."""
        try:
            return self.memory.share(self.state.redis) >= self.max_memory_share
        except TRANSIENT_REDIS_ERRORS:
            return True

    def _apply(
        self,
        job: _Job,
        feed_id: str,
        lane: str,
        cursor: int,
        chunk: list[tuple[int, bytes]],
        room: Room,
    ) -> tuple[str, list[str], int]:
        """Feed the head of ``chunk`` that fits ``room``; returns the outcome, per line codes
        and the cursor after the lines it took."""
        submission = feed_id.partition(".")[2]
        taken: list[tuple[FeedLine | None, Queued | None]] = []
        spent, end = 0, cursor
        for offset, raw in chunk:
            line = self._parse(raw, feed_id)
            queued = self._queued(job, line, submission, lane) if line is not None else None
            size = len(queued.message) if queued is not None else 0
            # One line at least, whatever its size: a line larger than the window runs alone.
            if taken and spent + size > room.bytes:
                break
            taken.append((line, queued))
            spent, end = spent + size, offset
        valid = [(line, queued) for line, queued in taken if queued is not None]
        span = (str(cursor), str(end))
        queued_lines = [q for _, q in valid if q is not None]
        outcome, codes = self.state.feeds.feed(
            job.job_id, feed_id, span, len(taken), queued_lines, lane
        )
        if outcome == "fed":
            room.lines -= len(taken)
            room.bytes -= spent
            duplicates = [
                _duplicate(line)
                for (line, _), code in zip(valid, codes, strict=True)
                if code == "d" and line is not None
            ]
            self.state.jobs.record_line_errors(job.job_id, duplicates, self.max_line_errors)
        return outcome, codes, end

    def _lost_input(self, job_id: str, feed_id: str, state: dict[str, str]) -> None:
        """Lines are left but the input has none from the cursor on (the object was removed
        from the store, or cut short): they cannot run, and the job must still finish."""
        if self.store.size(state["input"]) is not None and int(state.get("left") or 0) <= 0:
            return
        log.error("feed %s: its input %s is gone; its unfed lines fail", feed_id, state["input"])
        self.state.feeds.drop(job_id, feed_id, TaskState.FAILED)

    def _parse(self, raw: bytes, feed_id: str) -> FeedLine | None:
        try:
            return FeedLine.parse(raw)
        except (ValueError, KeyError, TypeError):
            # The input was written by the validation pass; a line it cannot read back is a
            # damaged object: counted out of the job (lua/jobs.lua), never fed.
            log.error("feed %s: an unreadable line in its staged input was skipped", feed_id)
            return None

    def _job(self, job_id: str) -> _Job | None:
        fields = ("seq", "expires_at", "queued", "running", "unfed", "fed_bytes", "fed_lines")
        values = self.state.redis.hmget(self.keys.job(job_id), fields)
        seq, expires_at, queued, running, unfed, fed_bytes, fed_lines = values
        if seq is None:
            return None
        expires = datetime.fromtimestamp(float(expires_at), tz=timezone.utc) if expires_at else None
        live = int(queued or 0) + int(running or 0) - int(unfed or 0)
        # Its live tasks' bytes, at the mean size of the messages fed so far (the messages
        # themselves are not counted one by one as they leave).
        mean = int(fed_bytes or 0) / max(1, int(fed_lines or 0))
        return _Job(job_id, str(seq), expires, live, int(live * mean))

    def _queued(self, job: _Job, line: FeedLine, submission: str, lane: str) -> Queued:
        claim = claim_of(line.custom_id)
        task_id = fed_task_id(job.number, claim, submission)
        queue = self.keys.lane_queue(line.modality, lane, job.job_id)
        wire = line.request_json(task_id, job.job_id)
        message = encode_message(wire, task_id, queue, expires=job.expires)
        # (no "queue": a fed task's is its job's list for its class, and the lease records
        # where a held message came from)
        fields = {
            "job_id": job.job_id,
            "custom_id": line.custom_id,
            "modality": line.modality,
            "expires_at": f"{job.expires.timestamp():.3f}" if job.expires else None,
            "claim": claim,
        }
        return Queued(task_id, line.custom_id, line.modality, fields, message)


def _duplicate(line: FeedLine) -> LineError:
    custom_id = line.custom_id
    return LineError(
        line.number,
        custom_id,
        "duplicate_custom_id",
        f"custom_id {custom_id[:80]!r} appears more than once",
    )
