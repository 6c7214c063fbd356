"""Prompt-length estimates made before collation, visual tokens included.

Batches are cut under a token budget before the processor runs, so lengths
come from the rendered chat template (exact for the text, one placeholder per
image or video) plus each item's visual tokens from image sizes, frame counts
and the processor's own patch arithmetic (``_get_num_multimodal_tokens``). The
arithmetic that is vlmq's own (template tokens around frames, placeholder expansion) lives in
``config/vision.py``, which the producer's pre-flight (``vlmq submit --dry-run``) shares.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from vlmq.config.vision import (
    INTERNVL_IMAGE_WRAPPER,
    expanded_prompt_tokens,
    internvl_video_tokens,
    template_stub,
    video_wrapper_tokens,
)

__all__ = ["estimate_prompt_tokens", "template_stub"]


# Per processor, what was counted before: a bulk job asks the same prompt of many images of
# the same size, and rendering the template or the processor's arithmetic (which validates
# its kwargs on every call) costs ~1.5 ms a request. Bounded; a race only counts twice.
_COUNTED: weakref.WeakKeyDictionary[Any, dict[Any, int]] = weakref.WeakKeyDictionary()
_MAX_COUNTED = 4096


def _counted(processor: Any, key: Any, count: Callable[[], int]) -> int:
    memo = _COUNTED.get(processor)
    if memo is None:
        memo = _COUNTED.setdefault(processor, {})
    found = memo.get(key)
    if found is None:
        if len(memo) >= _MAX_COUNTED:
            memo.clear()
        found = memo[key] = count()
    return found


def _rendered_tokens(processor: Any, conversation: list[dict[str, Any]]) -> int:
    stub = template_stub(conversation)

    def count() -> int:
        text = processor.apply_chat_template([stub], tokenize=False, add_generation_prompt=True)[0]
        return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    # Keyed by a digest: a long conversation is not kept 4,096 times over.
    named = json.dumps(stub, sort_keys=True, default=str).encode()
    return _counted(processor, ("prompt", hashlib.blake2b(named, digest_size=16).digest()), count)


def _image_tokens(processor: Any, family: str, sizes: list[tuple[int, int]]) -> list[int]:
    return [
        _counted(processor, ("image", tuple(size)), partial(_one_image, processor, family, size))
        for size in sizes
    ]


def _one_image(processor: Any, family: str, size: tuple[int, int]) -> int:
    data = processor._get_num_multimodal_tokens(image_sizes=[list(size)])
    if family == "internvl":
        # From the tile count: transformers 5.25 stopped counting the <img></img> around the
        # tiles in num_image_tokens (5.24 did), and the prompt holds them either way.
        tiles = int(data.num_image_patches[0])
        return INTERNVL_IMAGE_WRAPPER + int(processor.image_seq_length) * tiles
    return int(data.num_image_tokens[0])


def _video_tokens(processor: Any, family: str, videos: list[tuple[int, int, int]]) -> list[int]:
    if not videos:
        return []
    if family == "internvl":
        seq = int(processor.image_seq_length)
        return [internvl_video_tokens(frames, seq) for frames, _, _ in videos]
    # The template's own tokens around the frames (Qwen3-VL's timestamps) come on top.
    return [
        n + video_wrapper_tokens(family, frames)
        for n, (frames, _, _) in zip(_video_patch_tokens(processor, videos), videos, strict=True)
    ]


def _video_patch_tokens(processor: Any, videos: list[tuple[int, int, int]]) -> list[int]:
    """Each video's visual tokens by the processor's arithmetic. transformers 5.17 (the GPU
    machine's) breaks its own helper for videos (it calls a video processor method that does
    not exist, and ``merge_size`` is set only when images are asked too): the video
    processor's own count is what later releases use there."""
    try:
        data = processor._get_num_multimodal_tokens(video_sizes=[list(v) for v in videos])
        return [int(n) for n in data.num_video_tokens]
    except (AttributeError, NameError):
        video = processor.video_processor
        merge = int(video.merge_size)
        return [int(video.get_num_of_video_patches(*v, {})) // merge**2 for v in videos]


def estimate_prompt_tokens(
    processor: Any,
    family: str,
    conversation: list[dict[str, Any]],
    image_sizes: list[tuple[int, int]],
    video_sizes: list[tuple[int, int, int]],
) -> int:
    """Prompt tokens of one conversation; image sizes (h, w), videos (frames, h, w)."""
    visual = _image_tokens(processor, family, image_sizes) + _video_tokens(
        processor, family, video_sizes
    )
    return expanded_prompt_tokens(_rendered_tokens(processor, conversation), visual)
