"""Bundled example requests and the synthetic media they point at.

The request template ships inside the package (``vlmq/examples``, the repository's
``examples/`` folder), so ``vlmq demo`` works from any directory after ``pip install
vlmq[worker]``. The media is generated, never shipped: :func:`make_examples` writes it next to
the resolved request file in a directory of the caller's (the demo's working directory).
"""

from __future__ import annotations

import io
from importlib import resources
from pathlib import Path

import click

__all__ = ["make_examples", "make_examples_command", "request_template"]

DEFAULT_DIR = Path(".vlmq/examples")


def request_template() -> str:
    """The bundled ``requests.jsonl``, with ``EXAMPLES_DIR`` and ``DATA_URI_SMALL_PNG`` holes."""
    template = resources.files("vlmq").joinpath("examples", "requests.jsonl")
    return template.read_text(encoding="utf-8")


def make_examples(directory: Path = DEFAULT_DIR) -> Path:
    """Write the example media (if missing) and the resolved request file under
    ``directory``; returns the request file."""
    # Pillow and PyAV are worker-side dependencies: imported only here.
    from vlmq.workers.demo.media import data_uri, make_image, save_image, save_video

    directory = directory.resolve()
    media = directory / "media"
    media.mkdir(parents=True, exist_ok=True)
    if not (media / "shapes.png").exists():
        save_image(media / "shapes.png", size=(96, 80), seed=1)
    if not (media / "photo.jpg").exists():
        save_image(media / "photo.jpg", size=(128, 96), seed=2, format="JPEG")
    if not (media / "clip.mp4").exists():
        save_video(media / "clip.mp4", n_frames=16, size=(64, 48), fps=8, seed=3)
    buffer = io.BytesIO()
    make_image((32, 32), seed=4).save(buffer, format="PNG")
    resolved = (
        request_template()
        .replace("EXAMPLES_DIR", str(directory))
        .replace("DATA_URI_SMALL_PNG", data_uri(buffer.getvalue(), "image/png"))
    )
    target = directory / "requests.resolved.jsonl"
    target.write_text(resolved, encoding="utf-8")
    return target


@click.command("make-examples")
@click.option(
    "--directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DIR,
    show_default=True,
    help="Where the media and requests.resolved.jsonl go.",
)
def make_examples_command(directory: Path) -> None:
    """Write the synthetic example media and a resolved copy of the bundled requests."""
    click.echo(make_examples(directory))
