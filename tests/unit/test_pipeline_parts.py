"""The pieces the pipelined worker stands on: the media cache, the per-thread caching
processors, decode-time downscaling, the engine's steps (issue 11)."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.samples import make_image, make_video_bytes, save_image, save_video
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings
from vlmq.workers.demo.tiny import FAMILIES
from vlmq.workers.engine import Engine
from vlmq.workers.engine.mmcounts import count_placeholders_in_numpy
from vlmq.workers.engine.model import load_processor
from vlmq.workers.engine.placeholders import RunLengthTokenizer
from vlmq.workers.engine.prepare import video_content, visual_downscale
from vlmq.workers.engine.processors import ProcessorSet
from vlmq.workers.media import Downscale, MediaCache, MediaLoader, decode_image

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, checkpoint: Any) -> Path:
    return Path(checkpoint(request.param))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    save_image(folder / "a.png", size=(300, 180), seed=1)
    save_image(folder / "b.jpg", size=(120, 200), seed=2, format="JPEG")
    save_video(folder / "v.mp4", n_frames=16, size=(96, 64), fps=8, seed=3)
    return folder


def _conversation(loader: MediaLoader, media: Path, processor: Any) -> list[dict[str, Any]]:
    image_target, video_target = visual_downscale(processor)
    video = loader.load_video(str(media / "v.mp4"), 4.0, 8, video_target)
    parts = [
        {"type": "image", "image": loader.load_image(str(media / "a.png"), image_target)},
        {"type": "text", "text": "and"},
        {"type": "image", "image": loader.load_image(str(media / "b.jpg"), image_target)},
        video_content(video),
        {"type": "text", "text": "what changed?"},
    ]
    return [{"role": "user", "content": parts}]


def _collate(processor: Any, conversations: list[Any]) -> Any:
    metadata = [
        part["metadata"]
        for conversation in conversations
        for message in conversation
        for part in message["content"]
        if part["type"] == "video"
    ]
    return processor.apply_chat_template(
        conversations,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True, "do_sample_frames": False, "video_metadata": metadata},
    )


def test_cached_processors_give_the_tensors_of_the_plain_one(family_dir: Path, media: Path) -> None:
    settings = EngineSettings()
    cache = MediaCache(256 * 1024 * 1024)
    loader = MediaLoader(MediaSettings(local_roots=[str(media)]), cache=cache)
    plain = load_processor(str(family_dir), settings)
    conversations = [_conversation(loader, media, plain)] * 2  # the same media twice
    expected = _collate(plain, conversations)
    processors = ProcessorSet(
        load_processor(str(family_dir), settings),
        lambda: load_processor(str(family_dir), settings),
        cache,
    )
    missed = _collate(processors.for_thread(), conversations)
    hits_before = cache.stats.hits
    hit = _collate(processors.for_thread(), conversations)
    assert cache.stats.hits > hits_before  # the second call came from the cache
    for got in (missed, hit):
        assert set(got) == set(expected)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def test_run_length_tokenizing_gives_the_plain_tokenizers_ids(
    family_dir: Path, media: Path
) -> None:
    """Prompts of different lengths (left padding), images and a video: the processor with
    its placeholders run-length tokenized gives the plain processor's tensors."""
    settings = EngineSettings()
    loader = MediaLoader(MediaSettings(local_roots=[str(media)]))
    plain = load_processor(str(family_dir), settings)
    full = _conversation(loader, media, plain)
    image_only = [
        {"role": "user", "content": [full[0]["content"][0], {"type": "text", "text": "Hi"}]}
    ]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "No media here."}]}]
    expected = _collate(plain, [full, image_only])
    processors = ProcessorSet(
        load_processor(str(family_dir), settings),
        lambda: load_processor(str(family_dir), settings),
        MediaCache(0),
    )
    wrapped = processors.for_thread()
    assert isinstance(wrapped.tokenizer, RunLengthTokenizer)
    got = _collate(wrapped, [full, image_only])
    assert wrapped.tokenizer.served == 1  # the run-length path answered, no fallback
    assert wrapped._check_special_mm_tokens.__self__.served == 1  # counted in NumPy
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # Text alone has no run to shorten: the tokenizer's own call.
    alone = wrapped.apply_chat_template(text_only, tokenize=True, add_generation_prompt=True)
    assert alone == plain.apply_chat_template(text_only, tokenize=True, add_generation_prompt=True)
    assert wrapped.tokenizer.served == 1


