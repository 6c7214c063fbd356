"""A total wall-clock budget for one fetch, shared by every step and hop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

from vlmq.config.errors import MediaFetchTransient

__all__ = ["Deadline", "call_with_deadline"]

T = TypeVar("T")


class Deadline:
    """Per-read socket timeouts alone let a slow-drip server stretch a download
    forever; every step of a fetch asks this object how long it may still take."""

    def __init__(self, seconds: float) -> None:
        self._expires_at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._expires_at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._expires_at

    def check(self) -> float:
        """Raise if the budget is spent, else return the seconds left."""
        left = self.remaining()
        if left <= 0.0:
            raise MediaFetchTransient("media fetch timed out")
        return left


class _Outcome(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


def call_with_deadline(fn: Callable[[], T], deadline: Deadline) -> T:
    """Run a blocking call that has no total timeout of its own (getaddrinfo,
    a boto3 request) in a daemon thread and stop waiting at the deadline.

    The thread may outlive the deadline; callers that stream data give ``fn``
    a way to notice (see the S3 fetcher's cancel event)."""
    outcome: _Outcome[T] = _Outcome()

    def run() -> None:
        try:
            outcome.value = fn()
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome.error = exc
        finally:
            outcome.done.set()

    threading.Thread(target=run, name="vlmq-media-io", daemon=True).start()
    if not outcome.done.wait(deadline.check()):
        raise MediaFetchTransient("media fetch timed out")
    if outcome.error is not None:
        raise outcome.error
    return cast(T, outcome.value)  # set whenever error is None
