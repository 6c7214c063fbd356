"""Media for VLM requests: fetch (with SSRF, size and time limits) and decode.

Usage::

    loader = MediaLoader(settings.media, s3_client_factory=make_s3_client)
    image = loader.load_image("data:image/png;base64,...")
    video = loader.load_video("s3://bucket/clip.mp4", fps=2.0, max_frames=16)

Every failure is a ``config.errors`` media error with a fixed, client-safe
message; nothing here configures logging.
"""

from __future__ import annotations

from PIL import Image

from vlmq.config.errors import InvalidRequest
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.decode import (
    DecodedVideo,
    check_image_pixels,
    decode_image,
    decode_video,
    to_rgb,
)
from vlmq.workers.media.fetch import MediaFetcher, MediaKind
from vlmq.workers.media.netpolicy import Resolver
from vlmq.workers.media.s3_fetch import S3ClientFactory

__all__ = [
    "DecodedVideo",
    "MediaFetcher",
    "MediaKind",
    "MediaLoader",
    "decode_image",
    "decode_video",
]


class MediaLoader:
    """Fetch + decode with one set of limits; safe to share between threads."""

    def __init__(
        self,
        settings: MediaSettings,
        s3_client_factory: S3ClientFactory | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.settings = settings
        self.fetcher = MediaFetcher(settings, s3_client_factory, resolver)

    def load_image(self, source: str | Image.Image) -> Image.Image:
        """An RGB image from a source string, or an in-process PIL image."""
        if isinstance(source, Image.Image):
            # Already decoded by a trusted caller; the pixel limit still holds.
            check_image_pixels(source.size, self.settings)
            return to_rgb(source)
        _require_str(source)
        return decode_image(self.fetcher.fetch(source, "image"), self.settings)

    def load_video(
        self, source: str, fps: float | None = None, max_frames: int | None = None
    ) -> DecodedVideo:
        """Frames sampled at ``fps`` (default ``settings.video_fps``), at most
        ``max_frames`` (never more than ``settings.video_max_frames``)."""
        _require_str(source)
        data = self.fetcher.fetch(source, "video")
        return decode_video(data, self.settings, fps=fps, max_frames=max_frames)


def _require_str(source: object) -> None:
    if not isinstance(source, str):
        raise InvalidRequest("media source must be a string")
