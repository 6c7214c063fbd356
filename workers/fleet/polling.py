"""The polling loop every worker runs (a GPU worker's batch loop, a prepare worker's loop):
the fleet's chores, then one step, until stopped; it backs off while there is nothing to do,
and rides Redis outages out instead of exiting (as does :func:`when_answered` for one call)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.workers.fleet.clock import Backoff
from vlmq.workers.fleet.housekeeping import Housekeeper

__all__ = ["poll_until_stopped", "when_answered"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def poll_until_stopped(
    step: Callable[[], bool],
    housekeeper: Housekeeper,
    stop: threading.Event,
    idle_s: tuple[float, float],
) -> None:
    """Run ``step`` (True: it found work) until ``stop`` is set, housekeeping first each
    time. Redis restarted, unreachable, loading, read-only or full: what the worker holds stays
    leased (or is swept back by then), and it retries until Redis answers. Any other error
    propagates (the worker exits and its leases lapse)."""
    backoff = Backoff(idle_s)
    while not stop.is_set():
        try:
            housekeeper.tick()
            busy = step()
        except TRANSIENT_REDIS_ERRORS as exc:
            wait = backoff.outage()
            log.warning("Redis %s; retrying in %.1fs", type(exc).__name__, wait)
            stop.wait(wait)
            continue
        backoff.answered()
        if busy:
            backoff.worked()
        else:
            stop.wait(backoff.idle())


def when_answered(call: Callable[..., _T], stop: threading.Event, *args: Any) -> _T:
    """``call(*args)`` (a call safe to repeat), retried while Redis does not answer; raises
    once ``stop`` is set."""
    backoff = Backoff((0.0, 0.0))  # (its outage pauses only)
    while True:
        try:
            return call(*args)
        except TRANSIENT_REDIS_ERRORS as exc:
            if stop.is_set():
                raise
            wait = backoff.outage()
            log.warning("Redis %s; retrying in %.1fs", type(exc).__name__, wait)
            stop.wait(wait)
