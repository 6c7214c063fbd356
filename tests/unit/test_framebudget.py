"""The frame store is bounded: a size budget kept by deleting the least recently used
objects, a local volume's free space left to whatever shares it, and a failing store left
alone for a pause (no services: a folder store)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.samples import make_image
from vlmq.config.errors import StoreUnavailable
from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.stores.base import ObjectInfo
from vlmq.stores.files import FileStore
from vlmq.workers.media import Downscale
from vlmq.workers.media.prepared.framebudget import FrameBudget
from vlmq.workers.media.prepared.framestore import FrameStore

pytestmark = pytest.mark.unit

TARGET = Downscale(max_pixels=12544)


def _object(files: FileStore, key: str, size: int, age_s: float) -> None:
    files.put_blob(key, b"x" * size)
    used = time.time() - age_s
    os.utime(files.root / key, (used, used))


def _keys(files: FileStore) -> list[str]:
    return sorted(o.key for o in files.objects())


class Volume(FileStore):
    """A folder store on a volume with as much free space as the test says."""

    free = 10**12

    def free_bytes(self) -> int | None:
        return self.free


def test_a_sweep_deletes_the_least_recently_used_until_under_the_budget(tmp_path: Path) -> None:
    files = FileStore(f"file://{tmp_path}")
    for n, age in enumerate([500, 400, 300, 200]):
        _object(files, f"t/image/0{n}/{n}.vfr", 1000, age)
    # Not the frame store's (a results object where the location is shared): left alone.
    _object(files, "job/task.1.json", 5000, 10_000)
    swept = FrameBudget(files, max_bytes=3000, min_free_bytes=0).sweep()
    # 4,000 bytes against 3,000: the two oldest go, leaving at most 90% of the budget.
    assert (swept.total, swept.evicted, swept.freed) == (4000, 2, 2000)
    assert _keys(files) == ["job/task.1.json", "t/image/02/2.vfr", "t/image/03/3.vfr"]


def test_a_read_keeps_an_object_among_the_recently_used(tmp_path: Path) -> None:
    files = FileStore(f"file://{tmp_path}")
    _object(files, "t/a.vfr", 1000, 900)
    _object(files, "t/b.vfr", 1000, 800)
    budget = FrameBudget(files, max_bytes=1500, min_free_bytes=0, touch_after_s=60)
    info = files.info("t/a.vfr")
    assert info is not None
    budget.used(info)  # the oldest, read now
    budget.sweep()
    assert _keys(files) == ["t/a.vfr"]
    # Read again within touch_after_s: no write at all.
    fresh = files.info("t/a.vfr")
    assert fresh is not None
    os.utime(files.root / "t/a.vfr", (fresh.modified - 30, fresh.modified - 30))
    budget.used(ObjectInfo("t/a.vfr", 1000, time.time() - 30))
    assert files.info("t/a.vfr") == ObjectInfo("t/a.vfr", 1000, fresh.modified - 30)


def test_writes_past_the_budget_are_refused_and_make_room(tmp_path: Path) -> None:
    files = FileStore(f"file://{tmp_path}")
    budget = FrameBudget(files, max_bytes=3000, min_free_bytes=0)
    budget.sweep()  # counted: an empty store
    for n in range(3):
        assert budget.admit(1000)
        _object(files, f"t/{n}.vfr", 1000, 300 - n)
        budget.added(1000)
    assert not budget.admit(1000)  # a fourth would pass the budget: refused, a sweep started
    assert not budget.admit(3001)  # larger than the whole budget: never
    budget.sweep()  # waits for the one the refusal started
    assert budget.evicted == 1 and _keys(files) == ["t/1.vfr", "t/2.vfr"]
    assert budget.admit(1000)


def test_a_local_volume_keeps_its_reserve(tmp_path: Path) -> None:
    files = Volume(f"file://{tmp_path}")
    for n in range(4):
        _object(files, f"t/{n}.vfr", 1000, 400 - n)
    budget = FrameBudget(files, max_bytes=10**9, min_free_bytes=1000)
    files.free = 1500  # room for 500 more bytes of frames: a 1,000-byte write is not made
    assert not budget.admit(1000) and budget.admit(400)
    budget.sweep()
    assert budget.evicted == 0  # not under the reserve yet: nothing to delete
    files.free = 200  # something else filled the volume: the frames make way
    swept = budget.sweep()
    assert swept.allowed == 3200 and swept.evicted == 2
    assert _keys(files) == ["t/2.vfr", "t/3.vfr"]


def test_a_put_the_budget_has_no_room_for_is_not_written(tmp_path: Path) -> None:
    image = make_image((64, 48), seed=1)
    store = FrameStore(
        Volume(f"file://{tmp_path}"), FrameStoreSettings(kinds=["image"]), MediaSettings()
    )
    first = store.key_for("sha256:aa", None, TARGET, "t")
    assert store.put(first, image)
    size = (tmp_path / first).stat().st_size
    store.budget.max_bytes = size * 3 // 2  # room for one object, not two
    assert store.budget.sweep().evicted == 0
    second = store.key_for("sha256:bb", None, TARGET, "t")
    assert not store.put(second, image) and not (tmp_path / second).exists()
    assert store.get(first) is not None


class Failing(FileStore):
    """A store that is down: every call raises, and is counted."""

    calls = 0

    def info(self, key: str) -> ObjectInfo | None:
        self.calls += 1
        raise StoreUnavailable("down")

    def put_blob(self, key: str, data: bytes, content_type: str = "") -> str:
        self.calls += 1
        raise StoreUnavailable("down")


def test_a_failing_store_is_left_alone_for_a_pause_that_grows(tmp_path: Path) -> None:
    now = [0.0]
    failing = Failing(f"file://{tmp_path}")
    store = FrameStore(
        failing, FrameStoreSettings(kinds=["image"]), MediaSettings(), clock=lambda: now[0]
    )
    key = store.key_for("sha256:aa", None, TARGET, "t")
    assert store.get(key) is None and failing.calls == 1
    assert store.get(key) is None and not store.has(key) and failing.calls == 1  # paused 1 s
    now[0] = 1.0
    assert store.get(key) is None and failing.calls == 2  # tried again: paused 2 s
    now[0] = 2.5
    assert store.get(key) is None and failing.calls == 2
    # Writes have a pause of their own (a full volume still serves reads).
    image = make_image((16, 16), seed=2)
    assert not store.put(key, image) and failing.calls == 3
    assert not store.put(key, image) and failing.calls == 3
