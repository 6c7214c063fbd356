"""Frames as one planar uint8 array: what the frame store reads back.

A GPU worker fed by the prepare tier spends its own CPU on what it does between the store
and the device. Pillow keeps RGB as 4 bytes a pixel, and the processors turn every PIL image
into a channel-first tensor, so each PIL frame costs three copies of its pixels on the host
(into Pillow, out to NumPy, transposed); a clip's 16 frames at the processor's target are
~29 MB. ``Pixels`` holds the frames as the processors take them, ``(frames, 3, height,
width)``, so the store's bytes become the processor's input without a copy
(``as_tensor``), and the device does the rest (bench/README.md, the prepare tier).

``key`` names the pixels (the frame store's content address): the processor-output cache
keys on it instead of hashing ~29 MB again.

Torch-free (prepare workers run without a model); ``as_tensor`` imports torch when called.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["KEY_ATTRIBUTE", "Pixels", "pixels_of"]

CHANNELS = 3
# The attribute a tensor made by ``as_tensor`` carries its pixels' key in.
KEY_ATTRIBUTE = "vlmq_pixels_key"


@dataclass(frozen=True, eq=False)
class Pixels:
    """``array``: uint8, ``(frames, 3, height, width)``, C-contiguous, not written to once
    made (a cached item is shared); ``key``: what names exactly these pixels (None: nothing
    does)."""

    array: np.ndarray
    key: str | None = None

    def __post_init__(self) -> None:
        shape = self.array.shape
        if self.array.dtype != np.uint8 or len(shape) != 4 or shape[1] != CHANNELS:
            raise ValueError(f"Pixels hold uint8 (frames, 3, h, w), not {self.array.dtype}{shape}")

    mode = "RGB"

    @property
    def width(self) -> int:
        return int(self.array.shape[3])

    @property
    def height(self) -> int:
        return int(self.array.shape[2])

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)``, as Pillow's."""
        return self.width, self.height

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __getitem__(self, index: int) -> Image.Image:
        return self.image(index)

    def __iter__(self) -> Iterator[Image.Image]:
        """The frames as Pillow images (copies: for tests and rare consumers)."""
        return (self.image(index) for index in range(len(self)))

    def tobytes(self) -> bytes:
        """The frames' bytes channel-last, as Pillow's ``tobytes`` of each, joined."""
        return self.channels_last().tobytes()

    def take(self, indices: Sequence[int]) -> Pixels:
        """The frames at ``indices`` (repeats allowed), keyed apart from these."""
        picked = list(indices)
        key = None if self.key is None else f"{self.key}{picked}"
        return Pixels(np.ascontiguousarray(self.array[picked]), key)

    def image(self, index: int = 0) -> Image.Image:
        """One frame as a Pillow image (for consumers that need one: vLLM's images)."""
        return Image.fromarray(np.ascontiguousarray(self.array[index].transpose(1, 2, 0)))

    def channels_last(self) -> np.ndarray:
        """``(frames, height, width, 3)``, a copy (vLLM's videos)."""
        return np.ascontiguousarray(self.array.transpose(0, 2, 3, 1))

    def as_tensor(self, single: bool = False) -> Any:
        """A torch tensor over the same memory (no copy), carrying ``key`` in
        ``KEY_ATTRIBUTE``: ``(frames, 3, h, w)``, or ``(3, h, w)`` with ``single`` (an
        image). The processors only read it: it is moved to their device or resized."""
        import torch

        array = self.array[0] if single else self.array
        with warnings.catch_warnings():
            # An array over a bytes object (zlib's read-back) is read-only; the processors
            # never write to their input, so no writable copy is made for torch's sake.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            tensor = torch.from_numpy(array)
        setattr(tensor, KEY_ATTRIBUTE, self.key)
        return tensor


def pixels_of(frames: Sequence[Image.Image], key: str | None = None) -> Pixels:
    """Pillow frames (RGB, one size) as ``Pixels``: one copy of each frame, transposed on
    the way (the prepare side's cost)."""
    width, height = frames[0].size
    out = np.empty((len(frames), CHANNELS, height, width), dtype=np.uint8)
    for index, frame in enumerate(frames):
        out[index] = np.asarray(frame).transpose(2, 0, 1)
    return Pixels(out, key)
