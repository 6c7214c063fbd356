"""Video on the GPU's hardware decoders (NVDEC): only the sampled frames, resized on the device.

An H100/H200 has 7 NVDEC engines beside the SMs; a GPU host's 16 cores cannot feed it video
(2.19 CPU-s to prepare one 20 s 720p clip on the first GPU run). Two decoders are used where
they import, in this order:

* **PyNvVideoCodec** (``pynvvideocodec``: NVIDIA's bindings; needs the driver's
  ``libnvcuvid``): ``SimpleDecoder`` over the clip, planar RGB in device memory,
  ``get_batch_frames_by_index`` for the sampled frames only.
* **torchcodec** with its CUDA device: ``VideoDecoder(device="cuda")``,
  ``get_frames_played_at`` for the sample times only.

Both seek to the keyframe before each sampled frame and decode forward from it; nothing else
is decoded. The sample times are the CPU reference's (``video.plan_sample_times``), so the
frames are the same frames (``frame_indices`` match); their pixels are not bit-exact
(hardware decoders and the device resize differ from FFmpeg's).

The route (``video_route``) is automatic and conservative: published figures show CUDA decode
slower than the CPU at low resolution (540p: 5.6x, meta-pytorch/torchcodec#378) and for sparse
seeks, and its first frame costs a context start (271 ms vs 13 ms). So the device takes a clip
only with ``media.device_decode`` on, a decoder installed, its codec in
``media.device_video_codecs``, at least ``device_video_min_height`` rows and at least
``device_video_min_samples_per_s``; ``keyframes`` sampling stays on the CPU path (opt-in, and
already one decode per sample). Any failure on the device falls back to the CPU reference for
that clip alone; ``vlmq_media_device_video_decodes_total{result=...}`` counts each clip's route.

The worker's loader uses it (``DeviceVideoDecoder``, built once per worker by
``device_video_decoder`` when the processor runs on a GPU and a decoder imports): its frames
stay on the device as ``devpixels.DeviceFrames`` and go whole to the processor there, cached
apart from the CPU's frames and never written to the frame store.

Tested by injection (a fake decoder module in tests/support); torch and the decoders are
imported only when a device decode runs.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter

from vlmq.config.errors import MediaDecodeFailed, VlmqError
from vlmq.config.media_checks import open_video_container
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.device import Route, processor_gpu, resized_on_device
from vlmq.workers.media.devpixels import DeviceFrames, device_key
from vlmq.workers.media.image import Downscale
from vlmq.workers.media.video import (
    DecodedVideo,
    Sampling,
    check_header_resolution,
    decode_video,
    plan_sample_times,
)

__all__ = [
    "DEVICE_VIDEO_DECODES",
    "DeviceVideo",
    "DeviceVideoDecoder",
    "StreamInfo",
    "VideoBackend",
    "decode_on_device",
    "device_video_decoder",
    "find_backend",
    "probe",
    "video_route",
]

log = logging.getLogger(__name__)

DEVICE_VIDEO_DECODES = Counter(
    "vlmq_media_device_video_decodes",
    "Clips decoded for the device path, by route: device, cpu (the rule), fallback (failed)",
    ["result"],
)


@dataclass(frozen=True)
class StreamInfo:
    """What the container says about the clip's video stream (nothing decoded)."""

    codec: str  # FFmpeg's name: h264, hevc, av1, vp9, mpeg4...
    width: int
    height: int
    fps: float
    duration_s: float
    total_frames: int


@dataclass
class DeviceVideo:
    """Sampled frames on the device, ``(frames, 3, H, W)`` uint8, at the processor's target."""

    frames: Any
    fps: float
    duration_s: float
    frame_indices: list[int]
    total_frames: int
    width: int
    height: int
    route: Route


class VideoBackend(Protocol):
    """A hardware decoder: the frames played at ``seconds``, as one ``(N, 3, H, W)`` uint8
    tensor on ``device``, decoding only what those frames need."""

    name: str

    def frames_at(
        self, data: bytes, seconds: list[float], indices: list[int], device: str
    ) -> Any: ...


