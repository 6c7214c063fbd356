"""What the GPU media check's worker processes do: make its media and prepare media ahead,
as prepare-tier workers do, into a ``file://`` frame store.

Torch-free (the processes are spawned and import this module and ``bench.gpu_media``, which
imports torch only in functions). Arguments and results are JSON strings: the processes are
given work as the fleet gives it, never pickled objects of ours.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["downscale_json", "make_clip", "make_photo", "prepare_ahead", "warm_up"]

_FPS = 30
_GOP = 60  # a keyframe every 2 s, as bench/realmedia.py's clips


def make_photo(path: str, width: int, height: int, seed: int) -> str:
    """A JPEG photo (quality 90) of seeded gradients, shapes and noise; kept if made before."""
    from vlmq.workers.demo.media import make_image

    target = Path(path)
    if not target.exists():
        partial = target.with_name(target.name + ".part")
        make_image((width, height), seed=seed).save(partial, format="JPEG", quality=90)
        partial.rename(target)
    return path


def make_clip(path: str, width: int, height: int, seconds: int, seed: int) -> str:
    """An H.264 clip at 30 fps, a keyframe every 2 s; kept if made before."""
    from vlmq.workers.demo.media import make_video_bytes

    target = Path(path)
    if not target.exists():
        data = make_video_bytes(
            n_frames=_FPS * seconds,
            size=(width, height),
            fps=_FPS,
            seed=100 + seed,
            codec="libx264",
            gop=_GOP,
        )
        partial = target.with_name(target.name + ".part")
        partial.write_bytes(data)
        partial.rename(target)
    return path


def warm_up() -> None:
    """Each process's imports before it is timed (a prepare worker has made them long before
    it prepares anything)."""


def downscale_json(downscale: Any) -> dict[str, Any] | None:
    """A ``Downscale`` as JSON (None stays None)."""
    if downscale is None:
        return None
    cover = list(downscale.cover) if downscale.cover else None
    return {"max_pixels": downscale.max_pixels, "cover": cover}


def _downscale(spec: dict[str, Any] | None) -> Any:
    from vlmq.workers.media.image import Downscale

    if spec is None:
        return None
    cover = tuple(spec["cover"]) if spec["cover"] else None
    return Downscale(max_pixels=spec["max_pixels"], cover=cover)


_LOADERS: dict[tuple[str, str], Any] = {}


def _loader(media_json: str, store_url: str) -> Any:
    """This process's loader over the frame store (one per settings and store)."""
    key = (media_json, store_url)
    if key not in _LOADERS:
        from vlmq.config.settings import MediaSettings
        from vlmq.stores.urls import open_store
        from vlmq.workers.media import MediaLoader
        from vlmq.workers.media.prepared.framestore import FrameStore

        media = MediaSettings.model_validate_json(media_json)
        frames = FrameStore(open_store(store_url), media.frame_store, media)
        _LOADERS[key] = MediaLoader(media, frames=frames)
    return _LOADERS[key]


def prepare_ahead(job: str) -> str:
    """One item prepared as a prepare worker prepares it (``PrepareLoop._load``: fetch,
    decode, sample, resize to the model's target, put in the frame store, ``prepared=True``).
    ``job``: JSON with kind, source, target, tenant, media (settings JSON), store (URL).
    Returns JSON: this process's CPU seconds for it, and its decodes and frame store hits."""
    spec = json.loads(job)
    loader = _loader(spec["media"], spec["store"])
    target = _downscale(spec["target"])
    before = loader.thread_counts()
    cpu = time.process_time()
    if spec["kind"] == "image":
        loader.load_image(spec["source"], target, spec["tenant"], prepared=True)
    else:
        loader.load_video(spec["source"], None, None, target, None, spec["tenant"], prepared=True)
    after = loader.thread_counts()
    return json.dumps(
        {
            "cpu_s": time.process_time() - cpu,
            "decodes": after.decodes - before.decodes,
            "store_hits": after.store_hits - before.store_hits,
        }
    )