def _counted_in_numpy(family_dir: Path) -> tuple[Any, Any, str]:
    processor = load_processor(str(family_dir), EngineSettings())
    library = load_processor(str(family_dir), EngineSettings())
    count_placeholders_in_numpy(processor)
    return processor, library, processor.image_token


def test_placeholder_counts_in_numpy_give_the_librarys_answers(family_dir: Path) -> None:
    """On a padded batch (left and right) the type ids are the library's and its count
    check passes without it; a list of lists is the library's own work."""
    processor, library, token = _counted_in_numpy(family_dir)
    counts = processor._check_special_mm_tokens.__self__
    texts = [f"a {token * 5} b", f"{token}{token} and {token}"]
    for side in ("left", "right"):
        batch = library.tokenizer(texts, padding=True, padding_side=side, return_tensors="pt")
        got = processor.create_mm_token_type_ids(batch["input_ids"])
        assert got.tolist() == library.create_mm_token_type_ids(batch["input_ids"])
        library._check_special_mm_tokens(texts, batch, ["image", "video", "audio"])
        processor._check_special_mm_tokens(texts, batch, ["image", "video", "audio"])
    assert counts.served == 2
    listed = library.tokenizer(texts)["input_ids"]
    assert processor.create_mm_token_type_ids(listed) == library.create_mm_token_type_ids(listed)


@pytest.mark.parametrize("case", ["cut", "marked"])
def test_a_placeholder_count_the_library_refuses_is_its_error(family_dir: Path, case: str) -> None:
    """Text whose placeholders (a marked one is user text, not a placeholder) do not match
    the ids: the library's own error, word for word."""
    from transformers import processing_utils

    processor, library, token = _counted_in_numpy(family_dir)
    marker = processing_utils._CONTROL_TOKEN_START
    texts = [f"a {token * 5} b", f"c {token * 2}"]
    batch = library.tokenizer(texts, padding=True, return_tensors="pt")
    asked = [f"a {token * 4} b" if case == "cut" else f"a {token * 4}{marker}{token} b", texts[1]]
    with pytest.raises(ValueError, match="Mismatch in `image` token count") as expected:
        library._check_special_mm_tokens(asked, batch, ["image"])
    with pytest.raises(ValueError) as got:
        processor._check_special_mm_tokens(asked, batch, ["image"])
    assert str(got.value) == str(expected.value)
    assert processor._check_special_mm_tokens.__self__.served == 0


def test_a_thread_gets_its_own_processor(family_dir: Path) -> None:
    settings = EngineSettings()
    processors = ProcessorSet(
        load_processor(str(family_dir), settings),
        lambda: load_processor(str(family_dir), settings),
        MediaCache(0),
    )
    seen: list[Any] = []
    threads = [
        threading.Thread(target=lambda: seen.append(processors.for_thread())) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(p) for p in seen}) == 3
    assert processors.for_thread() is processors.for_thread()  # loaded once per thread


def test_concurrent_loads_of_one_clip_decode_it_once(media: Path) -> None:
    cache = MediaCache(64 * 1024 * 1024)
    loader = MediaLoader(MediaSettings(local_roots=[str(media)]), cache=cache)
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def load() -> None:
        barrier.wait()
        results.append(loader.load_video(str(media / "v.mp4"), 4.0, 8))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.stats.misses == 1 and cache.stats.hits == 7
    assert all(r is results[0] for r in results)


def test_the_cache_keeps_its_byte_budget() -> None:
    cache = MediaCache(100)
    for key in "abcde":
        cache.get_or_compute(key, str, lambda _: 30)
    assert cache.stats.bytes <= 100 and cache.stats.evictions == 2
    _, hit = cache.get_or_compute("e", lambda: "x", lambda _: 30)
    assert hit
    _, hit = cache.get_or_compute("a", lambda: "x", lambda _: 30)
    assert not hit  # evicted, least recently used first
    value, _ = cache.get_or_compute("big", lambda: "v", lambda _: 1000)
    assert value == "v" and "big" not in cache._entries  # larger than the cache: not kept


