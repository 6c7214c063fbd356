"""Photos of requests prepared at the same time share nvJPEG batches (``photobatch.py``): the
device decode runs with ``device="cpu"`` here (torchvision decodes JPEG batches there too),
and a recording decode counts the batches."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from tests.support.samples import encode, make_image
from vlmq.config.errors import MediaDecodeFailed
from vlmq.config.settings import MediaSettings
from vlmq.workers.media import Downscale
from vlmq.workers.media.devpixels import DeviceImages, DevicePhotoDecoder, decode_to_device
from vlmq.workers.media.photobatch import PhotoBatcher

SETTINGS = MediaSettings()
TARGET = Downscale(max_pixels=64 * 48)
# Long enough that a batch never runs on the window in these tests: it runs when it is full.
NEVER_S = 30.0


class Recording:
    """``decode_to_device``, recording the size of each batch it decodes."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def __call__(
        self,
        datas: Sequence[bytes],
        settings: MediaSettings,
        downscales: Sequence[Downscale | None],
        device: str,
    ) -> DeviceImages:
        with self.lock:
            self.batches.append(len(datas))
        return decode_to_device(datas, settings, downscales, device)


def _jpegs(n: int) -> list[bytes]:
    return [encode(make_image((80 + 8 * i, 60), seed=i), "JPEG", quality=90) for i in range(n)]


def _together(batcher: PhotoBatcher, datas: list[bytes]) -> list[Any]:
    """Each photo decoded on a thread of its own, all started at once (as the preparer's
    threads decode their requests' photos); each thread's image or exception."""
    start = threading.Barrier(len(datas))

    def one(data: bytes) -> Any:
        start.wait()
        try:
            return batcher.decode(data, SETTINGS, TARGET)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(datas)) as pool:
        return list(pool.map(one, datas))


def test_photos_decoded_at_the_same_time_share_one_batch() -> None:
    recording = Recording()
    batcher = PhotoBatcher("cpu", 8, NEVER_S, recording)
    datas = _jpegs(8)
    images = _together(batcher, datas)
    assert recording.batches == [8]  # one call, run as soon as the batch was full
    for data, image in zip(datas, images, strict=True):
        alone = decode_to_device([data], SETTINGS, [TARGET], "cpu").images[0]
        assert torch.equal(image, alone)  # each caller gets its own photo


def test_batches_hold_at_most_the_batch_size() -> None:
    recording = Recording()
    batcher = PhotoBatcher("cpu", 3, 0.5, recording)
    images = _together(batcher, _jpegs(7))
    assert all(isinstance(image, torch.Tensor) for image in images)
    assert sum(recording.batches) == 7 and max(recording.batches) <= 3


def test_a_lone_photo_is_decoded_once_its_window_passes() -> None:
    recording = Recording()
    batcher = PhotoBatcher("cpu", 32, 0.001, recording)
    (data,) = _jpegs(1)
    assert isinstance(batcher.decode(data, SETTINGS, TARGET), torch.Tensor)
    assert recording.batches == [1]


def test_a_corrupt_photo_fails_alone_and_its_batch_mates_decode() -> None:
    recording = Recording()
    batcher = PhotoBatcher("cpu", 4, NEVER_S, recording)
    good = _jpegs(3)
    corrupt = good[0][:200]  # a JPEG cut short
    results = _together(batcher, [*good, corrupt])
    assert recording.batches == [4]
    assert all(isinstance(r, torch.Tensor) for r in results[:3])
    assert isinstance(results[3], MediaDecodeFailed)


def test_a_batch_that_raises_fails_its_callers_and_the_next_batch_runs() -> None:
    calls = Recording()

    def broken_once(*args: Any) -> DeviceImages:
        if not calls.batches:
            calls.batches.append(0)
            raise RuntimeError("CUDA error: out of memory")
        return calls(*args)

    batcher = PhotoBatcher("cpu", 2, NEVER_S, broken_once)
    results = _together(batcher, _jpegs(2))
    assert all(isinstance(r, RuntimeError) for r in results)
    results = _together(batcher, _jpegs(2))  # no caller was left waiting; the next one runs
    assert all(isinstance(r, torch.Tensor) for r in results)


def test_the_loaders_device_decoder_batches_and_raises_its_own_error() -> None:
    decoder = DevicePhotoDecoder("cpu", batch=2, window_s=NEVER_S)
    good, bad = _jpegs(1)[0], b"\xff\xd8\xff\xe0 not a jpeg"
    start = threading.Barrier(2)

    def one(data: bytes) -> Any:
        start.wait()
        return decoder.decode(data, SETTINGS, TARGET)

    with ThreadPoolExecutor(2) as pool:
        photo, failed = pool.submit(one, good), pool.submit(one, bad)
        assert photo.result().tensor.shape[0] == 3
        with pytest.raises(MediaDecodeFailed):
            failed.result()
