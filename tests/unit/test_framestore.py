"""The frame store: prepared media content-addressed in the object store, read back by any
worker instead of fetched and decoded again."""

from __future__ import annotations

import gc
import hashlib
import logging
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.support.samples import make_image, make_video_bytes, save_image
from vlmq.config.errors import ConfigError
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, FrameStoreSettings, MediaSettings
from vlmq.stores.files import FileStore
from vlmq.workers.demo.tiny import FAMILIES
from vlmq.workers.media import DecodedVideo, Downscale, MediaLoader, Pixels
from vlmq.workers.media.prepared.framecodec import (
    CODECS,
    CorruptObject,
    decode_object,
    encode_object,
    missing_package,
)
from vlmq.workers.media.prepared.framestore import (
    FrameStore,
    content_id,
    frame_store_url,
    open_frame_store,
    staged_digest,
)
from vlmq.workers.media.video import Sampling

pytestmark = pytest.mark.unit

BOTH = FrameStoreSettings(kinds=["image", "video"])
SAMPLING = Sampling(2.0, 16, "exact")
TARGET = Downscale(max_pixels=12544)


def _has(codec: str) -> bool:
    return missing_package(codec) is None


def _codecs() -> list[str]:
    return [name for name in CODECS if _has(name)]


def _video(frames: int = 4) -> DecodedVideo:
    images = [make_image((48, 32), seed=n) for n in range(frames)]
    return DecodedVideo(images, 29.97, 3.5, list(range(0, 8 * frames, 8)), 105, 48, 32)


def _same_video(a: DecodedVideo, b: DecodedVideo) -> bool:
    same_meta = (a.fps, a.duration_s, a.frame_indices, a.total_frames, a.width, a.height) == (
        b.fps,
        b.duration_s,
        b.frame_indices,
        b.total_frames,
        b.width,
        b.height,
    )
    return same_meta and [f.tobytes() for f in a.frames] == [f.tobytes() for f in b.frames]


def _store(root: Path, settings: FrameStoreSettings = BOTH, **media: Any) -> FrameStore:
    return FrameStore(FileStore(f"file://{root}"), settings, MediaSettings(**media))


# --- the object format ------------------------------------------------------------------------


@pytest.mark.parametrize("codec", _codecs())
def test_every_codec_reads_back_the_exact_pixels_and_metadata(codec: str) -> None:
    image = make_image((37, 23), seed=4)
    back = decode_object(encode_object(image, codec), 10**6, 16, key="k")
    # Read back planar, as the processors take them: (frames, 3, height, width).
    assert isinstance(back, Pixels) and back.array.shape == (1, 3, 23, 37) and back.key == "k"
    assert back.size == image.size and back.tobytes() == image.tobytes()
    assert back.image().tobytes() == image.tobytes()
    video = _video()
    again = decode_object(encode_object(video, codec), 10**6, 16)
    assert isinstance(again, DecodedVideo) and isinstance(again.frames, Pixels)
    assert _same_video(again, video)
    # What was read back writes the same object again.
    rewritten = decode_object(encode_object(again, codec), 10**6, 16)
    assert isinstance(rewritten, DecodedVideo) and _same_video(rewritten, again)


def _noise_video(frames: int = 3) -> DecodedVideo:
    """Incompressible frames: zstd and zlib store them as they are, so only a checksum can
    tell a flipped payload byte."""
    rng = np.random.default_rng(5)
    images = [
        Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)) for _ in range(frames)
    ]
    return DecodedVideo(images, 25.0, 1.0, list(range(frames)), 25, 48, 32)


