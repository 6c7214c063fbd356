"""The official ``openai`` client, unchanged, against a real uvicorn server:
upload a file, run a batch through an in-process worker loop, read the output
and error files back."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from tests.integration.test_api_support import (
    FAIL_MARKER,
    api_settings,
    uvicorn_server,
    wait_for_state,
    worker_loop,
)
from vlmq.producers.api.app import create_app
from vlmq.producers.api.openai.batch_records import BatchRecords
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client

KEY = "test-key-0123456789"


def _line(custom_id: str, content: Any, **body: Any) -> str:
    request = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body},
    }
    return json.dumps(request)


def _input_file() -> tuple[bytes, set[str]]:
    good = {f"ok-{n}" for n in range(6)}
    lines = [_line(cid, f"question {cid}", max_tokens=8) for cid in sorted(good)]
    image = [{"type": "image_url", "image_url": {"url": "/m/1.png"}}, {"type": "text", "text": "?"}]
    lines.append(_line("ok-image", image))
    good.add("ok-image")
    # vlmq's own line format is accepted in the same file.
    lines.append(
        json.dumps({"custom_id": "ok-vlmq", "messages": [{"role": "user", "content": "v"}]})
    )
    good.add("ok-vlmq")
    lines.append(_line("will-fail", FAIL_MARKER))
    lines.append(json.dumps({"custom_id": "broken", "body": {"model": "m", "messages": "nope"}}))
    lines.append("{this is not json")
    return ("\n".join(lines) + "\n").encode(), good


@pytest.fixture
def settings(redis_server, moto_server, request):
    return api_settings(redis_server, moto_server, request.node.name, api_keys=[KEY])


@pytest.fixture
def server(settings):
    with uvicorn_server(create_app(settings)) as url:
        yield url


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=20)


def test_openai_batch_round_trip(settings, oai):
    data, good = _input_file()
    uploaded = oai.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data)
    assert uploaded.purpose == "batch" and uploaded.status == "processed"
    assert oai.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert oai.files.content(uploaded.id).content == data

    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "test"},
    )
    assert batch.id.startswith("batch_") and batch.status in ("validating", "in_progress")
    assert batch.metadata == {"run": "test"}
    with worker_loop(settings):
        done = wait_for_state(lambda: oai.batches.retrieve(batch.id), {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts.total == len(good) + 3
    assert done.request_counts.completed == len(good)
    assert done.request_counts.failed == 3
    assert done.completed_at and done.output_file_id and done.error_file_id
    # The validation pass's estimate rides on the batch object (vlmq's own field).
    preflight = done.model_extra["preflight"] if done.model_extra else None
    assert preflight is not None and preflight["lines"] == len(good) + 3
    assert preflight["invalid_lines"] == 2 and preflight["modality"]["image"] == 1
    assert preflight["prompt_tokens"] > 0 and preflight["output_tokens"] > 0

    output = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert {line["custom_id"] for line in output} == good
    first = output[0]
    assert first["response"]["status_code"] == 200 and first["error"] is None
    completion = openai.types.chat.ChatCompletion.model_validate(first["response"]["body"])
    assert completion.choices[0].message.content == f"echo:{first['custom_id']}"

    errors = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line["error"] for line in errors}
    assert by_id["will-fail"]["code"] == "generation_failed"
    assert by_id["broken"]["code"] == "invalid_request"
    assert by_id[None]["code"] == "invalid_request" and by_id[None]["line"] == len(good) + 3
    assert oai.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in {b.id for b in oai.batches.list(limit=10).data}


def test_openai_batch_cancel(settings, oai):
    data, _ = _input_file()
    uploaded = oai.files.create(file=("r.jsonl", data), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for_state(lambda: oai.batches.retrieve(batch.id), {"in_progress"})  # no worker
    cancelling = oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for_state(lambda: oai.batches.retrieve(batch.id), {"cancelled"})
    assert done.cancelled_at and done.request_counts.completed == 0
    assert done.output_file_id is None  # nothing ran
    errors = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    codes = [e["error"]["code"] for e in errors]
    assert codes.count("cancelled") == 9 and codes.count("invalid_request") == 2


def test_a_batch_cancelled_before_its_file_is_read_ends_cancelled(settings, oai):
    uploaded = oai.files.create(file=("r.jsonl", _line("a", "hi").encode()), purpose="batch")
    batch_id = "batch_early"
    # The race by hand: a batch record whose cancel came before its feeder ran.
    records = BatchRecords(Client(settings))
    fields = {
        "id": batch_id,
        "input_file_id": uploaded.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "created_at": str(int(time.time())),
        "metadata": "{}",
        "cancelling_at": str(int(time.time())),
    }
    records.create(batch_id, fields)
    done = wait_for_state(lambda: oai.batches.retrieve(batch_id), {"cancelled"})
    assert done.request_counts.total == 0 and done.error_file_id is None


def test_openai_errors_are_openai_exceptions(oai, server):
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.UnprocessableEntityError):
        oai.files.create(file=("x.jsonl", b"{}\n"), purpose="assistants")
    uploaded = oai.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError):
        oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    anonymous = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.batches.list()


def test_output_files_are_written_when_first_asked_for(settings, oai):
    """A client that asks for the output file before polling the batch gets it."""
    uploaded = oai.files.create(file=("r.jsonl", _line("only", "hi").encode()), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    output_id = f"file-{batch.id}-output"
    with pytest.raises(openai.ConflictError):
        oai.files.content(output_id)
    with worker_loop(settings):
        deadline = time.monotonic() + 30
        while True:
            try:
                text = oai.files.content(output_id).text
                break
            except openai.ConflictError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    assert json.loads(text)["custom_id"] == "only"


def test_a_feeder_that_died_is_resumed_without_duplicates(settings, oai):
    lines = [_line(f"r{n}", f"question {n}") for n in range(5)]
    uploaded = oai.files.create(file=("r.jsonl", "\n".join(lines).encode()), purpose="batch")
    client = Client(settings)
    batch_id = "batch_resumed"
    fields = {
        "id": batch_id,
        "input_file_id": uploaded.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "created_at": str(int(time.time())),
        "metadata": "{}",
    }
    BatchRecords(client).create(batch_id, fields)
    # The first feeder got two lines in, then its process died (no lock left, job unsealed).
    submit_jsonl(client, lines[:2], batch_id, chunk=1)
    client.redis.hset(client.keys.job(batch_id), "sealed", "0")
    client.redis.hdel(client.keys.job(batch_id), "finished_at")
    with worker_loop(settings):
        done = wait_for_state(lambda: oai.batches.retrieve(batch_id), {"completed"})
    assert done.request_counts.total == 5 and done.request_counts.completed == 5
    output = oai.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == [f"r{n}" for n in range(5)]


def test_a_mostly_invalid_file_fails_validation_and_nothing_runs(settings, oai):
    data = ("{broken\n" * 10 + _line("only", "hi") + "\n").encode()
    uploaded = oai.files.create(file=("bad.jsonl", data), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for_state(lambda: oai.batches.retrieve(batch.id), {"failed"})
    assert done.errors is not None and done.errors.data
    assert "10 of 11 lines are invalid" in str(done.errors.data[0].message)
    # The invalid lines are its failures; the valid one never ran.
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 10)
    assert Client(settings).redis.llen("vlmq.text.job." + batch.id) == 0
