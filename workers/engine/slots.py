"""The decode loop's KV cache: one static buffer per layer, a slot (row) per sequence, and each
slot writing at its own position, so sequences of different lengths decode together and a slot
freed by one sequence takes the next without moving the others.

Keys and values are ``slots x kv_heads x capacity x head_dim`` per layer, allocated once (grown
by doubling when a longer sequence arrives). A decode step works on a prefix of it, ``rows``
slots by ``length`` positions (the step's bucket), through a ``SlotView`` the model takes as its
cache: the layer's new key and value are written at each row's ``write_pos`` and the view's
keys and values are returned for attention, which the step's 4-D mask restricts to each row's
own positions. Views are slices of the same storage, so a view made once (as a CUDA graph
captures it) stays valid while the cache is not grown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KvLayers", "SlotCache", "SlotView", "bucket"]

# (keys, values) per layer, as a prefill's cache holds them: rows x heads x length x head_dim.
KvLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]


def bucket(value: int, sizes: Sequence[int]) -> int:
    """The smallest size in ``sizes`` (ascending) at least ``value``; the largest if none."""
    for size in sizes:
        if size >= value:
            return size
    return sizes[-1]


@dataclass
class SlotCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, like: KvLayers, slots: int, capacity: int) -> SlotCache:
        """Zeroed storage for ``slots`` x ``capacity`` positions, shaped like a prefill's layers."""
        keys, values = [], []
        for k, v in like:
            keys.append(k.new_zeros((slots, k.shape[1], capacity, k.shape[3])))
            values.append(v.new_zeros((slots, v.shape[1], capacity, v.shape[3])))
        return cls(keys, values)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def grown(self, capacity: int) -> SlotCache:
        """A larger cache holding the same slots' positions (the old one is dropped)."""
        keys, values = [], []
        for old_k, old_v in zip(self.keys, self.values, strict=True):
            k = old_k.new_zeros((*old_k.shape[:2], capacity, old_k.shape[3]))
            v = old_v.new_zeros((*old_v.shape[:2], capacity, old_v.shape[3]))
            k[:, :, : self.capacity].copy_(old_k)
            v[:, :, : self.capacity].copy_(old_v)
            keys.append(k)
            values.append(v)
        return SlotCache(keys, values)

    def insert(self, slots: torch.Tensor, layers: KvLayers) -> None:
        """A prefill's keys and values (positions 0..length) into ``slots``."""
        for store_k, store_v, (k, v) in zip(self.keys, self.values, layers, strict=True):
            length = k.shape[2]
            store_k[:, :, :length].index_copy_(0, slots, k.to(store_k.dtype))
            store_v[:, :, :length].index_copy_(0, slots, v.to(store_v.dtype))

    def move(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Rows' first ``length`` positions from ``sources`` to ``targets`` (slots)."""
        for store in (*self.keys, *self.values):
            part = store[:, :, :length]
            part.index_copy_(0, targets, part.index_select(0, sources))

    def view(self, rows: int, length: int, write_pos: torch.Tensor) -> SlotView:
        """The first ``rows`` slots by ``length`` positions; ``write_pos`` (rows,) on the device
        says where each row's new token goes (read when the model runs, not now)."""
        return SlotView(
            [k[:rows, :, :length] for k in self.keys],
            [v[:rows, :, :length] for v in self.values],
            torch.arange(rows, device=write_pos.device),
            write_pos,
        )


class SlotView:
    """What the model's attention layers take as their cache for one decode step (the part of
    transformers' ``Cache`` they call: ``update``, and the length for the mask helpers, which a
    4-D mask makes them skip)."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        rows: torch.Tensor,
        write_pos: torch.Tensor,
    ) -> None:
        self.keys = keys
        self.values = values
        self.rows = rows
        self.write_pos = write_pos
        self.is_compileable = True

    def __len__(self) -> int:
        return len(self.keys)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.write_pos] = key_states[:, :, 0].to(keys.dtype)
        values[self.rows, :, self.write_pos] = value_states[:, :, 0].to(values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[2])

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx), 0
