"""Pixels: frames read back from the frame store, handed to the processor without a copy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.samples import make_image
from vlmq.workers.engine.processors import _pixels_key
from vlmq.workers.engine.runner import processor_media
from vlmq.workers.media.prepared.pixels import KEY_ATTRIBUTE, Pixels, pixels_of

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


class _TemplateOnly:
    """A processor as vLLM's prompt builder uses it: the chat template as text."""

    def apply_chat_template(self, conversation: Any, **_: Any) -> str:
        return "prompt"


def test_vllm_gets_pillow_images_and_channel_last_frames_from_pixels() -> None:
    from vlmq.config.schemas import Request
    from vlmq.workers.engine.prepare import Prepared
    from vlmq.workers.engine.vllm_engine import _prompt

    images = [make_image((40, 30), seed=n) for n in range(3)]
    photo, frames = pixels_of(images[:1], key="p"), pixels_of(images, key="v")
    request = Request.model_validate({"messages": [{"role": "user", "content": ["Hi"]}]})
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": photo},
                {"type": "video", "video": frames, "metadata": {"fps": 2.0}},
            ],
        }
    ]
    prompt = _prompt(Prepared(request, 8, conversation), _TemplateOnly())
    [image] = prompt["multi_modal_data"]["image"]
    assert image.tobytes() == images[0].tobytes()
    [(video, meta)] = prompt["multi_modal_data"]["video"]
    assert video.shape == (3, 30, 40, 3)
    assert [Image.fromarray(f).tobytes() for f in video] == [i.tobytes() for i in images]
    assert meta["do_sample_frames"] is False
