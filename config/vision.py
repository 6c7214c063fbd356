"""Visual-token arithmetic of the supported model families, without torch or transformers.

Shared by the worker's pre-generate length estimate (``workers/engine/estimate.py``) and the
producer's pre-flight (``vlmq submit --dry-run``, ``producers/preflight``), so both count a
request's prompt the same way:

* how many frames the worker samples from a video (``sampled_frame_count``, the count of
  ``workers/media/video.plan_sample_times``) and how it repeats or evens them out
  (``worker_frame_counts``);
* how small the worker decodes an image or frame (``downscaled_size``, ``Downscale``);
* how many placeholder tokens the processor expands each image or video into
  (``image_tokens``, ``video_tokens``): Qwen's ``smart_resize`` onto a patch x merge grid,
  InternVL's tiles, plus the tokens the chat template writes around video frames;
* the prompt length from the rendered text and those counts (``expanded_prompt_tokens``).

The per-item counts restate what the processors' ``_get_num_multimodal_tokens`` computes from
the numbers in the model's processor config (``VisionProfile.from_configs``); the worker keeps
asking its processor, and tests/unit/test_preflight.py checks the two agree for all three
families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAMILIES",
    "PixelBudget",
    "Tiles",
    "VisionProfile",
    "detect_family",
    "downscaled_size",
    "expanded_prompt_tokens",
    "image_tokens",
    "internvl_video_tokens",
    "sampled_frame_count",
    "smart_resize",
    "template_stub",
    "video_tokens",
    "video_wrapper_tokens",
    "worker_frame_counts",
]

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")

# Qwen3-VL writes a "<t seconds>" timestamp and vision start/end tokens around each temporal
# patch group; InternVL writes "FrameN: <img>...</img>\n" per frame.
QWEN3_TOKENS_PER_FRAME_GROUP = 8
INTERNVL_TOKENS_PER_FRAME = 8
# InternVL writes <img> and </img> around each image's tiles.
INTERNVL_IMAGE_WRAPPER = 2
# Qwen's processors refuse anything more elongated (smart_resize raises).
QWEN_MAX_ASPECT = 200


def detect_family(model_type: str) -> str | None:
    """The family of a ``config.json`` ``model_type``; None for an unsupported one."""
    for family in FAMILIES:
        if model_type.startswith(family):
            return family
    return None


# --- what the worker decodes ----------------------------------------------------------------


def downscaled_size(
    size: tuple[int, int], max_pixels: int | None = None, cover: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(width, height) an image or frame of ``size`` is decoded at: at most ``max_pixels``
    in area keeping its aspect ratio, never smaller than covering ``cover`` (w, h), never
    larger than the source (``workers/media/image.Downscale``)."""
    width, height = size
    scales = []
    if max_pixels:
        scales.append(math.sqrt(max_pixels / (width * height)))
    if cover:
        scales.append(max(cover[0] / width, cover[1] / height))
    scale = min(1.0, max(scales)) if scales else 1.0
    if scale >= 1.0:
        return size
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def sampled_frame_count(
    duration_s: float, total_frames: int, target_fps: float, max_frames: int
) -> int:
    """Frames the worker samples: ``duration * target_fps``, clamped to [2, max_frames] and
    to the frame count, made even whenever that leaves at least 2 (Qwen groups frames in
    temporal pairs)."""
    wanted = round(duration_s * target_fps)
    count = min(max(wanted, 2), max_frames, max(total_frames, 1))
    if count >= 2 and count % 2:
        count -= 1
    return count


def worker_frame_counts(family: str, counts: list[int]) -> list[int]:
    """Frames each of one request's videos reaches the processor with: a one-frame clip is
    repeated (Qwen's temporal patch covers two frames), and InternVL stacks every video of
    one call, so they are cut to the shortest (``workers/engine/prepare._load_videos``)."""
    counts = [2 if n == 1 else n for n in counts]
    if family == "internvl" and counts:
        common = min(counts)
        counts = [min(n, common) for n in counts]
    return counts


# --- the processor's arithmetic -------------------------------------------------------------


