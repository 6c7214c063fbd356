"""vlmq's Lua behind one dispatch: ``lua/`` holds one file per concern, this runs them.

The files (intake and leases, jobs and feeds, tasks: moves and settle, tenants, events) are
concatenated in a fixed order into one Redis function library, whose last part
(``lua/dispatch.lua``) runs the command ARGV[1] names. A library, not a script: EVALSHA runs a
script's whole text each call (defining every function and table: ~177,000 instructions, more
than a task's settle), FCALL calls a function the library defined once, at ``FUNCTION LOAD``.
The library is named for its text (:func:`library`), so each version's functions are its own
and two versions of vlmq share a Redis during a rolling update. It persists with Redis's data
and reaches replicas as a write does; a Redis without it (new, restarted without persistence,
flushed) answers "Function not found", and the call loads it and runs again (it did not run).
A library takes ~300 KB of Redis memory, so versions do not pile up: each process records
hourly that its version is in use (``Keys.libraries``), and one that loads a version deletes
the vlmq libraries nobody used for :data:`STALE_LIBRARY_S`.

Each command is registered twice: plain (refused, whole, while Redis is over ``maxmemory``: a
pull or a status write never half-applies) and with ``flags=allow-oom`` for the commands that
free memory or keep it level (settle, give back, reap, renew), so a full Redis still lets the
fleet finish what it holds. Redis's own replies under ``maxmemory`` were measured: a script
without a shebang runs until its first denied write and stops there (a pull could pop a
message and lose it), and in a MULTI even an allow-oom script is refused, so the terminal
transitions and the acknowledgements are one command (``settle``), not a transaction.

**Every call is safe to repeat.** redis-py resends a command whose reply a connection reset
lost (``vlmq/broker/connection.py``: the command ran, the reply did not arrive), and callers retry
on their own after a timeout. The commands that are safe to repeat by construction run as
they are: renew, ack, give back, hand back and reap (fenced by the holder's token), seal, the event
leases, and settle (a task it already ended reads as this holder's: moved no further, counted
once, its object kept). Every other one (:data:`REPLAYED`) carries a call id: the script
keeps its first reply under ``Keys.call(id)`` for ``replay_ttl_s``, written in the same atomic
step as its effect, and a retry of that call answers it without changing anything. redis-py's
own resend reuses the id (it resends the same arguments); a caller that retries on its own
passes the same :class:`Call` again.

A call may be followed by ``WAIT replicas timeout`` (:class:`Wait`; the worker's settle with
``VLMQ_FLEET__SETTLE_WAIT_REPLICAS``): FCALL and WAIT go in one non-transactional pipeline, so
on one connection, and WAIT counts the replicas that have this very call's writes. Fewer
replicas than asked is logged and reported (``Wait.on_short``), never raised: the write is done
on the master, only its copy is late.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from vlmq.broker import layouts
from vlmq.config.errors import LayoutUnreadable
from vlmq.config.keys import JOB_SUFFIXES, Keys

__all__ = ["ALLOW_OOM", "REPLAYED", "Call", "Scripts", "Wait", "library"]

log = logging.getLogger(__name__)

# The concerns' files, in the order their definitions depend on each other.
LUA_FILES = ("common", "layouts", "tenants", "intake", "jobs", "tasks", "events", "dispatch")

# Every vlmq library's name starts so (the rest: its text's digest).
LIBRARY_PREFIX = "vlmq_"
# A library that no process has used for this long is deleted when another version loads.
STALE_LIBRARY_S = 7 * 24 * 3600
# How often a process records that its library is in use (so it is never stale while used).
IN_USE_EVERY_S = 3600

# Commands that run while Redis is over maxmemory.
ALLOW_OOM = frozenset(
    {
        "settle",
        "ack",
        "give_back",
        "hand_back",
        "reap",
        "hand_on",
        "renew",
        "renew_event",
        "return_events",
        "reap_events",
        "done_event",
        "retire",
    }
)

# Commands that are not safe to repeat: each call carries a call id (the module's docstring).
REPLAYED = frozenset(
    {
        "pull",
        "transition",
        "dead_letter",
        "submit",
        "enqueue",
        "register_feed",
        "take_feeds",
        "drop_feed",
        "feed",
        "rate",
        "take_events",
    }
)

# How long a call's reply is kept for a retry of it: redis-py resends within seconds (five
# tries, backoff capped at 1 s); a Sentinel failover that outlasts them surfaces as an error
# and the caller makes a new call. Kept longer, the replies would cost Redis memory in
# proportion to the fleet's rate (a pull's is ~40 bytes per message).
REPLAY_TTL_S = 60


def job_keys() -> str:
    """The Lua's table of a job's key suffixes, ``JOB_KEYS`` (config/keys.py JOB_SUFFIXES): a
    script that learns a task's job appends them to the job's name, spelled in keys.py only."""
    entries = ", ".join(f"{name} = '{suffix}'" for name, suffix in JOB_SUFFIXES.items())
    comment = "-- a job's own keys: its name plus these (config/keys.py)"
    return f"{comment}\nlocal JOB_KEYS = {{{entries}}}"


def layout() -> str:
    """The Lua's ``LAYOUT``: the newest task layout this version reads and writes
    (vlmq/broker/layouts.py); the dispatch refuses every call while a newer one is in force."""
    comment = "-- the newest task layout this library reads (vlmq/broker/layouts.py)"
    return f"{comment}\nlocal LAYOUT = {layouts.NEWEST}"


def source() -> str:
    """The one script: the job key suffixes and the layout, every concern's file, then the
    dispatch."""
    lua = resources.files("vlmq.broker").joinpath("lua")
    files = (lua.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in LUA_FILES)
    return "\n".join((job_keys(), layout(), *files))


def library(text: str | None = None) -> tuple[str, str]:
    """The library's name (``vlmq_`` and its text's digest) and its ``FUNCTION LOAD`` text:
    the concerns' files (``text``: as given, else :func:`source`), then the registration of
    its two functions, ``NAME`` and ``NAME_oom`` (lua/dispatch.lua)."""
    text = source() if text is None else text
    name = LIBRARY_PREFIX + hashlib.sha1(text.encode()).hexdigest()[:16]
    return name, f"#!lua name={name}\n{text}\nregister('{name}')\n"


def _library_names(listed: Any) -> set[str]:
    """The names in ``FUNCTION LIST``'s reply: one flat field/value list per library (RESP2,
    decoded: how create_redis connects)."""
    return {dict(zip(entry[::2], entry[1::2], strict=True))["library_name"] for entry in listed}


def _missing(error: Any) -> bool:
    """Redis's answer to FCALL of a function it does not have (the call did not run)."""
    return isinstance(error, ResponseError) and "function not found" in str(error).lower()