@pytest.mark.parametrize("codec", _codecs())
def test_any_flipped_byte_is_caught(codec: str) -> None:
    data = bytearray(encode_object(_noise_video(), codec))
    for position in (0, 12, 40, len(data) // 2, len(data) - 40, len(data) - 1):
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        with pytest.raises(CorruptObject):
            decode_object(bytes(flipped), 10**6, 16)


def test_frames_of_several_sizes_are_not_stored(tmp_path: Path) -> None:
    video = _video()
    assert isinstance(video.frames, list)
    video.frames[1] = video.frames[1].resize((24, 16))
    store = _store(tmp_path)
    assert store.put("t/video/ab/x.vfr", video) is False
    assert store.get("t/video/ab/x.vfr") is None


def test_a_header_asking_for_too_much_is_refused_before_allocating() -> None:
    data = encode_object(_video(frames=4), "zlib")
    with pytest.raises(CorruptObject):
        decode_object(data, 10**6, max_frames=3)
    with pytest.raises(CorruptObject):
        decode_object(data, max_pixels=48 * 32 - 1, max_frames=16)


# --- keys -----------------------------------------------------------------------------------


def test_keys_are_per_tenant_unless_shared(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a = store.key_for("sha256:ab", SAMPLING, TARGET, "team-a")
    b = store.key_for("sha256:ab", SAMPLING, TARGET, "team-b")
    assert a != b and a.startswith("team-a/") and b.startswith("team-b/")
    with pytest.raises(ValueError):
        store.key_for("sha256:ab", SAMPLING, TARGET, None)
    shared = _store(tmp_path, FrameStoreSettings(share_across_tenants=True))
    assert shared.key_for("sha256:ab", SAMPLING, TARGET, "team-a") == shared.key_for(
        "sha256:ab", SAMPLING, TARGET, "team-b"
    )


def test_everything_that_changes_the_pixels_is_in_the_key(tmp_path: Path) -> None:
    store = _store(tmp_path)
    base = store.key_for("sha256:ab", SAMPLING, TARGET, "t")
    variants = [
        store.key_for("sha256:ac", SAMPLING, TARGET, "t"),
        store.key_for("sha256:ab", Sampling(1.0, 16, "exact"), TARGET, "t"),
        store.key_for("sha256:ab", Sampling(2.0, 8, "exact"), TARGET, "t"),
        store.key_for("sha256:ab", Sampling(2.0, 16, "keyframes"), TARGET, "t"),
        store.key_for("sha256:ab", SAMPLING, Downscale(max_pixels=3136), "t"),
        store.key_for("sha256:ab", SAMPLING, Downscale(cover=(448, 448)), "t"),
        store.key_for("sha256:ab", SAMPLING, None, "t"),
        store.key_for("sha256:ab", None, TARGET, "t"),  # an image
        store.key_for("sha256:ab", SAMPLING, TARGET, "t", decoder="nvjpeg"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert store.key_for("sha256:ab", SAMPLING, TARGET, "t") == base  # deterministic


# --- content ids ------------------------------------------------------------------------------


def test_content_ids() -> None:
    digest = "0f" * 32
    staging = "s3://bucket/vlmq/media"
    assert content_id(f"{staging}/sha256/{digest}.mp4", staging=staging) == f"sha256:{digest}"
    local = "file:///srv/results/media"
    assert staged_digest(f"{local}/sha256/{digest}.jpg", local) == digest
    assert staged_digest(f"/srv/results/media/sha256/{digest}.jpg", local) == digest
    assert staged_digest(f"{staging}/sha256/not-hex.mp4", staging) is None
    assert staged_digest("s3://bucket/other/clip.mp4", staging) is None
    data = b"some bytes"
    assert content_id("/any/path.jpg", data) == f"sha256:{hashlib.sha256(data).hexdigest()}"
    heads: list[str] = []

    def head(source: str) -> tuple[str, int]:
        heads.append(source)
        return '"etag-1"', 1234

    assert content_id("s3://b/clip.mp4", s3_head=head) == 's3:s3://b/clip.mp4@"etag-1":1234'
    assert content_id("https://host/clip.mp4", s3_head=head) is None  # bytes needed
    assert heads == ["s3://b/clip.mp4"]


# --- the store --------------------------------------------------------------------------------


def test_a_corrupt_object_reads_as_missing_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path)
    key = store.key_for("sha256:ab", SAMPLING, TARGET, "t")
    assert store.get(key) is None and not store.has(key)
    assert store.put(key, _video())
    assert store.has(key)
    path = tmp_path / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
    assert "corrupt" in caplog.text


def test_an_object_over_the_size_limit_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = _store(tmp_path).key_for("sha256:ab", SAMPLING, TARGET, "t")
    assert _store(tmp_path).put(key, _video())
    size = (tmp_path / key).stat().st_size
    small = _store(tmp_path, FrameStoreSettings(kinds=["video"], max_object_bytes=size - 1))
    with caplog.at_level(logging.WARNING):
        assert small.get(key) is None
    assert "too large" in caplog.text
    assert isinstance(_store(tmp_path).get(key), DecodedVideo)


def test_on_for_video_by_default_and_off_for_images(tmp_path: Path) -> None:
    media = MediaSettings()
    assert media.frame_store.kinds == ["video"] and media.frame_store.enabled
    # Beside the results store, never inside it (a full frame store once stopped results).
    store = open_frame_store(media, f"file://{tmp_path}/results")
    assert store is not None and store.store.url == f"file://{tmp_path}/frames"
    assert store.codec == ("raw" if _has("raw") else "zstd" if _has("zstd") else "zlib")
    off = MediaSettings(frame_store=FrameStoreSettings(enabled=False))
    assert open_frame_store(off, f"file://{tmp_path}") is None


@pytest.mark.parametrize(
    ("results", "frames"),
    [
        ("file://./.vlmq/results", "file://./.vlmq/frames"),
        ("s3://bucket/results/", "s3://bucket/frames"),
        ("s3://bucket/runs/results", "s3://bucket/runs/frames"),
        ("s3://bucket/frames", "s3://bucket/frames-prepared"),
    ],
)
def test_the_frame_store_lives_beside_the_results_never_inside(results: str, frames: str) -> None:
    assert frame_store_url(FrameStoreSettings(), results) == frames
    assert frame_store_url(FrameStoreSettings(url="s3://b/f"), results) == "s3://b/f"


@pytest.mark.parametrize("results", ["s3://bucket", "file:///"])
def test_a_results_store_with_nothing_beside_it_needs_the_url_set(results: str) -> None:
    with pytest.raises(ConfigError, match="VLMQ_MEDIA__FRAME_STORE__URL"):
        frame_store_url(FrameStoreSettings(), results)


@pytest.mark.parametrize(
    ("codec", "package", "without"),
    [("zstd", "zstandard", ("raw", "zlib")), ("raw", "xxhash", ("zstd", "zlib"))],
)
def test_an_object_whose_codec_package_is_missing_reads_as_corrupt(
    monkeypatch: pytest.MonkeyPatch, codec: str, package: str, without: tuple[str, str]
) -> None:
    """A worker without the codec's package reads the object as a miss (it prepares the media
    again) and writes with the next codec it has."""
    from vlmq.workers.media.prepared import framecodec

    if not _has(codec):
        pytest.skip(f"the {codec} codec's package is not installed here")
    data = encode_object(_video(), codec)
    other = _has(without[0])
    importable = framecodec.package_available
    monkeypatch.setattr(
        framecodec, "package_available", lambda name: name != package and importable(name)
    )
    with pytest.raises(CorruptObject, match=f"needs the {package} package"):
        decode_object(data, 10**6, 16)
    assert framecodec.resolve_codec("auto") == (without[0] if other else without[1])


def test_raw_frames_are_used_where_they_were_read_in_reused_memory(tmp_path: Path) -> None:
    if not _has("raw"):
        pytest.skip("xxhash is not installed")
    store = _store(tmp_path, FrameStoreSettings(kinds=["image"], codec="raw"))
    key = store.key_for("sha256:ab", None, TARGET, "t")
    image = make_image((37, 23), seed=4)
    assert store.put(key, image)
    back = store.get(key)
    assert isinstance(back, Pixels) and back.tobytes() == image.tobytes()
    # No second copy: a read-only view of the pooled memory the object was read into
    # (never a mapping of the file, which would hold a descriptor and fault on truncation).
    assert not back.array.flags.writeable and not back.array.flags.owndata
    base: Any = back.array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and not isinstance(base.obj, mmap.mmap)
    assert store.buffers.allocated == 1
    assert back.as_tensor().sum().item() == int(np.asarray(image, np.int64).sum())
    del back, base
    gc.collect()
    assert isinstance(store.get(key), Pixels) and store.buffers.reused == 1


# --- through the loader -----------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    names = ("media", "store", "staging")
    out = {name: tmp_path / name for name in names}
    for folder in out.values():
        folder.mkdir()
    return out


def _loader(folders: dict[str, Path], **media: Any) -> MediaLoader:
    settings = MediaSettings(
        **{"cache_bytes": 0, **media},
        local_roots=[str(folders["media"]), str(folders["staging"])],
        frame_store=BOTH,
    )
    store = FrameStore(FileStore(f"file://{folders['store']}"), BOTH, settings)
    return MediaLoader(settings, frames=store, staging=f"file://{folders['staging']}")


def _stage(folders: dict[str, Path], data: bytes, ext: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = folders["staging"] / "sha256" / f"{digest}.{ext}"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return f"file://{path}"


def test_a_second_worker_skips_fetch_and_decode_of_a_staged_clip(
    folders: dict[str, Path],
) -> None:
    source = _stage(folders, make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=5), "mp4")
    first = _loader(folders)
    direct = first.load_video(source, 4.0, 8, TARGET, tenant="t")
    assert first.thread_counts().decodes == 1
    Path(source.removeprefix("file://")).unlink()  # the source is gone: only the store has it
    second = _loader(folders)
    stored = second.load_video(source, 4.0, 8, TARGET, tenant="t")
    counts = second.thread_counts()
    assert counts.decodes == 0 and counts.store_hits == 1
    assert _same_video(stored, direct)


def test_prepared_from_store_and_direct_give_identical_pixels(folders: dict[str, Path]) -> None:
    photo = folders["media"] / "p.jpg"
    save_image(photo, size=(320, 200), seed=6, format="JPEG")
    first = _loader(folders)
    direct = first.load_image(str(photo), TARGET, "t")
    second = _loader(folders)
    stored = second.load_image(str(photo), TARGET, "t")
    assert second.thread_counts().decodes == 0  # the bytes were read (their hash), not decoded
    assert isinstance(stored, Pixels) and isinstance(direct, Image.Image)
    assert stored.size == direct.size and stored.tobytes() == direct.tobytes()


def test_a_corrupt_object_is_prepared_again_and_replaced(folders: dict[str, Path]) -> None:
    source = _stage(folders, make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=7), "mp4")
    direct = _loader(folders).load_video(source, 4.0, 8, TARGET, tenant="t")
    [path] = [p for p in folders["store"].rglob("*.vfr")]
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    again = _loader(folders)
    video = again.load_video(source, 4.0, 8, TARGET, tenant="t")
    assert again.thread_counts().decodes == 1 and again.thread_counts().store_hits == 0
    assert _same_video(video, direct)
    third = _loader(folders)  # the re-prepared object replaced the corrupt one
    assert _same_video(third.load_video(source, 4.0, 8, TARGET, tenant="t"), direct)
    assert third.thread_counts().store_hits == 1


def test_tenants_do_not_read_each_others_media(folders: dict[str, Path]) -> None:
    source = _stage(folders, make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=8), "mp4")
    _loader(folders).load_video(source, 4.0, 8, TARGET, tenant="team-a")
    other = _loader(folders)
    other.load_video(source, 4.0, 8, TARGET, tenant="team-b")
    assert other.thread_counts().decodes == 1 and other.thread_counts().store_hits == 0
    untenanted = _loader(folders)  # no tenant and no sharing: the store is not used at all
    untenanted.load_video(source, 4.0, 8, TARGET)
    assert untenanted.thread_counts().store_hits == 0
    assert len(list(folders["store"].rglob("*.vfr"))) == 2


def test_the_workers_own_cache_stays_shared_by_tenants(folders: dict[str, Path]) -> None:
    source = _stage(folders, make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=14), "mp4")
    loader = _loader(folders, cache_bytes=64 * 1024 * 1024)
    loader.load_video(source, 4.0, 8, TARGET, tenant="team-a")
    loader.load_video(source, 4.0, 8, TARGET, tenant="team-b")
    assert loader.thread_counts() == (1, 0, 1)  # one decode, then a hit in memory
    assert [p.parts[-4] for p in folders["store"].rglob("*.vfr")] == ["team-a"]


