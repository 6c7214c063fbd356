"""Media staging without services: where staged media lives, how requests are rewritten,
what is uploaded once, what is refused, and what the worker's allowlist makes of it."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.support.samples import save_image, save_video
from vlmq.config.errors import ConfigError, InvalidRequest, MediaForbidden, StagingRefused
from vlmq.config.schemas import Request
from vlmq.config.settings import MediaSettings, Settings
from vlmq.config.staging import staging_url
from vlmq.producers.staging import MediaStager, StagingProgress, media_type
from vlmq.stores.base import BlobWriter
from vlmq.stores.files import FileStore
from vlmq.workers.media.fetch import MediaFetcher
from vlmq.workers.media.fleet import fleet_media_settings
from vlmq.workers.media.s3_fetch import is_allowed


class CountingStore(FileStore):
    """A file store that counts what reaches it (and may claim to gain from parallelism)."""

    def __init__(self, url: str, parallel: bool = False) -> None:
        super().__init__(url)
        self.parallel_uploads = parallel
        self.uploads: list[str] = []
        self.lookups = 0

    def exists(self, key: str) -> bool:
        self.lookups += 1
        return super().exists(key)

    def writer(self, key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        self.uploads.append(key)
        return super().writer(key, content_type)

    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        self.uploads.append(key)
        return super().put_blob(key, data, content_type)


class BrokenStore(CountingStore):
    def writer(self, key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        raise OSError("read-only")

    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        raise OSError("read-only")


def _settings(tmp_path: Path, **media: Any) -> Settings:
    return Settings(results_url=f"file://{tmp_path / 'results'}", media=MediaSettings(**media))


def _request(*parts: Any) -> Request:
    return Request.model_validate({"messages": [{"role": "user", "content": [*parts, "what?"]}]})


def _image(source: str) -> dict[str, str]:
    return {"type": "image", "image": source}


def _sources(request: Request) -> list[str]:
    return [p.source for p in request.messages[0].content if p.type != "text"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def media(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    save_image(folder / "a.png", size=(40, 30), seed=1)
    save_image(folder / "b.jpg", size=(40, 30), seed=2, format="JPEG")
    save_video(folder / "v.mp4", n_frames=4, size=(32, 32), fps=4, seed=3)
    return folder


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(f"file://{tmp_path / 'results'}")


# where staged media lives --------------------------------------------------------------
def test_staging_url_defaults_to_the_results_store_and_is_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert staging_url(Settings(results_url="file://./res")) == f"file://{tmp_path}/res/media"
    assert staging_url(Settings(results_url="s3://b/runs/")) == "s3://b/runs/media"
    explicit = Settings(media=MediaSettings(staging_url="s3://media-bucket/staged/"))
    assert staging_url(explicit) == "s3://media-bucket/staged"
    with pytest.raises(ConfigError, match="staging URL"):
        staging_url(Settings(media=MediaSettings(staging_url="https://x/y")))


# rewriting ---------------------------------------------------------------------------------
def test_local_paths_and_file_urls_become_content_addressed_urls(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    stager = MediaStager(_settings(tmp_path), store)
    request = _request(
        _image("a.png"),  # relative to base_dir
        _image(str(media / "b.jpg")),
        _image(f"file://{media / 'a.png'}"),
        {"type": "video", "video": str(media / "v.mp4"), "fps": 2},
        _image("https://example.com/x.png"),
        _image("s3://bucket/key.png"),
    )
    staged = stager.stage(request, media)
    root = f"file://{tmp_path / 'results'}/media/sha256"
    assert _sources(staged) == [
        f"{root}/{_sha(media / 'a.png')}.png",
        f"{root}/{_sha(media / 'b.jpg')}.jpg",
        f"{root}/{_sha(media / 'a.png')}.png",
        f"{root}/{_sha(media / 'v.mp4')}.mp4",
        "https://example.com/x.png",
        "s3://bucket/key.png",
    ]
    assert staged.parts("video")[0].fps == 2  # everything but the source is kept
    assert staged.id == request.id
    for url in _sources(staged)[:4]:
        path = Path(url.removeprefix("file://"))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.stem
    assert len(store.uploads) == 3  # a.png once though named twice
    assert stager.progress == StagingProgress(media=4, uploaded=3, bytes_uploaded=_size(media))


def _size(media: Path) -> int:
    return sum((media / name).stat().st_size for name in ("a.png", "b.jpg", "v.mp4"))


def test_a_text_request_is_returned_as_it_is(tmp_path: Path, store: CountingStore) -> None:
    request = Request.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert MediaStager(_settings(tmp_path), store).stage(request) is request
    assert store.lookups == 0


def test_data_uris_are_staged_by_their_decoded_bytes(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    payload = (media / "a.png").read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(payload).decode()
    opaque = "data:image/webp;base64," + base64.b64encode(b"not a known signature").decode()
    staged = MediaStager(_settings(tmp_path), store).stage(_request(_image(uri), _image(opaque)))
    first, second = _sources(staged)
    assert first.endswith(f"/media/sha256/{hashlib.sha256(payload).hexdigest()}.png")
    assert second.endswith(".webp")  # no signature: the declared type names it
    assert Path(first.removeprefix("file://")).read_bytes() == payload


def test_a_file_named_by_many_requests_is_hashed_and_looked_up_once(
    tmp_path: Path, media: Path, store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vlmq.producers.staging as staging

    hashed: list[str] = []
    real_hash = staging._hash_file

    def counted(path: str, cap: int) -> tuple[str, bytes]:
        hashed.append(path)
        return real_hash(path, cap)

    monkeypatch.setattr(staging, "_hash_file", counted)
    stager = MediaStager(_settings(tmp_path), store)
    requests = [_request(_image(str(media / "a.png"))) for _ in range(50)]
    for request in requests[:25]:  # one at a time, as a line-by-line caller does
        stager.stage(request)
    outcomes = stager.stage_all(requests[25:])
    assert len({_sources(r)[0] for r in outcomes if isinstance(r, Request)}) == 1
    assert hashed == [str(media / "a.png")]
    assert store.lookups == 1 and len(store.uploads) == 1
    assert stager.progress.media == 50


def test_a_second_stager_uploads_nothing_new(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    request = _request(_image(str(media / "a.png")), _image(str(media / "b.jpg")))
    first = MediaStager(_settings(tmp_path), store).stage(request)
    again = MediaStager(_settings(tmp_path), store)  # another run, job or process
    assert again.stage(request) == first
    assert len(store.uploads) == 2
    assert again.progress.uploaded == 0 and again.progress.already_stored == 2


def test_the_same_bytes_under_two_names_are_one_object(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    copy = tmp_path / "copy.png"
    copy.write_bytes((media / "a.png").read_bytes())
    staged = MediaStager(_settings(tmp_path), store).stage(
        _request(_image(str(media / "a.png")), _image(str(copy)))
    )
    assert len(set(_sources(staged))) == 1
    assert len(store.uploads) == 1


def test_parallel_uploads_stage_every_distinct_file_once(tmp_path: Path, media: Path) -> None:
    store = CountingStore(f"file://{tmp_path / 'results'}", parallel=True)
    seen: list[StagingProgress] = []
    stager = MediaStager(_settings(tmp_path), store, on_progress=seen.append)
    names = ["a.png", "b.jpg", "v.mp4"]
    requests = [_request(_image(str(media / names[n % 2]))) for n in range(20)]
    requests.append(_request({"type": "video", "video": str(media / "v.mp4")}))
    outcomes = stager.stage_all(requests)
    stager.close()
    assert all(isinstance(r, Request) for r in outcomes)
    assert sorted(store.uploads) == sorted(set(store.uploads)) and len(store.uploads) == 3
    assert seen[-1].uploaded == 3 and len(seen) == 3  # once per distinct item


# left in place ------------------------------------------------------------------------------
def test_files_under_local_roots_and_missing_files_are_left_for_the_worker(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    stager = MediaStager(_settings(tmp_path, local_roots=[str(media)]), store)
    staged = stager.stage(_request(_image("a.png"), _image("gone.png")), media)
    assert _sources(staged) == [str(media / "a.png"), str(media / "gone.png")]
    assert store.uploads == []
    assert stager.progress.in_place == 2


def test_a_stager_that_does_not_read_local_files_leaves_paths_alone(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    uri = "data:image/png;base64," + base64.b64encode((media / "a.png").read_bytes()).decode()
    request = _request(_image(str(media / "a.png")), _image("rel.png"), _image(uri))
    staged = MediaStager(_settings(tmp_path), store, local_files=False).stage(request)
    assert _sources(staged)[:2] == [str(media / "a.png"), "rel.png"]
    assert _sources(staged)[2].startswith("file://")  # the payload still leaves the message
    assert len(store.uploads) == 1


# refused -------------------------------------------------------------------------------------
def test_a_file_over_the_size_limit_fails_its_request_before_any_upload(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    stager = MediaStager(_settings(tmp_path, max_image_bytes=100), store)
    outcomes = stager.stage_all(
        [
            _request(_image(str(media / "a.png"))),
            _request({"type": "video", "video": str(media / "v.mp4")}),
        ]
    )
    error, fine = outcomes
    assert isinstance(error, InvalidRequest) and isinstance(fine, Request)
    assert error.field == "messages.0.content.0"
    assert "VLMQ_MEDIA__MAX_IMAGE_BYTES" in error.message
    assert store.uploads == ["media/" + _sources(fine)[0].split("/media/")[1]]
    assert stager.progress.refused == 1


def test_a_directory_is_not_media(tmp_path: Path, media: Path, store: CountingStore) -> None:
    with pytest.raises(InvalidRequest, match="not a regular file"):
        MediaStager(_settings(tmp_path), store).stage(_request(_image(str(media))))


def test_staging_off_refuses_files_no_worker_can_read_and_keeps_data_inline(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    stager = MediaStager(_settings(tmp_path, staging=False), store)
    uri = "data:image/png;base64," + base64.b64encode((media / "a.png").read_bytes()).decode()
    assert _sources(stager.stage(_request(_image(uri)))) == [uri]
    with pytest.raises(StagingRefused) as refused:
        stager.stage(_request(_image(str(media / "a.png"))))
    assert "VLMQ_MEDIA__STAGING=true" in refused.value.message
    assert "VLMQ_MEDIA__LOCAL_ROOTS" in refused.value.message
    assert refused.value.code == "staging_refused"
    assert store.uploads == []


def test_a_store_that_refuses_the_upload_names_the_setting(tmp_path: Path, media: Path) -> None:
    store = BrokenStore(f"file://{tmp_path / 'results'}")
    stager = MediaStager(_settings(tmp_path), store)
    with pytest.raises(StagingRefused) as refused:
        stager.stage(_request(_image(str(media / "a.png"))))
    assert "VLMQ_MEDIA__STAGING_URL" in refused.value.message
    assert "VLMQ_MEDIA__LOCAL_ROOTS" in refused.value.message
    lookups = store.lookups
    with pytest.raises(StagingRefused):  # at once: the store is not asked again for a while
        stager.stage(_request(_image(str(media / "b.jpg"))))
    assert store.lookups == lookups
    uri = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nxx").decode()
    assert _sources(stager.stage(_request(_image(uri)))) == [uri]  # workers read it inline


def test_a_file_that_changes_while_staged_is_refused_and_never_visible(
    tmp_path: Path, media: Path, store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vlmq.producers.staging as staging

    monkeypatch.setattr(staging, "_hash_file", lambda path, cap: ("0" * 64, b"\x89PNG\r\n\x1a\n"))
    with pytest.raises(InvalidRequest, match="changed while it was staged"):
        MediaStager(_settings(tmp_path), store).stage(_request(_image(str(media / "a.png"))))
    assert not list((tmp_path / "results").rglob("*.png"))


@pytest.mark.parametrize(
    ("head", "declared", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n....", "", ("png", "image/png")),
        (b"\xff\xd8\xff\xe0", ".png", ("jpg", "image/jpeg")),  # the bytes win
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "", ("webp", "image/webp")),
        (b"\x00\x00\x00\x18ftypisom", "", ("mp4", "video/mp4")),
        (b"\x00\x00\x00\x14ftypqt  ", "", ("mov", "video/quicktime")),
        (b"\x1a\x45\xdf\xa3", "", ("mkv", "video/x-matroska")),
        (b"unknown", "image/jpeg", ("jpg", "image/jpeg")),
        (b"unknown", ".GIF", ("gif", "image/gif")),
        (b"unknown", ".tar.gz/../x", ("bin", "application/octet-stream")),
        (b"", "", ("bin", "application/octet-stream")),
    ],
)
def test_media_type(head: bytes, declared: str, expected: tuple[str, str]) -> None:
    assert media_type(head, declared) == expected


# the worker's allowlist ----------------------------------------------------------------------
def test_workers_read_the_file_staging_folder_and_nothing_beside_it(
    tmp_path: Path, media: Path, store: CountingStore
) -> None:
    settings = _settings(tmp_path)
    staged = MediaStager(settings, store).stage(_request(_image(str(media / "a.png"))))
    fetcher = MediaFetcher(fleet_media_settings(settings))
    assert fetcher.fetch(_sources(staged)[0], "image") == (media / "a.png").read_bytes()
    with pytest.raises(MediaForbidden):
        fetcher.fetch(str(media / "a.png"), "image")  # the submitter's folder: not allowed
    escape = tmp_path / "results" / "media" / "sha256" / "escape.png"
    escape.symlink_to(media / "b.jpg")
    with pytest.raises(MediaForbidden):
        fetcher.fetch(str(escape), "image")  # a link out of the folder is still refused
    (tmp_path / "results" / "job").mkdir()
    (tmp_path / "results" / "job" / "t.json").write_text("{}")
    with pytest.raises(MediaForbidden):
        fetcher.fetch(str(tmp_path / "results" / "job" / "t.json"), "image")  # results beside


def test_workers_read_the_s3_staging_prefix_and_not_the_bucket() -> None:
    settings = Settings(results_url="s3://results-bucket/runs")
    media = fleet_media_settings(settings)
    assert media.allowed_s3_prefixes == ["s3://results-bucket/runs/media"]
    assert media.allowed_buckets == [] and media.local_roots == []
    assert is_allowed("results-bucket", "runs/media/sha256/ab.png", media)
    for bucket, key in [
        ("results-bucket", "runs/job/task.0.json"),  # a result beside the media
        ("results-bucket", "runs/mediax/a.png"),
        ("results-bucket", "runs/media/../job/task.0.json"),
        ("results-bucket", "runs/media//a.png"),
        ("other-bucket", "runs/media/sha256/ab.png"),
    ]:
        assert not is_allowed(bucket, key, media), key
    assert is_allowed("b", "any/key", MediaSettings(allowed_buckets=["b"]))
