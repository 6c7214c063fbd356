"""Issue 36's figures inside the GPU media check (``bash bench/gpu.sh --media``, step (e)):
media that stays on the device, measured against the CPU reference in the same run.

* **Photos** (``workers/media/devpixels.py``): the GPU host's CPU per photo (process CPU time
  over the photos, one thread driving) and wall per photo for nvJPEG in batches, resized and
  normalised on the device, left there; beside the CPU reference (Pillow) on one thread.
  Pixel error at the processor's target against the CPU reference: mean, p99, max (0-255).
* **Video** (``workers/media/nvdec.py``): a clip's sampled frames through the hardware decoder
  (PyNvVideoCodec or torchcodec, whichever imports), frames/s, against the same clips decoded
  by the CPU reference on every prepare process at once (the host's cores).
* **Logits agreement**: the model's next-token logits on CPU-decoded against device-decoded
  photos: max absolute difference, and top-1 agreement where the top-1 margin exceeds the
  dtype's rounding noise (random weights give near ties that bf16 flips).
* **GPU busy** as GPU time: NVML's utilisation sampled every 10 ms during each device step
  (the share of time a kernel ran), never wall time inside a call.

Every function returns markdown lines; a step that cannot run says why in its line.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GpuBusy", "logits_lines", "photo_lines", "video_lines"]

# Sampled frames per clip in the video figure (the target: 16 of a 720p H.264 clip).
CLIP_SAMPLES = 16


class GpuBusy:
    """NVML utilisation sampled in a thread while a step runs: the share of samples in which
    a kernel was running on the device. ``None`` without NVML or CUDA."""

    def __init__(self, device: str) -> None:
        self.samples: list[int] = []
        self.handle: Any = None
        self._stop = threading.Event()
        if not device.startswith("cuda"):
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.split(":")[1]) if ":" in device else 0
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:
            self.handle = None

    def __enter__(self) -> GpuBusy:
        if self.handle is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self._stop.set()
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))

    @property
    def busy(self) -> float | None:
        return statistics.fmean(self.samples) / 100 if self.samples else None


def _busy_text(busy: float | None) -> str:
    return f"{busy:.2f}" if busy is not None else "n/a (no GPU/NVML)"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _per_item(action: Callable[[], object], items: int, repeats: int) -> tuple[str, str]:
    """Wall ms and process-CPU ms per item: median of ``repeats``, with the spread."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        walls.append((time.perf_counter() - wall) * 1000 / items)
        cpus.append((time.process_time() - cpu) * 1000 / items)
    return _spread(walls), _spread(cpus)


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def photo_lines(
    datas: Sequence[bytes], settings: Any, target: Any, device: str, batch: int, repeats: int
) -> tuple[list[str], list[Any]]:
    """The photo table, and the device images (for the logits step)."""
    import numpy as np

    from vlmq.workers.media.devpixels import decode_to_device, normalise, pixel_error
    from vlmq.workers.media.image import decode_image

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    kept: list[Any] = []

    def reference() -> None:
        for data in datas:
            decode_image(data, settings, target)

    def on_device() -> None:
        kept.clear()
        for start in range(0, len(datas), batch):
            chunk = datas[start : start + batch]
            out = decode_to_device(chunk, settings, [target] * len(chunk), device)
            kept.extend(out.images)
            for image in out.images:
                normalise(image, mean, std)
        _sync(device)

    on_device()  # warm-up: the nvJPEG handle, the CUDA context, the resize kernels
    cpu_wall, cpu_cpu = _per_item(reference, len(datas), repeats)
    with GpuBusy(device) as busy:
        dev_wall, dev_cpu = _per_item(on_device, len(datas), repeats)
    loader_rows = [
        _loader_row(datas, settings, target, device, size, repeats) for size in (1, batch)
    ]
    errors = [
        pixel_error(image, decode_image(data, settings, target))
        for data, image in zip(datas, kept, strict=True)
    ]
    lines = [
        "",
        f"### (e) Photos on the device ({len(datas)} photos, ms per photo: median (min-max) "
        f"of {repeats})",
        "",
        "| path | wall ms | host CPU ms | GPU busy (NVML) |",
        "| --- | ---: | ---: | ---: |",
        f"| CPU reference (Pillow draft + bicubic), one thread | {cpu_wall} | {cpu_cpu} | - |",
        f"| nvJPEG batch {batch} on {device}, resized + normalised there, left there | "
        f"{dev_wall} | {dev_cpu} | {_busy_text(busy.busy)} |",
        *loader_rows,
        "",
        f"Pixel error, device path vs CPU reference at the target ({len(errors)} photos, 0-255):"
        f" mean {np.mean([e[0] for e in errors]):.2f}, p99 {max(e[1] for e in errors):.0f}, "
        f"max {max(e[2] for e in errors)}.",
    ]
    return lines, kept