def test_images_are_downscaled_at_decode_to_what_the_processor_uses() -> None:
    photo = make_image((1920, 1080), seed=5)
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=90)
    target = Downscale(max_pixels=50176)
    small = decode_image(buffer.getvalue(), MediaSettings(), target)
    assert small.width * small.height <= 50176
    assert abs(small.width / small.height - 1920 / 1080) < 0.02  # aspect kept
    full = decode_image(buffer.getvalue(), MediaSettings())
    assert full.size == (1920, 1080)
    # A box target never goes below covering the box.
    assert Downscale(cover=(112, 112)).size_for((1280, 720)) == (199, 112)
    assert Downscale(max_pixels=10**9).size_for((64, 48)) == (64, 48)  # never upscaled


def test_video_frames_are_downscaled_as_they_are_converted() -> None:
    from vlmq.workers.media import decode_video

    data = make_video_bytes(n_frames=16, size=(640, 360), fps=8, seed=1)
    video = decode_video(data, MediaSettings(), 4.0, 8, Downscale(max_pixels=12544))
    assert all(f.width * f.height <= 12544 for f in video.frames)
    assert video.frames[0].size == (149, 84)


@pytest.mark.parametrize("inflight", [False, True])
def test_the_engine_steps_give_what_run_gives(checkpoint: Any, media: Path, inflight: bool) -> None:
    """Static: one micro-batch at a time, all of it from the next poll. In flight (the decode
    loop's default): micro-batches go in while others decode; polls return what finished."""
    model = checkpoint("qwen2_5_vl")
    settings = EngineSettings(decode=DecodeSettings(inflight=inflight))
    engine = Engine(str(model), settings, MediaSettings(local_roots=[str(media)])).setup()
    from vlmq.config.schemas import Request

    requests = [
        Request.model_validate({"messages": [{"role": "user", "content": f"hi {n}"}]})
        for n in range(3)
    ] + [
        Request.model_validate(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": str(media / "a.png")}, "what?"],
                    }
                ]
            }
        )
    ]
    whole = {r.id: r.output for r in engine.run(requests)}
    prepared = [engine.prepare(r) for r in requests]
    stepped: dict[str, Any] = {}
    for batch in engine.plan(prepared):
        assert engine.capacity() >= len(batch)
        engine.submit(engine.collate(batch))
        if not inflight:
            assert engine.capacity() == 0  # one static micro-batch at a time
            stepped |= {r.id: r.output for r in engine.poll("w")}
    assert engine.pending == (len(requests) if inflight else 0)
    while engine.pending:
        stepped |= {r.id: r.output for r in engine.poll("w")}
    assert stepped == whole


def test_processors_run_on_a_cuda_models_device_with_the_torchvision_backend() -> None:
    from vlmq.workers.engine.model import processor_device

    assert processor_device(EngineSettings(), "cuda:0") == "cuda:0"
    assert processor_device(EngineSettings(), "cpu") is None
    assert processor_device(EngineSettings(processor_device="cpu"), "cuda:0") is None
    pil = EngineSettings(image_processor_backend="pil")
    assert processor_device(pil, "cuda:0") is None  # the pil processors are CPU-only


def test_the_device_reaches_the_processors(checkpoint: Any, media: Path) -> None:
    """The runner passes ``device`` through ``processor_kwargs``; on CPU the tensors equal a
    call without it (on CUDA they come back on the GPU and are not pinned)."""
    from vlmq.config.schemas import Request
    from vlmq.workers.engine.model import load_model
    from vlmq.workers.engine.prepare import Prepared
    from vlmq.workers.engine.runner import BatchRunner

    model = checkpoint("qwen2_5_vl")
    loaded = load_model(str(model), EngineSettings())
    loader = MediaLoader(MediaSettings(local_roots=[str(media)]), cache=MediaCache(0))
    conversation = _conversation(loader, media, loaded.processor)

    request = Request.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    item = Prepared(request, 4, conversation)
    calls: list[dict[str, Any]] = []
    original = loaded.processor.apply_chat_template

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["processor_kwargs"])
        return original(*args, **kwargs)

    loaded.processor.apply_chat_template = spy
    plain = BatchRunner(loaded).collate([item], loaded.processor)
    placed = BatchRunner(loaded, processor_device="cpu").collate([item], loaded.processor)
    assert "device" not in calls[0] and calls[1]["device"] == "cpu"
    for name, value in plain.inputs.items():
        assert torch.equal(placed.inputs[name], value), name


