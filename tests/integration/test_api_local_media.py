"""The HTTP API never reads its own disk on a caller's say, on real Redis and moto's S3: a
local path or ``file://`` URL in ``POST /v1/tasks`` (with a token quota, so its estimate is
taken) or in an OpenAI batch (whose pre-flight is on by default) is never opened. A FIFO or
``/dev/ptmx`` cannot pin a request thread, and whether a path exists, or how big the image
there is, changes nothing in the answer: not the status, not the tokens counted.

Written against public behaviour only (the routes), so the same file runs on code before the
rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support.blocking import fifo, within
from tests.support.samples import save_image
from vlmq.config.settings import Settings, TenantQuota, TenantSettings
from vlmq.producers.api.app import create_app
from vlmq.producers.client import Client

PROMPT_S = 20.0  # what "at once" may take on a loaded machine; a blocked read never ends


def _settings(redis_server: Any, moto_server: Any, name: str) -> Settings:
    bucket = f"local-media-{abs(hash(name)) % 10**8}"
    moto_server.s3().create_bucket(Bucket=bucket)
    return Settings(
        model="/nonexistent-model",  # the estimate's defaults: no model files needed
        redis_url=redis_server.url,
        results_url=f"s3://{bucket}/runs",
        s3_endpoint_url=moto_server.endpoint,
        tenants=TenantSettings(default_quota=TenantQuota(max_queued_tokens=10**9)),
    )


@pytest.fixture
def settings(redis_server: Any, moto_server: Any, request: Any) -> Settings:
    return _settings(redis_server, moto_server, request.node.name)


@pytest.fixture
def http(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        yield client


def _task(*parts: Any) -> dict[str, Any]:
    question = {"type": "text", "text": "what is this?"}
    return {"messages": [{"role": "user", "content": [*parts, question]}]}


def _image(source: str) -> dict[str, str]:
    return {"type": "image", "image": source}


def _queued_tokens(settings: Settings) -> int:
    client = Client(settings)
    raw: dict[str, str] = client.redis.hgetall(client.keys.quota("default"))  # type: ignore[assignment]
    return int(raw.get("tokens", 0))


def test_a_fifo_named_by_a_caller_does_not_pin_a_request_thread(
    settings: Settings, http: TestClient, tmp_path: Path
) -> None:
    with fifo(tmp_path / "pipe") as pipe:
        body = _task(_image(str(pipe)), {"type": "video", "video": f"file://{pipe}"})
        done, reply = within(PROMPT_S, lambda: http.post("/v1/tasks", json=body))
        assert done, "POST /v1/tasks blocked opening a FIFO the caller named"
    assert reply.status_code == 202, reply.text


def test_dev_ptmx_named_by_a_caller_does_not_pin_a_request_thread(settings: Settings) -> None:
    """/dev/ptmx opens and then blocks every read: the server runs in a process of its own,
    killed with the blocked read rather than leaving a thread pinned here."""
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx here")
    code = (
        "import json, sys\n"
        "from fastapi.testclient import TestClient\n"
        "from vlmq.config.settings import Settings\n"
        "from vlmq.producers.api.app import create_app\n"
        "settings = Settings.model_validate_json(sys.argv[1])\n"
        "body = {'messages': [{'role': 'user', 'content': [\n"
        "    {'type': 'image', 'image': '/dev/ptmx'}, {'type': 'text', 'text': '?'}]}]}\n"
        "with TestClient(create_app(settings), base_url='http://localhost') as http:\n"
        "    reply = http.post('/v1/tasks', json=body)\n"
        "print(reply.status_code)\n"
    )
    command = [sys.executable, "-c", code, settings.model_dump_json()]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("POST /v1/tasks blocked reading /dev/ptmx")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "202"


def test_whether_a_path_exists_changes_nothing_a_caller_sees(
    settings: Settings, http: TestClient, tmp_path: Path
) -> None:
    save_image(tmp_path / "small.png", size=(32, 32), seed=1)
    save_image(tmp_path / "large.png", size=(1400, 1000), seed=2)
    (tmp_path / "secret.png").write_bytes(b"API_KEY=do-not-leak\n")
    named = [
        str(tmp_path / "small.png"),
        str(tmp_path / "large.png"),
        f"file://{tmp_path / 'large.png'}",
        str(tmp_path / "secret.png"),
        str(tmp_path / "no-such-file.png"),
        str(tmp_path),  # a directory
        "/proc/self/environ",
        "https://example.com/not-fetched.png",  # a size nobody knows here either
    ]
    answers: dict[str, tuple[int, int]] = {}
    for source in named:
        before = _queued_tokens(settings)
        reply = http.post("/v1/tasks", json=_task(_image(source)))
        answers[source] = (reply.status_code, _queued_tokens(settings) - before)
    assert len(set(answers.values())) == 1, answers
    assert next(iter(answers.values()))[0] == 202


def _batch_file(http: TestClient, source: str) -> str:
    line = {
        "custom_id": "only",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": source}},
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
            "max_tokens": 8,
        },
    }
    files = {"file": ("in.jsonl", (json.dumps(line) + "\n").encode(), "application/jsonl")}
    reply = http.post("/v1/files", files=files, data={"purpose": "batch"})
    assert reply.status_code == 200, reply.text
    file_id: str = reply.json()["id"]
    return file_id


def _batch_preflight(http: TestClient, file_id: str) -> dict[str, Any]:
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    reply = http.post("/v1/batches", json=body)
    assert reply.status_code == 200, reply.text
    batch_id = reply.json()["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        if batch.get("preflight"):
            preflight: dict[str, Any] = batch["preflight"]
            return preflight
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never got its pre-flight estimate: {batch}")


def test_an_openai_batchs_preflight_never_reads_a_path_a_line_names(
    settings: Settings, http: TestClient, tmp_path: Path
) -> None:
    save_image(tmp_path / "large.png", size=(1400, 1000), seed=2)
    named = [
        str(tmp_path / "large.png"),
        f"file://{tmp_path / 'large.png'}",
        str(tmp_path / "no-such-file.png"),
        "/proc/self/environ",
    ]
    estimates = {source: _batch_preflight(http, _batch_file(http, source)) for source in named}
    assert len({json.dumps(e, sort_keys=True) for e in estimates.values()}) == 1, estimates
    assert next(iter(estimates.values()))["predicted_failures"] == 0
