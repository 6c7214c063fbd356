"""Decode fetched image bytes into RGB images (the CPU reference), and the downscale rule that
images and sampled video frames share.

Every limit comes from :class:`MediaSettings` and is a hard error, checked before pixels are
allocated where possible. Decoder exceptions never reach a client: their text can carry object
reprs and addresses (CVE-2026-22778 leaked a heap address through a Pillow error message), so
each becomes a ``MediaDecodeFailed`` with a fixed message.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps

from vlmq.config.errors import MediaDecodeFailed, MediaTooLarge, VlmqError
from vlmq.config.media_checks import check_image_pixels
from vlmq.config.settings import MediaSettings
from vlmq.config.vision import downscaled_size

__all__ = ["Downscale", "check_image_pixels", "decode_image", "to_rgb"]

_IMAGE_FAILED = "could not decode image"
_WHITE = (255, 255, 255)


@dataclass(frozen=True)
class Downscale:
    """How small a decoded image or frame may be made for the model's processor: at most
    ``max_pixels`` in area, keeping its aspect ratio (Qwen's processors resize to a pixel
    budget), but never smaller than covering a ``cover`` box (InternVL resizes frames to
    a fixed tile). Never larger than the source."""

    max_pixels: int | None = None
    cover: tuple[int, int] | None = None

    def size_for(self, size: tuple[int, int]) -> tuple[int, int]:
        # Shared with the producer's pre-flight estimate (config/vision.py).
        return downscaled_size(size, self.max_pixels, self.cover)


def decode_image(
    data: bytes, settings: MediaSettings, downscale: Downscale | None = None
) -> Image.Image:
    """Decode one image (first frame if animated) to RGB, or raise a MediaError.

    ``downscale`` (what the model's processor will use at most) applies at decode: a JPEG
    is decoded at 1/2 to 1/8 scale where that still covers the target (``draft``), then
    resized to it, so a 1080p photo bound for a few hundred visual tokens is never decoded,
    held or processed at full size."""
    try:
        with Image.open(io.BytesIO(data), formats=settings.image_formats) as img:
            check_image_pixels(img.size, settings)  # header size; nothing decoded yet
            if downscale is not None:
                img.draft("RGB", downscale.size_for(img.size))
            img.load()  # truncated data raises here: LOAD_TRUNCATED_IMAGES stays off
            image = to_rgb(_upright(img))
            target = downscale.size_for(image.size) if downscale is not None else image.size
            if target != image.size:
                image = image.resize(target, Image.Resampling.BICUBIC)
            return image
    except VlmqError:
        raise
    except Image.DecompressionBombError:
        raise MediaTooLarge("image has too many pixels") from None
    except Exception:  # Pillow raises OSError, SyntaxError, ValueError, struct.error...
        raise MediaDecodeFailed(_IMAGE_FAILED) from None


def _upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation (what a viewer shows); a broken EXIF block
    is not worth failing the image for, so it is then ignored."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with transparency composited onto white (as Qwen's loader does)
    rather than dropped, which would expose whatever colour the alpha hid."""
    if img.mode == "RGB":
        return img
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*_WHITE, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")
