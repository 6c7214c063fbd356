"""vlmq's Lua behind one dispatch: ``scripts.lua`` holds every command, this runs them.

The source is registered twice: with a plain ``#!lua`` shebang (refused, whole, while Redis is
over ``maxmemory``: a pull or a status write never half-applies) and with ``flags=allow-oom``
for the commands that free memory or keep it level (settle, give back, reap, renew), so a full
Redis still lets the fleet finish what it holds. Redis's own replies under ``maxmemory`` were
measured: a script without a shebang runs until its first denied write and stops there (a pull
could pop a message and lose it), and in a MULTI even an allow-oom script is refused, so the
terminal transitions and the acknowledgements are one command (``settle``), not a transaction.

A call may be followed by ``WAIT replicas timeout`` (:class:`Wait`; the worker's settle with
``VLMQ_FLEET__SETTLE_WAIT_REPLICAS``): EVALSHA and WAIT go in one non-transactional pipeline, so
on one connection, and WAIT counts the replicas that have this very call's writes. Fewer
replicas than asked is logged and reported (``Wait.on_short``), never raised: the write is done
on the master, only its copy is late.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

__all__ = ["ALLOW_OOM", "Scripts", "Wait"]

log = logging.getLogger(__name__)

# Commands that run while Redis is over maxmemory.
ALLOW_OOM = frozenset(
    {"settle", "ack", "give_back", "reap", "renew", "renew_event", "return_events", "reap_events"}
)


def _source() -> str:
    return resources.files("vlmq.config").joinpath("scripts.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Wait:
    """``WAIT replicas timeout_ms`` after a call; ``on_short(acked)`` when fewer replicas
    acknowledged it in time."""

    replicas: int
    timeout_ms: int
    on_short: Callable[[int], None] | None = None


class Scripts:
    def __init__(self, redis: Redis) -> None:
        source = _source()
        self.redis = redis
        self._guarded = redis.register_script("#!lua\n" + source)
        self._oom_safe = redis.register_script("#!lua flags=allow-oom\n" + source)

    def __call__(
        self,
        command: str,
        keys: Sequence[str],
        args: Sequence[Any],
        pipe: Any = None,
        wait: Wait | None = None,
    ) -> Any:
        script = self._oom_safe if command in ALLOW_OOM else self._guarded
        if wait is not None and wait.replicas > 0 and pipe is None:
            return self._then_wait(script, command, keys, args, wait)
        if pipe is not None:
            return script(keys=list(keys), args=[command, *args], client=pipe)
        try:
            return script(keys=list(keys), args=[command, *args], client=self.redis)
        except NoScriptError:
            # The node changed between redis-py's load and its second EVALSHA (a failover: a
            # retry reached the new master, which has no scripts); the script did not run.
            return script(keys=list(keys), args=[command, *args], client=self.redis)

    def _then_wait(
        self, script: Script, command: str, keys: Sequence[str], args: Sequence[Any], wait: Wait
    ) -> Any:
        """The script, then WAIT, on one connection (a pipeline without MULTI: in a MULTI an
        allow-oom script is refused under maxmemory, and WAIT is pointless)."""
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, command, *args)
            pipe.execute_command("WAIT", wait.replicas, wait.timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 1:
                # A Redis that restarted or failed over to a replica that never loaded it;
                # the script did not run, so loading it and running it again is safe.
                self.redis.script_load(script.script)
                continue
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