def test_the_heartbeat_record_carries_the_engine_and_cache_counters_as_json() -> None:
    import json

    from vlmq.workers.engine.engine import EngineStats
    from vlmq.workers.fleet.service import _engine_stats
    from vlmq.workers.media.cache import CacheStats

    stats = EngineStats(cache=CacheStats(hits=2, misses=1))
    record = json.loads(json.dumps(_engine_stats(stats)))
    assert record["cache"]["hits"] == 2 and record["cache"]["misses"] == 1
    assert "batch_sizes" not in record
    assert _engine_stats(None) == {}  # an engine that keeps no counters (vLLM)


@pytest.mark.parametrize("tensors", ["pt", "np", None])
@pytest.mark.parametrize("side", ["left", "right"])
def test_run_length_padding_matches_the_tokenizers_on_either_side(
    family_dir: Path, side: str, tensors: str | None
) -> None:
    """Padded in NumPy (tensors asked) or by the tokenizer's own ``pad`` (lists), a batch of
    uneven prompts comes out as the tokenizer gives it; one text alone is the tokenizer's."""
    plain = load_processor(str(family_dir), EngineSettings()).tokenizer
    tokens = _placeholders_of(plain)
    wrapped = RunLengthTokenizer(plain, tokens)
    texts = [f"a {tokens[0] * 9} b", f"longer text {tokens[0] * 3} then {tokens[0] * 2} c"]
    options = {"padding": True, "padding_side": side, "return_tensors": tensors}
    expected, got = plain(texts, **options), wrapped(texts, **options)
    assert wrapped.served == 1 and set(got) == set(expected)
    for name in expected:
        assert _as_list(got[name]) == _as_list(expected[name]), name
    alone = wrapped(texts[1], return_tensors=tensors)["input_ids"]
    assert _as_list(alone) == _as_list(plain(texts[1], return_tensors=tensors)["input_ids"])
    assert wrapped.served == 1


def _placeholders_of(tokenizer: Any) -> list[str]:
    added = tokenizer.get_added_vocab()
    return [t for t in ("<|image_pad|>", "<IMG_CONTEXT>", "<|video_pad|>") if t in added]


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def test_a_length_estimate_is_counted_once_per_prompt_and_image_size(
    family_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate remembers, per processor, a prompt's rendered length and an image size's
    visual tokens: the same answers, without the processor's work on a repeat."""
    from vlmq.workers.engine.estimate import estimate_prompt_tokens

    processor = load_processor(str(family_dir), EngineSettings())
    family = family_dir.name.split("-")[0]
    fresh = load_processor(str(family_dir), EngineSettings())

    def user(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]

    calls: list[str] = []
    original = processor.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("render")
        return original(*args, **kwargs)

    monkeypatch.setattr(processor, "apply_chat_template", counting)
    first = estimate_prompt_tokens(processor, family, user("What is it?"), [(56, 84)], [])
    again = estimate_prompt_tokens(processor, family, user("What is it?"), [(56, 84)], [])
    longer = estimate_prompt_tokens(
        processor, family, user("What is it, in detail?"), [(56, 84)], []
    )
    bigger = estimate_prompt_tokens(processor, family, user("What is it?"), [(112, 84)], [])
    assert first == again and calls == ["render", "render"]
    assert longer > first
    # Another processor counts for itself, and agrees, size by size.
    assert estimate_prompt_tokens(fresh, family, user("What is it?"), [(56, 84)], []) == first
    assert estimate_prompt_tokens(fresh, family, user("What is it?"), [(112, 84)], []) == bigger
