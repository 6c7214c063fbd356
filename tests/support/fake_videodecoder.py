"""A stand-in for torchcodec's ``decoders`` module (and its CUDA decoder) on machines with no
GPU: ``VideoDecoder(data, device=..., seek_mode=...)`` with ``get_frames_played_at``, decoding
on the CPU with PyAV and recording what it was asked for. Used by injection only; never in the
package."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
import torch


@dataclass
class FrameBatch:
    data: Any
    pts_seconds: Any


@dataclass
class FakeDecoders:
    """The module: ``VideoDecoder`` built per clip; ``calls`` records each clip's sample times;
    ``fail`` makes every decode raise (a device that breaks mid-run), ``fail_on`` only the
    decodes of those clips' bytes (a stream the hardware decoder rejects)."""

    calls: list[list[float]] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    fail: bool = False
    fail_on: set[bytes] = field(default_factory=set)

    def VideoDecoder(self, source: bytes, device: str = "cpu", seek_mode: str = "exact") -> Any:
        self.devices.append(device)
        return _Decoder(self, source, device)


class _Decoder:
    def __init__(self, module: FakeDecoders, source: bytes, device: str) -> None:
        self.module, self.source, self.device = module, source, device

    def get_frames_played_at(self, seconds: list[float]) -> FrameBatch:
        self.module.calls.append(list(seconds))
        if self.module.fail or self.source in self.module.fail_on:
            raise RuntimeError("CUDA error: the fake decoder fails")
        frames: list[tuple[float, np.ndarray]] = []
        last = max(seconds)
        container: Any = av.open(io.BytesIO(self.source))
        with container:
            for frame in container.decode(video=0):
                t = float(frame.time) if frame.time is not None else 0.0
                if t > last + 1e-6:
                    break
                frames.append((t, frame.to_ndarray(format="rgb24")))
        start = frames[0][0]
        picked = []
        for s in seconds:
            shown = [array for t, array in frames if t - start <= s + 1e-6]
            picked.append(shown[-1])
        data = torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2).contiguous()
        return FrameBatch(data.to(self.device), torch.tensor(seconds))
