"""Real-size media for the pipeline benchmarks, generated offline once and kept in .vlmq/.

Photos: 1920x1080 JPEG (quality 90) of seeded gradients, shapes and noise. Clips: 1280x720
H.264 at 30 fps with a keyframe every 2 s (GOP 60) unless asked otherwise, a square moving
over a seeded background, 20 s unless asked otherwise; "camera" clips pan across a wider
scene with per-frame sensor noise at 4 Mbit/s. Generating a 20 s clip takes ~15 s
here, so they are cached under ``.vlmq/bench-media/`` by their parameters.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.samples import make_image, make_video_bytes

__all__ = ["CAMERA_BITRATE", "MEDIA_DIR", "clips", "photos", "small_images"]

MEDIA_DIR = Path(__file__).resolve().parents[1] / ".vlmq" / "bench-media"
# 720p30 as streamed and uploaded (YouTube recommends 5 Mbit/s for 720p30 uploads).
CAMERA_BITRATE = 4_000_000


def photos(count: int, start: int = 0, folder: Path = MEDIA_DIR) -> list[Path]:
    """``count`` photos, seeds from ``start`` (distinct seeds: distinct pixels)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(start, start + count):
        path = folder / f"photo-1080p-{seed}.jpg"
        if not path.exists():
            make_image((1920, 1080), seed=seed).save(path, format="JPEG", quality=90)
        paths.append(path)
    return paths


def small_images(count: int, start: int = 0, folder: Path = MEDIA_DIR) -> list[Path]:
    """``count`` 56x56 PNGs (4 visual tokens on Qwen): requests whose media cost nothing, so
    what a worker spends on them is the fleet's own work per request."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(start, start + count):
        path = folder / f"small-56-{seed}.png"
        if not path.exists():
            make_image((56, 56), seed=seed).save(path, format="PNG")
        paths.append(path)
    return paths


def clips(
    count: int,
    seconds: int = 20,
    start: int = 0,
    folder: Path = MEDIA_DIR,
    gop: int = 60,
    camera: bool = False,
) -> list[Path]:
    """``count`` clips, seeds from ``start``, a keyframe every ``gop`` frames. ``camera``:
    filmed-like clips at a streaming bitrate (``CAMERA_BITRATE``): the view pans and each
    frame has its own sensor noise. The still clips get a 110 Mbit/s target that a still
    scene spends on its keyframes (~810 KB each against ~340 KB for the camera clips' and
    ~2 KB for other frames: 3.8 Mbit/s on average at GOP 60), so a keyframe costs ~85 ms of
    CPU to decode against ~35 ms (``bench.framestore``)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    kind = f"-camera{CAMERA_BITRATE // 1_000_000}m" if camera else ""
    for seed in range(start, start + count):
        path = folder / f"clip-720p-{seconds}s-gop{gop}{kind}-{seed}.mp4"
        if not path.exists():
            data = make_video_bytes(
                n_frames=30 * seconds,
                size=(1280, 720),
                fps=30,
                seed=100 + seed,
                codec="libx264",
                gop=gop,
                bit_rate=CAMERA_BITRATE if camera else None,
                camera=camera,
            )
            partial = path.with_suffix(".part")
            partial.write_bytes(data)
            partial.rename(path)
        paths.append(path)
    return paths
