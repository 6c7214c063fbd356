"""Reused memory for pixels read back from the frame store: a buffer goes back to the pool
only once nothing refers to it, and what was read back never changes under its reader."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.samples import make_image
from vlmq.config.errors import ConfigError
from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.stores.files import FileStore
from vlmq.workers.media import Downscale, Pixels
from vlmq.workers.media.prepared.buffers import BufferPool
from vlmq.workers.media.prepared.framestore import FrameStore
from vlmq.workers.media.prepared.pixels import pixels_of

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _collected() -> None:
    gc.collect()


def test_memory_comes_back_only_when_the_array_its_views_and_tensors_are_gone() -> None:
    pool = BufferPool(64 * MiB)
    array = pool.array((2, 3, 16, 16))
    view = array[1].reshape(-1)
    tensor = torch.from_numpy(array[0])
    del array
    _collected()
    assert pool.free_bytes == 0  # a view still reads it
    del view
    _collected()
    assert pool.free_bytes == 0  # a tensor still reads it
    del tensor
    _collected()
    assert pool.free_bytes == MiB
    again = pool.array((2, 3, 16, 16))
    assert (pool.reused, pool.allocated) == (1, 1)
    assert again.flags.c_contiguous and again.flags.writeable


def test_a_buffer_in_use_is_never_handed_out_twice() -> None:
    pool = BufferPool(64 * MiB)
    first = pool.array((1000,))
    first[:] = 7
    second = pool.array((1000,))
    second[:] = 9
    assert (first == 7).all() and pool.allocated == 2


def test_free_memory_is_kept_up_to_its_cap_and_none_with_zero() -> None:
    pool = BufferPool(2 * MiB)
    arrays = [pool.array((MiB,)) for _ in range(3)]
    del arrays
    _collected()
    assert pool.free_bytes == 2 * MiB
    off = BufferPool(0)
    plain = off.array((10,))
    assert plain.base is None and off.allocated == 0


def test_a_buffer_dropped_in_another_thread_comes_back() -> None:
    pool = BufferPool(64 * MiB)
    holder = [pool.array((4096,))]
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    _collected()
    assert pool.free_bytes == MiB


# --- the frame store reading into it ---------------------------------------------------------


def _photo_store(root: Path) -> tuple[FrameStore, list[str], list[Pixels]]:
    """Written with zstd: its frames are decompressed into pooled memory (the raw codec's
    are used where they lie)."""
    settings = FrameStoreSettings(kinds=["image"], codec="zstd")
    store = FrameStore(FileStore(f"file://{root}"), settings, MediaSettings())
    keys, written = [], []
    for seed in range(3):
        pixels = pixels_of([make_image((96, 64), seed=seed)])
        key = store.key_for(f"sha256:{seed:064x}", None, Downscale(max_pixels=10**6), "t")
        assert store.put(key, pixels)
        keys.append(key)
        written.append(pixels)
    return store, keys, written


def test_objects_read_back_into_reused_memory_stay_exact_while_held(tmp_path: Path) -> None:
    store, keys, written = _photo_store(tmp_path)
    held = [store.get(key) for key in keys]  # all alive at once: three sets of buffers
    for back, original in zip(held, written, strict=True):
        assert isinstance(back, Pixels)
        assert np.array_equal(back.array, original.array)
    del held, back
    _collected()
    reused = store.buffers.reused
    for _ in range(2):  # now each read takes buffers the last one gave back
        for key, original in zip(keys, written, strict=True):
            again = store.get(key)
            assert isinstance(again, Pixels) and np.array_equal(again.array, original.array)
            del again
            _collected()
    assert store.buffers.reused > reused


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_store_reads_an_object_into_the_memory_given_and_keeps_nothing_open(
    tmp_path: Path,
) -> None:
    files = FileStore(f"file://{tmp_path}")
    files.put_blob("a/b.bin", b"0123456789" * 1000)
    memory = bytearray(16384)
    before = _open_fds()
    view = files.read_blob("a/b.bin", lambda size: memoryview(memory))
    assert _open_fds() == before  # nothing held open by what was read
    assert isinstance(view, memoryview) and view.readonly and view.obj is memory
    assert bytes(view) == b"0123456789" * 1000
    # Replaced by rename, rewritten in place, truncated, deleted: what was read stays.
    files.put_blob("a/b.bin", b"x" * 20)
    (tmp_path / "a" / "b.bin").write_bytes(b"y" * 5)
    assert bytes(view) == b"0123456789" * 1000
    (tmp_path / "a" / "b.bin").unlink()
    assert bytes(view) == b"0123456789" * 1000
    files.put_blob("a/empty.bin", b"")
    assert files.read_blob("a/empty.bin", lambda size: memoryview(memory)) == b""
    assert files.read_blob("a/missing.bin", lambda size: memoryview(memory)) is None


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", ""])
def test_a_key_may_not_leave_the_store_root(tmp_path: Path, key: str) -> None:
    files = FileStore(f"file://{tmp_path / 'root'}")
    with pytest.raises(ConfigError):
        files.put_blob(key, b"x")


def test_a_read_cut_short_by_corruption_leaves_the_next_read_exact(tmp_path: Path) -> None:
    """Each thread keeps its zstd decompressor: one that stopped on a corrupt object in the
    middle of its frames reads the next object whole."""
    store, keys, written = _photo_store(tmp_path)
    path = tmp_path / keys[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(keys[0]) is None
    back = store.get(keys[1])
    assert isinstance(back, Pixels) and np.array_equal(back.array, written[1].array)
