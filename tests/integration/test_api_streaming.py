"""Files stream through the API: an upload goes to the store a chunk at a time, a
download comes back the same way, and a batch's output files are multipart uploads
written while its results are read.

Memory is measured on a real ``vlmq serve`` process (its peak RSS from /proc, reset
before each transfer) with a file four times the growth allowed; the store is moto's
S3 server, so the multipart uploads are real ones."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.integration.test_api_support import api_settings, wait_for_state, worker_loop
from tests.support.services import vlmq_serve
from vlmq.config.errors import StoreUnavailable
from vlmq.config.settings import Settings
from vlmq.producers.api.app import create_app
from vlmq.producers.api.openai import batch_work
from vlmq.producers.api.openai.batch_records import BatchRecords
from vlmq.producers.api.openai.batch_work import BatchWork, output_file_ids
from vlmq.producers.api.openai.files import FileRegistry, FileTooLarge, content_key
from vlmq.producers.client import Client
from vlmq.stores import base as results
from vlmq.stores import s3 as s3_backend
from vlmq.stores.s3 import S3Store
from vlmq.stores.urls import open_store

MiB = 1024 * 1024
# The uploaded file, and how much the API process may grow while it passes through
# (either way): a few read chunks and multipart parts, never the file.
FILE_BYTES = 256 * MiB
GROWTH_ALLOWED = 64 * MiB
# S3's smallest part (moto enforces it too): the smallest honest multipart upload.
SMALL_PART = 5 * MiB


@pytest.fixture
def settings(redis_server, moto_server, request):
    return api_settings(redis_server, moto_server, request.node.name)


@pytest.fixture
def s3(moto_server):
    return moto_server.s3()


def _object_key(settings: Settings, file_id: str) -> tuple[str, str]:
    """(bucket, key) of a file's content, found without the code under test."""
    parsed = urlparse(settings.results_url)
    return parsed.netloc, f"{parsed.path.strip('/')}/{content_key(file_id)}"


def _parts_in(etag: str) -> int:
    """S3 names a multipart object's part count in its ETag (``"<md5>-<parts>"``)."""
    _, _, parts = etag.strip('"').partition("-")
    return int(parts) if parts else 1


def _open_uploads(s3: Any, bucket: str, key: str) -> list[dict[str, Any]]:
    reply = s3.list_multipart_uploads(Bucket=bucket, Prefix=key)
    return [u for u in reply.get("Uploads", []) if u["Key"] == key]


def _parts_uploaded(s3: Any, bucket: str, key: str) -> int:
    uploads = _open_uploads(s3, bucket, key)
    if not uploads:
        return 0
    reply = s3.list_parts(Bucket=bucket, Key=key, UploadId=uploads[0]["UploadId"])
    return len(reply.get("Parts", []))


# a real `vlmq serve` process and its peak RSS --------------------------------
class PeakRss:
    """A process's peak resident memory (VmHWM), which Linux resets on request."""

    def __init__(self, pid: int) -> None:
        self.status = Path(f"/proc/{pid}/status")
        self.clear_refs = Path(f"/proc/{pid}/clear_refs")

    def _kib(self, field: str) -> int:
        for line in self.status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in {self.status}")

    def reset(self) -> int:
        """Make the peak the current RSS (``5`` > clear_refs); returns it."""
        self.clear_refs.write_text("5")
        peak, now = self._kib("VmHWM"), self._kib("VmRSS")
        assert peak - now < 4 * MiB, "the peak did not reset"
        return peak

    def peak(self) -> int:
        return self._kib("VmHWM")


@pytest.fixture
def api_process(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, PeakRss]]:
    env = {
        **os.environ,
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
    }
    env.pop("VLMQ_API__API_KEYS", None)
    with vlmq_serve(tmp_path, env, timeout_s=30) as (url, process):
        yield url, PeakRss(process.pid)


def _request_line(n: int) -> bytes:
    question = f"question {n}: " + "lorem ipsum dolor sit amet " * 36
    request = {
        "custom_id": f"r{n}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": question}]},
    }
    return json.dumps(request).encode() + b"\n"


def _write_jsonl(path: Path, size: int) -> str:
    """A JSONL file of about ``size`` bytes of distinct lines; returns its sha256."""
    digest, written, n = hashlib.sha256(), 0, 0
    with path.open("wb") as out:
        while written < size:
            block = b"".join(_request_line(n + i) for i in range(1000))
            out.write(block)
            digest.update(block)
            written, n = written + len(block), n + 1000
    return digest.hexdigest()


