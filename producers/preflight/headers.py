"""Media sizes from headers: an image's dimensions, a video's dimensions, rate and length.

Nothing is decoded: ``PIL.Image.open`` parses the header only (``.size`` allocates no
pixels; a JPEG's reduced-scale ``draft`` is header arithmetic too), ``av.open`` reads the
container's metadata and, only when that says too little, counts packets without decoding
them, as the worker's probe does (``workers/media/video._probe``). The worker's own checks
that need no pixels (pixel and aspect limits, allowed formats and containers, byte caps,
duration) are applied here too, so a line the worker would refuse is reported up front.

Pillow and PyAV are the worker extra's; without them a size is unknown, never guessed
silently (``HeadersUnavailable``).

Local files are opened only for a local caller, and only through ``producers/localfiles.py``
(a regular file, opened non-blocking, never read past the byte cap); for a remote caller a
local path or ``file://`` URL is never opened, not even to learn whether it exists
(``LocalMediaNotRead``: its size is unknown).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

from vlmq.config.errors import (
    InvalidRequest,
    MediaDecodeFailed,
    MediaTooLarge,
    VlmqError,
)
from vlmq.config.media_checks import (
    check_aspect_ratio,
    check_image_pixels,
    decode_data_uri,
    demuxed_span,
    open_video_container,
)
from vlmq.config.settings import MediaSettings
from vlmq.config.vision import downscaled_size
from vlmq.producers.localfiles import open_local, resolve_local

__all__ = [
    "HeadersUnavailable",
    "ImageTarget",
    "LocalMediaNotRead",
    "RemoteMedia",
    "VideoHeader",
    "image_size",
    "open_media",
    "video_header",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_REMOTE_SCHEMES = ("http", "https", "s3")
# EXIF orientations that turn the picture a quarter turn (width and height swap).
_QUARTER_TURNS = {5, 6, 7, 8}
_ORIENTATION_TAG = 0x0112


class RemoteMedia(Exception):
    """A remote source (http, s3): not fetched for an estimate, its size is unknown."""


class LocalMediaNotRead(Exception):
    """A local path or ``file://`` URL named by a remote caller: never opened (its existence
    and size are not this caller's to learn), so its size is unknown."""


class HeadersUnavailable(Exception):
    """Pillow or PyAV is not installed here: sizes cannot be read."""


@dataclass(frozen=True)
class VideoHeader:
    """What the container says about the first video stream."""

    width: int
    height: int
    fps: float
    duration_s: float
    total_frames: int


@dataclass(frozen=True)
class ImageTarget:
    """What the worker decodes an image down to (``config.vision.downscaled_size``)."""

    max_pixels: int | None = None
    cover: tuple[int, int] | None = None


# --- sources ---------------------------------------------------------------------------------


def _local_path(source: str, base_dir: Path | None, confine: bool) -> str:
    """The resolved path of a local source; a relative one against ``base_dir`` (as
    ``vlmq submit`` resolves it before enqueueing), kept inside it when ``confine``."""
    scheme = _SCHEME.match(source)
    if scheme and scheme.group(1).lower() == "file":
        return resolve_local(unquote(urlsplit(source).path), None, confine=False)
    return resolve_local(source, base_dir, confine=confine)


def open_media(
    source: str,
    base_dir: Path | None,
    cap: int,
    *,
    local_files: bool = True,
    confine: bool = False,
) -> IO[bytes]:
    """A readable file for a local path, ``file://`` URL or ``data:`` URI, after the
    worker's byte cap; raises ``RemoteMedia`` for http(s)/s3, a ``VlmqError`` otherwise.

    ``local_files`` False (a remote caller): a local path or ``file://`` URL raises
    ``LocalMediaNotRead`` before anything touches the disk. Otherwise the file is opened the
    one safe way (``producers/localfiles.py``): only a regular file, opened non-blocking,
    never read past ``cap``; with ``confine`` a relative path must stay inside ``base_dir``.
    """
    scheme = _SCHEME.match(source)
    name = scheme.group(1).lower() if scheme else None
    if name in _REMOTE_SCHEMES:
        raise RemoteMedia(name)
    if name == "data":
        return io.BytesIO(decode_data_uri(source, cap)[1])
    if name not in (None, "file"):
        raise InvalidRequest("unsupported media source scheme")
    if not local_files:
        raise LocalMediaNotRead("local paths named by a remote caller are not read")
    # Buffered: Pillow and PyAV read headers in many small pieces.
    return io.BufferedReader(open_local(_local_path(source, base_dir, confine), cap))


