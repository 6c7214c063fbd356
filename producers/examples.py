"""Bundled example requests and the synthetic media they point at."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["EXAMPLES_DIR", "make_examples", "make_examples_command"]

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def make_examples(directory: Path = EXAMPLES_DIR) -> Path:
    """Write the example media (if missing) and the resolved request file."""
    # Pillow and PyAV are worker-side dependencies: imported only here.
    from workers.samples import data_uri, make_image, save_image, save_video

    media = directory / "media"
    media.mkdir(parents=True, exist_ok=True)
    if not (media / "shapes.png").exists():
        save_image(media / "shapes.png", size=(96, 80), seed=1)
    if not (media / "photo.jpg").exists():
        save_image(media / "photo.jpg", size=(128, 96), seed=2, format="JPEG")
    if not (media / "clip.mp4").exists():
        save_video(media / "clip.mp4", n_frames=16, size=(64, 48), fps=8, seed=3)
    small = make_image((32, 32), seed=4)
    import io

    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    template = (directory / "requests.jsonl").read_text(encoding="utf-8")
    resolved = template.replace("EXAMPLES_DIR", str(directory)).replace(
        "DATA_URI_SMALL_PNG", data_uri(buffer.getvalue(), "image/png")
    )
    target = directory / "requests.resolved.jsonl"
    target.write_text(resolved, encoding="utf-8")
    return target


@click.command("make-examples")
def make_examples_command() -> None:
    """Write the synthetic example media and examples/requests.resolved.jsonl."""
    click.echo(make_examples())
