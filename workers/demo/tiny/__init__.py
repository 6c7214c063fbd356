"""Deterministic tiny random-weight checkpoints of the real VLM architectures, built offline.

``build_tiny_model(dir, family, size, seed)`` writes a directory that
``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` load exactly
as they load the real Qwen2.5-VL / Qwen3-VL / InternVL3-hf checkpoints. See NOTES.md for how to
feed pre-decoded images and video frames to these processors.
"""

from vlmq.workers.demo.tiny.builder import (
    build_config,
    build_processor,
    build_tiny_model,
    count_parameters,
)
from vlmq.workers.demo.tiny.specs import FAMILIES, SIZES, get_spec

__all__ = [
    "FAMILIES",
    "SIZES",
    "build_config",
    "build_processor",
    "build_tiny_model",
    "count_parameters",
    "get_spec",
]
