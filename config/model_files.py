"""A model's configuration files on disk, read without loading the model: where they are (a
local directory or the Hugging Face cache's snapshot) and the visual-token profile they give.

Shared by pre-flight (``producers/preflight/model.py``) and the prepare tier, which resizes
media for the same targets as the GPU workers without torch or transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vlmq.config.vision import VisionProfile

__all__ = ["find_model_dir", "processor_specs", "read_json", "vision_profile_of"]


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return Path(home) / "hub"


def find_model_dir(name: str) -> Path | None:
    """A local checkpoint directory, or the Hugging Face cache's snapshot of a hub id
    (``org/name``, its ``main`` ref); None when neither is on this machine."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name.count("/") != 1:
        return None
    repo = _hub_cache() / f"models--{name.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def processor_specs(directory: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(processor, image processor, video processor) configs: transformers 5 nests the two
    in processor_config.json; older checkpoints keep preprocessor_config.json (images, and
    videos too when there is no video_preprocessor_config.json)."""
    processor = read_json(directory / "processor_config.json") or {}
    image = processor.get("image_processor")
    video = processor.get("video_processor")
    if not isinstance(image, dict):
        image = read_json(directory / "preprocessor_config.json") or {}
    if not isinstance(video, dict):
        video = read_json(directory / "video_preprocessor_config.json") or image
    return processor, image, video


def vision_profile_of(directory: Path) -> VisionProfile | None:
    """The visual-token profile in a model's files (config.json and the processor configs),
    or None without a config.json: what a prepare worker resizes media for, torch-free."""
    config = read_json(directory / "config.json")
    if config is None:
        return None
    processor, image, video = processor_specs(directory)
    return VisionProfile.from_configs(config, image, video, processor)
