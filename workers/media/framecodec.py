"""How prepared media (decoded, sampled, resized RGB frames plus their video metadata) is
serialised for the frame store: one self-describing, checksummed object.

Layout: ``MAGIC | u32 header length | header (JSON) | payload | SHA-256 of all before it``.
The header names the codec and each frame's size (and, for the per-frame codecs, each frame's
byte length), so any worker reads any object whatever codec wrote it. Every codec here is
lossless: frames read back are byte-identical to the ones written (tested), which is what lets
a prepared-from-store request give the same tokens as a direct one. The codec was chosen by
measurement (``python -m bench.framestore``, bench/README.md): raw uint8 + zstd level 3
(``zstandard``, in the worker extra), with raw uint8 + zlib level 1 where it is missing.

Torch-free: prepare workers run without a model.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from vlmq.workers.media.decode import DecodedVideo

__all__ = [
    "CODECS",
    "CorruptObject",
    "PreparedMedia",
    "decode_object",
    "encode_object",
    "resolve_codec",
    "zstd_available",
]

PreparedMedia = Image.Image | DecodedVideo

MAGIC = b"VLMQFRM1"
_LENGTH = struct.Struct(">I")
_DIGEST_BYTES = 32
_MAX_HEADER_BYTES = 1 << 20
_RGB = 3


class CorruptObject(Exception):
    """The object is not one this module wrote intact: wrong magic, checksum, header or sizes."""


# --- codecs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Codec:
    """``encode(frames) -> (payload, per-frame lengths or [])``;
    ``decode(payload, sizes, lengths) -> frames``."""

    encode: Callable[[list[Image.Image]], tuple[bytes, list[int]]]
    decode: Callable[[bytes, list[tuple[int, int]], list[int]], list[Image.Image]]


def _raw(frames: list[Image.Image]) -> bytes:
    return b"".join(frame.tobytes() for frame in frames)


def _split_raw(raw: bytes, sizes: list[tuple[int, int]]) -> list[Image.Image]:
    if len(raw) != _raw_bytes(sizes):
        raise CorruptObject("frame bytes do not match the header")
    frames, offset = [], 0
    for width, height in sizes:
        end = offset + width * height * _RGB
        frames.append(Image.frombytes("RGB", (width, height), raw[offset:end]))
        offset = end
    return frames


def _raw_bytes(sizes: list[tuple[int, int]]) -> int:
    return sum(width * height * _RGB for width, height in sizes)


def _zlib_encode(frames: list[Image.Image], level: int = 1) -> tuple[bytes, list[int]]:
    return zlib.compress(_raw(frames), level), []


def _zlib_decode(payload: bytes, sizes: list[tuple[int, int]], _: list[int]) -> list[Image.Image]:
    expected = _raw_bytes(sizes)
    inflater = zlib.decompressobj()
    try:
        # Never more than the header's frames need: a crafted object cannot inflate a bomb.
        raw = inflater.decompress(payload, expected + 1)
    except zlib.error:
        raise CorruptObject("frames do not decompress") from None
    if not inflater.eof or inflater.unconsumed_tail:
        raise CorruptObject("frame bytes do not match the header")
    return _split_raw(raw, sizes)


def zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_codec(name: str) -> str:
    """``auto``: zstd where ``zstandard`` is importable (measured best by far), else zlib."""
    if name != "auto":
        return name
    return "zstd" if zstd_available() else "zlib"


def _zstd_encode(frames: list[Image.Image], level: int = 3) -> tuple[bytes, list[int]]:
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(_raw(frames)), []


def _zstd_decode(payload: bytes, sizes: list[tuple[int, int]], _: list[int]) -> list[Image.Image]:
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=_raw_bytes(sizes))
    except zstandard.ZstdError:
        raise CorruptObject("frames do not decompress") from None
    return _split_raw(raw, sizes)


def _image_encoder(
    format: str, **params: Any
) -> Callable[[list[Image.Image]], tuple[bytes, list[int]]]:
    def encode(frames: list[Image.Image]) -> tuple[bytes, list[int]]:
        parts = []
        for frame in frames:
            buffer = io.BytesIO()
            frame.save(buffer, format=format, **params)
            parts.append(buffer.getvalue())
        return b"".join(parts), [len(p) for p in parts]

    return encode


def _image_decode(
    payload: bytes, sizes: list[tuple[int, int]], lengths: list[int]
) -> list[Image.Image]:
    if len(lengths) != len(sizes) or sum(lengths) != len(payload):
        raise CorruptObject("frame lengths do not match the header")
    frames, offset = [], 0
    for size, length in zip(sizes, lengths, strict=True):
        try:
            with Image.open(io.BytesIO(payload[offset : offset + length])) as img:
                if img.size != size or img.mode != "RGB":
                    raise CorruptObject("a frame does not match the header")
                img.load()
                frames.append(img.copy())
        except CorruptObject:
            raise
        except Exception:  # Pillow's OSError, SyntaxError, ValueError...
            raise CorruptObject("a frame does not decode") from None
        offset += length
    return frames


CODECS: dict[str, _Codec] = {
    "zlib": _Codec(_zlib_encode, _zlib_decode),
    "zstd": _Codec(_zstd_encode, _zstd_decode),
    "png": _Codec(_image_encoder("PNG", compress_level=1), _image_decode),
    "webp": _Codec(_image_encoder("WEBP", lossless=True, quality=0, method=0), _image_decode),
}


# --- the object -----------------------------------------------------------------------------


def encode_object(media: PreparedMedia, codec: str) -> bytes:
    """One stored object for an image or a sampled video."""
    frames = [media] if isinstance(media, Image.Image) else list(media.frames)
    if any(frame.mode != "RGB" for frame in frames):
        raise ValueError("prepared media must be RGB")
    payload, lengths = CODECS[codec].encode(frames)
    header = {
        "codec": codec,
        "sizes": [list(frame.size) for frame in frames],
        "lengths": lengths,
        "video": None if isinstance(media, Image.Image) else _video_header(media),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + _LENGTH.pack(len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def _video_header(video: DecodedVideo) -> dict[str, Any]:
    return {
        "fps": video.fps,
        "duration_s": video.duration_s,
        "frame_indices": list(video.frame_indices),
        "total_frames": video.total_frames,
    }


def decode_object(data: bytes, max_pixels: int, max_frames: int) -> PreparedMedia:
    """The image or video an object holds, or CorruptObject. ``max_pixels`` (per frame) and
    ``max_frames`` bound what a header may ask to be allocated."""
    body = _verified_body(data)
    header, payload = _split(body)
    sizes = _sizes(header, max_pixels, max_frames)
    codec = CODECS.get(str(header.get("codec")))
    if codec is None:
        raise CorruptObject("unknown codec")
    lengths = header.get("lengths") or []
    if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
        raise CorruptObject("bad frame lengths")
    if header.get("codec") == "zstd" and not zstd_available():
        raise CorruptObject("a zstd object needs the zstandard package")
    frames = codec.decode(payload, sizes, lengths)
    video = header.get("video")
    if video is None:
        if len(frames) != 1:
            raise CorruptObject("an image object holds one frame")
        return frames[0]
    return _video(frames, video)


def _verified_body(data: bytes) -> bytes:
    if len(data) < len(MAGIC) + _LENGTH.size + _DIGEST_BYTES or not data.startswith(MAGIC):
        raise CorruptObject("not a frame store object")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptObject("checksum mismatch")
    return body


def _split(body: bytes) -> tuple[dict[str, Any], bytes]:
    start = len(MAGIC) + _LENGTH.size
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    if length > _MAX_HEADER_BYTES or start + length > len(body):
        raise CorruptObject("bad header length")
    try:
        header = json.loads(body[start : start + length])
    except ValueError:
        raise CorruptObject("bad header") from None
    if not isinstance(header, dict):
        raise CorruptObject("bad header")
    return header, body[start + length :]


def _sizes(header: dict[str, Any], max_pixels: int, max_frames: int) -> list[tuple[int, int]]:
    raw = header.get("sizes")
    if not isinstance(raw, list) or not 1 <= len(raw) <= max_frames:
        raise CorruptObject("bad frame count")
    sizes = []
    for item in raw:
        pair = isinstance(item, list) and len(item) == 2
        if not pair or not all(isinstance(v, int) for v in item):
            raise CorruptObject("bad frame size")
        width, height = item
        if width < 1 or height < 1 or width * height > max_pixels:
            raise CorruptObject("bad frame size")
        sizes.append((width, height))
    return sizes


def _video(frames: list[Image.Image], video: Any) -> DecodedVideo:
    try:
        indices = [int(i) for i in video["frame_indices"]]
        fps, duration = float(video["fps"]), float(video["duration_s"])
        total = int(video["total_frames"])
    except (KeyError, TypeError, ValueError):
        raise CorruptObject("bad video metadata") from None
    if len(indices) != len(frames):
        raise CorruptObject("bad video metadata")
    width, height = frames[0].size
    return DecodedVideo(frames, fps, duration, indices, total, width, height)
