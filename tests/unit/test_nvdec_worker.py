"""NVDEC in the worker's media path: the preparer's video decoder (chosen once, logged), the
loader caching device frames apart from the CPU's and never storing them, the fallback per
clip, the frames reaching the processor as one tensor, prepared media and vLLM kept on the
host. No GPU here: the fake decoder module (tests/support) runs the device code with
device="cpu", and CUDA is injected where the choice asks for it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.fake_videodecoder import FakeDecoders
from tests.support.samples import make_video_bytes
from vlmq.config.errors import MediaTooLarge
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, FrameStoreSettings, MediaSettings
from vlmq.stores.files import FileStore
from vlmq.workers.engine import Engine
from vlmq.workers.engine.prepare import (
    Prepared,
    _subsample,
    _taken,
    _video_decoder,
    video_content,
    video_frame_counts,
)
from vlmq.workers.engine.runner import processor_media
from vlmq.workers.media import Downscale, MediaCache, MediaLoader, Pixels, decode_video, nvdec
from vlmq.workers.media import device as device_module
from vlmq.workers.media.devpixels import DeviceFrames
from vlmq.workers.media.loader import frames_bytes
from vlmq.workers.media.nvdec import (
    DEVICE_VIDEO_DECODES,
    DeviceVideoDecoder,
    TorchCodecBackend,
    device_video_decoder,
)
from vlmq.workers.media.prepared.framestore import FrameStore
from vlmq.workers.media.prepared.pixels import KEY_ATTRIBUTE

pytestmark = pytest.mark.unit

BOTH = FrameStoreSettings(kinds=["image", "video"])
TARGET = Downscale(max_pixels=64 * 48)
ON_GPU = EngineSettings(processor_device="auto", image_processor_backend="torchvision")
NVDEC_LOG = "vlmq.workers.media.nvdec"


def _clip(seed: int) -> bytes:
    """4 s at 25 fps, a keyframe every 25 frames, H.264."""
    return make_video_bytes(
        n_frames=100, size=(128, 96), fps=25, codec="libx264", gop=25, seed=seed
    )


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("nvdec-clips")
    paths = {name: folder / f"{name}.mp4" for name in ("a", "b")}
    for seed, path in enumerate(paths.values()):
        path.write_bytes(_clip(seed))
    return paths


def _media(clips: dict[str, Path], **extra: Any) -> MediaSettings:
    folder = str(next(iter(clips.values())).parent)
    return MediaSettings(
        local_roots=[folder], device_decode="auto", device_video_min_height=1, **extra
    )


def _count(result: str) -> float:
    return float(DEVICE_VIDEO_DECODES.labels(result=result)._value.get())


def _stacked(frames: Any) -> torch.Tensor:
    """CPU-reference Pillow frames as one ``(frames, 3, H, W)`` uint8 tensor."""
    array = np.stack([np.asarray(frame, dtype=np.uint8) for frame in frames])
    return torch.from_numpy(array).permute(0, 3, 1, 2)


# --- the choice, once per worker -------------------------------------------------------------


def test_the_worker_takes_nvdec_only_when_everything_allows_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeDecoders()
    monkeypatch.setattr(nvdec, "find_backend", lambda *_: TorchCodecBackend(fake))
    on = MediaSettings(device_decode="auto")
    monkeypatch.setattr(device_module, "cuda_available", lambda: False)
    assert _video_decoder(ON_GPU, on, "cuda:0") is None
    monkeypatch.setattr(device_module, "cuda_available", lambda: True)
    assert _video_decoder(ON_GPU, MediaSettings(), "cuda:0") is None  # default: off
    assert _video_decoder(ON_GPU, on, "cpu") is None  # a CPU model
    assert _video_decoder(EngineSettings(processor_device="cpu"), on, "cuda:0") is None
    assert _video_decoder(ON_GPU, on, "vllm") is None  # vLLM takes host frames only
    with caplog.at_level(logging.INFO, logger=NVDEC_LOG):
        chosen = _video_decoder(ON_GPU, on, "cuda:0")
    assert isinstance(chosen, DeviceVideoDecoder) and chosen.device == "cuda:0"
    assert chosen.backend.name == "torchcodec"
    assert "video decoder: torchcodec on cuda:0" in caplog.text
    caplog.clear()
    monkeypatch.setattr(nvdec, "find_backend", lambda *_: None)
    with caplog.at_level(logging.INFO, logger=NVDEC_LOG):
        assert _video_decoder(ON_GPU, on, "cuda:0") is None
    assert "video decoder: cpu (no hardware video decoder" in caplog.text


def test_the_decoder_is_found_through_the_importer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDecoders()
    monkeypatch.setattr(device_module, "cuda_available", lambda: True)

    def only_torchcodec(name: str) -> Any:
        if name == "torchcodec.decoders":
            return fake
        raise ImportError(name)

    on = MediaSettings(device_decode="cuda")
    chosen = device_video_decoder(on, "cuda:1", only_torchcodec)
    assert chosen is not None and chosen.device == "cuda:1"
    assert isinstance(chosen.backend, TorchCodecBackend) and chosen.backend.decoders is fake


# --- through the loader ----------------------------------------------------------------------


def test_device_frames_are_cached_apart_from_the_cpus_and_the_route_logged(
    clips: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    settings = _media(clips)
    loader = MediaLoader(settings, cache=MediaCache(64 * 1024 * 1024))
    fake = FakeDecoders()
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    source = str(clips["a"])
    before = _count("device")
    with caplog.at_level(logging.INFO, logger=NVDEC_LOG):
        video = loader.load_video(source, 2.0, 8, TARGET, decoder=decoder)
    assert "video decode route: cuda (torchcodec: h264 96p" in caplog.text
    assert _count("device") == before + 1
    assert isinstance(video.frames, DeviceFrames) and len(fake.calls) == 1
    assert loader.load_video(source, 2.0, 8, TARGET, decoder=decoder) is video  # cached
    assert len(fake.calls) == 1 and loader.thread_counts().decodes == 1
    cpu = loader.load_video(source, 2.0, 8, TARGET)  # the CPU's: keyed apart, decoded again
    assert isinstance(cpu.frames, list) and loader.thread_counts().decodes == 2
    assert loader.load_video(source, 2.0, 8, TARGET) is cpu
    assert cpu.frame_indices == video.frame_indices and len(cpu.frames) == len(video.frames)
    assert video.frames.size == cpu.frames[0].size == (video.width, video.height)
    assert frames_bytes(video.frames) == frames_bytes(cpu.frames)
    # Same frames (the fake decodes like FFmpeg), resized by other filters: close.
    difference = (video.frames.tensor.to(torch.int16) - _stacked(cpu.frames).to(torch.int16)).abs()
    assert float(difference.float().mean()) < 6.0


def test_a_failing_clip_falls_back_to_the_cpu_frames_alone(clips: dict[str, Path]) -> None:
    settings = _media(clips)
    loader = MediaLoader(settings, cache=MediaCache(64 * 1024 * 1024))
    bad = clips["a"].read_bytes()
    fake = FakeDecoders(fail_on={bad})
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    fallbacks, devices = _count("fallback"), _count("device")
    failed = loader.load_video(str(clips["a"]), 2.0, 8, TARGET, decoder=decoder)
    worked = loader.load_video(str(clips["b"]), 2.0, 8, TARGET, decoder=decoder)
    assert _count("fallback") == fallbacks + 1 and _count("device") == devices + 1
    assert len(fake.calls) == 2  # each clip asked of the device once
    assert isinstance(failed.frames, DeviceFrames) and isinstance(worked.frames, DeviceFrames)
    reference = decode_video(bad, settings, 2.0, 8, TARGET)
    assert failed.frame_indices == reference.frame_indices
    assert torch.equal(failed.frames.tensor, _stacked(reference.frames))  # the CPU's, exactly
    assert worked.frames.key != failed.frames.key


def test_a_clip_over_the_size_limit_fails_before_the_device_decodes(
    clips: dict[str, Path],
) -> None:
    settings = _media(clips, video_max_pixels_per_frame=128 * 96 - 1)
    fake = FakeDecoders()
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    with pytest.raises(MediaTooLarge):
        MediaLoader(settings).load_video(str(clips["a"]), 2.0, 8, TARGET, decoder=decoder)
    assert fake.calls == []


def test_device_frames_never_go_to_the_frame_store(clips: dict[str, Path], tmp_path: Path) -> None:
    settings = _media(clips, cache_bytes=0, frame_store=BOTH)
    store = FrameStore(FileStore(f"file://{tmp_path}"), BOTH, settings)
    loader = MediaLoader(settings, frames=store)
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(FakeDecoders()))
    video = loader.load_video(str(clips["a"]), 2.0, 8, TARGET, "exact", "t", decoder=decoder)
    assert isinstance(video.frames, DeviceFrames)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    loader.load_video(str(clips["a"]), 2.0, 8, TARGET, "exact", "t")  # the CPU's: stored
    assert [p for p in tmp_path.rglob("*") if p.is_file()]


# --- in the preparer and to the processor ----------------------------------------------------


def _device_video(clips: dict[str, Path]) -> Any:
    loader = MediaLoader(_media(clips), cache=MediaCache(0))
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(FakeDecoders()))
    return loader.load_video(str(clips["a"]), 2.0, 8, TARGET, decoder=decoder)


def test_device_frames_reach_the_processor_as_their_one_tensor(clips: dict[str, Path]) -> None:
    video = _device_video(clips)
    part = video_content(video)
    assert part["video"] is video.frames  # whole, not a list of frames
    conversation = [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]
    assert video_frame_counts(conversation) == (8,)
    [message] = processor_media(conversation)
    tensor = message["content"][0]["video"]
    assert tensor is video.frames.tensor and tuple(tensor.shape) == (8, 3, 48, 64)
    assert getattr(tensor, KEY_ATTRIBUTE) == video.frames.key
    assert message["content"][0]["metadata"]["frames_indices"] == video.frame_indices


def test_taking_and_subsampling_device_frames_keep_them_whole_and_keyed_apart(
    clips: dict[str, Path],
) -> None:
    video = _device_video(clips)
    doubled = _taken(video, [0, 0])
    assert isinstance(doubled.frames, DeviceFrames) and len(doubled.frames) == 2
    assert torch.equal(doubled.frames.tensor[1], video.frames.tensor[0])
    assert doubled.frames.key != video.frames.key
    assert doubled.frame_indices == [video.frame_indices[0]] * 2
    fewer = _subsample(video, 4)
    assert isinstance(fewer.frames, DeviceFrames) and len(fewer.frames) == 4
    assert fewer.frame_indices == video.frame_indices[::2]


class _Recording:
    """The processor, recording the conversations the runner hands it."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.seen: list[Any] = []

    def apply_chat_template(self, conversations: Any, **kwargs: Any) -> Any:
        self.seen.append(conversations)
        return self.processor.apply_chat_template(conversations, **kwargs)


