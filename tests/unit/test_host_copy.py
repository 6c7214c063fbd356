"""Prepared media to the device (workers/engine/hostcopy.py): pinned blocks only with CUDA,
the frame store's read buffers allocated through the pool's allocator, and copies that land
the same bytes. No GPU here: CUDA is injected where the choice is made."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmq.workers.engine import hostcopy
from vlmq.workers.media.prepared.buffers import BufferPool

pytestmark = pytest.mark.unit


def test_without_cuda_nothing_is_pinned() -> None:
    pool = BufferPool(64 << 20)
    assert hostcopy.pin_buffers(pool, cuda=False) is False
    assert pool.allocate is not hostcopy.pinned_block
    array = pool.array((3, 4, 5))
    assert array.shape == (3, 4, 5) and array.dtype == np.uint8


def test_with_cuda_the_pool_allocates_through_the_pinned_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes: list[int] = []

    def fake_pinned(size: int) -> np.ndarray:  # pinning needs a CUDA context: not here
        sizes.append(size)
        return np.zeros(size, np.uint8)

    monkeypatch.setattr(hostcopy, "pinned_block", fake_pinned)
    pool = BufferPool(64 << 20)
    assert hostcopy.pin_buffers(pool, cuda=True) is True
    first = pool.array((2, 3, 100, 100))
    first[:] = 7
    del first
    again = pool.array((2, 3, 100, 100))  # the freed block is reused, not pinned again
    assert sizes == [1 << 20] and pool.reused == 1 and again.shape == (2, 3, 100, 100)


def test_to_device_on_the_cpu_is_the_plain_copy() -> None:
    tensor = torch.arange(24, dtype=torch.uint8).view(2, 3, 4)
    out = hostcopy.to_device(tensor, "cpu")
    assert torch.equal(out, tensor) and out.device.type == "cpu"


def test_pinned_block_needs_cuda_or_is_pinned() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            hostcopy.pinned_block(4096)  # no CUDA: pinning fails, so pin_buffers checks first
    else:
        block = hostcopy.pinned_block(4096)
        assert block.nbytes == 4096