def probe(data: bytes, settings: MediaSettings) -> StreamInfo:
    """The stream's codec, size, rate and length from the container header; a size over the
    limits fails here, before anything is decoded."""
    try:
        with open_video_container(io.BytesIO(data), settings) as container:
            if not container.streams.video:
                raise MediaDecodeFailed("media has no video stream")
            stream = container.streams.video[0]
            check_header_resolution(stream, settings)
            ctx = stream.codec_context
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
            if stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            else:
                duration = float(container.duration or 0) / 1_000_000
            frames = int(stream.frames or 0) or max(1, round(duration * fps))
            return StreamInfo(ctx.name, ctx.width, ctx.height, fps, duration, frames)
    except VlmqError:
        raise
    except Exception:
        raise MediaDecodeFailed("could not decode video") from None


def video_route(
    info: StreamInfo,
    plan: Sampling,
    samples: int,
    mode: str,
    cuda: bool,
    backend: str | None,
    settings: MediaSettings,
) -> Route:
    """Where a clip's sampled frames are decoded, and why (logged, shown by the tests)."""
    samples_per_s = samples / max(info.duration_s, 1e-9)
    if mode == "cpu":
        return Route("cpu", "device decoding is off (media.device_decode=cpu)")
    if not cuda:
        return Route("cpu", "CUDA is not available")
    if backend is None:
        return Route("cpu", "no hardware video decoder: neither PyNvVideoCodec nor torchcodec")
    if plan.mode != "exact":
        return Route("cpu", "keyframe sampling: the CPU path decodes one frame per sample")
    if info.codec not in settings.device_video_codecs:
        return Route("cpu", f"codec {info.codec} is not in media.device_video_codecs")
    if mode == "cuda":
        return Route("cuda", f"{backend}: device decoding forced (media.device_decode=cuda)")
    if info.height < settings.device_video_min_height:
        return Route("cpu", f"{info.height} rows: CUDA decode measured slower at low resolution")
    if samples_per_s < settings.device_video_min_samples_per_s:
        return Route("cpu", f"{samples_per_s:.2f} samples/s: sparse seeks are slower there")
    return Route("cuda", f"{backend}: {info.codec} {info.height}p, {samples_per_s:.2f} samples/s")


def decode_on_device(
    data: bytes,
    settings: MediaSettings,
    plan: Sampling,
    downscale: Downscale | None,
    device: str,
    backend: VideoBackend | None,
    cuda: bool = True,
) -> DeviceVideo:
    """The clip's sampled frames on ``device``: through ``backend`` where the route says so,
    else (or when the device fails) the CPU reference's frames, uploaded."""
    info = probe(data, settings)
    if info.duration_s > settings.video_max_duration_s:
        return _on_cpu(data, settings, plan, downscale, device, Route("cpu", "too long"))
    times = plan_sample_times(
        info.duration_s, info.fps, info.total_frames, plan.fps, plan.max_frames
    )
    name = backend.name if backend is not None else None
    route = video_route(info, plan, len(times), settings.device_decode, cuda, name, settings)
    log.info("video decode route: %s (%s)", route.device, route.reason)
    if route.device == "cuda" and backend is not None:
        indices = [min(int(t * info.fps + 1e-6), info.total_frames - 1) for t in times]
        try:
            frames = backend.frames_at(data, times, indices, device)
            frames = resized_on_device(frames, downscale)
        except VlmqError:
            raise
        except Exception as exc:
            log.warning("device video decode failed (%s): the CPU path", type(exc).__name__)
            DEVICE_VIDEO_DECODES.labels(result="fallback").inc()
            fallback = Route("cpu", f"{name} failed: {type(exc).__name__}")
            return _on_cpu(data, settings, plan, downscale, device, fallback, count=False)
        DEVICE_VIDEO_DECODES.labels(result="device").inc()
        height, width = int(frames.shape[-2]), int(frames.shape[-1])
        return DeviceVideo(
            frames, info.fps, info.duration_s, indices, info.total_frames, width, height, route
        )
    return _on_cpu(data, settings, plan, downscale, device, route)


def _on_cpu(
    data: bytes,
    settings: MediaSettings,
    plan: Sampling,
    downscale: Downscale | None,
    device: str,
    route: Route,
    count: bool = True,
) -> DeviceVideo:
    import numpy as np
    import torch

    if count:
        DEVICE_VIDEO_DECODES.labels(result="cpu").inc()
    video = decode_video(data, settings, plan.fps, plan.max_frames, downscale, plan.mode)
    array = np.stack([np.array(frame, dtype=np.uint8) for frame in video.frames])
    frames = torch.from_numpy(array).permute(0, 3, 1, 2).contiguous().to(device)
    return DeviceVideo(
        frames,
        video.fps,
        video.duration_s,
        video.frame_indices,
        video.total_frames,
        video.width,
        video.height,
        route,
    )


