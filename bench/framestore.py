"""The frame store's format, what a hit saves, and keyframe sampling: measured side by side.

Sections (``--repeats`` runs each; medians with the spread, min-max):

* **formats**: encode and decode time and bytes of prepared media, per 1080p photo downscaled
  to the processor's target and per 16-frame sample of a 20 s 720p clip (the small Qwen2.5-VL
  checkpoint's processor targets, as ``bench.pipeline``): raw uint8 + zlib (levels 1 and 6),
  raw uint8 + zstd (level 3; only where ``zstandard`` is importable: not a vlmq dependency),
  PNG (levels 1 and 6), lossless WebP (fastest and default effort), and JPEG q95 with its
  mean / max pixel error. The lossless ones are timed through the store's own object
  (``framecodec``: header and SHA-256 included) and checked to read back byte-identical.
* **store**: reading a stored object back from a ``file://`` store against decoding the
  source again, and what a ``put`` costs the first request (encode + write).
* **keyframes**: 16 samples (2 fps) of 20 s 720p H.264 clips with a keyframe every 30, 60 and
  250 frames: exact vs keyframe sampling, decode seconds (wall and process CPU: the
  decoder's slice threads run in parallel), frames decoded, and the mean |timestamp error|
  of the keyframe samples against the exact ones.

    python -m bench.framestore                       # everything, 3 repeats, writes README
    python -m bench.framestore --seconds 4 --repeats 1 --write ''   # a quick look
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.common import machine, replace_section
from bench.realmedia import clips, photos

ROOT = Path(__file__).resolve().parents[1]
MARKER = "framestore"
GOPS = (30, 60, 250)


@dataclass
class Media:
    """The prepared media measured: one downscaled photo and one 16-frame clip sample."""

    photo_bytes: bytes
    photo: Image.Image
    clip_bytes: dict[int, bytes]
    camera_bytes: dict[int, bytes]  # filmed-like clips at 4 Mbit/s (bench/realmedia.py)
    clip: Any  # DecodedVideo of the GOP 60 clip
    image_target: Any
    video_target: Any


def _timed(call: Callable[[], Any], repeats: int) -> list[float]:
    return _timed_cpu(call, repeats)[0]


def _timed_cpu(call: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds per call: the decoder's slice threads make the wall
    time shorter than the CPU a prepare core spends."""
    wall, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return wall, cpu


def _ms(values: list[float]) -> str:
    low, high = min(values) * 1000, max(values) * 1000
    return f"{statistics.median(values) * 1000:.1f} ({low:.1f}-{high:.1f})"


