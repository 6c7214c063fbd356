"""Media decoding on the model's GPU, where there is no prepare tier: which items go there
(a pure rule, per item) and the batched nvJPEG path with its fallback.

The CPU path (``image.py``: Pillow; ``video.py``: FFmpeg) stays the reference: device decoding
is opt-in (``media.device_decode``: ``cpu`` by default, ``auto`` or ``cuda``), is not bit-exact
(nvJPEG upsamples chroma differently from libjpeg; hardware video decoders differ from FFmpeg's
software ones), and any error on the device falls back to the CPU decode of the same bytes.
Decoded images are resized to the processor's target on the device and come back to the host
as small uint8 images, so everything after decoding (the media cache, the frame store, the
length estimate, the processor, which normalises on the GPU with ``processor_device=auto``)
is unchanged; a photo downscaled to ~1 MP is ~3 MB over PCIe, a fraction of a millisecond.

Rules, from published figures (no GPU here to measure them; /work notes, gpu-media.md):
* JPEG images go to nvJPEG whenever CUDA is available: batched ``decode_jpeg(device="cuda")``
  passes 8,000 images/s on one A100, ~20x one CPU thread (pytorch/vision#8496). Other image
  formats, and JPEGs with an EXIF rotation (nvJPEG ignores it), stay on the CPU.
* Video goes to a CUDA decoder only at 720p and above with dense enough samples: torchcodec's
  CUDA decoder doubles 1080p throughput but is 5.6x slower than the CPU at 540p, and sparse
  seeks are slower on the device (meta-pytorch/torchcodec#378); it needs torchcodec.

torch and torchvision are imported only when a device decode runs: prepare workers (no model)
import this module without them.
"""

from __future__ import annotations

import importlib.util
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from PIL import Image

from vlmq.config.errors import VlmqError
from vlmq.config.media_checks import check_image_pixels
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.image import Downscale, decode_image

__all__ = [
    "NvJpegDecoder",
    "Route",
    "cuda_available",
    "decode_jpegs",
    "device_image_decoder",
    "image_route",
    "is_jpeg",
    "processor_gpu",
    "resized_on_device",
    "torchcodec_available",
    "video_route",
]

log = logging.getLogger(__name__)

_JPEG_MAGIC = b"\xff\xd8\xff"
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class Route:
    """Where one item is decoded, and why (logged, and shown by the tests)."""

    device: Literal["cpu", "cuda"]
    reason: str


def cuda_available() -> bool:
    """CUDA usable by torch (False without torch: a prepare worker without a model)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def torchcodec_available() -> bool:
    return importlib.util.find_spec("torchcodec") is not None


def is_jpeg(data: bytes) -> bool:
    return data[:3] == _JPEG_MAGIC


# --- the rule ---------------------------------------------------------------------------------


def image_route(data: bytes, mode: str, cuda: bool) -> Route:
    """Where an image's bytes are decoded: ``mode`` is ``media.device_decode``."""
    if mode == "cpu":
        return Route("cpu", "device decoding is off (media.device_decode=cpu)")
    if not cuda:
        return Route("cpu", "CUDA is not available")
    if not is_jpeg(data):
        return Route("cpu", "not a JPEG: nvJPEG decodes JPEG only")
    if _exif_rotated(data):
        return Route("cpu", "EXIF rotation: nvJPEG ignores it, the CPU path applies it")
    return Route("cuda", "a JPEG on a CUDA device: nvJPEG")


def video_route(
    height: int,
    samples_per_s: float,
    mode: str,
    cuda: bool,
    decoder: bool,
    settings: MediaSettings,
) -> Route:
    """Where a video's sampled frames are decoded. ``decoder``: a CUDA video decoder is
    installed (torchcodec). ``samples_per_s``: sampled frames per second of video."""
    if mode == "cpu":
        return Route("cpu", "device decoding is off (media.device_decode=cpu)")
    if not cuda:
        return Route("cpu", "CUDA is not available")
    if not decoder:
        return Route("cpu", "no CUDA video decoder: torchcodec is not installed")
    if mode == "cuda":
        return Route("cuda", "device decoding forced (media.device_decode=cuda)")
    if height < settings.device_video_min_height:
        return Route(
            "cpu",
            f"{height} rows is below {settings.device_video_min_height}: CUDA decoding "
            "measured slower at low resolution (540p: 5.6x)",
        )
    if samples_per_s < settings.device_video_min_samples_per_s:
        return Route(
            "cpu",
            f"{samples_per_s:.2f} samples/s is sparse: seeks on the device measured slower",
        )
    return Route("cuda", f"{height} rows, {samples_per_s:.2f} samples/s: CUDA decoding")


