"""Media staging on real Redis and moto's S3 server: local media from a folder no worker is
configured for, and data: URIs, staged once each, then run by a real worker loop whose
allowlist comes from the same settings; the refusals; the worker's allowlist."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_fleet_loop import Running, make_loop
from tests.support.samples import data_uri, make_image, save_image, save_video
from tests.support.services import wait_until
from vlmq.config.errors import MediaForbidden, StagingRefused
from vlmq.config.settings import EngineSettings, MediaSettings, Settings
from vlmq.config.staging import split_s3_url
from vlmq.producers.client import Client, as_request
from vlmq.stores.base import BlobWriter
from vlmq.stores.urls import open_store
from vlmq.workers.engine import Engine
from vlmq.workers.media.fleet import fleet_loader


@pytest.fixture(scope="module")
def tiny_model(checkpoint: Any) -> str:
    return str(checkpoint("qwen2_5_vl"))


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """The submitter's folder: no worker has it in its local roots."""
    folder = tmp_path / "submitter" / "photos"
    folder.mkdir(parents=True)
    save_image(folder / "a.png", size=(64, 48), seed=1)
    save_image(folder / "b.jpg", size=(48, 64), seed=2, format="JPEG")
    save_video(folder / "v.mp4", n_frames=8, size=(64, 48), fps=4, seed=3)
    return folder


def _png_uri() -> str:
    import io

    buffer = io.BytesIO()
    make_image((40, 40), seed=9).save(buffer, format="PNG")
    return data_uri(buffer.getvalue(), "image/png")


def _line(custom_id: str, *parts: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "messages": [{"role": "user", "content": [*parts, "what is this?"]}],
        "generation": {"max_new_tokens": 4},
    }


def _items(photos: Path, uri: str) -> list[dict[str, Any]]:
    """Eleven lines naming three files (relative, absolute, file://) and one data: URI."""
    image_a = {"type": "image", "image": "a.png"}  # relative to the submitter's folder
    image_b = {"type": "image", "image": str(photos / "b.jpg")}
    video = {"type": "video", "video": f"file://{photos / 'v.mp4'}", "fps": 2, "max_frames": 4}
    inline = {"type": "image_url", "image_url": {"url": uri}}
    return [
        *[_line(f"a-{n}", image_a) for n in range(3)],
        *[_line(f"b-{n}", image_b) for n in range(2)],
        _line("a-and-b", image_a, image_b),
        *[_line(f"v-{n}", video) for n in range(2)],
        *[_line(f"inline-{n}", inline) for n in range(2)],
        {"custom_id": "text", "messages": [{"role": "user", "content": "hi"}]},
    ]