def test_a_tampered_staged_object_is_decoded_but_not_stored(folders: dict[str, Path]) -> None:
    clip = make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=9)
    source = _stage(folders, clip, "mp4")
    path = Path(source.removeprefix("file://"))
    path.write_bytes(make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=10))
    _loader(folders).load_video(source, 4.0, 8, TARGET, tenant="t")
    assert not list(folders["store"].rglob("*.vfr"))


def test_an_s3_source_is_named_by_a_head_before_any_download(folders: dict[str, Path]) -> None:
    clip = make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=11)
    calls: list[str] = []

    class Body:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def read(self, n: int) -> bytes:
            chunk, self.data = self.data[:n], self.data[n:]
            return chunk

        def close(self) -> None:
            pass

    class Client:
        def head_object(self, **_: Any) -> dict[str, Any]:
            calls.append("head")
            return {"ETag": '"e1"', "ContentLength": len(clip)}

        def get_object(self, **_: Any) -> dict[str, Any]:
            calls.append("get")
            return {"Body": Body(clip)}

    def loader() -> MediaLoader:
        made = _loader(folders, allowed_buckets=["media-bucket"])
        made.fetcher = type(made.fetcher)(made.settings, Client)
        return made

    first = loader().load_video("s3://media-bucket/c.mp4", 4.0, 8, TARGET, tenant="t")
    assert "get" in calls
    calls.clear()
    second = loader()
    video = second.load_video("s3://media-bucket/c.mp4", 4.0, 8, TARGET, tenant="t")
    assert calls == ["head"] and second.thread_counts().decodes == 0
    assert _same_video(video, first)


