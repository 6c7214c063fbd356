"""The frame store's size budget: the least recently used objects go, on any store.

Prepared media is a cache: any object may go (a missing one is a miss, prepared again). So
the store is kept under ``max_bytes``, and a store on a local volume never takes the volume's
free space below ``min_free_bytes``: a results store, or anything else on that volume, keeps
its room (a frame store that filled the results' volume once stopped every result from being
stored, docs/reliability.md).

* **Recency** is each object's modification time, which a read refreshes once it is older
  than ``touch_after_s`` (a file's mtime; on S3 a copy of the object onto itself). No index
  of its own: every process of the fleet sees the same order, and nothing is lost with one.
* **Accounting**: a process lists the store at most every ``scan_interval_s`` and adds its
  own writes in between. A write that would pass the budget (as far as this process knows)
  is refused and starts a sweep: the store is listed again and, while it holds more than
  ``LOW_WATER`` of what it may, the objects used longest ago are deleted. A sweep runs on a
  thread of its own, one per process at a time, never inside a read or a write; processes
  that sweep at once delete at worst a few objects more than needed.
* Only frame store objects (``*.vfr``) are counted and deleted, whatever else shares the
  location.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vlmq.config.errors import StoreUnavailable
from vlmq.stores.base import ObjectInfo, ObjectStore

__all__ = ["LOW_WATER", "FrameBudget", "Sweep"]

log = logging.getLogger(__name__)

SUFFIX = ".vfr"
# A sweep leaves the store at this share of what it may hold, so the next one is not due at
# the next write.
LOW_WATER = 0.9
# Sweeps start at most this often in a process: a volume short of room refuses every write,
# and each refusal asks for one.
SWEEP_EVERY_S = 2.0


@dataclass(frozen=True)
class Sweep:
    """What one sweep found (bytes in the store, bytes it may hold) and did."""

    total: int
    allowed: int
    evicted: int
    freed: int


class FrameBudget:
    """``admit(size)`` before a write, ``added(size)`` after it, ``used(info)`` after a read.
    Thread-safe."""

    def __init__(
        self,
        store: ObjectStore,
        max_bytes: int,
        min_free_bytes: int,
        scan_interval_s: float = 60.0,
        touch_after_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.scan_interval_s = scan_interval_s
        self.touch_after_s = touch_after_s
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._counted: int | None = None  # bytes in the store at the last listing, + ours since
        self._counted_at = float("-inf")
        self._swept_at = float("-inf")
        self.evicted = 0  # objects this process deleted (metrics and tests read it)

    # --- writes ----------------------------------------------------------------------------

    def admit(self, size: int) -> bool:
        """Whether ``size`` more bytes may be written now. No: over the budget or into the
        volume's reserve (a sweep is started to make room for later writes)."""
        if size > self.max_bytes:
            return False
        with self._lock:
            counted = self._counted
            stale = self._clock() - self._counted_at > self.scan_interval_s
        room = self._volume_room()
        fits = (counted is None or counted + size <= self.max_bytes) and (
            room is None or size <= room
        )
        if stale or not fits:
            self.sweep_soon()
        return fits

    def added(self, size: int) -> None:
        with self._lock:
            if self._counted is not None:
                self._counted += size

    def _volume_room(self) -> int | None:
        """What may still be written before the volume's free space reaches the reserve;
        None: not a local volume."""
        free = self.store.free_bytes()
        return None if free is None else free - self.min_free_bytes

    # --- reads -----------------------------------------------------------------------------

    def used(self, info: ObjectInfo) -> None:
        """An object was read: keep it among the recently used (best effort)."""
        if self._wall() - info.modified < self.touch_after_s:
            return
        try:
            self.store.touch(info.key)
        except StoreUnavailable:
            log.info("frame store object %s could not be marked used", info.key)

    # --- sweeping --------------------------------------------------------------------------

    def sweep_soon(self) -> None:
        """Start a sweep on a thread of its own unless one is running in this process or one
        started less than ``SWEEP_EVERY_S`` ago."""
        if self._clock() - self._swept_at < SWEEP_EVERY_S:
            return
        if not self._sweeping.acquire(blocking=False):
            return
        self._swept_at = self._clock()
        thread = threading.Thread(target=self._sweep_held, name="frame-sweep", daemon=True)
        try:
            thread.start()
        except BaseException:
            self._sweeping.release()
            raise

    def _sweep_held(self) -> None:
        try:
            self._sweep()
        except Exception:  # a sweep only saves room: the next write starts another
            log.warning("sweeping the frame store failed", exc_info=True)
        finally:
            self._sweeping.release()

    def sweep(self) -> Sweep:
        """List the store and delete the least recently used objects until it holds no more
        than it may (in this thread; waits for a sweep already running)."""
        with self._sweeping:
            return self._sweep()

    def _sweep(self) -> Sweep:
        objects = sorted(
            (o for o in self.store.objects() if o.key.endswith(SUFFIX)),
            key=lambda o: o.modified,
        )
        total = sum(o.size for o in objects)
        room = self._volume_room()
        allowed = self.max_bytes if room is None else max(0, min(self.max_bytes, total + room))
        # Down to LOW_WATER, not just under the limit: a store at its limit would refuse
        # every write and never make room.
        evicted, freed = self._evict(objects, total - int(allowed * LOW_WATER))
        if evicted:
            log.info(
                "frame store near what it may hold (%d of %d bytes): %d least recently used "
                "objects deleted (%d bytes)",
                *(total, allowed, evicted, freed),
            )
        with self._lock:
            self._counted = total - freed
            self._counted_at = self._clock()
            self.evicted += evicted
        return Sweep(total, allowed, evicted, freed)

    def _evict(self, oldest_first: list[ObjectInfo], excess: int) -> tuple[int, int]:
        """Delete objects, oldest first, until ``excess`` bytes are gone: (count, bytes)."""
        evicted = freed = 0
        for victim in oldest_first:
            if freed >= excess:
                break
            self.store.delete(victim.key)
            evicted += 1
            freed += victim.size
        return evicted, freed
