"""The frame store on real stores: what a reader holds survives the stored files changing
under it (in a process of its own, which a SIGBUS would kill), and the budget on moto's S3
(listing, recency, eviction)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.samples import make_image
from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.stores.files import FileStore
from vlmq.stores.s3 import S3Store
from vlmq.workers.media import Downscale, Pixels
from vlmq.workers.media.prepared.framebudget import FrameBudget
from vlmq.workers.media.prepared.framestore import FrameStore

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
IMAGES = FrameStoreSettings(kinds=["image"])
TARGET = Downscale(max_pixels=12544)


def _signal_name(code: int | None) -> str:
    return signal.Signals(-code).name if code is not None and code < 0 else str(code)


def test_a_reader_keeps_its_pixels_when_stored_files_change_under_it(tmp_path: Path) -> None:
    """Objects a reader holds are truncated in place (two) and rewritten in place with other
    pixels (two) before it uses them. Read into its own memory, it sees the pixels it read.
    A mapped read saw the rewritten pixels, and died of SIGBUS on the truncated ones."""
    store = FrameStore(FileStore(f"file://{tmp_path}"), IMAGES, MediaSettings())
    images = [make_image((64, 48), seed=n) for n in range(5)]
    keys = [store.key_for(f"sha256:{n:064x}", None, TARGET, "t") for n in range(5)]
    for key, image in zip(keys, images, strict=True):
        assert store.put(key, image)
    sums = [int(np.asarray(image, np.int64).sum()) for image in images]
    reader = subprocess.Popen(
        [sys.executable, "-m", "tests.support.framereader", str(tmp_path), *keys[:4]],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert reader.stdin is not None and reader.stdout is not None
    try:
        assert json.loads(reader.stdout.readline()) == {"read": 4}
        for key in keys[:2]:
            path = tmp_path / key
            os.truncate(path, path.stat().st_size // 3)
        other = (tmp_path / keys[4]).read_bytes()  # same size: the same frame shape
        for key in keys[2:4]:
            with (tmp_path / key).open("r+b") as handle:
                handle.write(other)
        out, _ = reader.communicate(b"go\n", timeout=30)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(10)
    assert reader.returncode == 0, f"the reader died: {_signal_name(reader.returncode)}"
    assert json.loads(out) == sums[:4]


@pytest.fixture
def s3(moto_server: Any, request: pytest.FixtureRequest) -> S3Store:
    bucket = f"frames-{abs(hash(request.node.name)) % 10**8}"
    moto_server.s3().create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/frames", endpoint_url=moto_server.endpoint)


def test_an_s3_frame_store_keeps_its_budget_least_recently_used_first(s3: S3Store) -> None:
    store = FrameStore(s3, IMAGES, MediaSettings())
    image = make_image((64, 48), seed=1)
    keys = [store.key_for(f"sha256:{n:064x}", None, TARGET, "t") for n in range(3)]
    for key in keys:
        assert store.put(key, image)
    s3.put_blob("results/job/task.1.json", b"{}")  # not the frame store's: never counted
    listed = {o.key: o for o in s3.objects()}
    assert set(listed) == {*keys, "results/job/task.1.json"}
    size = listed[keys[0]].size
    assert s3.info(keys[0]) == listed[keys[0]] and s3.info("t/missing.vfr") is None
    time.sleep(1.1)  # Last-Modified counts whole seconds
    # A read marks the oldest object used (a copy onto itself: a newer Last-Modified).
    store.budget = FrameBudget(s3, size * 3 // 2, 0, touch_after_s=0)
    assert isinstance(store.get(keys[0]), Pixels)
    touched = s3.info(keys[0])
    assert touched is not None and touched.modified > listed[keys[0]].modified
    swept = store.budget.sweep()
    assert (swept.total, swept.evicted) == (3 * size, 2)
    assert {o.key for o in s3.objects()} == {keys[0], "results/job/task.1.json"}
    assert isinstance(store.get(keys[0]), Pixels) and store.get(keys[1]) is None