def _upload(http: httpx.Client, path: Path) -> httpx.Response:
    with path.open("rb") as source:  # httpx sends it in chunks
        return http.post(
            "/v1/files", files={"file": (path.name, source)}, data={"purpose": "batch"}
        )


def _download_sha256(http: httpx.Client, file_id: str) -> tuple[str, int, int]:
    """(sha256, bytes received, Content-Length) of a file's content, read as it streams."""
    digest, received = hashlib.sha256(), 0
    with http.stream("GET", f"/v1/files/{file_id}/content") as reply:
        assert reply.status_code == 200
        for chunk in reply.iter_bytes():
            digest.update(chunk)
            received += len(chunk)
        return digest.hexdigest(), received, int(reply.headers["content-length"])


def _stored_sha256(s3: Any, bucket: str, key: str) -> str:
    digest = hashlib.sha256()
    for chunk in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(results.READ_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def test_a_file_larger_than_the_memory_allowed_streams_up_and_down(
    api_process, settings, s3, tmp_path
):
    url, rss = api_process
    big = tmp_path / "big.jsonl"
    sha256 = _write_jsonl(big, FILE_BYTES)
    size = big.stat().st_size
    small = tmp_path / "small.jsonl"
    _write_jsonl(small, 1)
    with httpx.Client(base_url=url, timeout=120) as http:
        # First use loads code and opens pools: before the baseline, not in the growth.
        warm = _upload(http, small).json()
        _download_sha256(http, warm["id"])

        before = rss.reset()
        reply = _upload(http, big)
        upload_growth = rss.peak() - before
        assert reply.status_code == 200, reply.text
        uploaded = reply.json()

        before = rss.reset()
        downloaded, received, declared = _download_sha256(http, uploaded["id"])
        download_growth = rss.peak() - before

    bucket, key = _object_key(settings, uploaded["id"])
    stored = s3.head_object(Bucket=bucket, Key=key)
    print(
        f"\n{size / MiB:.0f} MiB file: API peak RSS growth {upload_growth / MiB:.1f} MiB "
        f"uploading, {download_growth / MiB:.1f} MiB downloading; "
        f"{_parts_in(stored['ETag'])} parts"
    )
    assert uploaded["bytes"] == size == stored["ContentLength"] == received == declared
    assert _stored_sha256(s3, bucket, key) == sha256 == downloaded
    # Written through the streaming writer: one multipart part per PART_BYTES.
    assert _parts_in(stored["ETag"]) == math.ceil(size / s3_backend.PART_BYTES)
    assert upload_growth < GROWTH_ALLOWED, f"upload: +{upload_growth / MiB:.0f} MiB"
    assert download_growth < GROWTH_ALLOWED, f"download: +{download_growth / MiB:.0f} MiB"


# output files ----------------------------------------------------------------
def _succeeded(n: int) -> dict[str, Any]:
    return {
        "id": f"t{n}",
        "custom_id": f"c{n}",
        "status": "succeeded",
        "model": "echo",
        "output": f"answer {n} " + "x" * 100_000,
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }


def _failed(n: int) -> dict[str, Any]:
    error = {"code": "generation_failed", "message": "generation failed"}
    return {"id": f"f{n}", "custom_id": f"bad{n}", "status": "failed", "error": error}


def _finished_batch(client: Client, batch_id: str) -> None:
    fields = {
        "id": batch_id,
        "input_file_id": "file-none",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "created_at": "0",
        "metadata": "{}",
    }
    BatchRecords(client).create(batch_id, fields)


def test_a_large_output_file_is_a_multipart_upload_written_while_results_are_read(
    settings, s3, monkeypatch
):
    monkeypatch.setattr(s3_backend, "PART_BYTES", SMALL_PART)
    client = Client(settings)
    files = FileRegistry(client)
    batch_id = "batch_bigoutput"
    _finished_batch(client, batch_id)
    output_id, error_id = output_file_ids(batch_id)
    bucket, output_key = _object_key(settings, output_id)
    n_succeeded = 480  # ~48 MiB of output lines
    parts_while_reading: list[int] = []

    def results_of(_client: Client, job_id: str) -> Iterator[dict[str, Any]]:
        assert job_id == batch_id
        yield from (_succeeded(n) for n in range(n_succeeded))
        yield from (_failed(n) for n in range(3))
        # Not finished reading yet: the output file's parts are already in the store.
        parts_while_reading.append(_parts_uploaded(s3, bucket, output_key))

    line_error = {"line": 7, "error": {"code": "invalid_request", "message": "bad"}}
    monkeypatch.setattr(batch_work, "iter_results", results_of)
    monkeypatch.setattr(batch_work, "iter_line_errors", lambda _c, _j: iter([line_error]))
    records = BatchRecords(client)
    work = BatchWork(client, files, records)
    tracemalloc.start()
    try:
        assert work.finalize_now(batch_id)
        _, finalize_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        work.shutdown()

    assert records.has(batch_id, "finalized_at")
    stored = s3.head_object(Bucket=bucket, Key=output_key)
    parts = _parts_in(stored["ETag"])
    print(
        f"\n{stored['ContentLength'] / MiB:.0f} MiB output file: {parts} parts, "
        f"{parts_while_reading[0]} uploaded while reading; "
        f"finalize peak {finalize_peak / MiB:.1f} MiB (tracemalloc)"
    )
    assert parts >= 8 and parts_while_reading == [parts - 1]
    # Bounded by a part (and its copy on the way out), not by the file.
    assert finalize_peak < 4 * SMALL_PART < stored["ContentLength"] / 2
    output = files.get(output_id)
    assert output is not None and output.bytes == stored["ContentLength"]
    lines = [json.loads(line) for _, line in files.lines(output_id)]
    assert [line["custom_id"] for line in lines] == [f"c{n}" for n in range(n_succeeded)]
    assert lines[5]["response"]["body"]["choices"][0]["message"]["content"].startswith("answer 5")
    # The small error file: one plain put, all four records.
    _, error_key = _object_key(settings, error_id)
    assert _parts_in(s3.head_object(Bucket=bucket, Key=error_key)["ETag"]) == 1
    errors = [json.loads(line) for _, line in files.lines(error_id)]
    assert [e["error"]["code"] for e in errors] == ["generation_failed"] * 3 + ["invalid_request"]
    record = records.get(batch_id) or {}
    assert (record["output_count"], record["error_count"]) == ("480", "4")


# the writer's aborts -----------------------------------------------------------
def test_a_stream_past_its_cap_is_aborted_leaving_nothing(settings, s3):
    files = FileRegistry(Client(settings))
    file_id = "file-toolarge"
    bucket, key = _object_key(settings, file_id)
    open_before_cap: list[int] = []

    def chunks() -> Iterator[bytes]:
        for n in range(12):
            if n == 10:  # 10 MiB written: a multipart upload is under way
                open_before_cap.append(len(_open_uploads(s3, bucket, key)))
            yield bytes([n]) * MiB

    with pytest.raises(FileTooLarge):
        files.create_stream(chunks(), "big.jsonl", "batch", file_id, max_bytes=10 * MiB)
    assert open_before_cap == [1]
    assert _open_uploads(s3, bucket, key) == []
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=key)
    assert files.get(file_id) is None and files.size(file_id) is None


