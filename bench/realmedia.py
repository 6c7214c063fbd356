"""Real-size media for the pipeline benchmarks, generated offline once and kept in .vlmq/.

Photos: 1920x1080 JPEG (quality 90) of seeded gradients, shapes and noise. Clips: 1280x720
H.264 at 30 fps with a keyframe every 2 s (GOP 60) unless asked otherwise, a square moving
over a seeded background, 20 s unless asked otherwise. Generating a 20 s clip takes ~15 s
here, so they are cached under ``.vlmq/bench-media/`` by their parameters.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.samples import make_image, make_video_bytes

__all__ = ["MEDIA_DIR", "clips", "photos"]

MEDIA_DIR = Path(__file__).resolve().parents[1] / ".vlmq" / "bench-media"


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


def clips(
    count: int, seconds: int = 20, start: int = 0, folder: Path = MEDIA_DIR, gop: int = 60
) -> list[Path]:
    """``count`` clips, seeds from ``start``, a keyframe every ``gop`` frames."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(start, start + count):
        path = folder / f"clip-720p-{seconds}s-gop{gop}-{seed}.mp4"
        if not path.exists():
            data = make_video_bytes(
                n_frames=30 * seconds,
                size=(1280, 720),
                fps=30,
                seed=100 + seed,
                codec="libx264",
                gop=gop,
            )
            partial = path.with_suffix(".part")
            partial.write_bytes(data)
            partial.rename(path)
        paths.append(path)
    return paths
