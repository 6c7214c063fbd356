"""Issue 13's mixed batch through the OpenAI Batch API, with the official ``openai`` client
against a real uvicorn server, real Redis, moto S3 and an in-process worker loop running the
real engine on the tiny qwen2_5_vl checkpoint: every output line is a chat completion the
client's own type accepts and honours its line (``check_record``); invalid constraints land
in the error file, naming their field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.test_api_support import (
    api_settings,
    uvicorn_server,
    wait_for_state,
    worker_loop,
)
from tests.support.samples import save_image
from tests.support.structured import check_record, mixed_lines, openai_line
from vlmq.config.settings import EngineSettings, Settings
from vlmq.producers.api.app import create_app
from vlmq.workers.engine import Engine
from vlmq.workers.media.fleet import fleet_loader

KEY = "test-key-0123456789"


def _request(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return openai_line({"custom_id": custom_id, "messages": messages, **body})


# Refused when the file is read (the producer-side check): an error-file line, never a task.
BAD_REGEX = _request("bad_regex", "When?", regex="(a")
# Passes the producer-side check (no tokenizer); the worker's tokenizer refuses it.
BAD_GRAMMAR = _request("bad_grammar", "Say x.", grammar='start: "x" <|no_such_token|>')


@pytest.fixture(scope="module")
def tiny_model(checkpoint: Any) -> Path:
    return Path(checkpoint("qwen2_5_vl"))


@pytest.fixture
def media(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    save_image(folder / "a.png", size=(64, 64), seed=1)
    return folder


@pytest.fixture
def settings(
    redis_server: Any, moto_server: Any, request: pytest.FixtureRequest, media: Path
) -> Settings:
    base = api_settings(redis_server, moto_server, request.node.name, api_keys=[KEY])
    # The image is read where it is: the media folder is a local root of both sides.
    return base.model_copy(
        update={"media": base.media.model_copy(update={"local_roots": [str(media)]})}
    )


@pytest.fixture
def server(settings: Settings) -> Iterator[str]:
    with uvicorn_server(create_app(settings)) as url:
        yield url


@pytest.fixture
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=20)


def _engine(settings: Settings, model: Path) -> Engine:
    """The engine as ``vlmq worker`` builds it (its media allowlist from the settings)."""
    loader = fleet_loader(settings)
    return Engine(str(model), EngineSettings(), loader.settings, loader=loader).setup()


def _lines(path: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.splitlines()]


def test_the_mixed_batch_through_the_openai_batch_api(
    settings: Settings, oai: openai.OpenAI, server: str, media: Path, tiny_model: Path
) -> None:
    good = [openai_line(line) for line in mixed_lines(str(media / "a.png"))]
    lines = [*good, BAD_REGEX, BAD_GRAMMAR]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = oai.files.create(file=("structured.jsonl", data), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    engine = _engine(settings, tiny_model)
    try:
        with worker_loop(settings, engine):
            done = wait_for_state(
                lambda: oai.batches.retrieve(batch.id), {"completed", "failed"}, timeout=240
            )
    finally:
        engine.close()
    assert done.status == "completed", done.errors
    counts = done.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(good), 2)
    assert done.output_file_id and done.error_file_id

    output = _lines(oai.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == sorted(g["custom_id"] for g in good)
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        completion = openai.types.chat.ChatCompletion.model_validate(body)
        assert completion.object == "chat.completion" and completion.model == str(tiny_model)
        check_record(line["custom_id"], body)

    errors = {
        line["custom_id"]: line for line in _lines(oai.files.content(done.error_file_id).text)
    }
    assert sorted(errors) == ["bad_grammar", "bad_regex"]
    for custom_id, field in (("bad_regex", "regex"), ("bad_grammar", "grammar")):
        line = errors[custom_id]
        assert line["response"] is None
        assert line["error"]["code"] == "invalid_request", line
        assert field in line["error"]["message"], line
    assert errors["bad_grammar"]["error"]["message"].startswith("grammar:")

    # Each task's result, read back one by one as a chat completion (format=openai), is the
    # same completion as its batch output line.
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=20) as http:
        for line in output:
            task_id = line["response"]["request_id"]
            reply = http.get(f"/v1/tasks/{task_id}/result", params={"format": "openai"})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            openai.types.chat.ChatCompletion.model_validate(body)
            check_record(line["custom_id"], body)
            assert body["choices"] == line["response"]["body"]["choices"]
            record = http.get(f"/v1/tasks/{task_id}/result").json()
            check_record(line["custom_id"], record)  # and the vlmq record (with ``parsed``)