# The first word of the dispatch's refusal while a newer layout is in force (lua/layouts.lua).
_LAYOUT_REFUSED = "UNREADABLE "


def _layout_refusal(error: Any) -> LayoutUnreadable | None:
    """The library's refusal while a newer layout is in force (the call did not run), or
    None for any other error or reply."""
    if not isinstance(error, ResponseError) or not str(error).startswith(_LAYOUT_REFUSED):
        return None
    return LayoutUnreadable(str(error).removeprefix(_LAYOUT_REFUSED))


class Call:
    """One logical call of a command that is not safe to repeat: its id names the reply the
    first run keeps. A caller that retries on its own (a settle after a timeout) passes the
    same Call again; a new Call is a new call."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = secrets.token_hex(10)


@dataclass(frozen=True)
class Wait:
    """``WAIT replicas timeout_ms`` after a call; ``on_short(acked)`` when fewer replicas
    acknowledged it in time."""

    replicas: int
    timeout_ms: int
    on_short: Callable[[int], None] | None = None


class Scripts:
    def __init__(self, redis: Redis, keys: Keys, replay_ttl_s: int = REPLAY_TTL_S) -> None:
        self.redis = redis
        self.keys = keys
        self.replay_ttl_s = replay_ttl_s
        self.name, self.code = library()
        # The task layouts this version reads, and the newest (its library's LAYOUT).
        self.reads, self.newest = layouts.READS, layouts.NEWEST
        self._in_use_due = 0.0  # (monotonic) when to record the library in use next

    def __call__(
        self,
        command: str,
        keys: Sequence[str],
        args: Sequence[Any],
        wait: Wait | None = None,
        call: Call | None = None,
    ) -> Any:
        """Run ``command``; one not safe to repeat gets a call id (``call``'s, else a new one)."""
        if time.monotonic() >= self._in_use_due:
            self._record_in_use()
        function = f"{self.name}_oom" if command in ALLOW_OOM else self.name
        argv = [function, len(keys), *keys, command, *args, *self._dispatch_args(command, call)]
        if wait is not None and wait.replicas > 0:
            return self._then_wait(command, argv, wait)
        try:
            return self._fcall(argv)
        except ResponseError as error:
            refusal = _layout_refusal(error)
            if refusal is None:
                raise
            raise refusal from None

    def _fcall(self, argv: list[Any]) -> Any:
        """FCALL; a Redis without this version's library gets it loaded first (the call did
        not run)."""
        try:
            return self.redis.execute_command("FCALL", *argv)
        except ResponseError as error:
            if not _missing(error):
                raise
        self.load()
        return self.redis.execute_command("FCALL", *argv)

    def load(self) -> None:
        """Loads this version's library into Redis (another process may have just done so),
        then deletes the vlmq libraries that are stale (:meth:`_prune`)."""
        try:
            self.redis.execute_command("FUNCTION LOAD", self.code)
        except ResponseError as error:
            if "already exists" not in str(error):
                raise
        self._prune()

    def _record_in_use(self) -> None:
        """Records, at most once an hour, that this library is in use: a process that runs
        for weeks keeps its version from being pruned under it (a full Redis refuses a
        ``FUNCTION LOAD``, so a library pruned then could not be loaded again until memory
        frees). Refused (a full Redis), it is tried again in a minute."""
        try:
            now = int(self.redis.time()[0])
            self.redis.hset(self.keys.libraries(), self.name, now)
        except ResponseError:
            self._in_use_due = time.monotonic() + 60
            return
        self._in_use_due = time.monotonic() + IN_USE_EVERY_S

    def _prune(self) -> None:
        """Deletes the vlmq libraries, other than this one, that no process used for
        :data:`STALE_LIBRARY_S`. ``Keys.libraries`` holds when each was last recorded in use
        (:meth:`_record_in_use`, hourly, this process's own at its first call) or first seen
        here; a process of a pruned version (one stopped for a week, then started again)
        loads it again at its next call."""
        registry = self.keys.libraries()
        now = int(self.redis.time()[0])
        loaded = {name: int(seen) for name, seen in self.redis.hgetall(registry).items()}
        present = _library_names(
            self.redis.execute_command("FUNCTION LIST", "LIBRARYNAME", LIBRARY_PREFIX + "*")
        )
        for name in present - {self.name}:
            if name not in loaded:
                self.redis.hsetnx(registry, name, now)
            elif now - loaded[name] > STALE_LIBRARY_S:
                self.redis.execute_command("FUNCTION DELETE", name)
                self.redis.hdel(registry, name)
                log.info(
                    "deleted the vlmq library %s (not used for %d s)", name, now - loaded[name]
                )
        gone = set(loaded) - present - {self.name}
        if gone:
            self.redis.hdel(registry, *gone)

    def _dispatch_args(self, command: str, call: Call | None) -> list[Any]:
        """The dispatch's own three arguments: the layout key, the call's replay key and its
        ttl."""
        if command not in REPLAYED:
            return [self.keys.layout(), "", 0]
        return [self.keys.layout(), self.keys.call((call or Call()).id), self.replay_ttl_s]

    def _then_wait(self, command: str, argv: list[Any], wait: Wait) -> Any:
        """The call, then WAIT, on one connection (a pipeline without MULTI: in a MULTI an
        allow-oom function is refused under maxmemory, and WAIT is pointless)."""
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            pipe.execute_command("FCALL", *argv)
            pipe.execute_command("WAIT", wait.replicas, wait.timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            if attempt == 1 and _missing(reply):
                # A Redis that restarted or failed over to a replica that never had it; the
                # call did not run, so loading the library and running it again is safe.
                self.load()
                continue
            refusal = _layout_refusal(reply)
            if refusal is not None:
                raise refusal from None
            if isinstance(reply, Exception):
                raise reply
            self._check_wait(command, acked, wait)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _check_wait(command: str, acked: Any, wait: Wait) -> None:
        count = acked if isinstance(acked, int) else 0
        if count >= wait.replicas:
            return
        why = f"WAIT failed ({acked})" if isinstance(acked, Exception) else f"{count} acknowledged"
        log.warning(
            "%s is on the master but not yet on %d replica(s) after %d ms (%s); going on",
            command,
            wait.replicas,
            wait.timeout_ms,
            why,
        )
        if wait.on_short is not None:
            wait.on_short(count)