def _loader_row(
    datas: Sequence[bytes], settings: Any, target: Any, device: str, size: int, repeats: int
) -> str:
    """The worker's own decoder (``DevicePhotoDecoder``), one photo per call from a thread per
    photo as the preparer calls it: batch 1 is one nvJPEG call per photo; ``size`` lets calls
    made together share one (``photobatch.py``, 2 ms window)."""
    from concurrent.futures import ThreadPoolExecutor

    from vlmq.workers.media.devpixels import DevicePhotoDecoder

    decoder = DevicePhotoDecoder(device, size, 0.002 if size > 1 else 0.0)

    def through_loader() -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda data: decoder.decode(data, settings, target), datas))
        _sync(device)

    through_loader()  # warm-up
    with GpuBusy(device) as busy:
        wall, cpu = _per_item(through_loader, len(datas), repeats)
    how = "one nvJPEG call a photo" if size == 1 else f"calls share batches of up to {size}"
    return (
        f"| the worker's decoder, 16 threads, {how}, left on {device} | {wall} | {cpu} | "
        f"{_busy_text(busy.busy)} |"
    )


def _cpu_clip(args: tuple[bytes, Any, float, Any]) -> int:
    """One clip through the CPU reference in a prepare process: its sampled frame count."""
    from vlmq.workers.media.video import decode_video

    data, settings, fps, target = args
    return len(decode_video(data, settings, fps, CLIP_SAMPLES, target).frames)


def video_lines(
    datas: Sequence[bytes],
    settings: Any,
    target: Any,
    device: str,
    clip_seconds: float,
    pool: Any,
    procs: int,
    repeats: int,
) -> list[str]:
    """Frames/s through the hardware decoder against the host's cores on the CPU reference."""
    from vlmq.workers.media.nvdec import decode_on_device, find_backend, probe, video_route
    from vlmq.workers.media.video import Sampling

    fps = CLIP_SAMPLES / clip_seconds
    plan = Sampling(fps, CLIP_SAMPLES)
    info = probe(datas[0], settings)
    backend = find_backend()
    auto = video_route(
        info,
        plan,
        CLIP_SAMPLES,
        "auto",
        device.startswith("cuda"),
        backend.name if backend else None,
        settings.model_copy(update={"device_decode": "auto"}),
    )
    lines = [
        "",
        f"### (e) Video: {len(datas)} clips {info.width}x{info.height} {info.codec}, "
        f"{CLIP_SAMPLES} sampled frames each (frames/s: median (min-max) of {repeats})",
        "",
        f"Route under media.device_decode=auto: **{auto.device}**: {auto.reason}.",
        "",
        "| decoder | frames/s |",
        "| --- | ---: |",
    ]
    jobs = [(data, settings, fps, target) for data in datas]

    def on_cores() -> int:
        return sum(pool.map(_cpu_clip, jobs, chunksize=1))

    on_cores()  # warm-up: the processes' first import of PyAV and the decoders
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        frames = on_cores()
        rates.append(frames / (time.perf_counter() - started))
    lines.append(f"| CPU reference (PyAV, exact), {procs} processes | {_spread(rates)} |")
    if backend is None:
        lines.append(
            "| hardware decoder | skipped: neither PyNvVideoCodec nor torchcodec imports here |"
        )
        return lines
    forced = settings.model_copy(update={"device_decode": "cuda"})

    def on_device() -> int:
        count = 0
        for data in datas:
            out = decode_on_device(data, forced, plan, target, device, backend)
            count += int(out.frames.shape[0])
            if out.route.device != "cuda":
                raise RuntimeError(f"{backend.name} fell back: {out.route.reason}")
        _sync(device)
        return count

    on_device()  # warm-up: the decoder's context
    rates = []
    with GpuBusy(device) as busy:
        for _ in range(repeats):
            started = time.perf_counter()
            frames = on_device()
            rates.append(frames / (time.perf_counter() - started))
    lines.append(
        f"| {backend.name} on {device}, one stream, resized there | {_spread(rates)} "
        f"(GPU busy {_busy_text(busy.busy)}) |"
    )
    return lines


def logits_lines(loaded: Any, cpu_images: Sequence[Any], device_images: Sequence[Any]) -> list[str]:
    """Next-token logits on CPU-decoded against device-decoded photos, one photo a request."""
    import torch

    processor, model = loaded.processor, loaded.model
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def logits(image: Any) -> Any:
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        inputs = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in inputs.items()}
        with torch.no_grad():
            return model(**inputs).logits[0, -1].float().cpu()

    diffs, agree, decided = [], 0, 0
    dtype = next(model.parameters()).dtype
    eps = torch.finfo(dtype).eps
    for cpu_image, dev_image in zip(cpu_images, device_images, strict=True):
        ref, ours = logits(cpu_image), logits(dev_image.to("cpu"))
        diffs.append(float((ref - ours).abs().max()))
        top = torch.topk(ref, 2).values
        noise = 4 * eps * float(ref.abs().max())  # a few roundings of the largest logit
        if float(top[0] - top[1]) > noise:
            decided += 1
            agree += int(int(ref.argmax()) == int(ours.argmax()))
    return [
        "",
        f"Logits, device-decoded vs CPU-decoded photos ({len(diffs)} requests, {dtype}): max abs "
        f"difference {max(diffs):.4g} (median {statistics.median(diffs):.4g}); top-1 agrees on "
        f"{agree}/{decided} where the margin exceeds the dtype's noise "
        f"({len(diffs) - decided} near ties left out).",
    ]
