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


# --- photos that stay on the device (devpixels), run with device="cpu" -----------------------


def _photo(size: tuple[int, int], seed: int) -> Image.Image:
    """A photo-like image: smooth gradients with some texture (JPEG's usual content)."""
    width, height = size
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(seed)
    channels = [127 + 100 * np.sin(xx / (17 + 5 * c) + yy / (23 + 3 * c) + seed) for c in range(3)]
    noise = rng.normal(0, 6, (height, width, 3))
    array = np.clip(np.stack(channels, axis=-1) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(array, "RGB")


def _cmyk_jpeg() -> bytes:
    return encode(_photo((64, 48), 1).convert("CMYK"), "JPEG")


def test_device_path_matches_the_cpu_reference_within_jpeg_noise() -> None:
    from vlmq.workers.media.devpixels import decode_to_device, pixel_error

    datas = [encode(_photo((640, 480), seed), "JPEG", quality=90) for seed in range(4)]
    out = decode_to_device(datas, SETTINGS, [TARGET] * len(datas), "cpu")
    assert out.routes == ["device"] * 4 and not out.errors
    errors = []
    for data, image in zip(datas, out.images, strict=True):
        assert image.dtype == torch.uint8 and image.device.type == "cpu"
        reference = decode_image(data, SETTINGS, TARGET)
        assert tuple(image.shape) == (3, reference.height, reference.width)
        errors.append(pixel_error(image, reference))
    mean = float(np.mean([e[0] for e in errors]))
    p99 = float(np.max([e[1] for e in errors]))
    # The reference decodes at a JPEG draft scale and resizes with Pillow; the device path
    # decodes in full and resizes with torchvision: close, never identical.
    assert mean < 3.0, errors
    assert p99 < 24, errors


def test_items_nvjpeg_cannot_take_fall_back_one_by_one_and_are_counted() -> None:
    from vlmq.workers.media.devpixels import DEVICE_DECODES, decode_to_device

    good = encode(_photo((96, 64), 2), "JPEG")
    progressive = encode(_photo((96, 64), 3), "JPEG", progressive=True)
    png = encode(_photo((96, 64), 4), "PNG")
    corrupt = good[: len(good) // 2]
    before = {r: DEVICE_DECODES.labels(result=r)._value.get() for r in ("device", "cmyk")}
    datas = [good, _rotated_jpeg(), _cmyk_jpeg(), progressive, png, corrupt]
    out = decode_to_device(datas, SETTINGS, [None] * len(datas), "cpu")
    assert out.routes[:5] == ["device", "exif", "cmyk", "progressive", "format"]
    assert out.routes[5] in ("corrupt", "device")  # a truncated tail may still parse a header
    assert set(out.errors) == {5} and isinstance(out.errors[5], MediaDecodeFailed)
    for i in range(5):
        reference = np.asarray(decode_image(datas[i], SETTINGS, None))
        assert out.images[i].permute(1, 2, 0).shape == reference.shape
    # Fallback items are the CPU reference itself, exactly.
    for i in (1, 2, 3, 4):
        reference = np.asarray(decode_image(datas[i], SETTINGS, None))
        assert np.array_equal(out.images[i].permute(1, 2, 0).numpy(), reference)
    assert DEVICE_DECODES.labels(result="device")._value.get() == before["device"] + 1
    assert DEVICE_DECODES.labels(result="cmyk")._value.get() == before["cmyk"] + 1


def test_a_failing_batch_is_retried_item_by_item(monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmq.workers.media.devpixels import decode_to_device

    real = torchvision.io.decode_jpeg
    calls: list[int] = []

    def batch_fails(data: Any, **kwargs: Any) -> Any:
        calls.append(len(data) if isinstance(data, list) else 1)
        if isinstance(data, list):
            raise RuntimeError("nvjpeg batch")
        return real(data, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", batch_fails)
    datas = [encode(_photo((64, 48), s), "JPEG") for s in range(3)]
    out = decode_to_device(datas, SETTINGS, [None] * 3, "cpu")
    assert calls == [3, 1, 1, 1]
    assert out.routes == ["device"] * 3 and not out.errors


def test_normalise_on_the_device_matches_the_processor_formula() -> None:
    from vlmq.workers.media.devpixels import normalise

    image = torch.tensor([[[0, 255]], [[128, 64]], [[255, 0]]], dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.25, 0.5, 0.2)
    out = normalise(image, mean, std)
    expected = (image.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(
        3, 1, 1
    )
    assert out.dtype == torch.float32 and torch.allclose(out, expected)
    assert normalise(image, mean, std, torch.bfloat16).dtype == torch.bfloat16


def test_photo_route_is_the_cpu_unless_on_and_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmq.workers.media.devpixels import photo_device

    assert photo_device(MediaSettings(), "cuda:0") is None  # default: CPU machines unchanged
    assert photo_device(MediaSettings(device_decode="auto"), None) is None
    monkeypatch.setattr(device_module, "cuda_available", lambda: False)
    assert photo_device(MediaSettings(device_decode="auto"), "cuda:0") is None
    monkeypatch.setattr(device_module, "cuda_available", lambda: True)
    assert photo_device(MediaSettings(device_decode="auto"), "cuda:0") == "cuda:0"


def test_device_photos_go_through_the_loader_and_straight_to_the_processor() -> None:
    """The loader caches a device photo (keyed apart from the CPU's pixels), and the runner
    hands its tensor, named for the processor cache, to the processor as it is."""
    from vlmq.workers.engine.runner import processor_media
    from vlmq.workers.media.devpixels import DevicePhoto, DevicePhotoDecoder
    from vlmq.workers.media.prepared.pixels import KEY_ATTRIBUTE

    data = encode(_photo((320, 240), 5), "JPEG", quality=90)
    source = "data:image/jpeg;base64," + __import__("base64").b64encode(data).decode()
    loader = MediaLoader(SETTINGS, cache=MediaCache(64 * 1024 * 1024))
    decoder = DevicePhotoDecoder("cpu")
    photo = loader.load_image(source, TARGET, decoder=decoder)
    assert isinstance(photo, DevicePhoto)
    reference = decode_image(data, SETTINGS, TARGET)
    assert photo.size == reference.size and photo.nbytes == reference.width * reference.height * 3
    assert loader.load_image(source, TARGET, decoder=decoder) is photo  # cached
    assert isinstance(loader.load_image(source, TARGET), Image.Image)  # the CPU's: apart
    conversation = [{"role": "user", "content": [{"type": "image", "image": photo}]}]
    (message,) = processor_media(conversation)
    tensor = message["content"][0]["image"]
    assert tensor is photo.tensor and getattr(tensor, KEY_ATTRIBUTE) == photo.key


def test_the_preparer_picks_device_photos_only_with_the_processor_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vlmq.config.settings import EngineSettings
    from vlmq.workers.engine.prepare import _image_decoder
    from vlmq.workers.media.devpixels import DevicePhotoDecoder

    engine = EngineSettings(processor_device="auto", image_processor_backend="torchvision")
    assert _image_decoder(engine, MediaSettings(), "cuda:0") is None  # default: off
    monkeypatch.setattr(device_module, "cuda_available", lambda: True)
    on = MediaSettings(device_decode="auto")
    chosen = _image_decoder(engine, on, "cuda:0")
    assert isinstance(chosen, DevicePhotoDecoder) and chosen.device == "cuda:0"
    assert _image_decoder(engine, on, "cpu") is None
