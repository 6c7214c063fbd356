"""Prompt-length estimates made before collation, visual tokens included.

Batches are cut under a token budget before the processor runs, so lengths
come from the rendered chat template (exact for the text, one placeholder per
image or video) plus each item's visual tokens from image sizes, frame counts
and the processor's own patch arithmetic (``_get_num_multimodal_tokens``). The
arithmetic that is vlmq's own (template tokens around frames, placeholder expansion) lives in
``config/vision.py``, which the producer's pre-flight (``vlmq submit --dry-run``) shares.
"""

from __future__ import annotations

from typing import Any

from vlmq.config.vision import (
    expanded_prompt_tokens,
    internvl_video_tokens,
    template_stub,
    video_wrapper_tokens,
)

__all__ = ["estimate_prompt_tokens", "template_stub"]


def _rendered_tokens(processor: Any, conversation: list[dict[str, Any]]) -> int:
    text = processor.apply_chat_template(
        [template_stub(conversation)], tokenize=False, add_generation_prompt=True
    )[0]
    return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])


def _image_tokens(processor: Any, sizes: list[tuple[int, int]]) -> list[int]:
    if not sizes:
        return []
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(n) for n in data.num_image_tokens]


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
    visual = _image_tokens(processor, image_sizes) + _video_tokens(processor, family, video_sizes)
    return expanded_prompt_tokens(_rendered_tokens(processor, conversation), visual)