# --- the engine: identical greedy fp32 tokens -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_store_and_direct_give_identical_greedy_tokens(
    family: str, checkpoint: Any, folders: dict[str, Path]
) -> None:
    import torch

    from vlmq.workers.engine import Engine

    photo = folders["media"] / "p.png"
    save_image(photo, size=(200, 150), seed=12)
    clip = _stage(folders, make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=13), "mp4")
    request = Request.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(photo)},
                        {"type": "video", "video": clip, "fps": 4.0, "max_frames": 8},
                        "What changed?",
                    ],
                }
            ],
            "max_new_tokens": 8,
        }
    )
    model = str(checkpoint(family))
    loader = _loader(folders)
    engine = Engine(model, EngineSettings(), loader.settings, loader=loader).setup()

    inputs: list[dict[str, Any]] = []

    def tokens(decodes: int, hits: int) -> list[int]:
        prepared = engine.prepare(request, "t")
        assert prepared.error is None
        assert prepared.timings["media_decodes"] == decodes
        assert prepared.timings["frame_store_hits"] == hits
        collated = engine.collate([prepared])
        inputs.append(dict(collated.inputs))
        [outcome] = engine.generate(collated)
        assert outcome.completion is not None
        return list(outcome.completion.token_ids)

    direct = tokens(decodes=2, hits=0)  # Pillow media
    stored = tokens(decodes=0, hits=2)  # read back as Pixels: nothing decoded
    assert stored == direct
    # The processor made the same tensors of both, bit for bit.
    assert inputs[0].keys() == inputs[1].keys()
    for name, value in inputs[0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, inputs[1][name]), name
    engine.close()
