"""vlmq's Lua behind one dispatch: ``scripts.lua`` holds every command, this runs them.

The source is registered twice: with a plain ``#!lua`` shebang (refused, whole, while Redis is
over ``maxmemory``: a pull or a status write never half-applies) and with ``flags=allow-oom``
for the commands that free memory or keep it level (settle, give back, reap, renew), so a full
Redis still lets the fleet finish what it holds. Redis's own replies under ``maxmemory`` were
measured: a script without a shebang runs until its first denied write and stops there (a pull
could pop a message and lose it), and in a MULTI even an allow-oom script is refused, so the
terminal transitions and the acknowledgements are one command (``settle``), not a transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis import Redis

__all__ = ["ALLOW_OOM", "Scripts"]

# Commands that run while Redis is over maxmemory.
ALLOW_OOM = frozenset(
    {"settle", "ack", "give_back", "reap", "renew", "renew_event", "return_events", "reap_events"}
)


def _source() -> str:
    return resources.files("vlmq.config").joinpath("scripts.lua").read_text(encoding="utf-8")


class Scripts:
    def __init__(self, redis: Redis) -> None:
        source = _source()
        self.redis = redis
        self._guarded = redis.register_script("#!lua\n" + source)
        self._oom_safe = redis.register_script("#!lua flags=allow-oom\n" + source)

    def __call__(
        self, command: str, keys: Sequence[str], args: Sequence[Any], pipe: Any = None
    ) -> Any:
        script = self._oom_safe if command in ALLOW_OOM else self._guarded
        return script(keys=list(keys), args=[command, *args], client=pipe or self.redis)
