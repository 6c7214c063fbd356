"""What the device can do, measured in the same run, and what a model's work costs it: the
yardsticks of the GPU checks (bench.gpu_bench, bench.gpu_media).

- ``memory_bandwidth``: a device-to-device copy of a large buffer, best of a few (read + write).
- ``ModelCost``: the bytes one decode step reads (the language model's weights and output head
  once, plus each row's keys and values) and the FLOPs of a prefill (2 per parameter per token,
  vision encoder included), from the loaded model itself.
- ``UtilizationSampler``: NVML's "a kernel was running" share, sampled every 50 ms while a block
  runs (``torch.cuda.utilization``, which needs ``pynvml``); None where there is none.

A decode step is memory-bound at these batch sizes, so its roofline is bytes / bandwidth; the
fraction a run reaches is (bytes per step / measured step time) / bandwidth.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelCost", "UtilizationSampler", "memory_bandwidth", "model_cost"]


def memory_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a copy moves on ``device`` (counting its read and its write)."""
    size = int(gib * 2**30)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
        best = min(best, seconds)
    del source, target
    return 2 * size / best


@dataclass(frozen=True)
class ModelCost:
    decode_weight_bytes: int  # read once per decode step: decoder layers, norm, output head
    kv_bytes_per_token: int  # keys and values of one position, every layer
    language_params: int
    vision_params: int

    def step_bytes(self, rows: int, context: float) -> float:
        """Bytes a decode step of ``rows`` rows reads with ``context`` positions each."""
        return self.decode_weight_bytes + rows * context * self.kv_bytes_per_token

    def prefill_flops(self, prompt_tokens: int, vision_tokens: int) -> float:
        return 2.0 * (self.language_params * prompt_tokens + self.vision_params * vision_tokens)


def _bytes(parameters: Any) -> int:
    return sum(p.numel() * p.element_size() for p in parameters)


def model_cost(model: Any) -> ModelCost:
    language = model.model.language_model
    head = model.get_output_embeddings()
    embed = language.get_input_embeddings()
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    # The input embedding is a lookup (a few rows a step); the head reads its whole matrix.
    read = _bytes(p for n, p in language.named_parameters() if not n.startswith("embed_tokens"))
    read += _bytes([head.weight])
    config = language.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = next(language.parameters()).element_size()
    kv = config.num_hidden_layers * 2 * kv_heads * head_dim * element
    language_params = sum(p.numel() for p in language.parameters())
    if not tied:
        language_params += head.weight.numel()
    vision = getattr(model.model, "visual", None) or getattr(model.model, "vision_tower", None)
    vision_params = sum(p.numel() for p in vision.parameters()) if vision is not None else 0
    return ModelCost(read, kv, language_params, vision_params)


class UtilizationSampler:
    """NVML utilisation (0-1) sampled while the block runs; ``mean`` None without NVML."""

    def __init__(self, device: str, every_s: float = 0.05) -> None:
        self.device = device
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = device.startswith("cuda") and _nvml_available(device)

    def __enter__(self) -> UtilizationSampler:
        if self.available:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(torch.cuda.utilization(self.device) / 100.0)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _nvml_available(device: str) -> bool:
    try:
        torch.cuda.utilization(device)
    except Exception:  # no pynvml, or NVML refused: the figure is left out
        return False
    return True