@dataclass(frozen=True)
class PixelBudget:
    """Qwen: each image or frame is resized onto a (patch x merge) grid holding between
    ``min_pixels`` and ``max_pixels`` (the processor config's ``size`` shortest/longest edge)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    temporal_patch_size: int = 2
    # Qwen3-VL video only: each frame's pixels capped at ``max_video_tokens`` patches or an
    # even share of ``max_pixels`` (the processor config's ``cap_pixels_per_frame``).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class Tiles:
    """InternVL: an image is one thumbnail tile plus, with ``crop_to_patches``, the tiles
    of the grid closest to its aspect ratio; each tile is ``image_seq_length`` tokens."""

    height: int
    width: int
    crop_to_patches: bool = False
    min_patches: int = 1
    max_patches: int = 12


@dataclass(frozen=True)
class VisionProfile:
    """What a model's processor needs to count visual tokens, read from its configs."""

    family: str
    image: PixelBudget | Tiles
    video: PixelBudget | Tiles
    image_seq_length: int = 256  # InternVL tokens per tile
    context_length: int = 32768

    @classmethod
    def from_configs(
        cls,
        config: dict[str, Any],
        image_processor: dict[str, Any],
        video_processor: dict[str, Any],
        processor: dict[str, Any] | None = None,
    ) -> VisionProfile:
        """From ``config.json`` and the image/video processor configs (either the nested
        ``processor_config.json`` of transformers 5, or ``preprocessor_config.json`` and
        ``video_preprocessor_config.json``); a missing field takes transformers' default."""
        family = detect_family(str(config.get("model_type", "")))
        if family is None:
            raise ValueError(f"unsupported model type {config.get('model_type')!r}")
        processor = processor or {}
        if family == "internvl":
            seq = processor.get("image_seq_length", config.get("image_seq_length", 256))
            return cls(
                family,
                _tiles(image_processor),
                _tiles(video_processor),
                image_seq_length=int(seq),
                context_length=_context_length(config),
            )
        return cls(
            family,
            _pixel_budget(family, image_processor, video=False),
            _pixel_budget(family, video_processor, video=True),
            context_length=_context_length(config),
        )

    def decode_targets(self, video: bool) -> tuple[int | None, tuple[int, int] | None]:
        """(max_pixels, cover) the worker decodes an image (or a video frame) down to, as
        ``workers/engine/prepare.visual_downscale`` derives them from the processor."""
        spec = self.video if video else self.image
        if isinstance(spec, PixelBudget):
            return spec.max_pixels, None
        if not video and spec.crop_to_patches and spec.max_patches > 1:
            return spec.height * spec.width * spec.max_patches, None
        return None, (spec.width, spec.height)


# transformers' class defaults, used for fields a processor config leaves out.
_QWEN_DEFAULTS = {
    ("qwen2_5_vl", False): (14, 56 * 56, 28 * 28 * 1280),
    ("qwen2_5_vl", True): (14, 128 * 28 * 28, 28 * 28 * 768),
    ("qwen3_vl", False): (14, 56 * 56, 28 * 28 * 1280),  # Qwen2VLImageProcessor's
    ("qwen3_vl", True): (16, 128 * 32 * 32, 32 * 32 * 768),
}


def _pixel_budget(family: str, spec: dict[str, Any], video: bool) -> PixelBudget:
    patch, min_default, max_default = _QWEN_DEFAULTS[(family, video)]
    size = dict(spec.get("size") or {})
    # Older configs name the budget min_pixels / max_pixels; the processors let them win.
    min_pixels = spec.get("min_pixels") or size.get("shortest_edge") or min_default
    max_pixels = spec.get("max_pixels") or size.get("longest_edge") or max_default
    return PixelBudget(
        patch_size=int(spec.get("patch_size") or patch),
        merge_size=int(spec.get("merge_size") or 2),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        temporal_patch_size=int(spec.get("temporal_patch_size") or 2),
        # Only Qwen3-VL's token count applies the cap (Qwen2-VL's counts frames uncapped).
        cap_pixels_per_frame=video
        and family == "qwen3_vl"
        and bool(spec.get("cap_pixels_per_frame")),
        max_video_tokens=int(spec.get("max_video_tokens") or 768),
    )


def _tiles(spec: dict[str, Any]) -> Tiles:
    size = dict(spec.get("size") or {})
    return Tiles(
        height=int(size.get("height") or 384),
        width=int(size.get("width") or 384),
        crop_to_patches=bool(spec.get("crop_to_patches", False)),
        min_patches=int(spec.get("min_patches") or 1),
        max_patches=int(spec.get("max_patches") or 12),
    )


