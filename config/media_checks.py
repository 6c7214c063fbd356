"""Media checks shared by producers and workers, torch-free: inline ``data:`` URIs, and the
pixel and aspect limits a header is judged by before anything is decoded.

The worker's fetch and decode, the producer's staging and its pre-flight estimate all apply
these same rules, so a request the estimate or the stager accepts is one a worker accepts.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import IO, Any

from vlmq.config.errors import InvalidRequest, MediaDecodeFailed, MediaTooLarge
from vlmq.config.settings import MediaSettings

__all__ = [
    "check_aspect_ratio",
    "check_image_pixels",
    "decode_data_uri",
    "demuxed_span",
    "open_video_container",
]

_MAX_DATA_URI_HEADER = 256
_WHITESPACE = str.maketrans("", "", " \t\r\n")


def check_path_name(path: str) -> None:
    """A local media path that can name a file: no NUL, valid Unicode (a lone surrogate has
    no file-system name). InvalidRequest otherwise."""
    if "\x00" in path:
        raise InvalidRequest("media path contains a NUL character")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise InvalidRequest("media path is not valid Unicode") from None


def decode_data_uri(uri: str, cap: int) -> tuple[str, bytes]:
    """(declared type, bytes) of ``data:[<mime>][;params];base64,<payload>``, after checking
    that the decoded size cannot exceed ``cap`` (so a huge URI is never decoded)."""
    comma = uri.find(",", 0, _MAX_DATA_URI_HEADER)
    if comma < 0:
        raise InvalidRequest("malformed data URI")
    declared, *params = uri[len("data:") : comma].split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidRequest("data URI must be base64-encoded")
    # 4 base64 characters carry 3 bytes; whitespace only makes this an overestimate.
    if (len(uri) - comma - 1) // 4 * 3 > cap + 2:
        raise MediaTooLarge("media is larger than the allowed size")
    try:
        data = base64.b64decode(uri[comma + 1 :].translate(_WHITESPACE), validate=True)
    except (binascii.Error, ValueError):
        raise MediaDecodeFailed("data URI payload is not valid base64") from None
    if len(data) > cap:
        raise MediaTooLarge("media is larger than the allowed size")
    if not data:
        raise MediaDecodeFailed("data URI payload is empty")
    return declared.strip().lower(), data


def check_image_pixels(size: tuple[int, int], settings: MediaSettings) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaDecodeFailed("could not decode image")
    if width * height > settings.max_image_pixels:
        raise MediaTooLarge("image has too many pixels")
    check_aspect_ratio(width, height, settings, "image")


def check_aspect_ratio(width: int, height: int, settings: MediaSettings, kind: str) -> None:
    """A 1x100000 image is within the pixel limit but no processor can tile it."""
    limit = settings.max_aspect_ratio
    if width > 0 and height > 0 and max(width, height) > limit * min(width, height):
        raise MediaDecodeFailed(f"{kind} aspect ratio is more than {limit:g}:1")


def _refuse_nested_open(url: str, flags: int, options: dict[str, Any]) -> Any:
    # Demuxers that reference other files or URLs (playlists, drefs) get nothing.
    raise PermissionError("nested media opens are disabled")


def open_video_container(file: IO[bytes], settings: MediaSettings) -> Any:
    """A PyAV container over ``file``, opened the one safe way: only the allowlisted demuxers
    are even probed, so formats with references to other files (hls, concat) never parse
    the input, and a nested open is refused. (PyAV is imported here, not at import: the
    producer's base install has none.)"""
    import av

    container = av.open(
        file,
        mode="r",
        container_options={"format_whitelist": ",".join(settings.video_formats)},
        metadata_errors="ignore",
        io_open=_refuse_nested_open,
    )
    if container.format.name not in settings.video_formats:
        container.close()
        raise MediaDecodeFailed("video container format is not allowed")
    return container


def demuxed_span(container: Any, stream: Any, settings: MediaSettings) -> tuple[int, float]:
    """(packets, seconds) of a stream that carries no usable duration, counted by demuxing
    alone (nothing decoded), bounded by ``video_max_decoded_frames``."""
    count, first, end = 0, None, None
    for packet in container.demux(stream):
        if packet.pts is None or packet.size == 0:
            continue  # the flush packet
        count += 1
        if count > settings.video_max_decoded_frames:
            raise MediaTooLarge("video has too many frames")
        first = packet.pts if first is None else min(first, packet.pts)
        stop = packet.pts + (packet.duration or 0)
        end = stop if end is None else max(end, stop)
    if count == 0 or first is None or end is None:
        raise MediaDecodeFailed("video has no decodable frames")
    return count, float((end - first) * (stream.time_base or 1))