def _s(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def targets(name: str) -> tuple[Any, Any]:
    """The resize targets of images and video frames: ``serving``, Qwen2.5-VL as commonly
    served (images at most 1280 x 28 x 28 pixels, video frames 768 x 28 x 28: its video
    processor's default), or ``small``, the small bench checkpoint's processor (what
    ``bench.pipeline`` decodes to: 50,176 and 12,544 pixels)."""
    from vlmq.workers.media import Downscale

    if name == "serving":
        return Downscale(max_pixels=1280 * 28 * 28), Downscale(max_pixels=768 * 28 * 28)
    from bench.fleet import _model_dir
    from vlmq.config.settings import EngineSettings
    from vlmq.workers.engine.model import load_processor
    from vlmq.workers.engine.prepare import visual_downscale

    processor = load_processor(str(_model_dir(ROOT / ".vlmq" / "bench")), EngineSettings())
    return visual_downscale(processor)


def load_media(seconds: int, target: str) -> Media:
    from vlmq.config.settings import MediaSettings
    from vlmq.workers.media import decode_image, decode_video

    image_target, video_target = targets(target)
    photo_bytes = photos(1)[0].read_bytes()
    clip_bytes = {gop: clips(1, seconds, gop=gop)[0].read_bytes() for gop in GOPS}
    camera_bytes = {gop: clips(1, seconds, gop=gop, camera=True)[0].read_bytes() for gop in GOPS}
    settings = MediaSettings()
    return Media(
        photo_bytes,
        decode_image(photo_bytes, settings, image_target),
        clip_bytes,
        camera_bytes,
        decode_video(clip_bytes[60], settings, 2.0, 16, video_target),
        image_target,
        video_target,
    )


# --- formats --------------------------------------------------------------------------------


def _store_codecs() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, codec, overrides of its encoder): the store's lossless codecs and variants."""
    from vlmq.workers.media.prepared.framecodec import missing_package

    variants = [
        ("raw uint8 + zlib 1 (without zstandard)", "zlib", {}),
        ("raw uint8 + zlib 6", "zlib", {"level": 6}),
        ("PNG, compress level 1", "png", {}),
        ("PNG, compress level 6", "png", {"compress_level": 6}),
        ("WebP lossless, fastest", "webp", {}),
        ("WebP lossless, default effort", "webp", {"quality": 80, "method": 4}),
    ]
    if missing_package("zstd") is None:
        variants[:0] = [
            ("raw uint8 + zstd -1 (literals raw; without xxhash)", "zstd", {}),
            ("raw uint8 + zstd 1", "zstd", {"level": 1}),
            ("raw uint8 + zstd 3", "zstd", {"level": 3}),
        ]
    if missing_package("raw") is None:
        variants[:0] = [("raw uint8 + XXH3-128 (chosen)", "raw", {})]
    return variants


def _codec_with(codec: str, overrides: dict[str, Any]) -> Any:
    """The store's codec table with one entry's encoder parameters changed."""
    from vlmq.workers.media.prepared import framecodec

    base = framecodec.CODECS[codec]
    if not overrides:
        return base
    if codec == "zlib":
        return framecodec._Codec(lambda f: framecodec._zlib_encode(f, **overrides), base.decode)
    if codec == "zstd":
        return framecodec._Codec(lambda f: framecodec._zstd_encode(f, **overrides), base.decode)
    fmt = {"png": "PNG", "webp": "WEBP"}[codec]
    defaults: dict[str, dict[str, Any]] = {"png": {"compress_level": 1}, "webp": {"lossless": True}}
    params = defaults[codec] | overrides
    return framecodec._Codec(framecodec._image_encoder(fmt, **params), base.decode)


def _lossless_row(
    label: str, codec: str, overrides: dict[str, Any], media: Any, repeats: int
) -> str:
    from vlmq.workers.media.prepared import framecodec

    saved = framecodec.CODECS[codec]
    framecodec.CODECS[codec] = _codec_with(codec, overrides)
    try:
        data = framecodec.encode_object(media, codec)
        encode = _timed(lambda: framecodec.encode_object(media, codec), repeats)
        decode = _timed(lambda: framecodec.decode_object(data, 10**8, 10**4), repeats)
        back = framecodec.decode_object(data, 10**8, 10**4)
    finally:
        framecodec.CODECS[codec] = saved
    frames = _frames(media)
    exact = [f.tobytes() for f in _frames(back)] == [f.tobytes() for f in frames]
    raw = sum(f.width * f.height * 3 for f in frames)
    return (
        f"| {label} | {_ms(encode)} | {_ms(decode)} | {len(data):,} | {len(data) / raw:.2f} "
        f"| {'0 / 0 (exact)' if exact else '**not exact**'} |"
    )


def _frames(media: Any) -> list[Any]:
    """Pillow frames, or one frame of Pixels read back (its ``tobytes`` is Pillow's)."""
    from vlmq.workers.media import DecodedVideo

    return list(media.frames) if isinstance(media, DecodedVideo) else [media]


