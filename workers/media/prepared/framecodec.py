"""How prepared media (decoded, sampled, resized RGB frames plus their video metadata) is
serialised for the frame store: one self-describing, checksummed object.

Layout: ``MAGIC | u32 header length | header (JSON) | payload | SHA-256``. The header names
the codec, the frames' size and count (and, for the per-frame image codecs, each frame's byte
length), so any worker reads any object whatever codec wrote it. The payload is the frames
*planar*, ``(frames, 3, height, width)`` uint8, which is what the processors take: read
back, it becomes their input without a copy (``Pixels``, workers/media/prepared/pixels.py).

The checksum: the raw codec's payload starts with the XXH3-128 of its frames, and zstd and
zlib check their own payload while decompressing (zstd's XXH64 of the content, zlib's
Adler-32); for these (``"checked": "payload"`` in the header) the SHA-256 covers the header
only, so reading a clip back does not hash ~29 MB with a slow hash. For the image codecs it
covers the payload too. Every codec here is lossless: frames read back are byte-identical to
the ones written (tested), which is what lets a prepared-from-store request give the same
tokens as a direct one. The codec was chosen by measurement (``python -m bench.framestore``,
bench/README.md): raw uint8 checked by XXH3 (``xxhash``, in the worker and prepare extras),
whose frames a GPU worker uses where they lie (a ``file://`` store maps the object: no copy,
no decompression; ~15% more bytes than zstd -1, which only leaves the frames' literals raw
anyway); raw uint8 + zstd (``frame_store.zstd_level``) without ``xxhash``, raw uint8 + zlib
level 1 without either.

Torch-free: prepare workers run without a model.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from PIL import Image

from vlmq.workers.media.prepared.pixels import CHANNELS, Pixels, pixels_of
from vlmq.workers.media.video import DecodedVideo

__all__ = [
    "CODECS",
    "CorruptObject",
    "PreparedMedia",
    "decode_object",
    "encode_object",
    "missing_package",
    "resolve_codec",
]

# What the store keeps and gives back: an image (written from Pillow, read back as one
# frame of ``Pixels``) or a sampled video (its frames as ``Pixels`` once read back).
PreparedMedia = Image.Image | Pixels | DecodedVideo
Shape = tuple[int, int, int, int]
Allocate = Callable[[Shape], np.ndarray]  # an uninitialised uint8 array of that shape

MAGIC = b"VLMQFRM2"
_LENGTH = struct.Struct(">I")
_DIGEST_BYTES = 32
_MAX_HEADER_BYTES = 1 << 20
_SELF_CHECKED = "payload"  # the header's ``checked``: the codec verifies its payload
_READ_SIZE = 1 << 20  # compressed bytes per step of a zstd read (measured best of 128K-all)


class CorruptObject(Exception):
    """The object is not one this module wrote intact: wrong magic, checksum, header or sizes."""


# --- codecs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Codec:
    """``encode(pixels) -> (payload, per-frame lengths or [])``;
    ``decode(payload, shape, lengths, allocate) -> planar uint8 array of that shape``
    (``allocate(shape)``: where a codec that decompresses into memory puts the frames).
    ``checks``: decoding verifies the payload itself (a flipped byte cannot read back as
    pixels). ``package``: the optional dependency its encoder and decoder import."""

    encode: Callable[..., tuple[bytes, list[int]]]
    decode: Callable[[memoryview, Shape, list[int], Allocate], np.ndarray]
    checks: bool = False
    package: str | None = None


def _planar(raw: bytes, shape: Shape) -> np.ndarray:
    if len(raw) != _raw_bytes(shape):
        raise CorruptObject("frame bytes do not match the header")
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def _raw_bytes(shape: Shape) -> int:
    frames, channels, height, width = shape
    return frames * channels * height * width


def _zlib_encode(pixels: Pixels, level: int = 1) -> tuple[bytes, list[int]]:
    return zlib.compress(pixels.array.tobytes(), level), []


def _zlib_decode(payload: memoryview, shape: Shape, _: list[int], __: Allocate) -> np.ndarray:
    expected = _raw_bytes(shape)
    inflater = zlib.decompressobj()
    try:
        # Never more than the header's frames need: a crafted object cannot inflate a bomb.
        # zlib checks the stream's Adler-32 when it reaches the end.
        raw = inflater.decompress(payload, expected + 1)
    except zlib.error:
        raise CorruptObject("frames do not decompress") from None
    if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise CorruptObject("frame bytes do not match the header")
    return _planar(raw, shape)


@cache
def package_available(package: str) -> bool:
    """Asked on every object read (``decode_object``): a process's packages do not change,
    and a failed import searches the path again each time."""
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def missing_package(codec: str) -> str | None:
    """The package ``codec`` needs and this process cannot import, or None."""
    package = CODECS[codec].package
    return package if package is not None and not package_available(package) else None


def resolve_codec(name: str) -> str:
    """``auto``: raw frames checked by XXH3 where ``xxhash`` is importable (the cheapest for
    the GPU worker that reads them back, measured), else zstd, else zlib."""
    if name != "auto":
        return name
    return next(codec for codec in ("raw", "zstd", "zlib") if missing_package(codec) is None)


def _zstd_encode(pixels: Pixels, level: int = -1) -> tuple[bytes, list[int]]:
    import zstandard

    # The content checksum (XXH64) is what verifies the payload on reading.
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return compressor.compress(pixels.array.reshape(-1).data), []  # the array itself: no copy


def _zstd_decode(payload: memoryview, shape: Shape, _: list[int], allocate: Allocate) -> np.ndarray:
    import zstandard

    expected = _raw_bytes(shape)
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError:
        raise CorruptObject("frames do not decompress") from None
    if not params.has_checksum or params.content_size != expected:
        raise CorruptObject("frame bytes do not match the header")
    # Straight into an array (a GPU worker's come from its BufferPool: memory already
    # faulted in), never through a bytes object.
    out = allocate(shape)
    view = out.reshape(-1).data
    try:
        reader = _decompressor().stream_reader(payload, read_size=_READ_SIZE)
        filled = 0
        while filled < expected:
            count = reader.readinto(view[filled:])
            if not count:
                break
            filled += count
        # Reading on to the frame's end is what checks its checksum (and finds extra data).
        if filled != expected or reader.readinto(bytearray(1)):
            raise CorruptObject("frame bytes do not match the header")
    except zstandard.ZstdError:
        raise CorruptObject("frames do not decompress") from None
    return out


_THREAD = threading.local()


def _decompressor() -> Any:
    """This thread's zstd decompressor, kept: a new one allocates its context and a window
    buffer of several MB for each object, and that fresh memory's page faults cost a GPU
    worker ~3 ms of CPU per photo (measured). One decompressor serves one read at a time."""
    import zstandard

    decompressor = getattr(_THREAD, "zstd", None)
    if decompressor is None:
        decompressor = _THREAD.zstd = zstandard.ZstdDecompressor()
    return decompressor


_XXH_BYTES = 16  # XXH3-128


def _raw_encode(pixels: Pixels) -> tuple[bytes, list[int]]:
    import xxhash

    frames = pixels.array.reshape(-1).data
    return b"".join((xxhash.xxh3_128_digest(frames), frames)), []


def _raw_decode(payload: memoryview, shape: Shape, _: list[int], __: Allocate) -> np.ndarray:
    """The frames where they lie (a view: over a mapped file, no copy at all), once their
    XXH3-128 matches: ~0.2 ms for a 1080p photo, where decompressing zstd costs ~1.2 ms."""
    import xxhash

    frames = payload[_XXH_BYTES:]
    if len(frames) != _raw_bytes(shape):
        raise CorruptObject("frame bytes do not match the header")
    if xxhash.xxh3_128_digest(frames) != bytes(payload[:_XXH_BYTES]):
        raise CorruptObject("checksum mismatch")
    return np.frombuffer(frames, dtype=np.uint8).reshape(shape)


def _image_encoder(format: str, **params: Any) -> Callable[[Pixels], tuple[bytes, list[int]]]:
    def encode(pixels: Pixels) -> tuple[bytes, list[int]]:
        parts = []
        for index in range(len(pixels)):
            buffer = io.BytesIO()
            pixels.image(index).save(buffer, format=format, **params)
            parts.append(buffer.getvalue())
        return b"".join(parts), [len(p) for p in parts]

    return encode


def _image_decode(
    payload: memoryview, shape: Shape, lengths: list[int], __: Allocate
) -> np.ndarray:
    count, _, height, width = shape
    if len(lengths) != count or sum(lengths) != len(payload):
        raise CorruptObject("frame lengths do not match the header")
    frames, offset = [], 0
    for length in lengths:
        try:
            with Image.open(io.BytesIO(payload[offset : offset + length])) as img:
                if img.size != (width, height) or img.mode != "RGB":
                    raise CorruptObject("a frame does not match the header")
                img.load()
                frames.append(img.copy())
        except CorruptObject:
            raise
        except Exception:  # Pillow's OSError, SyntaxError, ValueError...
            raise CorruptObject("a frame does not decode") from None
        offset += length
    return pixels_of(frames).array


CODECS: dict[str, _Codec] = {
    "raw": _Codec(_raw_encode, _raw_decode, checks=True, package="xxhash"),
    "zlib": _Codec(_zlib_encode, _zlib_decode, checks=True),
    "zstd": _Codec(_zstd_encode, _zstd_decode, checks=True, package="zstandard"),
    "png": _Codec(_image_encoder("PNG", compress_level=1), _image_decode),
    "webp": _Codec(_image_encoder("WEBP", lossless=True, quality=0, method=0), _image_decode),
}


# --- the object -----------------------------------------------------------------------------


def encode_object(media: PreparedMedia, codec: str, **params: Any) -> bytes:
    """One stored object for an image or a sampled video (ValueError: frames that are not
    RGB or not all one size, which the store does not keep). ``params`` go to the codec's
    encoder (zstd's ``level``)."""
    pixels = _pixels_of(media)
    chosen = CODECS[codec]
    payload, lengths = chosen.encode(pixels, **params)
    header = {
        "codec": codec,
        "frames": len(pixels),
        "size": [pixels.width, pixels.height],
        "lengths": lengths,
        "checked": _SELF_CHECKED if chosen.checks else "all",
        "video": _video_header(media) if isinstance(media, DecodedVideo) else None,
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + _LENGTH.pack(len(encoded)) + encoded
    digest = hashlib.sha256(head)
    if not chosen.checks:
        digest.update(payload)
    return b"".join((head, payload, digest.digest()))


def _pixels_of(media: PreparedMedia) -> Pixels:
    if isinstance(media, Pixels):
        return media
    frames = media.frames if isinstance(media, DecodedVideo) else [media]
    if isinstance(frames, Pixels):
        return frames
    if not isinstance(frames, list):  # device frames (devpixels.DeviceFrames): never stored
        raise ValueError("prepared frames must be on the host")
    if any(frame.mode != "RGB" for frame in frames):
        raise ValueError("prepared media must be RGB")
    if len({frame.size for frame in frames}) != 1:
        raise ValueError("prepared frames must share one size")
    return pixels_of(frames)


def _video_header(video: DecodedVideo) -> dict[str, Any]:
    return {
        "fps": video.fps,
        "duration_s": video.duration_s,
        "frame_indices": list(video.frame_indices),
        "total_frames": video.total_frames,
    }


def decode_object(
    data: bytes | memoryview,
    max_pixels: int,
    max_frames: int,
    key: str | None = None,
    allocate: Allocate | None = None,
) -> Pixels | DecodedVideo:
    """The image (one frame of ``Pixels``) or video an object holds, or CorruptObject.
    ``max_pixels`` (per frame) and ``max_frames`` bound what a header may ask to be
    allocated; ``key`` names the pixels (the store's content address); ``allocate`` gives
    the memory the frames are decompressed into (default: a new array)."""
    header, payload = _split(data)
    name = str(header.get("codec"))
    codec = CODECS.get(name)
    if codec is None:
        raise CorruptObject("unknown codec")
    _verify(data, len(data) - len(payload) - _DIGEST_BYTES, codec.checks, header)
    shape = _shape(header, max_pixels, max_frames)
    lengths = header.get("lengths") or []
    if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
        raise CorruptObject("bad frame lengths")
    missing = missing_package(name)
    if missing is not None:
        raise CorruptObject(f"a {name} object needs the {missing} package")
    pixels = Pixels(codec.decode(payload, shape, lengths, allocate or _new_array), key)
    video = header.get("video")
    if video is None:
        if len(pixels) != 1:
            raise CorruptObject("an image object holds one frame")
        return pixels
    return _video(pixels, video)


def _new_array(shape: Shape) -> np.ndarray:
    return np.empty(shape, dtype=np.uint8)


def _split(data: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The header, and the payload (what lies between it and the digest)."""
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start + _DIGEST_BYTES or bytes(data[: len(MAGIC)]) != MAGIC:
        raise CorruptObject("not a frame store object")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > _MAX_HEADER_BYTES or start + length > len(data) - _DIGEST_BYTES:
        raise CorruptObject("bad header length")
    try:
        header = json.loads(bytes(data[start : start + length]))
    except ValueError:
        raise CorruptObject("bad header") from None
    if not isinstance(header, dict):
        raise CorruptObject("bad header")
    # A view, not a copy: a clip's payload is tens of MB.
    return header, memoryview(data)[start + length : len(data) - _DIGEST_BYTES]


def _verify(
    data: bytes | memoryview, head_bytes: int, codec_checks: bool, header: dict[str, Any]
) -> None:
    """The digest covers the header, and the payload unless its codec checks it (the
    header, covered, says which: a flipped ``checked`` is caught too)."""
    self_checked = header.get("checked") == _SELF_CHECKED
    if self_checked and not codec_checks:
        raise CorruptObject("bad header")
    view = memoryview(data)
    covered = view[:head_bytes] if self_checked else view[: len(data) - _DIGEST_BYTES]
    if hashlib.sha256(covered).digest() != bytes(view[-_DIGEST_BYTES:]):
        raise CorruptObject("checksum mismatch")


def _shape(header: dict[str, Any], max_pixels: int, max_frames: int) -> Shape:
    count, size = header.get("frames"), header.get("size")
    if not isinstance(count, int) or not 1 <= count <= max_frames:
        raise CorruptObject("bad frame count")
    if not isinstance(size, list) or len(size) != 2 or not all(isinstance(v, int) for v in size):
        raise CorruptObject("bad frame size")
    width, height = size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise CorruptObject("bad frame size")
    return count, CHANNELS, height, width


def _video(pixels: Pixels, video: Any) -> DecodedVideo:
    try:
        indices = [int(i) for i in video["frame_indices"]]
        fps, duration = float(video["fps"]), float(video["duration_s"])
        total = int(video["total_frames"])
    except (KeyError, TypeError, ValueError):
        raise CorruptObject("bad video metadata") from None
    if len(indices) != len(pixels):
        raise CorruptObject("bad video metadata")
    return DecodedVideo(pixels, fps, duration, indices, total, pixels.width, pixels.height)
