"""A content-addressed, byte-budgeted LRU for decoded media and per-media processor outputs.

A job that asks several questions about one image or clip should decode it, and run the
image or video processor on it, once per worker. Keys are content hashes: of the fetched
bytes with the decode parameters (for a remote source with a version tag, of its URL and
ETag or Last-Modified, so a current copy is found without downloading it again), or of a
decoded item's pixels with the processor call's settings. Two sources with the same bytes
share an entry and a changed file never hits a stale one. Lookups are single-flight: while
one thread computes a key, the others asking for it wait for that result instead of
computing it too (eight requests about one clip, prepared in parallel, decode it once)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["CacheStats", "MediaCache", "Versions", "content_key", "version_key"]

T = TypeVar("T")


def content_key(data: bytes, *params: object) -> str:
    """A key for decoded bytes: their hash plus everything that changes the decode."""
    digest = hashlib.blake2b(data, digest_size=20)
    digest.update(repr(params).encode())
    return digest.hexdigest()


def version_key(source: str, tag: str, *params: object) -> str:
    """A key for a remote source's decode: its URL and version tag, plus the decode's
    parameters (the same version of the same URL is the same bytes)."""
    return content_key(f"{source}\0{tag}".encode(), "versioned", *params)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class MediaCache:
    """``get_or_compute(key, compute, size_of)``; entries beyond ``budget_bytes`` are evicted
    least recently used first. A budget of 0 disables caching (every call computes)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._computing: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get_or_compute(
        self, key: str, compute: Callable[[], T], size_of: Callable[[T], int]
    ) -> tuple[T, bool]:
        """The value for ``key`` and whether it was a hit (or waited on another's compute)."""
        if self.budget_bytes <= 0:
            return compute(), False
        with self._lock:
            entry = self._hit(key)
            if entry is not None:
                return entry[0], True
            pending = self._computing.get(key)
            if pending is None:
                mine: Future[Any] = Future()
                self._computing[key] = mine
            self.stats.hits += pending is not None
            self.stats.misses += pending is None
        if pending is not None:
            return pending.result(), True  # the other thread's exception, if it failed
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                self._computing.pop(key, None)
            mine.set_exception(exc)
            raise
        self._put(key, value, size_of(value))
        mine.set_result(value)
        return value, False

    def peek(self, key: str) -> Any | None:
        """The value under ``key`` if it is held (a hit), else None (not counted)."""
        with self._lock:
            entry = self._hit(key)
            return None if entry is None else entry[0]

    def _hit(self, key: str) -> tuple[Any, int] | None:
        """The entry under ``key``, made most recently used and counted a hit (the lock
        held)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
        return entry

    def _put(self, key: str, value: Any, size: int) -> None:
        """Keep the value (unless larger than the whole cache: served, not kept) and end
        the key's single flight, in one step."""
        with self._lock:
            self._computing.pop(key, None)
            if size > self.budget_bytes:
                return
            self._entries[key] = (value, size)
            self.stats.bytes += size
            while self.stats.bytes > self.budget_bytes and self._entries:
                _, (_, freed) = self._entries.popitem(last=False)
                self.stats.bytes -= freed
                self.stats.evictions += 1
            self.stats.entries = len(self._entries)


class Versions:
    """The version tag (ETag or Last-Modified) last seen per remote source, for the
    conditional fetch that lets a cached decode stand without a download; least recently
    used sources are forgotten past ``limit`` (a forgotten one is fetched in full)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._tags: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: str) -> str | None:
        with self._lock:
            tag = self._tags.get(source)
            if tag is not None:
                self._tags.move_to_end(source)
            return tag

    def put(self, source: str, tag: str) -> None:
        with self._lock:
            self._tags[source] = tag
            self._tags.move_to_end(source)
            while len(self._tags) > self.limit:
                self._tags.popitem(last=False)
