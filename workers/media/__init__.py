"""Media for VLM requests: fetch (with SSRF, size and time limits) and decode.

Usage::

    loader = MediaLoader(settings.media, s3_client_factory=make_s3_client)
    image = loader.load_image("data:image/png;base64,...")
    video = loader.load_video("s3://bucket/clip.mp4", fps=2.0, max_frames=16)

Decoded media is kept in the loader's :class:`MediaCache` (content-addressed, a byte budget
from ``settings.cache_bytes``), so the same bytes are decoded once per worker.

Every failure is a ``config.errors`` media error with a fixed, client-safe
message; nothing here configures logging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

from PIL import Image

from vlmq.config.errors import InvalidRequest
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.cache import MediaCache, Versions, content_key, version_key
from vlmq.workers.media.decode import (
    DecodedVideo,
    Downscale,
    check_image_pixels,
    decode_image,
    decode_video,
    to_rgb,
)
from vlmq.workers.media.fetch import MediaFetcher, MediaKind
from vlmq.workers.media.netpolicy import Resolver
from vlmq.workers.media.s3_fetch import S3ClientFactory

T = TypeVar("T")

__all__ = [
    "DecodedVideo",
    "Downscale",
    "MediaCache",
    "MediaFetcher",
    "MediaKind",
    "MediaLoader",
    "decode_image",
    "decode_video",
    "image_bytes",
    "video_bytes",
]


def image_bytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())


def video_bytes(video: DecodedVideo) -> int:
    return sum(image_bytes(frame) for frame in video.frames)


class MediaLoader:
    """Fetch + decode with one set of limits; safe to share between threads."""

    def __init__(
        self,
        settings: MediaSettings,
        s3_client_factory: S3ClientFactory | None = None,
        resolver: Resolver | None = None,
        cache: MediaCache | None = None,
    ) -> None:
        self.settings = settings
        self.fetcher = MediaFetcher(settings, s3_client_factory, resolver)
        self.cache = cache if cache is not None else MediaCache(settings.cache_bytes)
        self.versions = Versions()
        self._local = threading.local()

    def thread_hits(self) -> int:
        """Cache hits of loads made on this thread so far (a request's share of them is
        the difference around its loads: its ``timings.media_cache_hits``)."""
        return int(getattr(self._local, "hits", 0))

    def _cached(self, key: str, compute: Callable[[], T], size_of: Callable[[T], int]) -> T:
        value, hit = self.cache.get_or_compute(key, compute, size_of)
        self._count_hits(hit)
        return value

    def _count_hits(self, hits: int) -> None:
        self._local.hits = self.thread_hits() + hits

    def load_image(
        self, source: str | Image.Image, downscale: Downscale | None = None
    ) -> Image.Image:
        """An RGB image from a source string, or an in-process PIL image."""
        if isinstance(source, Image.Image):
            # Already decoded by a trusted caller; the pixel limit still holds.
            check_image_pixels(source.size, self.settings)
            return to_rgb(source)
        _require_str(source)
        return self._load(
            source,
            "image",
            lambda data: decode_image(data, self.settings, downscale),
            image_bytes,
            downscale,
        )

    def load_video(
        self,
        source: str,
        fps: float | None = None,
        max_frames: int | None = None,
        downscale: Downscale | None = None,
    ) -> DecodedVideo:
        """Frames sampled at ``fps`` (default ``settings.video_fps``), at most
        ``max_frames`` (never more than ``settings.video_max_frames``)."""
        _require_str(source)
        return self._load(
            source,
            "video",
            lambda data: decode_video(data, self.settings, fps, max_frames, downscale),
            video_bytes,
            fps,
            max_frames,
            downscale,
        )

    def _load(
        self,
        source: str,
        kind: MediaKind,
        decode: Callable[[bytes], T],
        size_of: Callable[[T], int],
        *params: object,
    ) -> T:
        """Fetch and decode through the cache: a remote source whose version tag is still
        current is served from it without a download; anything else by its bytes' hash."""
        caching = self.cache.budget_bytes > 0
        known = self.versions.get(source) if caching else None
        data, tag = self.fetcher.fetch_versioned(source, kind, known)
        if data is None:  # not modified since ``known``
            assert known is not None
            cached = self.cache.peek(version_key(source, known, kind, *params))
            if cached is not None:
                self._count_hits(1)
                return cast(T, cached)
            data, tag = self.fetcher.fetch_versioned(source, kind)  # evicted: in full
            assert data is not None
        if tag is None:
            key = content_key(data, kind, *params)
        else:
            key = version_key(source, tag, kind, *params)
            if caching:
                self.versions.put(source, tag)
        body = data
        return self._cached(key, lambda: decode(body), size_of)


def _require_str(source: object) -> None:
    if not isinstance(source, str):
        raise InvalidRequest("media source must be a string")