# --- images ----------------------------------------------------------------------------------


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise HeadersUnavailable("Pillow is not installed") from None
    return Image


def _orientation(img: Any) -> int:
    """The EXIF orientation, from what the header already parsed: PNG keeps EXIF in a chunk
    that Pillow reads only by loading the pixels, so one it has not met counts as upright."""
    if img.format == "PNG" and "exif" not in img.info:
        return 1
    try:
        return int(img.getexif().get(_ORIENTATION_TAG, 1))
    except Exception:  # a broken EXIF block: the worker ignores it too
        return 1


def image_size(
    file: IO[bytes], media: MediaSettings, target: ImageTarget | None
) -> tuple[int, int]:
    """(height, width) the worker's decoded image will have: the header's size, reduced as
    a JPEG draft is, turned upright by its EXIF orientation, downscaled to ``target``."""
    image = _pil()
    try:
        with image.open(file, formats=media.image_formats) as img:
            width, height = img.size
            check_image_pixels((width, height), media)
            if target is not None:
                # A JPEG decodes at 1/2..1/8 scale where that still covers the target.
                img.draft("RGB", downscaled_size(img.size, target.max_pixels, target.cover))
                width, height = img.size
            if _orientation(img) in _QUARTER_TURNS:
                width, height = height, width
    except VlmqError:
        raise
    except image.DecompressionBombError:
        raise MediaTooLarge("image has too many pixels") from None
    except Exception:  # Pillow raises OSError, SyntaxError, ValueError... for a bad header
        raise MediaDecodeFailed("could not decode image") from None
    if target is not None:
        width, height = downscaled_size((width, height), target.max_pixels, target.cover)
    return height, width


# --- videos ----------------------------------------------------------------------------------


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise HeadersUnavailable("PyAV is not installed") from None
    return av


def _stream_fps(stream: Any) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate and rate > 0:
            return float(rate)
    return None


def _stream_duration_s(av: Any, container: Any, stream: Any) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / av.time_base
    return None


def _from_metadata(av: Any, container: Any, stream: Any) -> tuple[float, float, int] | None:
    """(fps, duration, frames) from the container's metadata, or None when it says too
    little (the worker then counts packets)."""
    fps = _stream_fps(stream)
    duration = _stream_duration_s(av, container, stream)
    frames = stream.frames if stream.frames and stream.frames > 0 else None
    if fps is None or (duration is None and frames is None):
        return None
    if frames is None:
        frames = max(1, round((duration or 0.0) * fps))
    if duration is None:
        duration = frames / fps
    return fps, duration, frames


def _from_packets(container: Any, stream: Any, media: MediaSettings) -> tuple[float, float, int]:
    """Count packets (no decoding), bounded as the worker bounds it."""
    count, duration = demuxed_span(container, stream, media)
    fps = _stream_fps(stream) or (count / duration if duration > 0 else 1.0)
    return fps, duration if duration > 0 else count / fps, count


def _read_video_header(av: Any, file: IO[bytes], media: MediaSettings) -> VideoHeader:
    with open_video_container(file, media) as container:
        if not container.streams.video:
            raise MediaDecodeFailed("media has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width or 0, stream.codec_context.height or 0
        if width * height > media.video_max_pixels_per_frame:
            raise MediaTooLarge("video resolution is too large")
        check_aspect_ratio(width, height, media, "video")
        timing = _from_metadata(av, container, stream)
    if timing is None:
        file.seek(0)
        with open_video_container(file, media) as container:
            timing = _from_packets(container, container.streams.video[0], media)
    fps, duration, frames = timing
    if duration > media.video_max_duration_s:
        raise MediaTooLarge("video is too long")
    if width <= 0 or height <= 0:
        raise MediaDecodeFailed("could not decode video")
    return VideoHeader(width, height, fps, duration, frames)


def video_header(file: IO[bytes], media: MediaSettings) -> VideoHeader:
    """The first video stream's size, frame rate, duration and frame count."""
    av = _av()
    try:
        return _read_video_header(av, file, media)
    except VlmqError:
        raise
    except Exception:  # av.FFmpegError, and ValueError/OSError from PyAV
        raise MediaDecodeFailed("could not decode video") from None
