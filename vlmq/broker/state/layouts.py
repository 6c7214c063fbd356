"""The task layout in force, and the fleet-wide switch that raises it (``vlmq layout``;
vlmq/broker/layouts.py says why, ``lua/layouts.lua`` does it). The layouts a process reads
are its library's (``Scripts.reads``, ``Scripts.newest``)."""

from __future__ import annotations

from typing import Any

import redis as redis_py

from vlmq.broker.scripts import Scripts
from vlmq.config.errors import ConfigError, LayoutUnreadable
from vlmq.config.keys import Keys

__all__ = ["Layouts", "check_readable"]


def _layout(raw: Any) -> int | None:
    """``Keys.layout``'s value as read (absent: layout 1; None: not a layout, which nothing
    reads, as the Lua's ``layout_refusal`` has it)."""
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        return None


def check_readable(raw: Any, newest: int) -> None:
    """Raises :class:`LayoutUnreadable` unless a version whose newest layout is ``newest``
    reads the layout in force (``raw``: ``Keys.layout``'s value, read with what it guards): a
    plain read of a task by a process of an older version must not misreport what it cannot
    understand."""
    in_force = _layout(raw)
    if in_force is None or in_force > newest:
        raise LayoutUnreadable(
            f"layout {raw} is in force and this version of vlmq reads layouts up to "
            f"{newest}: update this process (docs/deploy.md, Upgrades)"
        )


class Layouts:
    def __init__(self, redis: redis_py.Redis, scripts: Scripts, keys: Keys) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys

    @property
    def reads(self) -> tuple[int, ...]:
        """The layouts this version reads (its library's: a worker's record lists them)."""
        return self.scripts.reads

    def in_force(self) -> int:
        """The layout in force: a plain read, so any version can tell which it is."""
        raw = self.redis.get(self.keys.layout())
        in_force = _layout(raw)
        if in_force is None:
            raise ConfigError(f"{self.keys.layout()} holds {raw!r}, not a layout")
        return in_force

    def check(self) -> None:
        """Raises :class:`LayoutUnreadable` when this version cannot read the layout in force
        (before a worker loads its model; every library call checks it too)."""
        check_readable(self.redis.get(self.keys.layout()), self.scripts.newest)

    def raise_to(self, layout: int) -> tuple[int, list[str]]:
        """Puts ``layout`` in force unless a live worker's record does not list it; returns
        the layout in force after the call and the workers that kept it from being raised
        (none: it is in force). Never lowers one."""
        if layout not in self.reads:
            raise ConfigError(
                f"this version of vlmq reads layouts {list(self.reads)}, not {layout}"
            )
        keys = [self.keys.layout(), self.keys.workers()]
        in_force, behind = self.scripts("raise_layout", keys, [layout])
        return int(in_force), list(behind)
