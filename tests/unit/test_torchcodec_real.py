"""The torchcodec adapter (``nvdec.TorchCodecBackend``) against the real library, where it
imports: the same code as on a GPU, with ``device="cpu"`` (torchcodec's CPU decoder takes the
same calls as its CUDA one). torchcodec is not a dependency (a GPU worker image adds it) and
needs FFmpeg's shared libraries, so this skips where either is missing: CI skips it; it ran in
the session that wrote it (torchcodec 0.17.0, FFmpeg 5.1 from Debian)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

from tests.support.samples import make_video_bytes
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.image import Downscale
from vlmq.workers.media.nvdec import TorchCodecBackend, decode_on_device, find_backend
from vlmq.workers.media.video import Sampling, decode_video

pytestmark = pytest.mark.unit


def _torchcodec() -> Any:
    try:
        return importlib.import_module("torchcodec.decoders")
    except Exception as exc:  # not installed (ImportError), or no FFmpeg libraries (OSError)
        pytest.skip(f"torchcodec does not import here: {type(exc).__name__}")


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_the_real_torchcodec_gives_the_reference_frames(codec: str) -> None:
    decoders = _torchcodec()
    clip = make_video_bytes(n_frames=100, size=(128, 96), fps=25, codec=codec, gop=25)
    name = "h264" if codec == "libx264" else codec
    settings = MediaSettings(
        device_decode="cuda", device_video_codecs=[name], device_video_min_height=1
    )
    plan = Sampling(fps=2.0, max_frames=8)
    target = Downscale(max_pixels=64 * 48)
    backend = TorchCodecBackend(decoders)
    out = decode_on_device(clip, settings, plan, target, "cpu", backend)
    assert out.route.device == "cuda" and "torchcodec" in out.route.reason, out.route
    reference = decode_video(clip, settings, plan.fps, plan.max_frames, target)
    assert out.frame_indices == reference.frame_indices
    assert tuple(out.frames.shape) == (8, 3, reference.height, reference.width)
    ours = out.frames.permute(0, 2, 3, 1).numpy().astype(np.int16)
    theirs = np.stack([np.asarray(f, dtype=np.int16) for f in reference.frames])
    # Resized, the filters differ (the device's bicubic, swscale's area): close, not equal.
    assert float(np.abs(ours - theirs).mean()) < 6.0
    # At full size the frames are the reference's to the bit: the same frames, decoded alike.
    whole = decode_on_device(clip, settings, plan, None, "cpu", backend).frames
    reference_whole = decode_video(clip, settings, plan.fps, plan.max_frames, None)
    theirs = np.stack([np.asarray(f) for f in reference_whole.frames])
    assert np.array_equal(whole.permute(0, 2, 3, 1).numpy(), theirs)


def test_find_backend_takes_the_real_torchcodec_when_pynvvideocodec_is_absent() -> None:
    _torchcodec()

    def importer(name: str) -> Any:
        if name == "PyNvVideoCodec":
            raise ImportError(name)
        return importlib.import_module(name)

    backend = find_backend(importer)
    assert isinstance(backend, TorchCodecBackend)