def _context_length(config: dict[str, Any]) -> int:
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or 32768)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize target: both sides multiples of ``factor``, area within the budget,
    aspect ratio kept as closely as possible."""
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _smart_resize_clip(
    frames: int, height: int, width: int, temporal: int, factor: int, min_px: int, max_px: int
) -> tuple[int, int]:
    """Qwen3-VL's video resize target: the budget covers all frames of the clip."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_px:
        beta = math.sqrt((frames * height * width) / max_px)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_px:
        beta = math.sqrt(min_px / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise ValueError(f"aspect ratio is more than {QWEN_MAX_ASPECT}:1")


def _tiled_canvas(height: int, width: int, tiles: Tiles) -> tuple[int, int]:
    """(columns, rows) of the tile grid closest to the image's aspect ratio (GotOcr2's
    ``get_optimal_tiled_canvas``): on a tie, more tiles while they cover at most twice the
    image's area."""
    grids = sorted(
        (
            (columns, rows)
            for columns in range(1, tiles.max_patches + 1)
            for rows in range(1, tiles.max_patches + 1)
            if tiles.min_patches <= columns * rows <= tiles.max_patches
        ),
        key=lambda grid: grid[0] * grid[1],
    )
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tiles.height * tiles.width * columns * rows:
            best = (columns, rows)
    return best


def _internvl_tiles(height: int, width: int, tiles: Tiles) -> int:
    if not (tiles.crop_to_patches and tiles.max_patches > 1):
        return 1
    columns, rows = _tiled_canvas(height, width, tiles)
    return 1 + columns * rows if columns * rows > 1 else 1


def image_tokens(profile: VisionProfile, height: int, width: int) -> int:
    """Placeholder tokens one image of (height, width), as decoded, expands into."""
    spec = profile.image
    if isinstance(spec, Tiles):
        tiles = _internvl_tiles(height, width, spec)
        return INTERNVL_IMAGE_WRAPPER + profile.image_seq_length * tiles
    resized_h, resized_w = smart_resize(
        height, width, spec.factor, spec.min_pixels, spec.max_pixels
    )
    return (resized_h // spec.patch_size) * (resized_w // spec.patch_size) // spec.merge_size**2


def _clip_patch_tokens(spec: PixelBudget, family: str, frames: int, height: int, width: int) -> int:
    if family == "qwen3_vl":
        max_px = spec.max_pixels
        if spec.cap_pixels_per_frame:
            frame_cap = spec.max_video_tokens * spec.factor**2
            per_frame = max(min(frame_cap, max_px // frames), int(spec.min_pixels * 1.05))
            max_px = per_frame * frames
        resized_h, resized_w = _smart_resize_clip(
            frames, height, width, spec.temporal_patch_size, spec.factor, spec.min_pixels, max_px
        )
    else:
        resized_h, resized_w = smart_resize(
            height, width, spec.factor, spec.min_pixels, spec.max_pixels
        )
    temporal = spec.temporal_patch_size
    grid_t = (frames + -frames % temporal) // temporal
    patches = grid_t * (resized_h // spec.patch_size) * (resized_w // spec.patch_size)
    return patches // spec.merge_size**2


def video_wrapper_tokens(family: str, frames: int) -> int:
    """Tokens a Qwen3-VL chat template writes around a clip's temporal patch groups
    (timestamps, vision start/end) beyond its visual tokens; 0 for the other families."""
    if family == "qwen3_vl":
        return (frames + 1) // 2 * QWEN3_TOKENS_PER_FRAME_GROUP
    return 0


def internvl_video_tokens(frames: int, image_seq_length: int) -> int:
    """InternVL: each frame is one tile plus its "FrameN: <img>...</img>" text."""
    return frames * (image_seq_length + INTERNVL_TOKENS_PER_FRAME)


def video_tokens(profile: VisionProfile, frames: int, height: int, width: int) -> int:
    """Tokens one video of ``frames`` frames of (height, width), as decoded, expands into."""
    spec = profile.video
    if isinstance(spec, Tiles):
        return internvl_video_tokens(frames, profile.image_seq_length)
    patch_tokens = _clip_patch_tokens(spec, profile.family, frames, height, width)
    return patch_tokens + video_wrapper_tokens(profile.family, frames)


def expanded_prompt_tokens(rendered_tokens: int, visual_tokens: list[int]) -> int:
    """Prompt length from the rendered template (one placeholder token per image or video)
    and each item's tokens: every placeholder expands into its item's tokens."""
    return rendered_tokens + sum(n - 1 for n in visual_tokens)


def template_stub(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with media replaced by bare placeholders (cheap to render)."""
    return [
        {
            "role": m["role"],
            "content": [p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]],
        }
        for m in conversation
    ]
