"""NVDEC video (workers/media/nvdec.py): the route, only the sampled frames asked of the
device decoder, its frames matching the CPU reference's, and the fallback per clip. No GPU
here: a fake decoder module (tests/support) runs the device code with device="cpu"."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.fake_videodecoder import FakeDecoders
from tests.support.samples import make_video_bytes
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.image import Downscale
from vlmq.workers.media.nvdec import (
    DEVICE_VIDEO_DECODES,
    StreamInfo,
    TorchCodecBackend,
    decode_on_device,
    find_backend,
    probe,
    video_route,
)
from vlmq.workers.media.video import Sampling, decode_video, resolve_sampling

pytestmark = pytest.mark.unit

ON = MediaSettings(device_decode="auto", device_video_min_height=1)
EXACT = Sampling(fps=2.0, max_frames=8)
HD = StreamInfo("h264", 1280, 720, 30.0, 20.0, 600)


@pytest.fixture(scope="module")
def clip() -> bytes:
    """4 s at 25 fps, a keyframe every 25 frames, H.264."""
    return make_video_bytes(n_frames=100, size=(128, 96), fps=25, codec="libx264", gop=25)


def _count(result: str) -> float:
    return float(DEVICE_VIDEO_DECODES.labels(result=result)._value.get())


def test_route_is_conservative_by_default() -> None:
    settings = MediaSettings(device_decode="auto")
    dense = Sampling(fps=2.0, max_frames=64)
    assert video_route(HD, dense, 40, "auto", True, "torchcodec", settings).device == "cuda"
    assert video_route(HD, dense, 40, "cpu", True, "torchcodec", settings).device == "cpu"
    assert video_route(HD, dense, 40, "auto", False, "torchcodec", settings).device == "cpu"
    assert video_route(HD, dense, 40, "auto", True, None, settings).device == "cpu"
    low = StreamInfo("h264", 960, 540, 30.0, 20.0, 600)
    assert "low resolution" in video_route(low, dense, 40, "auto", True, "x", settings).reason
    sparse = video_route(HD, dense, 8, "auto", True, "x", settings)  # 0.4 samples/s
    assert sparse.device == "cpu" and "sparse" in sparse.reason
    av1 = StreamInfo("av1", 1920, 1080, 30.0, 20.0, 600)
    assert video_route(av1, dense, 40, "cuda", True, "x", settings).device == "cpu"
    keyframes = Sampling(fps=2.0, max_frames=64, mode="keyframes")
    assert video_route(HD, keyframes, 40, "cuda", True, "x", settings).device == "cpu"
    assert video_route(low, dense, 2, "cuda", True, "x", settings).device == "cuda"


def test_probe_reads_the_header(clip: bytes) -> None:
    info = probe(clip, ON)
    assert (info.codec, info.width, info.height) == ("h264", 128, 96)
    assert info.fps == pytest.approx(25.0) and info.total_frames == 100


def test_device_decoder_gets_only_the_sampled_times_and_matches_the_reference(
    clip: bytes,
) -> None:
    fake = FakeDecoders()
    target = Downscale(max_pixels=64 * 48)
    before = _count("device")
    out = decode_on_device(clip, ON, EXACT, target, "cpu", TorchCodecBackend(fake))
    assert out.route.device == "cuda", out.route
    assert _count("device") == before + 1
    reference = decode_video(clip, ON, EXACT.fps, EXACT.max_frames, target)
    assert len(fake.calls) == 1 and len(fake.calls[0]) == len(reference.frames) == 8
    assert out.frame_indices == reference.frame_indices
    assert tuple(out.frames.shape) == (8, 3, reference.height, reference.width)
    ours = out.frames.permute(0, 2, 3, 1).numpy().astype(np.int16)
    theirs = np.stack([np.asarray(f, dtype=np.int16) for f in reference.frames])
    # Same frames (the fake decodes like FFmpeg); the resize filters differ (device bicubic,
    # swscale area): close, not identical.
    assert float(np.abs(ours - theirs).mean()) < 6.0


def test_a_failing_device_falls_back_to_the_reference_for_that_clip(clip: bytes) -> None:
    fake = FakeDecoders(fail=True)
    before = _count("fallback")
    out = decode_on_device(clip, ON, EXACT, None, "cpu", TorchCodecBackend(fake))
    assert _count("fallback") == before + 1
    assert out.route.device == "cpu" and "failed" in out.route.reason
    reference = decode_video(clip, ON, EXACT.fps, EXACT.max_frames, None)
    assert out.frame_indices == reference.frame_indices
    assert np.array_equal(
        out.frames.permute(0, 2, 3, 1).numpy(), np.stack([np.asarray(f) for f in reference.frames])
    )


def test_off_by_default_and_without_a_decoder(clip: bytes) -> None:
    fake = FakeDecoders()
    plan = resolve_sampling(MediaSettings())
    out = decode_on_device(clip, MediaSettings(), plan, None, "cpu", TorchCodecBackend(fake))
    assert out.route.device == "cpu" and fake.calls == []
    out = decode_on_device(clip, ON, EXACT, None, "cpu", None)
    assert out.route.device == "cpu" and "no hardware video decoder" in out.route.reason


def test_find_backend_takes_the_first_that_imports() -> None:
    fake = FakeDecoders()

    def only_torchcodec(name: str) -> Any:
        if name == "torchcodec.decoders":
            return fake
        raise ImportError(name)

    backend = find_backend(only_torchcodec)
    assert backend is not None and backend.name == "torchcodec"

    def nothing(name: str) -> Any:
        raise OSError("libnvcuvid.so.1: cannot open shared object file")

    assert find_backend(nothing) is None