# --- in the worker's loader ------------------------------------------------------------------


class DeviceVideoDecoder:
    """The loader's video decoder when the processor runs on a GPU: each clip's sampled frames
    through ``backend`` where the route says so, else the CPU reference's uploaded (the
    fallback per clip included), left on ``device`` as ``DeviceFrames``. Its frames are keyed
    apart from the CPU decoder's and never go to the frame store (device memory)."""

    name = "nvdec-device"

    def __init__(self, device: str, backend: VideoBackend, cuda: bool = True) -> None:
        self.device = device
        self.backend = backend
        self.cuda = cuda

    def decode(
        self, data: bytes, settings: MediaSettings, plan: Sampling, downscale: Downscale | None
    ) -> DecodedVideo:
        device, backend = self.device, self.backend
        out = decode_on_device(data, settings, plan, downscale, device, backend, self.cuda)
        key = device_key("device-video", data, downscale, plan.fps, plan.max_frames, plan.mode)
        frames = DeviceFrames(out.frames, key)
        return DecodedVideo(
            frames, out.fps, out.duration_s, out.frame_indices, out.total_frames, *frames.size
        )


def device_video_decoder(
    settings: MediaSettings,
    processor_device: str | None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> DeviceVideoDecoder | None:
    """The worker's video decoder: NVDEC on the processor's GPU when device decoding is on,
    the processor runs on a working GPU and a hardware decoder imports; None: the CPU path.
    Chosen once per worker and logged (each clip's own route is logged as it decodes)."""
    chosen, why = processor_gpu(settings, processor_device)
    backend = find_backend(importer) if chosen is not None else None
    if chosen is not None and backend is None:
        chosen, why = None, "no hardware video decoder: neither PyNvVideoCodec nor torchcodec"
    log.info(
        "video decoder: %s (%s)",
        f"{backend.name} on {chosen}" if chosen and backend else "cpu",
        why if backend is None else "clips the route sends there; the rest uploaded",
    )
    if chosen is None or backend is None:
        return None
    return DeviceVideoDecoder(chosen, backend)


# --- the decoders ---------------------------------------------------------------------------


class PyNvBackend:
    """PyNvVideoCodec's ``SimpleDecoder``: planar RGB in device memory, sampled frames by
    index (it seeks to the keyframe before each and decodes forward)."""

    name = "pynvvideocodec"

    def __init__(self, module: Any) -> None:
        self.nvc = module

    def frames_at(self, data: bytes, seconds: list[float], indices: list[int], device: str) -> Any:
        import torch

        gpu = int(device.split(":")[1]) if ":" in device else 0
        with tempfile.TemporaryDirectory(prefix="vlmq-nvdec-") as folder:
            path = os.path.join(folder, "clip")  # SimpleDecoder reads a seekable file
            with open(path, "wb") as out:
                out.write(data)
            decoder = self.nvc.SimpleDecoder(
                path,
                gpu_id=gpu,
                use_device_memory=True,
                output_color_type=self.nvc.OutputColorType.RGBP,
            )
            frames = decoder.get_batch_frames_by_index(indices)
            return torch.stack([torch.from_dlpack(frame) for frame in frames]).to(device)


class TorchCodecBackend:
    """torchcodec's CUDA ``VideoDecoder``: the frames played at the sample times."""

    name = "torchcodec"

    def __init__(self, module: Any) -> None:
        self.decoders = module

    def frames_at(self, data: bytes, seconds: list[float], indices: list[int], device: str) -> Any:
        decoder = self.decoders.VideoDecoder(data, device=device, seek_mode="exact")
        return decoder.get_frames_played_at(seconds=seconds).data


def find_backend(importer: Callable[[str], Any] = importlib.import_module) -> VideoBackend | None:
    """The first hardware decoder that imports (PyNvVideoCodec, then torchcodec), or None."""
    for module_name, make in (
        ("PyNvVideoCodec", PyNvBackend),
        ("torchcodec.decoders", TorchCodecBackend),
    ):
        try:
            backend: VideoBackend = make(importer(module_name))
        except Exception as exc:  # ImportError, or a missing libnvcuvid raising OSError
            log.debug("%s does not import: %s", module_name, type(exc).__name__)
            continue
        return backend
    return None
