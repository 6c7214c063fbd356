"""Media decoding on the model's GPU: the per-item rule, the nvJPEG path and its fallback to
the CPU reference. No GPU here: CUDA and nvJPEG are injected."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.io
from PIL import Image

from tests.support.samples import encode, make_image
from vlmq.config.errors import MediaDecodeFailed
from vlmq.config.settings import MediaSettings
from vlmq.workers.media import Downscale, MediaCache, MediaLoader, decode_image
from vlmq.workers.media import device as device_module
from vlmq.workers.media.device import (
    NvJpegDecoder,
    decode_jpegs,
    device_image_decoder,
    image_route,
    torchcodec_available,
    video_route,
)

pytestmark = pytest.mark.unit

SETTINGS = MediaSettings()
TARGET = Downscale(max_pixels=160 * 120)


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return encode(make_image((320, 240), seed=3), "JPEG", quality=90)


def _rotated_jpeg() -> bytes:
    image = make_image((64, 48), seed=4)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    return buffer.getvalue()


# --- the rule -------------------------------------------------------------------------------


def test_image_rule(jpeg: bytes) -> None:
    png = encode(make_image((32, 32)), "PNG")
    assert image_route(jpeg, "cpu", cuda=True).device == "cpu"
    assert "not available" in image_route(jpeg, "auto", cuda=False).reason
    assert "JPEG only" in image_route(png, "auto", cuda=True).reason
    assert "EXIF" in image_route(_rotated_jpeg(), "cuda", cuda=True).reason
    assert image_route(jpeg, "auto", cuda=True).device == "cuda"
    assert image_route(jpeg, "cuda", cuda=True).device == "cuda"


def test_video_rule() -> None:
    def route(height: int, density: float, mode: str = "auto", decoder: bool = True) -> Any:
        return video_route(height, density, mode, True, decoder, SETTINGS)

    assert route(1080, 2.0).device == "cuda"
    assert route(720, 1.0).device == "cuda"
    assert "below 720" in route(540, 4.0).reason
    assert "sparse" in route(1080, 0.5).reason
    assert route(540, 0.1, mode="cuda").device == "cuda"  # forced
    assert route(1080, 2.0, mode="cpu").device == "cpu"
    assert "torchcodec" in route(1080, 2.0, decoder=False).reason
    assert video_route(1080, 2.0, "auto", False, True, SETTINGS).reason == ("CUDA is not available")


def test_here_the_video_rule_picks_the_cpu_and_says_why() -> None:
    if torchcodec_available():
        pytest.skip("torchcodec is installed here")
    route = video_route(1080, 2.0, "auto", True, torchcodec_available(), SETTINGS)
    assert route.device == "cpu" and "torchcodec is not installed" in route.reason


# --- choosing the decoder -------------------------------------------------------------------


def test_no_device_decoder_without_cuda_or_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    on = MediaSettings(device_decode="auto")
    assert MediaSettings().device_decode == "cpu"  # the reference by default
    assert device_image_decoder(MediaSettings(), "cuda:0") is None
    assert device_image_decoder(on, "cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_image_decoder(on, "cuda:0") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    decoder = device_image_decoder(on, "cuda:0")
    assert isinstance(decoder, NvJpegDecoder) and decoder.device == "cuda:0"


# --- nvJPEG and its fallback ----------------------------------------------------------------


def test_any_device_error_falls_back_to_the_cpu_reference(
    jpeg: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("nvjpeg: CUDA error")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torchvision.io, "decode_jpeg", broken)
    [image] = decode_jpegs([jpeg], SETTINGS, [TARGET], "cuda:0")
    reference = decode_image(jpeg, SETTINGS, TARGET)
    assert image.size == reference.size and image.tobytes() == reference.tobytes()


def _decode_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """nvJPEG stood in for by torchvision's CPU JPEG decoder; records the devices asked."""
    real = torchvision.io.decode_jpeg
    devices: list[str] = []

    def fake(data: Any, mode: Any = None, device: str = "cpu") -> Any:
        devices.append(device)
        return real(data, mode=mode, device="cpu")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", fake)
    return devices


def test_the_device_path_decodes_a_batch_at_the_processors_target(
    jpeg: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    devices = _decode_on_cpu(monkeypatch)
    other = encode(make_image((200, 300), seed=5), "JPEG", quality=90)
    images = decode_jpegs([jpeg, other], SETTINGS, [TARGET, None], "cuda:0")
    assert devices == ["cuda:0"]  # one batched call
    reference = decode_image(jpeg, SETTINGS, TARGET)
    assert images[0].size == reference.size and images[0].mode == "RGB"
    assert images[1].size == (200, 300)
    diff = np.abs(np.asarray(images[0], np.int16) - np.asarray(reference, np.int16))
    assert diff.mean() < 3  # the same picture; not bit-exact (a different resize)


def test_bad_bytes_fail_the_item_with_the_usual_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _decode_on_cpu(monkeypatch)
    truncated = encode(make_image((64, 64)), "JPEG")[:200]
    with pytest.raises(MediaDecodeFailed):
        NvJpegDecoder("auto", "cuda:0").decode(truncated, SETTINGS, None)


def test_the_loader_keys_device_pixels_apart(jpeg: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    _decode_on_cpu(monkeypatch)
    loader = MediaLoader(SETTINGS, cache=MediaCache(64 * 1024 * 1024))
    source = "data:image/jpeg;base64," + __import__("base64").b64encode(jpeg).decode()
    cpu = loader.load_image(source, TARGET)
    on_device = loader.load_image(source, TARGET, decoder=NvJpegDecoder("auto", "cuda:0"))
    assert loader.thread_hits() == 0  # two entries: the device's pixels are not the CPU's
    assert cpu.tobytes() == decode_image(jpeg, SETTINGS, TARGET).tobytes()
    assert on_device.size == cpu.size


def test_png_and_rotated_jpegs_stay_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _decode_on_cpu(monkeypatch)
    decoder = NvJpegDecoder("auto", "cuda:0")
    for data in (encode(make_image((48, 32)), "PNG"), _rotated_jpeg()):
        image = decoder.decode(data, SETTINGS, None)
        assert image.tobytes() == decode_image(data, SETTINGS, None).tobytes()
    assert devices == []


def test_a_cpu_model_prepares_byte_for_byte_the_cpu_way(checkpoint: Any, tmp_path: Any) -> None:
    from vlmq.config.schemas import Request
    from vlmq.config.settings import EngineSettings
    from vlmq.workers.engine import Engine

    photo = tmp_path / "p.jpg"
    Image.fromarray(np.asarray(make_image((320, 240), seed=6))).save(photo, quality=90)
    request = Request.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image", "image": str(photo)}]}]}
    )
    media = MediaSettings(local_roots=[str(tmp_path)], device_decode="auto")
    engine = Engine(str(checkpoint("qwen2_5_vl")), EngineSettings(), media).setup()
    assert engine._preparer.image_decoder is None  # a CPU model: the reference path
    prepared = engine.prepare(request)
    [image] = [p["image"] for p in prepared.conversation[0]["content"] if p["type"] == "image"]
    target = engine._preparer.image_target
    assert image.tobytes() == decode_image(photo.read_bytes(), media, target).tobytes()
    engine.close()
    assert device_module.cuda_available() is torch.cuda.is_available()