def _jpeg_row(media: Any, repeats: int) -> str:
    frames = _frames(media)

    def encode() -> list[bytes]:
        out = []
        for frame in frames:
            buffer = io.BytesIO()
            frame.save(buffer, format="JPEG", quality=95)
            out.append(buffer.getvalue())
        return out

    encoded = encode()

    def decode() -> list[Image.Image]:
        return [Image.open(io.BytesIO(data)).convert("RGB") for data in encoded]

    encode_s, decode_s = _timed(encode, repeats), _timed(decode, repeats)
    errors = [
        np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16))
        for a, b in zip(frames, decode(), strict=True)
    ]
    mean = float(np.mean([e.mean() for e in errors]))
    worst = int(max(e.max() for e in errors))
    size = sum(len(d) for d in encoded)
    raw = sum(f.width * f.height * 3 for f in frames)
    return (
        f"| JPEG q95 (lossy) | {_ms(encode_s)} | {_ms(decode_s)} | {size:,} | {size / raw:.2f} "
        f"| {mean:.2f} / {worst} |"
    )


def formats_section(media: Media, repeats: int) -> list[str]:
    lines = []
    for title, item in (
        (f"1080p photo downscaled to {media.photo.size[0]}x{media.photo.size[1]}", media.photo),
        (
            f"16 frames of a 20 s 720p clip at {media.clip.width}x{media.clip.height}",
            media.clip,
        ),
    ):
        lines += [
            f"**{title}** (raw {sum(f.width * f.height * 3 for f in _frames(item)):,} bytes):",
            "",
            "| format | encode ms | decode ms | bytes | of raw | pixel error mean / max |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [_lossless_row(*variant, item, repeats) for variant in _store_codecs()]
        lines += [_jpeg_row(item, repeats), ""]
    return lines


# --- store vs decode ------------------------------------------------------------------------


def _codec() -> str:
    from vlmq.workers.media.prepared.framecodec import resolve_codec

    return resolve_codec("auto")


def store_section(media: Media, repeats: int) -> list[str]:
    from vlmq.config.settings import FrameStoreSettings, MediaSettings
    from vlmq.stores.files import FileStore
    from vlmq.workers.media import decode_image, decode_video
    from vlmq.workers.media.prepared.framestore import FrameStore

    settings = MediaSettings()
    lines = [
        "| media | decode from the source | frame store hit (read + verify + decode) "
        "| put on a miss (encode + write) | object bytes |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-frames-") as folder:
        store = FrameStore(FileStore(f"file://{folder}"), FrameStoreSettings(), settings)
        cases = [
            (
                "1080p photo",
                media.photo,
                lambda: decode_image(media.photo_bytes, settings, media.image_target),
            ),
            (
                "20 s 720p clip, 16 frames",
                media.clip,
                lambda: decode_video(media.clip_bytes[60], settings, 2.0, 16, media.video_target),
            ),
        ]
        for label, item, decode in cases:
            key = f"t/{label.replace(' ', '-')}.vfr"
            put = _timed(partial(store.put, key, item), repeats)
            hit = _timed(partial(store.get, key), repeats)
            size = store.store.size(key) or 0
            lines.append(
                f"| {label} | {_ms(_timed(decode, repeats))} | {_ms(hit)} | {_ms(put)} | {size:,} |"
            )
    return lines


# --- keyframes ------------------------------------------------------------------------------


def keyframes_section(media: Media, repeats: int) -> list[str]:
    lines = [
        "| clips | GOP (frames) | sampling | decode s | decode CPU s | distinct frames "
        "| frames decoded | mean abs timestamp error s | max s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, by_gop in (("still", media.clip_bytes), ("camera", media.camera_bytes)):
        for gop in GOPS:
            label = f"{kind}, {_clip_label(by_gop[gop])}"
            lines += _keyframe_rows(label, gop, by_gop[gop], media, repeats)
    return lines


def _clip_label(data: bytes) -> str:
    """A clip as its packets tell it: average bitrate and median keyframe size (what a
    keyframe costs to decode follows its size; a still scene spends a rate target on them)."""
    import av

    keyframes, total, frames = [], 0, 0
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            total += packet.size
            frames += 1
            if packet.is_keyframe:
                keyframes.append(packet.size)
        seconds = frames / float(stream.average_rate or 30)
    mbits = total * 8 / max(seconds, 1e-9) / 1e6
    return f"{mbits:.1f} Mbit/s, keyframes {statistics.median(keyframes) / 1000:.0f} KB"


def _keyframe_rows(kind: str, gop: int, data: bytes, media: Media, repeats: int) -> list[str]:
    from vlmq.config.settings import MediaSettings
    from vlmq.workers.media import decode_video

    results = {}
    for mode in ("exact", "keyframes"):
        sample = partial(decode_video, data, MediaSettings(), 2.0, 16, media.video_target)
        counter = _DecodeCounter()
        with counter:
            video = sample(mode)
        wall, cpu = _timed_cpu(partial(sample, mode), repeats)
        results[mode] = (video, wall, cpu, counter.frames)
    exact_times = [i / results["exact"][0].fps for i in results["exact"][0].frame_indices]
    lines = []
    for mode, (video, wall, cpu, decoded) in results.items():
        times = [i / video.fps for i in video.frame_indices]
        errors = [abs(a - b) for a, b in zip(times, exact_times, strict=True)]
        lines.append(
            f"| {kind} | {gop} | {mode} | {_s(wall)} | {_s(cpu)} "
            f"| {len(set(video.frame_indices))} | {decoded} | {statistics.mean(errors):.3f} "
            f"| {max(errors):.3f} |"
        )
    return lines


class _DecodeCounter:
    """Counts frames the decoder produced (the decode budget's spend) during one decode."""

    def __enter__(self) -> _DecodeCounter:
        from vlmq.workers.media import video

        self.frames = 0
        self._module = video
        self._original = video._DecodeBudget.spend
        counter = self

        def spend(budget: Any) -> None:
            counter.frames += 1
            counter._original(budget)

        video._DecodeBudget.spend = spend  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *_: object) -> None:
        self._module._DecodeBudget.spend = self._original  # type: ignore[method-assign]


# --- the report ------------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=20, help="clip length")
    parser.add_argument("--sections", default="formats,store,keyframes")
    parser.add_argument("--target", choices=["serving", "small"], default="serving")
    parser.add_argument(
        "--write", default=str(ROOT / "bench" / "README.md"), help="README to update ('' to skip)"
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    _progress("media (generated once into .vlmq/bench-media/)")
    media = load_media(args.seconds, args.target)
    given = argv if argv is not None else sys.argv[1:]
    lines = [
        f"Command: `python -m bench.framestore{' ' + ' '.join(given) if given else ''}`",
        "",
        f"Machine: {machine()}. {args.repeats} runs each, median (min-max). Resize "
        f"targets: {args.target} (images at most {media.image_target.max_pixels:,} pixels, "
        f"video frames {media.video_target.max_pixels:,}). Media: bench/realmedia.py "
        "(synthetic: seeded gradients, shapes and noise; the still clips, a still scene "
        "under a moving square encoded at a 110 Mbit/s target that its keyframes take, and "
        "the camera clips, panning with per-frame sensor noise at 4 Mbit/s; each clip's "
        "average bitrate and median keyframe size are in the keyframe table).",
        "",
    ]
    if "formats" in sections:
        _progress("formats")
        lines += ["Formats of prepared media:", "", *formats_section(media, args.repeats)]
    if "store" in sections:
        _progress("store")
        lines += [
            f"What a frame store hit saves (`file://` store on local disk, codec {_codec()}):",
            "",
            *store_section(media, args.repeats),
            "",
        ]
    if "keyframes" in sections:
        _progress("keyframes")
        lines += [
            f"Keyframe sampling: 16 samples (2 fps) of a {args.seconds} s 1280x720 H.264 clip "
            "at 30 fps, frames downscaled to the processor's target:",
            "",
            *keyframes_section(media, args.repeats),
            "",
        ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(Path(args.write), MARKER, text)


if __name__ == "__main__":
    main()
