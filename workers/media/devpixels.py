"""Photos that stay on the device: nvJPEG decode in batches, resize to the processor's target
and normalise there, so no uint8 frame makes a round trip to the host (issue 36).

The first GPU run (docs/prepare-tier.md) measured nvJPEG's decode at 0.47 ms a 1080p photo
left on the device, but 10.9 ms once resized and brought back to the host: the copy back and
the host's share were 20x the decode. Here the decoded photo is resized on the device and
handed on as a ``(3, H, W)`` uint8 tensor on that device, which the processor (on the device
too: ``engine.processor_device``) turns into ``pixel_values`` where the model reads them;
``normalise`` does the processor's last step for a caller that feeds the model itself.

The CPU path (``image.decode_image``: Pillow) stays the reference. nvJPEG ignores the EXIF
orientation, decodes no CMYK and is slower or unsupported on progressive scans on some builds,
so those items, anything that is not a JPEG, and any item the device fails on (a corrupt one)
go to the CPU reference one by one and are uploaded after it: the batch goes on.
``vlmq_media_device_decodes_total{result=...}`` counts each item's route.

Everything takes a ``device`` argument, so the same code runs with ``device="cpu"``
(torchvision's ``decode_jpeg`` decodes there too): the tests compare it with the CPU reference
on machines with no GPU. torch and torchvision are imported only when a decode runs.

Video frames decoded on the device (``nvdec.py``) are held the same way: ``DeviceFrames``, one
``(frames, 3, H, W)`` tensor handed whole to the processor.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image
from prometheus_client import Counter

from vlmq.config.errors import MediaDecodeFailed, VlmqError
from vlmq.config.media_checks import check_image_pixels
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.device import resized_on_device
from vlmq.workers.media.image import Downscale, decode_image
from vlmq.workers.media.photobatch import PhotoBatcher

__all__ = [
    "DEVICE_DECODES",
    "DeviceFrames",
    "DeviceImages",
    "DevicePhoto",
    "DevicePhotoDecoder",
    "decode_to_device",
    "device_key",
    "fallback_reason",
    "normalise",
    "photo_device",
    "pixel_error",
]

log = logging.getLogger(__name__)

# Process-wide (the default registry: on a worker's /metrics when VLMQ_METRICS__PORT is set).
# result: device, or the reason an item went to the CPU reference (exif, cmyk, progressive,
# format, corrupt, batch).
DEVICE_DECODES = Counter(
    "vlmq_media_device_decodes",
    "Photos decoded for the device path, by route: device, or why the CPU reference took it",
    ["result"],
)

_JPEG_MAGIC = b"\xff\xd8\xff"
_EXIF_ORIENTATION = 0x0112


@dataclass
class DeviceImages:
    """One batch's photos on ``device``: each a ``(3, H, W)`` uint8 tensor at its target, or
    the media error its item failed with (the others still stand)."""

    images: list[Any]
    routes: list[str]  # per item: "device" or the fallback's reason
    errors: dict[int, VlmqError] = field(default_factory=dict)

    def fallbacks(self) -> int:
        return sum(1 for route in self.routes if route != "device")


def fallback_reason(data: bytes) -> str | None:
    """Why this item cannot go to nvJPEG (from its header only; nothing decoded), or None."""
    if data[:3] != _JPEG_MAGIC:
        return "format"
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            if img.mode not in ("RGB", "L"):
                return "cmyk"  # CMYK / YCCK: nvJPEG has no conversion for them
            if img.info.get("progressive") or img.info.get("progression"):
                return "progressive"
            if int(img.getexif().get(_EXIF_ORIENTATION, 1)) not in (0, 1):
                return "exif"
    except Exception:
        return "corrupt"
    return None


def decode_to_device(
    datas: Sequence[bytes],
    settings: MediaSettings,
    downscales: Sequence[Downscale | None],
    device: str,
) -> DeviceImages:
    """Each photo decoded and resized on ``device`` in one batch where it can be, else by the
    CPU reference and uploaded; the route of each item is counted and logged."""
    routes: list[str] = [fallback_reason(data) or "device" for data in datas]
    images: list[Any] = [None] * len(datas)
    errors: dict[int, VlmqError] = {}
    on_device = [i for i, route in enumerate(routes) if route == "device"]
    for i in list(on_device):
        try:
            check_image_pixels(_header_size(datas[i]), settings)  # before anything is decoded
        except VlmqError as exc:
            errors[i] = exc
            on_device.remove(i)
    for i, image in _decode_batch(datas, on_device, device, routes).items():
        images[i] = resized_on_device(image, downscales[i])
    for i, route in enumerate(routes):
        if route != "device" and i not in errors:
            try:
                images[i] = _reference_on(datas[i], settings, downscales[i], device)
            except VlmqError as exc:
                errors[i] = exc
    for route in routes:
        DEVICE_DECODES.labels(result=route).inc()
    if any(route != "device" for route in routes):
        log.info("device photo decode on %s: routes %s", device, _tally(routes))
    return DeviceImages(images, routes, errors)


def _decode_batch(
    datas: Sequence[bytes], indices: list[int], device: str, routes: list[str]
) -> dict[int, Any]:
    """nvJPEG over ``indices`` in one call; a failed batch is retried item by item, and an item
    that fails alone is marked ``corrupt`` (the CPU reference then says what is wrong)."""
    if not indices:
        return {}
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in indices]
    try:
        decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        return dict(zip(indices, decoded, strict=True))
    except Exception as exc:
        log.info("device JPEG batch failed (%s): item by item", type(exc).__name__)
    done: dict[int, Any] = {}
    for i, tensor in zip(indices, encoded, strict=True):
        try:
            done[i] = decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device)
        except Exception:
            routes[i] = "corrupt"
    return done


def _header_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
        return img.size


def _reference_on(
    data: bytes, settings: MediaSettings, downscale: Downscale | None, device: str
) -> Any:
    """The CPU reference's pixels for one item, uploaded to ``device``."""
    import numpy as np
    import torch

    image = decode_image(data, settings, downscale)  # raises the item's media error
    array = np.array(image, dtype=np.uint8)  # a writable copy: torch shares it
    if array.ndim != 3:
        raise MediaDecodeFailed("could not decode image")
    tensor = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    return tensor.to(device, non_blocking=True)


