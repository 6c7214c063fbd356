"""What this worker holds: the deliveries it has leases on, renewed by its heartbeat.

The pulls, leases and settles themselves are the state layer's (``vlmq/broker/state/intake.py``,
``vlmq/broker/state/tasks.py``); this is the worker's own, in-memory side of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from vlmq.broker.state.intake import Delivery, Leases

__all__ = ["Held"]

log = logging.getLogger(__name__)


class Held:
    """The deliveries this worker holds leases on (task id -> token), renewed by its
    heartbeat until they are settled, given back or found lost."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, deliveries: Iterable[Delivery]) -> None:
        with self._lock:
            self._tokens.update((d.task_id, d.token) for d in deliveries)

    def release(self, task_ids: Iterable[str]) -> None:
        with self._lock:
            for task_id in task_ids:
                self._tokens.pop(task_id, None)

    def tokens(self, task_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Held ids and their tokens (all, or those of ``task_ids`` still held)."""
        with self._lock:
            if task_ids is None:
                return dict(self._tokens)
            return {i: self._tokens[i] for i in task_ids if i in self._tokens}

    def renew(self, leases: Leases, lease_s: float) -> int:
        """Renew every lease held; forget those this worker lost (reaped, or delivered again
        elsewhere after it was cut off past its lease: whatever it still does with them is
        refused when it settles). Returns how many it lost."""
        lost = leases.renew(self.tokens(), lease_s)
        lost_held = list(self.tokens(lost))  # not those settled meanwhile
        self.release(lost_held)
        return len(lost_held)

    def give_back(self, leases: Leases, task_ids: Iterable[str] | None = None) -> None:
        """What this worker holds (of ``task_ids``) goes back to its queues at once (a clean
        return: not a death), or, when Redis cannot take even that, by its leases lapsing:
        nothing is held and renewed without being worked on."""
        held = self.tokens(task_ids)
        if not held:
            return
        log.warning("giving back %d tasks", len(held))
        try:
            leases.give_back(held)
        except Exception:
            log.warning("could not give them back; their leases will lapse", exc_info=True)
        self.release(held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)