def _spied_store(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """The results store, recording every object written through it."""
    store = open_store(settings.results_url, settings.s3_endpoint_url)
    written: list[str] = []
    writer, put_blob = store.writer, store.put_blob

    def spy_writer(key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        written.append(key)
        return writer(key, content_type)

    def spy_put_blob(key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        written.append(key)
        return put_blob(key, data, content_type)

    monkeypatch.setattr(store, "writer", spy_writer)
    monkeypatch.setattr(store, "put_blob", spy_put_blob)
    return store, written


def _media_objects(settings: Settings, moto_server: Any) -> list[str]:
    bucket, prefix = split_s3_url(settings.results_url)
    listing = moto_server.s3().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/media/")
    return sorted(o["Key"] for o in listing.get("Contents", []))


def _redis_text(client: Client) -> str:
    """Every value Redis holds, as one string: what the queued messages carry."""
    redis = client.redis
    values: list[str] = []
    for key in redis.scan_iter(count=1000):
        kind = redis.type(key)
        if kind == "string":
            values.append(str(redis.get(key)))
        elif kind == "list":
            values += [str(v) for v in redis.lrange(key, 0, -1)]
        elif kind == "hash":
            values += [str(v) for v in redis.hgetall(key).values()]
    return "\n".join(_unwrapped(v) for v in values)


def _unwrapped(value: str) -> str:
    """A Celery message's body is base64 JSON: decode it so its contents can be searched."""
    try:
        import json

        body = json.loads(value).get("body", "")
        return value + base64.b64decode(body).decode("utf-8", "replace")
    except (ValueError, AttributeError, TypeError):
        return value


def _finished(client: Client, job: str) -> bool:
    return bool(client.status(job)["finished"])


def _fleet_engine(settings: Settings, model: str) -> Engine:
    """The engine as ``vlmq worker`` builds it: the allowlist comes from the settings alone."""
    loader = fleet_loader(settings)
    return Engine(model, EngineSettings(), loader.settings, loader=loader).setup()


def test_local_media_from_an_unconfigured_folder_runs_through_s3_staging(
    settings: Settings,
    photos: Path,
    tiny_model: str,
    moto_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings.media.local_roots == []  # neither side is configured for the folder
    uri = _png_uri()
    items = _items(photos, uri)
    store, written = _spied_store(settings, monkeypatch)
    client = Client(settings, store=store)
    job = client.submit_many(items, base_dir=photos)
    task = client.submit(_line("single", {"type": "image", "image": "b.jpg"}), base_dir=photos)

    distinct = 4  # a.png, b.jpg, v.mp4 and the data: URI's image
    assert len(written) == distinct and len(set(written)) == distinct
    objects = _media_objects(settings, moto_server)
    assert len(objects) == distinct
    for name in ("a.png", "b.jpg", "v.mp4"):
        digest = hashlib.sha256((photos / name).read_bytes()).hexdigest()
        assert any(f"/media/sha256/{digest}." in key for key in objects), name
    queued = _redis_text(client)
    assert uri.split(",")[1][:64] not in queued  # the payload is not in Redis
    assert str(photos) not in queued  # nor the submitter's paths
    bucket, prefix = split_s3_url(settings.results_url)
    assert f"s3://{bucket}/{prefix}/media/sha256/" in queued

    again = Client(settings, store=store)  # a second submission, a fresh stager
    second = again.submit_many(items, base_dir=photos)
    assert len(written) == distinct
    assert again.stager.progress.uploaded == 0 and again.stager.progress.already_stored == 4

    engine = _fleet_engine(settings, tiny_model)
    with Running(make_loop(settings, engine)):
        for name in (job, second):
            wait_until(lambda name=name: _finished(client, name), timeout=180, what="job")
        wait_until(lambda: client.result(task), timeout=60, what="single task")
    engine.close()
    for name in (job, second):
        records = [client.result(t) for t in client.job_task_ids(name)]
        failures = [(r["custom_id"], r.get("error")) for r in records if r["status"] != "succeeded"]
        assert len(records) == len(items) and not failures
    assert client.result(task)["status"] == "succeeded"


def test_staging_off_refuses_before_anything_is_enqueued(settings: Settings, photos: Path) -> None:
    off = settings.model_copy(update={"media": MediaSettings(staging=False)})
    client = Client(off)
    with pytest.raises(StagingRefused) as refused:
        client.submit_many(_items(photos, _png_uri()), job_id="refused", base_dir=photos)
    assert refused.value.message.startswith("item 0: messages.0.content.0:")
    assert "VLMQ_MEDIA__STAGING=true" in refused.value.message
    assert "VLMQ_MEDIA__LOCAL_ROOTS" in refused.value.message
    with pytest.raises(StagingRefused):
        client.submit(_line("one", {"type": "image", "image": str(photos / "a.png")}))
    assert client.redis.dbsize() == 0


def test_a_store_that_refuses_the_media_refuses_the_submission(
    settings: Settings, photos: Path
) -> None:
    media = MediaSettings(staging_url="s3://no-such-bucket-for-media/staged")
    client = Client(settings.model_copy(update={"media": media}))
    with pytest.raises(StagingRefused) as refused:
        client.submit_many(_items(photos, _png_uri()), base_dir=photos)
    assert "s3://no-such-bucket-for-media/staged" in refused.value.message
    assert "VLMQ_MEDIA__STAGING_URL" in refused.value.message
    assert client.redis.dbsize() == 0


def test_the_fleet_reads_the_staging_prefix_and_nothing_beside_it(
    settings: Settings, photos: Path, moto_server: Any
) -> None:
    client = Client(settings)
    image = {"type": "image", "image": str(photos / "a.png")}
    request = client.stager.stage(as_request([{"role": "user", "content": [image]}]))
    staged = request.parts("image")[0].source
    fetcher = fleet_loader(settings).fetcher
    assert fetcher.fetch(staged, "image") == (photos / "a.png").read_bytes()
    bucket, prefix = split_s3_url(settings.results_url)
    moto_server.s3().put_object(Bucket=bucket, Key=f"{prefix}/job/t.0.json", Body=b"{}")
    for refused in (
        f"s3://{bucket}/{prefix}/job/t.0.json",  # a result beside the staged media
        f"s3://{bucket}/{prefix}/media/../job/t.0.json",
        str(photos / "a.png"),  # the submitter's own folder
    ):
        with pytest.raises(MediaForbidden):
            fetcher.fetch(refused, "image")


def test_the_embedded_default_stages_into_the_file_store(
    settings: Settings, photos: Path, tmp_path: Path, tiny_model: str
) -> None:
    local = settings.model_copy(update={"results_url": f"file://{tmp_path / 'results'}"})
    client = Client(local)
    job = client.submit_many(_items(photos, _png_uri())[:6], base_dir=photos)
    staged = sorted((tmp_path / "results" / "media" / "sha256").iterdir())
    assert len(staged) == 2  # a.png and b.jpg
    engine = _fleet_engine(local, tiny_model)
    with Running(make_loop(local, engine, ("image",))):
        wait_until(lambda: _finished(client, job), timeout=120, what="job")
    engine.close()
    assert client.status(job)["counts"]["succeeded"] == 6


def test_the_api_never_reads_its_own_disk_but_stages_data_uris(
    settings: Settings, photos: Path, moto_server: Any
) -> None:
    from fastapi.testclient import TestClient

    from vlmq.producers.api.app import create_app

    uri = _png_uri()
    local = str(photos / "a.png")
    inline = {"type": "image_url", "image_url": {"url": uri}}
    body = {"messages": [{"role": "user", "content": [{"type": "image", "image": local}, inline]}]}
    with TestClient(create_app(settings), base_url="http://localhost") as http:
        reply = http.post("/v1/tasks", json=body)
    assert reply.status_code == 202, reply.text
    queued = _redis_text(Client(settings))
    assert local in queued  # left for the workers' own allowlist, never read by the server
    assert uri.split(",")[1][:64] not in queued
    assert len(_media_objects(settings, moto_server)) == 1
