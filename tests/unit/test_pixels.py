"""Pixels: frames read back from the frame store, handed to the processor without a copy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.support.samples import make_image
from vlmq.workers.engine.processors import _pixels_key
from vlmq.workers.engine.runner import processor_media
from vlmq.workers.media.pixels import KEY_ATTRIBUTE, Pixels, pixels_of

pytestmark = pytest.mark.unit


def _frames(count: int = 3) -> Pixels:
    return pixels_of([make_image((40, 30), seed=n) for n in range(count)], key="store/key")


def test_pillow_frames_become_planar_and_come_back_the_same() -> None:
    images = [make_image((40, 30), seed=n) for n in range(3)]
    pixels = pixels_of(images)
    assert pixels.array.shape == (3, 3, 30, 40) and pixels.array.flags.c_contiguous
    assert pixels.size == (40, 30) and len(pixels) == 3 and pixels.nbytes == 3 * 3 * 30 * 40
    assert [frame.tobytes() for frame in pixels] == [image.tobytes() for image in images]
    assert pixels.channels_last().shape == (3, 30, 40, 3)
    with pytest.raises(ValueError):
        Pixels(np.zeros((2, 30, 40, 3), np.uint8))  # channel-last is not Pixels


def test_the_tensor_shares_the_arrays_memory_and_carries_the_key() -> None:
    pixels = _frames()
    video = pixels.as_tensor()
    assert video.shape == (3, 3, 30, 40) and video.dtype == torch.uint8
    assert video.data_ptr() == pixels.array.ctypes.data  # no copy
    assert getattr(video, KEY_ATTRIBUTE) == "store/key"
    image = pixels.as_tensor(single=True)
    assert image.shape == (3, 30, 40) and torch.equal(image, video[0])


def test_taking_frames_keys_them_apart() -> None:
    pixels = _frames()
    doubled = pixels.take([0, 0])
    assert len(doubled) == 2 and doubled.key not in (None, pixels.key)
    assert np.array_equal(doubled.array[1], pixels.array[0])
    assert pixels.take([0, 0]).key == doubled.key and pixels.take([0, 1]).key != doubled.key


def test_the_processor_cache_keys_named_pixels_by_name_and_the_rest_by_content() -> None:
    pixels = _frames()
    named = pixels.as_tensor()
    # Named: the key, not a hash of the pixels; the shape is in it.
    assert _pixels_key(named) == _pixels_key(pixels.as_tensor())
    assert _pixels_key(named) != _pixels_key(pixels.as_tensor(single=True))
    unnamed = torch.from_numpy(pixels.array.copy())
    assert _pixels_key(unnamed) != _pixels_key(named)
    assert _pixels_key(unnamed) == _pixels_key(torch.from_numpy(pixels.array.copy()))
    changed = pixels.array.copy()
    changed[0, 0, 0, 0] ^= 1
    assert _pixels_key(torch.from_numpy(changed)) != _pixels_key(unnamed)


def test_a_conversation_hands_pixels_to_the_processor_as_tensors() -> None:
    pixels = _frames()
    image = Pixels(pixels.array[:1].copy(), key="image")
    pil = make_image((20, 10), seed=9)
    conversation: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "image", "image": pil},
                {"type": "video", "video": pixels, "metadata": {"fps": 2.0}},
                {"type": "text", "text": "What?"},
            ],
        }
    ]
    [message] = processor_media(conversation)
    first, second, video, text = message["content"]
    assert first["image"].shape == (3, 30, 40) and getattr(first["image"], KEY_ATTRIBUTE) == "image"
    assert second["image"] is pil
    assert video["video"].shape == (3, 3, 30, 40) and video["metadata"] == {"fps": 2.0}
    assert text == {"type": "text", "text": "What?"}
    assert conversation[0]["content"][0]["image"] is image  # the prepared request is unchanged
    plain: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "image", "image": pil}]}]
    assert processor_media(plain) is plain
