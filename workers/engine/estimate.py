"""Prompt-length estimates made before collation, visual tokens included.

Batches are cut under a token budget before the processor runs, so lengths
come from the rendered chat template (exact for the text, one placeholder per
image or video) plus each item's visual tokens from image sizes, frame counts
and the processor's own patch arithmetic (``_get_num_multimodal_tokens``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["estimate_prompt_tokens", "template_stub"]

# Qwen3-VL writes a "<t seconds>" timestamp and vision start/end tokens around
# each temporal patch group; InternVL writes "FrameN: <img>...</img>\n" per frame.
_QWEN3_PER_FRAME_GROUP = 8
_INTERNVL_PER_FRAME = 8


def template_stub(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with media replaced by bare placeholders (cheap to render)."""
    return [
        {
            "role": m["role"],
            "content": [p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]],
        }
        for m in conversation
    ]


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
        per_frame = int(processor.image_seq_length) + _INTERNVL_PER_FRAME
        return [frames * per_frame for frames, _, _ in videos]
    data = processor._get_num_multimodal_tokens(video_sizes=[list(v) for v in videos])
    counts = [int(n) for n in data.num_video_tokens]
    if family == "qwen3_vl":
        counts = [
            n + (frames + 1) // 2 * _QWEN3_PER_FRAME_GROUP
            for n, (frames, _, _) in zip(counts, videos, strict=True)
        ]
    return counts


def estimate_prompt_tokens(
    processor: Any,
    family: str,
    conversation: list[dict[str, Any]],
    image_sizes: list[tuple[int, int]],
    video_sizes: list[tuple[int, int, int]],
) -> int:
    """Prompt tokens of one conversation; image sizes (h, w), videos (frames, h, w)."""
    visual = _image_tokens(processor, image_sizes) + _video_tokens(processor, family, video_sizes)
    # Each placeholder token in the rendered text expands into n visual tokens.
    return _rendered_tokens(processor, conversation) + sum(n - 1 for n in visual)