def _exif_rotated(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return int(img.getexif().get(_EXIF_ORIENTATION, 1)) not in (0, 1)
    except Exception:
        return False  # a broken header: nvJPEG fails on it and the CPU path says why


# --- nvJPEG ---------------------------------------------------------------------------------


def decode_jpegs(
    datas: Sequence[bytes],
    settings: MediaSettings,
    downscales: Sequence[Downscale | None],
    device: str,
) -> list[Image.Image]:
    """JPEGs decoded in one nvJPEG batch on ``device``, each resized there to its target and
    brought back as an RGB image. Any error falls back to the CPU reference for the whole
    batch (which then fails a bad item with the usual media error)."""
    try:
        return _nvjpeg(datas, settings, downscales, device)
    except VlmqError:
        raise
    except Exception as exc:
        log.warning("device JPEG decoding failed (%s): decoding on the CPU", type(exc).__name__)
        return [decode_image(d, settings, s) for d, s in zip(datas, downscales, strict=True)]


def _nvjpeg(
    datas: Sequence[bytes],
    settings: MediaSettings,
    downscales: Sequence[Downscale | None],
    device: str,
) -> list[Image.Image]:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    for data in datas:
        check_image_pixels(_header_size(data), settings)  # before anything is decoded
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
    decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    return [
        _to_host(resized_on_device(image, downscale))
        for image, downscale in zip(decoded, downscales, strict=True)
    ]


def _header_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
        return img.size


def resized_on_device(pixels: Any, downscale: Downscale | None) -> Any:
    """(..., 3, H, W) uint8 on its device (one image or a stack of frames), resized
    (bicubic, antialiased: the CPU reference's filter) to the processor's target; never
    larger than the source."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf

    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    target = downscale.size_for((width, height)) if downscale is not None else (width, height)
    if target == (width, height):
        return pixels
    resized = tvf.resize(
        pixels.float(), [target[1], target[0]], InterpolationMode.BICUBIC, antialias=True
    )
    return resized.round_().clamp_(0, 255).to(pixels.dtype)


def _to_host(image: Any) -> Image.Image:
    array = image.permute(1, 2, 0).contiguous().cpu().numpy()
    return Image.fromarray(array, "RGB")


class NvJpegDecoder:
    """The loader's image decoder on a CUDA model: nvJPEG for the items the rule sends there,
    the CPU reference for the rest. Its pixels are keyed apart from the CPU decoder's."""

    name = "nvjpeg"

    def __init__(self, mode: str, device: str) -> None:
        self.mode = mode
        self.device = device

    def decode(
        self, data: bytes, settings: MediaSettings, downscale: Downscale | None
    ) -> Image.Image:
        route = image_route(data, self.mode, cuda=True)
        if route.device == "cpu" or "JPEG" not in settings.image_formats:
            return decode_image(data, settings, downscale)
        return decode_jpegs([data], settings, [downscale], self.device)[0]


def processor_gpu(settings: MediaSettings, processor_device: str | None) -> tuple[str | None, str]:
    """The processor's GPU when media may be decoded and left there: device decoding on
    (``auto`` or ``cuda``), the processor on a CUDA device and CUDA working; else None. With
    why (the photo and video routes log it)."""
    if settings.device_decode == "cpu":
        return None, "media.device_decode=cpu"
    if not (processor_device or "").startswith("cuda"):
        return None, f"the processor runs on {processor_device or 'the CPU'}"
    if not cuda_available():
        return None, "CUDA is not available"
    return processor_device, "the processor's GPU"


def device_image_decoder(settings: MediaSettings, model_device: str) -> NvJpegDecoder | None:
    """The image decoder for a model on ``model_device``: nvJPEG when device decoding is on
    (``auto`` or ``cuda``), the model is on a GPU and CUDA works; else None (the CPU path)."""
    if settings.device_decode == "cpu" or not model_device.startswith("cuda"):
        return None
    if not cuda_available():
        log.info("device decoding: CUDA is not available, decoding on the CPU")
        return None
    return NvJpegDecoder(settings.device_decode, model_device)
