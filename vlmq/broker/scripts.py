"""vlmq's Lua behind one dispatch: ``lua/`` holds one file per concern, this runs them.

The files (intake and leases, jobs and feeds, tasks: moves and settle, tenants, events) are
concatenated in a fixed order into one script, whose last part (``lua/dispatch.lua``) runs
the command ARGV[1] names. The source is registered twice: with a plain ``#!lua`` shebang
(refused, whole, while Redis is over ``maxmemory``: a pull or a status write never
half-applies) and with ``flags=allow-oom`` for the commands that free memory or keep it level
(settle, give back, reap, renew), so a full Redis still lets the fleet finish what it holds.
Redis's own replies under ``maxmemory`` were measured: a script without a shebang runs until
its first denied write and stops there (a pull could pop a message and lose it), and in a
MULTI even an allow-oom script is refused, so the terminal transitions and the
acknowledgements are one command (``settle``), not a transaction.

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
``VLMQ_FLEET__SETTLE_WAIT_REPLICAS``): EVALSHA and WAIT go in one non-transactional pipeline, so
on one connection, and WAIT counts the replicas that have this very call's writes. Fewer
replicas than asked is logged and reported (``Wait.on_short``), never raised: the write is done
on the master, only its copy is late.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from vlmq.config.keys import Keys

__all__ = ["ALLOW_OOM", "REPLAYED", "Call", "Scripts", "Wait"]

log = logging.getLogger(__name__)

# The concerns' files, in the order their definitions depend on each other.
LUA_FILES = ("common", "tenants", "intake", "jobs", "tasks", "events", "dispatch")

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


def source() -> str:
    """The one script: every concern's file, then the dispatch."""
    lua = resources.files("vlmq.broker").joinpath("lua")
    return "\n".join(lua.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in LUA_FILES)


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
        text = source()
        self.redis = redis
        self.keys = keys
        self.replay_ttl_s = replay_ttl_s
        self._guarded = redis.register_script("#!lua\n" + text)
        self._oom_safe = redis.register_script("#!lua flags=allow-oom\n" + text)

    def __call__(
        self,
        command: str,
        keys: Sequence[str],
        args: Sequence[Any],
        pipe: Any = None,
        wait: Wait | None = None,
        call: Call | None = None,
    ) -> Any:
        """Run ``command``; one not safe to repeat gets a call id (``call``'s, else a new one)."""
        script = self._oom_safe if command in ALLOW_OOM else self._guarded
        argv = [command, *args, *self._replay(command, call)]
        if wait is not None and wait.replicas > 0 and pipe is None:
            return self._then_wait(script, keys, argv, wait)
        if pipe is not None:
            return script(keys=list(keys), args=argv, client=pipe)
        try:
            return script(keys=list(keys), args=argv, client=self.redis)
        except NoScriptError:
            # The node changed between redis-py's load and its second EVALSHA (a failover: a
            # retry reached the new master, which has no scripts); the script did not run.
            return script(keys=list(keys), args=argv, client=self.redis)

    def _replay(self, command: str, call: Call | None) -> list[Any]:
        """The dispatch's own two arguments: the call's replay key and its ttl."""
        if command not in REPLAYED:
            return ["", 0]
        return [self.keys.call((call or Call()).id), self.replay_ttl_s]

    def _then_wait(self, script: Script, keys: Sequence[str], argv: list[Any], wait: Wait) -> Any:
        """The script, then WAIT, on one connection (a pipeline without MULTI: in a MULTI an
        allow-oom script is refused under maxmemory, and WAIT is pointless)."""
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *argv)
            pipe.execute_command("WAIT", wait.replicas, wait.timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 1:
                # A Redis that restarted or failed over to a replica that never loaded it;
                # the script did not run, so loading it and running it again is safe.
                self.redis.script_load(script.script)
                continue
            if isinstance(reply, Exception):
                raise reply
            self._check_wait(str(argv[0]), acked, wait)
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
