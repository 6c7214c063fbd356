"""Files that block whoever opens or reads them, and calls that must not block: for the tests
that check that no local read hangs a thread (a FIFO, a device) on a caller's say."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["fifo", "within"]


@contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO no one writes to. Afterwards any reader the code under test left blocked on it
    (in ``open`` or in ``read``) is released, and later opens find nothing, so no thread stays
    pinned past the test."""
    os.mkfifo(path)
    try:
        yield path
    finally:
        # Holding it open for writing as well (O_RDWR never blocks on Linux) lets a blocked
        # open return; once the name is gone and this closes, every read ends (EOF).
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.unlink(path)
        os.close(fd)


def within(seconds: float, call: Callable[[], Any]) -> tuple[bool, Any]:
    """(returned in time, its value or exception), the call run on a daemon thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # reported to the test
            box["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), box.get("value")
