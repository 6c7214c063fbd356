"""The demo's sample media: deterministic synthetic images and clips, made from a seed.

``vlmq demo`` / ``vlmq make-examples`` write them next to the bundled requests; the test suite
and the benchmarks build on them (tests/support/samples.py). Nothing binary is shipped. Images
have structure (gradients, shapes) plus seeded noise so that codecs and vision encoders see
something image-like. Each video frame carries its own index as a row of black/white
``FRAME_CODE_BLOCK`` pixel blocks, so a reader can tell exactly which source frame a sampler
returned, even after lossy compression.
"""

from __future__ import annotations

import base64
import io
import mimetypes
import random
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "FRAME_CODE_BLOCK",
    "MUXERS",
    "data_uri",
    "frame_code_bits",
    "make_image",
    "make_video_bytes",
    "save_image",
    "save_video",
]

FRAME_CODE_BLOCK = 8  # pixels per bit block; matches the 8x8 DCT blocks of most codecs
MUXERS = {"mkv": "matroska", "mp4": "mp4", "webm": "webm", "avi": "avi", "gif": "gif"}
_PIXEL_FORMATS = {"gif": "rgb8"}


def make_image(size: tuple[int, int] = (64, 64), seed: int = 0) -> Image.Image:
    """An RGB image: two gradients, a few seeded shapes, seeded noise."""
    width, height = size
    xs = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    ys = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    rng = np.random.default_rng(seed)
    base = np.stack([xs, ys, 255 - (xs + ys) / 2], axis=-1)
    noise = rng.normal(0.0, 12.0, size=(height, width, 3))
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, mode="RGB")
    _draw_shapes(image, random.Random(seed))
    return image


def _draw_shapes(image: Image.Image, rnd: random.Random) -> None:
    draw = ImageDraw.Draw(image)
    width, height = image.size
    for _ in range(3):
        x0, y0 = rnd.randrange(width), rnd.randrange(height)
        x1 = min(width - 1, x0 + rnd.randrange(4, max(5, width // 2)))
        y1 = min(height - 1, y0 + rnd.randrange(4, max(5, height // 2)))
        color = (rnd.randrange(256), rnd.randrange(256), rnd.randrange(256))
        if rnd.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            draw.ellipse((x0, y0, x1, y1), fill=color)
    draw.line((0, height - 1, width - 1, 0), fill=(255, 255, 255), width=max(1, width // 32))


def save_image(
    path: str | Path, size: tuple[int, int] = (64, 64), seed: int = 0, format: str = "PNG"
) -> Path:
    target = Path(path)
    image = make_image(size, seed)
    if format.upper() in ("JPEG", "BMP"):
        image = image.convert("RGB")
    image.save(target, format=format)
    return target


def frame_code_bits(width: int) -> int:
    """How many bit blocks the frame code of frames ``width`` pixels wide has."""
    return max(1, min(16, width // FRAME_CODE_BLOCK))


def _stamp_frame_code(image: Image.Image, index: int) -> Image.Image:
    """Write ``index`` (mod 2**bits) as a row of black/white blocks at the top."""
    stamped = image.copy()
    draw = ImageDraw.Draw(stamped)
    for bit in range(frame_code_bits(image.width)):
        on = (index >> bit) & 1
        x0 = bit * FRAME_CODE_BLOCK
        box = (x0, 0, x0 + FRAME_CODE_BLOCK - 1, FRAME_CODE_BLOCK - 1)
        draw.rectangle(box, fill=(255, 255, 255) if on else (0, 0, 0))
    return stamped


def _view(
    scene: Image.Image, width: int, index: int, n_frames: int, noise: np.random.Generator | None
) -> Image.Image:
    """The frame's background: the whole scene, or (a camera) a window panning across it with
    its own sensor noise."""
    if noise is None:
        return scene
    x = (scene.width - width) * index // max(1, n_frames - 1)
    view = np.asarray(scene.crop((x, 0, x + width, scene.height)), dtype=np.int16)
    grain = noise.integers(-6, 7, size=view.shape, dtype=np.int16)
    return Image.fromarray(np.clip(view + grain, 0, 255).astype(np.uint8), mode="RGB")


def _video_frame(base: Image.Image, index: int, n_frames: int) -> Image.Image:
    """The base image with a square moving left to right, plus the code row."""
    frame = base.copy()
    width, height = frame.size
    side = max(4, min(width, height) // 4)
    x = int((width - side) * index / max(1, n_frames - 1))
    y = height // 2 - side // 2
    ImageDraw.Draw(frame).rectangle((x, y, x + side - 1, y + side - 1), fill=(255, 32, 32))
    return _stamp_frame_code(frame, index)


def make_video_bytes(
    n_frames: int = 16,
    size: tuple[int, int] = (64, 64),
    fps: int = 8,
    seed: int = 0,
    container: str = "mp4",
    codec: str = "mpeg4",
    gop: int | None = None,
    live: bool = False,
    bit_rate: int | None = None,
    camera: bool = False,
) -> bytes:
    """Encode a synthetic clip with PyAV. ``codec`` may be "libx264" where the
    FFmpeg build has it; ``gop`` sets the keyframe interval (seek tests);
    ``live`` (Matroska/WebM) omits duration and cues, as streamed recordings do.
    ``bit_rate`` (default: high enough for the frame-code blocks of small clips);
    ``camera``: the view pans across a wider scene and every frame has its own sensor
    noise, so later frames carry new pixels as filmed clips do (a still scene costs an
    encoder its keyframes and almost nothing else)."""
    width, height = size
    if width % 2 or height % 2:
        raise ValueError("video width and height must be even")
    scene = make_image((width * 2 if camera else width, height), seed)
    noise = np.random.default_rng(seed) if camera else None
    buffer = io.BytesIO()
    muxer = MUXERS.get(container, container)
    options = {"live": "1"} if live else None
    with av.open(buffer, mode="w", format=muxer, container_options=options) as output:
        stream = output.add_stream(codec, rate=fps)
        if not isinstance(stream, av.VideoStream):
            raise ValueError("codec is not a video codec")
        stream.width, stream.height = width, height
        stream.pix_fmt = _PIXEL_FORMATS.get(codec, "yuv420p")
        # High quality so the frame-code blocks survive compression.
        stream.bit_rate = bit_rate or max(200_000, width * height * fps * 4)
        if gop is not None:
            stream.codec_context.gop_size = gop
        for index in range(n_frames):
            base = _view(scene, width, index, n_frames, noise)
            frame = av.VideoFrame.from_image(_video_frame(base, index, n_frames))
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def save_video(path: str | Path, **kwargs: object) -> Path:
    """Write :func:`make_video_bytes` output; the container defaults to the suffix."""
    target = Path(path)
    if "container" not in kwargs and target.suffix:
        kwargs["container"] = target.suffix.lstrip(".").lower()
    target.write_bytes(make_video_bytes(**kwargs))  # type: ignore[arg-type]
    return target


def data_uri(path_or_bytes: str | Path | bytes, mime: str | None = None) -> str:
    """``data:<mime>;base64,...``; the MIME type is guessed from a path's suffix."""
    if isinstance(path_or_bytes, bytes):
        payload = path_or_bytes
    else:
        payload = Path(path_or_bytes).read_bytes()
        mime = mime or mimetypes.guess_type(str(path_or_bytes))[0]
    encoded = base64.b64encode(payload).decode("ascii")
    return f"data:{mime or 'application/octet-stream'};base64,{encoded}"
