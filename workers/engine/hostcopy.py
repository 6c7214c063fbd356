"""Prepared media to the device cheaply: frame-store objects read into pinned host memory and
copied with ``non_blocking``.

A GPU worker fed by the prepare tier reads each item's frames from the frame store into a
reused host buffer (``prepared/buffers.BufferPool``), and the processor then copies them to
the device. From pageable memory that copy is synchronous and staged by the driver through
its own pinned bounce buffer (an extra host copy); from pinned memory it is one DMA the host
does not wait for. So on a CUDA worker the pool's blocks are allocated pinned (once: pinning
is slow, which is why the blocks are reused), and ``to_device`` copies with
``non_blocking=True``. Without CUDA nothing is pinned (pinning needs a CUDA context) and every
call is the plain path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vlmq.workers.media.prepared.buffers import BufferPool

__all__ = ["cuda_ready", "pin_buffers", "pinned_block", "to_device"]

log = logging.getLogger(__name__)


def cuda_ready() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pinned_block(size: int) -> np.ndarray:
    """``size`` bytes of page-locked host memory as a uint8 array (the array keeps the
    tensor that owns the memory alive)."""
    import torch

    return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()


def pin_buffers(pool: BufferPool, cuda: bool | None = None) -> bool:
    """Make ``pool`` allocate pinned blocks when CUDA is there; True when it does."""
    if not (cuda_ready() if cuda is None else cuda):
        return False
    pool.allocate = pinned_block
    log.info("frame-store reads go to pinned host memory (non-blocking copies to the device)")
    return True


def to_device(tensor: Any, device: str) -> Any:
    """``tensor`` on ``device``: a host tensor in pinned memory is copied without the host
    waiting; a pageable one is pinned first only for a CUDA target (on the same stream, so
    the device's later work on it is ordered after the copy)."""
    if tensor.device.type != "cpu" or not str(device).startswith("cuda"):
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
