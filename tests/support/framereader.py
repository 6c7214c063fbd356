"""A reader of a ``file://`` frame store in a process of its own, for tests that change the
store's files under a reader: a fault there (SIGBUS on a truncated mapping) kills the process,
so it cannot be the test's own.

``python -m tests.support.framereader ROOT KEY...`` reads every object back as a worker does
(``FrameStore.get``) and keeps what it read, as a worker's media cache does; prints
``{"read": N}``; waits for a line on stdin (the test changes the files meanwhile); then uses
the pixels it kept and prints their sums as one JSON list (null for an object not read).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.stores.files import FileStore
from vlmq.workers.media import Pixels
from vlmq.workers.media.prepared.framestore import FrameStore


def main(argv: list[str]) -> int:
    root, keys = argv[0], argv[1:]
    settings = FrameStoreSettings(kinds=["image", "video"])
    store = FrameStore(FileStore(f"file://{root}"), settings, MediaSettings())
    held = [store.get(key) for key in keys]
    print(json.dumps({"read": sum(item is not None for item in held)}), flush=True)
    sys.stdin.readline()
    sums = [
        int(item.array.sum(dtype=np.int64)) if isinstance(item, Pixels) else None for item in held
    ]
    print(json.dumps(sums), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