@pytest.fixture(scope="module")
def store_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nvdec-store")


@pytest.fixture(scope="module")
def engine(checkpoint: Any, clips: dict[str, Path], store_folder: Path) -> Iterator[Engine]:
    settings = _media(clips, cache_bytes=0, frame_store=BOTH)
    folder = store_folder
    loader = MediaLoader(settings, frames=FrameStore(FileStore(f"file://{folder}"), BOTH, settings))
    built = Engine(str(checkpoint("qwen2_5_vl")), EngineSettings(), settings, loader).setup()
    yield built
    built.close()


def _request(*paths: Path) -> Request:
    videos = [{"type": "video", "video": str(p), "fps": 2, "max_frames": 8} for p in paths]
    content = [*videos, {"type": "text", "text": "What happens?"}]
    return Request.model_validate({"messages": [{"role": "user", "content": content}]})


def _frames(prepared: Prepared) -> list[Any]:
    assert prepared.error is None, prepared.error
    return [p["video"] for m in prepared.conversation for p in m["content"] if p["type"] == "video"]


def test_a_prepared_request_carries_device_frames_to_the_processor(
    engine: Engine, clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    preparer = engine._preparer
    assert preparer.video_decoder is None  # a CPU model: the reference path
    cpu = engine.prepare(_request(clips["a"]))
    fake = FakeDecoders()
    monkeypatch.setattr(
        preparer, "video_decoder", DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    )
    device = engine.prepare(_request(clips["a"]))
    [frames] = _frames(device)
    assert isinstance(frames, DeviceFrames) and len(fake.calls) == 1
    assert device.media_bytes == frames.nbytes and device.prompt_tokens == cpu.prompt_tokens
    recording = _Recording(engine.processors.for_thread())
    collated = engine._runner.collate([device], recording)
    [[[message]]] = recording.seen  # one call, one conversation, one message
    assert message["content"][0]["video"] is frames.tensor  # one tensor, as it was decoded
    reference = engine._runner.collate([cpu], engine.processors.for_thread()).inputs
    assert torch.equal(collated.inputs["input_ids"], reference["input_ids"])
    assert torch.equal(collated.inputs["video_grid_thw"], reference["video_grid_thw"])
    assert collated.inputs["pixel_values_videos"].shape == reference["pixel_values_videos"].shape


def test_prepared_media_never_use_the_device_decoder(
    engine: Engine, clips: dict[str, Path], store_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeDecoders()
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    monkeypatch.setattr(engine._preparer, "video_decoder", decoder)
    store = store_folder
    engine.prepare(_request(clips["b"]), "t", prepared_media=True)  # a prepare worker's decode
    stored = sorted(p for p in store.rglob("*") if p.is_file())
    [frames] = _frames(engine.prepare(_request(clips["b"]), "t", prepared_media=True))
    assert isinstance(frames, Pixels) and fake.calls == []  # read back: host pixels
    [frames] = _frames(engine.prepare(_request(clips["b"]), "t"))
    assert isinstance(frames, DeviceFrames) and len(fake.calls) == 1
    assert sorted(p for p in store.rglob("*") if p.is_file()) == stored  # nothing stored


def test_a_request_whose_first_clip_fails_on_the_device_keeps_the_second_there(
    engine: Engine, clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeDecoders(fail_on={clips["a"].read_bytes()})
    decoder = DeviceVideoDecoder("cpu", TorchCodecBackend(fake))
    monkeypatch.setattr(engine._preparer, "video_decoder", decoder)
    fallbacks = _count("fallback")
    first, second = _frames(engine.prepare(_request(clips["a"], clips["b"])))
    assert _count("fallback") == fallbacks + 1 and len(fake.calls) == 2
    assert isinstance(first, DeviceFrames) and isinstance(second, DeviceFrames)
    settings = engine.media_settings
    reference = decode_video(clips["a"].read_bytes(), settings, 2, 8, engine._preparer.video_target)
    assert torch.equal(first.tensor, _stacked(reference.frames))


# --- vLLM ------------------------------------------------------------------------------------


class _TemplateOnly:
    def apply_chat_template(self, conversation: Any, **_: Any) -> str:
        return "prompt"


def test_vllm_gets_host_frames_even_from_device_frames(clips: dict[str, Path]) -> None:
    from vlmq.workers.engine.vllm_engine import _prompt

    video = _device_video(clips)
    request = Request.model_validate({"messages": [{"role": "user", "content": ["Hi"]}]})
    conversation = [{"role": "user", "content": [video_content(video)]}]
    prompt = _prompt(Prepared(request, 8, conversation), _TemplateOnly())
    [(frames, meta)] = prompt["multi_modal_data"]["video"]
    assert isinstance(frames, np.ndarray) and frames.shape == (8, 48, 64, 3)
    assert np.array_equal(frames, video.frames.tensor.permute(0, 2, 3, 1).numpy())
    assert meta["do_sample_frames"] is False