def test_a_failed_last_part_aborts_the_upload(settings, s3):
    store = open_store(settings.results_url, endpoint_url=settings.s3_endpoint_url)
    assert isinstance(store, S3Store)
    upload_part = store.client.upload_part
    calls = 0

    def failing_second_part(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            from botocore.exceptions import EndpointConnectionError

            raise EndpointConnectionError(endpoint_url="s3")
        return upload_part(**kwargs)

    store.client.upload_part = failing_second_part  # type: ignore[method-assign]
    bucket, key = _object_key(settings, "file-lastpart")
    with pytest.raises(StoreUnavailable), store.writer(content_key("file-lastpart")) as out:
        out.write(b"a" * s3_backend.PART_BYTES)  # one part now
        out.write(b"b" * MiB)  # the last, sent at commit
    assert calls == 2
    assert _open_uploads(s3, bucket, key) == []
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=key)


# submission reads the file line by line --------------------------------------
def test_a_batch_reads_its_file_line_by_line_and_a_bad_line_fails_alone(settings):
    good = [_request_line(n).rstrip(b"\n") for n in range(3)]
    # CRLF line ends, undecodable bytes on one line, a blank line, no final newline.
    data = b"\r\n".join([good[0], b'{"custom_id": "\xff\xfe"', b"", good[1], good[2]])
    with TestClient(create_app(settings), base_url="http://localhost") as http:
        uploaded = http.post(
            "/v1/files", files={"file": ("r.jsonl", data)}, data={"purpose": "batch"}
        ).json()
        body = {
            "input_file_id": uploaded["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch = http.post("/v1/batches", json=body).json()
        with worker_loop(settings):
            done = wait_for_state(
                lambda: http.get(f"/v1/batches/{batch['id']}").json(), {"completed"}
            )
        assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
        output = http.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()
        errors = http.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["r0", "r1", "r2"]
    assert [json.loads(line)["error"]["line"] for line in errors] == [2]
