"""Synthetic media for tests and benchmarks: the demo's sample media
(``vlmq.workers.demo.media``, re-exported here) plus what only tests need: reading a frame's
stamped index back, an audio-only file, a PNG bomb, re-encoding."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import av
import numpy as np
from PIL import Image

from vlmq.workers.demo.media import (
    FRAME_CODE_BLOCK,
    MUXERS,
    data_uri,
    frame_code_bits,
    make_image,
    make_video_bytes,
    save_image,
    save_video,
)

__all__ = [
    "data_uri",
    "encode",
    "frame_code_modulus",
    "make_audio_bytes",
    "make_image",
    "make_video_bytes",
    "png_header_only",
    "read_frame_code",
    "save_image",
    "save_video",
]


def frame_code_modulus(width: int) -> int:
    """Frame codes wrap at this value for frames ``width`` pixels wide."""
    return 1 << frame_code_bits(width)


def read_frame_code(image: Image.Image) -> int:
    """Read back the index :func:`make_video_bytes` stamped on a frame (mod 2**bits)."""
    gray = np.asarray(image.convert("L"), dtype=np.float32)
    block_size = FRAME_CODE_BLOCK
    value = 0
    for bit in range(frame_code_bits(image.width)):
        x0 = bit * block_size
        block = gray[1 : block_size - 1, x0 + 1 : x0 + block_size - 1]
        if block.mean() > 127:
            value |= 1 << bit
    return value


def make_audio_bytes(
    duration_s: float = 0.5, sample_rate: int = 16000, container: str = "mp4", codec: str = "aac"
) -> bytes:
    """An audio-only file (a sine tone): a valid container with no video stream."""
    samples = int(duration_s * sample_rate)
    tone = np.sin(2 * np.pi * 440.0 * np.arange(samples) / sample_rate).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=MUXERS.get(container, container)) as output:
        stream = output.add_stream(codec, rate=sample_rate)
        if not isinstance(stream, av.AudioStream):
            raise ValueError("codec is not an audio codec")
        frame = av.AudioFrame.from_ndarray(tone[None, :], format="fltp", layout="mono")
        frame.sample_rate = sample_rate
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def encode(image: Image.Image, format: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **params)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a size in IHDR and carries no pixels: a bomb for free."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