def normalise(image: Any, mean: Sequence[float], std: Sequence[float], dtype: Any = None) -> Any:
    """The processor's last step on the device: uint8 ``(3, H, W)`` to ``(x / 255 - mean) /
    std`` in ``dtype`` (default float32), without leaving the device."""
    import torch

    dtype = dtype or torch.float32
    mean_t = torch.tensor(mean, dtype=torch.float32, device=image.device).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=image.device).view(-1, 1, 1)
    return ((image.float() / 255.0 - mean_t) / std_t).to(dtype)


def pixel_error(device_image: Any, reference: Image.Image) -> tuple[float, float, int]:
    """Mean, p99 and max absolute difference (0-255) of a device image against the CPU
    reference at the same target (sizes must match)."""
    import numpy as np

    ours = device_image.detach().to("cpu").permute(1, 2, 0).numpy().astype(np.int16)
    theirs = np.asarray(reference, dtype=np.int16)
    if ours.shape != theirs.shape:
        raise ValueError(f"size differs: {ours.shape} vs {theirs.shape}")
    diff = np.abs(ours - theirs)
    return float(diff.mean()), float(np.percentile(diff, 99)), int(diff.max())


def _tally(routes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for route in routes:
        counts[route] = counts.get(route, 0) + 1
    return counts


def photo_device(settings: MediaSettings, processor_device: str | None) -> str | None:
    """Where photos are decoded for the model: the processor's device when device decoding is
    on (``auto`` or ``cuda``) and that device is a working GPU; None: the CPU path. Logged."""
    from vlmq.workers.media.device import processor_gpu

    chosen, why = processor_gpu(settings, processor_device)
    if chosen is not None:
        why = "nvJPEG, resized and normalised on the device"
    log.info("photo decode route: %s (%s)", chosen or "cpu", why)
    return chosen


def device_key(kind: str, data: bytes, downscale: Downscale | None, *params: object) -> str:
    """The name of media decoded from ``data`` and left on the device (the processor-output
    cache's key for it): the source bytes' digest, the target and what else shaped it."""
    import hashlib

    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    target = (downscale.max_pixels, downscale.cover) if downscale is not None else None
    return ":".join(str(part) for part in (kind, digest, *params, target))


class _OnDevice:
    """Pixels left on the device: a uint8 tensor, channel-first, its last two dimensions the
    height and width; ``key`` names them (set on the tensor, for the processor-output cache)."""

    def __init__(self, tensor: Any, key: str) -> None:
        from vlmq.workers.media.prepared.pixels import KEY_ATTRIBUTE

        self.tensor = tensor
        self.key = key
        setattr(tensor, KEY_ATTRIBUTE, key)

    @property
    def height(self) -> int:
        return int(self.tensor.shape[-2])

    @property
    def width(self) -> int:
        return int(self.tensor.shape[-1])

    @property
    def size(self) -> tuple[int, int]:
        return (self.width, self.height)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    mode = "RGB"


class DevicePhoto(_OnDevice):
    """A decoded photo left on the device: a ``(3, H, W)`` uint8 tensor at the processor's
    target. The loader caches it like any image (``nbytes``), the runner hands the tensor to
    the processor on the same device, and its ``key`` (the source bytes' digest and the
    target) names its processor output, so nothing hashes its pixels back on the host."""

    def tobytes(self) -> bytes:
        """Interleaved RGB bytes, as ``PIL.Image.tobytes``: a copy to the host (tests, tools)."""
        return bytes(self.tensor.permute(1, 2, 0).contiguous().cpu().numpy().tobytes())


class DevicePhotoDecoder:
    """The loader's image decoder when the processor runs on a GPU: the photo decoded,
    resized and left on ``device`` (``decode_to_device``), its fallbacks included. Photos of
    requests prepared at the same time share nvJPEG batches of up to ``batch`` (waiting at
    most ``window_s`` for company: ``photobatch.py``). Its pixels are keyed apart from the CPU
    decoder's and never go to the frame store (device memory)."""

    name = "nvjpeg-device"

    def __init__(self, device: str, batch: int = 1, window_s: float = 0.0) -> None:
        self.device = device
        self.batcher = PhotoBatcher(device, batch, window_s, decode_to_device)

    def decode(
        self, data: bytes, settings: MediaSettings, downscale: Downscale | None
    ) -> DevicePhoto:
        image = self.batcher.decode(data, settings, downscale)
        return DevicePhoto(image, device_key("device", data, downscale))


class DeviceFrames(_OnDevice):
    """A clip's sampled frames left on the device: one ``(frames, 3, H, W)`` uint8 tensor at
    the processor's target (NVDEC's output: ``nvdec.DeviceVideoDecoder``). Like ``Pixels``,
    the frames stay one tensor from the loader to the processor, and ``key`` (the source
    bytes' digest, the sampling and the target) names its processor output; unlike them, it
    never goes to the frame store (device memory)."""

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, index: int) -> Image.Image:
        return self.image(index)

    def __iter__(self) -> Iterator[Image.Image]:
        """The frames as Pillow images (copies to the host: tests and rare consumers)."""
        return (self.image(index) for index in range(len(self)))

    def image(self, index: int = 0) -> Image.Image:
        """One frame on the host as a Pillow image (a copy)."""
        array = self.tensor[index].permute(1, 2, 0).contiguous().cpu().numpy()
        return Image.fromarray(array, "RGB")

    def take(self, indices: Sequence[int]) -> DeviceFrames:
        """The frames at ``indices`` (repeats allowed), on the same device, keyed apart."""
        picked = list(indices)
        return DeviceFrames(self.tensor[picked], f"{self.key}{picked}")

    def channels_last(self) -> Any:
        """``(frames, height, width, 3)`` uint8 on the host, a copy (vLLM's videos; tests)."""
        return self.tensor.permute(0, 2, 3, 1).contiguous().cpu().numpy()
