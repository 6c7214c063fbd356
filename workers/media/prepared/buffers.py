"""Host memory for pixels read back from the frame store, used again once nothing needs it.

A GPU worker reading prepared media back decompresses each item's frames into a large
buffer (a 1080p photo ~6 MB, a clip ~29 MB: the zstd codec; the raw codec's frames are
used where they lie) and frees it a batch later. Fresh memory from the kernel is
faulted in a page at a time, and for NumPy's huge-page-advised arrays the kernel may compact
memory first: measured in the GPU worker, that made decompressing a photo cost ~7 ms of CPU
where the same decompression into memory already touched costs ~1.2 ms (bench/README.md, the
prepare tier). A pool keeps freed buffers and hands them out again.

Memory goes back to the pool only when nothing refers to it any more: an array from
:meth:`BufferPool.array` is backed by a lease object (``__array_interface__``), which NumPy
keeps as the base of the array and of every view made from it, and ``torch.from_numpy``
keeps the array; the lease's finalizer returns the memory when the last of them is gone.
So a processor's tensor, the media cache or a slice of the frames keeps its memory for as
long as it lives, and no caller has to say when it is done.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BufferPool"]

# Buffers are kept in size classes (rounded up to this), so a photo's read-back serves the
# next photo's even when their byte counts differ a little.
_GRANULE = 1 << 20


class _Lease:
    """The base object of an array over pooled memory: while it lives, the memory is used."""

    __slots__ = ("__array_interface__", "__weakref__", "_block")

    def __init__(self, block: np.ndarray, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self._block = block  # keeps the memory alive even if the pool is gone
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (block.ctypes.data, False),
            "version": 3,
        }


class BufferPool:
    """Arrays over reused memory. ``max_free_bytes``: how much freed memory is kept for
    reuse (the oldest free buffers are let go past it); 0 keeps none. Thread-safe: a
    buffer comes back in whichever thread drops the last reference to it."""

    def __init__(
        self, max_free_bytes: int, allocate: Callable[[int], np.ndarray] | None = None
    ) -> None:
        self.max_free_bytes = max_free_bytes
        # New blocks: plain host memory, or pinned memory on a CUDA worker (the engine's
        # hostcopy.pin_buffers), so a frame-store read is copied to the device asynchronously.
        self.allocate: Callable[[int], np.ndarray] = allocate or _host_block
        self._free: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (metrics and tests read these)
        self.allocated = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def array(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` over pooled memory."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0 or self.max_free_bytes <= 0:
            return np.empty(shape, dtype)
        block = self._take(_size_class(nbytes))
        lease = _Lease(block, tuple(shape), dtype)
        weakref.finalize(lease, self._give_back, block)
        return np.asarray(lease)

    def _take(self, size: int) -> np.ndarray:
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                block = blocks.pop()
                if not blocks:
                    del self._free[size]
                self._free_bytes -= size
                self.reused += 1
                return block
            self.allocated += 1
        return self.allocate(size)

    def _give_back(self, block: np.ndarray) -> None:
        size = block.nbytes
        with self._lock:
            if size > self.max_free_bytes:
                return
            self._free.setdefault(size, []).append(block)
            self._free.move_to_end(size)
            self._free_bytes += size
            while self._free_bytes > self.max_free_bytes:
                oldest, blocks = next(iter(self._free.items()))
                blocks.pop(0)
                if not blocks:
                    del self._free[oldest]
                self._free_bytes -= oldest


def _host_block(size: int) -> np.ndarray:
    return np.empty(size, np.uint8)


def _size_class(nbytes: int) -> int:
    return -(-nbytes // _GRANULE) * _GRANULE
