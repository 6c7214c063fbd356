"""The API's gate and failure answers: keys, body cap, rate limit, bounded
queue, readiness, and error bodies that never leak internals."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.test_api_support import api_settings
from vlmq.broker import layouts
from vlmq.config import wire
from vlmq.config.keys import Keys
from vlmq.config.schemas import MAX_PARTS
from vlmq.producers.api.app import create_app
from vlmq.producers.api.tasks import MAX_BATCH_PARTS
from vlmq.producers.client import Client

TASK = {"messages": [{"role": "user", "content": "hi"}]}
# Keys are at least min_key_length (16) characters.
KEY_ONE, KEY_TWO = "key-one-0123456789", "key-two-0123456789"


def _app(redis_server, moto_server, request, **api):
    return create_app(api_settings(redis_server, moto_server, request.node.name, **api))


@pytest.fixture
def make_http(redis_server, moto_server, request):
    clients = []

    def make(**api: Any) -> TestClient:
        client = TestClient(
            _app(redis_server, moto_server, request, **api),
            raise_server_exceptions=False,
            base_url="http://localhost",
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _error(reply: Any, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


def test_api_keys(make_http):
    http = make_http(api_keys=[KEY_ONE, KEY_TWO])
    missing = http.post("/v1/tasks", json=TASK)
    _error(missing, 401, "unauthorized")
    assert missing.headers["www-authenticate"] == "Bearer"
    _error(
        http.post("/v1/tasks", json=TASK, headers=_bearer("wrong-key-0123456789")),
        401,
        "unauthorized",
    )
    _error(http.get("/v1/batches", headers={"Authorization": "Basic a2V5"}), 401, "unauthorized")
    assert http.post("/v1/tasks", json=TASK, headers=_bearer(KEY_TWO)).status_code == 202
    assert http.get("/v1/tasks/x", headers=_bearer(KEY_ONE)).status_code == 404
    # Probes and the API description stay public.
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert http.get(path).status_code == 200
    assert http.get("/metrics").status_code == 401


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_body_cap_by_content_length_and_while_streaming(make_http):
    http = make_http(max_body_bytes=2000, max_file_bytes=3000)
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    _error(http.post("/v1/tasks", json=big), 413, "body_too_large")

    def chunks():  # no Content-Length: the cap must hold while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    streamed = http.post(
        "/v1/tasks", content=chunks(), headers={"content-type": "application/json"}
    )
    _error(streamed, 413, "body_too_large")
    upload = http.post(
        "/v1/files", files={"file": ("a.jsonl", b"z" * 4000)}, data={"purpose": "batch"}
    )
    _error(upload, 413, "body_too_large")
    small = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
    assert small.status_code == 200
    client: Client = http.app.state.ctx.client
    assert client.redis.llen("vlmq.text.interactive") == 0


def test_rate_limit_per_tenant_with_retry_after(make_http):
    http = make_http(
        tenant_keys={KEY_ONE: "team-a", KEY_TWO: "team-b"}, rate_limit_per_s=0.5, rate_limit_burst=3
    )
    answers = [http.get("/v1/tasks/x", headers=_bearer(KEY_ONE)).status_code for _ in range(3)]
    assert answers == [404, 404, 404]
    limited = http.get("/v1/tasks/x", headers=_bearer(KEY_ONE))
    _error(limited, 429, "rate_limited")
    assert 1 <= int(limited.headers["retry-after"]) <= 2
    # Another tenant has its own bucket.
    assert http.get("/v1/tasks/x", headers=_bearer(KEY_TWO)).status_code == 404
    assert http.get("/healthz").status_code == 200  # probes are never limited


def test_keys_of_one_tenant_share_its_bucket(make_http):
    http = make_http(api_keys=[KEY_ONE, KEY_TWO], rate_limit_per_s=0.01, rate_limit_burst=2)
    assert http.get("/v1/tasks/x", headers=_bearer(KEY_ONE)).status_code == 404
    assert http.get("/v1/tasks/x", headers=_bearer(KEY_TWO)).status_code == 404
    _error(http.get("/v1/tasks/x", headers=_bearer(KEY_ONE)), 429, "rate_limited")
    _error(http.get("/v1/tasks/x", headers=_bearer(KEY_TWO)), 429, "rate_limited")


def test_bounded_queue(make_http):
    http = make_http(max_queue_depth=3)
    assert [http.post("/v1/tasks", json=TASK).status_code for _ in range(3)] == [202] * 3
    full = http.post("/v1/tasks", json=TASK)
    _error(full, 429, "queue_full")
    assert int(full.headers["retry-after"]) >= 1
    # Another class has its own bound.
    image = {"messages": [{"role": "user", "content": [{"type": "image", "image": "/a.png"}]}]}
    assert http.post("/v1/tasks", json=image).status_code == 202
    _error(http.post("/v1/tasks:batch", json={"requests": [image] * 3}), 429, "queue_full")
    client: Client = http.app.state.ctx.client
    assert client.redis.llen("vlmq.text.interactive") == 3
    # A new OpenAI batch is refused while any class is full (its classes are unknown yet).
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}
    _error(http.post("/v1/batches", json=body), 429, "queue_full")


def test_bounded_queue_counts_bulk_job_lists(make_http):
    http = make_http(max_queue_depth=4)
    client: Client = http.app.state.ctx.client
    client.submit_many([TASK] * 4)  # lands in the job's own bulk list
    _error(http.post("/v1/tasks", json=TASK), 429, "queue_full")


@pytest.mark.private_redis
def test_readyz_and_requests_when_redis_is_down(make_http, redis_server):
    http = make_http()
    assert http.get("/readyz").status_code == 200
    redis_server.kill()
    ready = http.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"] == {
        "redis": "unavailable",
        "store": "ok",
        "layout": "unavailable",
    }
    assert ready.json()["error"]["code"] == "not_ready"
    assert http.get("/healthz").status_code == 200
    _error(http.post("/v1/tasks", json=TASK), 503, "broker_unavailable")


def test_an_api_server_older_than_the_task_layout_in_force_is_not_ready(make_http):
    """After the fleet-wide layout switch (vlmq/broker/layouts.py) an API server not yet
    updated answers 503 and says why, and its readiness sends traffic to the others."""
    http = make_http()
    http.app.state.ctx.client.redis.set(Keys().layout(), layouts.NEWEST + 1)
    ready = http.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["layout"] == "unavailable"
    error = _error(http.post("/v1/tasks", json=TASK), 503, "layout_unreadable")
    assert "update this process" in error["message"]


def test_unexpected_errors_leak_nothing(make_http, monkeypatch):
    http = make_http()
    tasks = http.app.state.ctx.client.state.tasks

    def explode(task_id):
        raise RuntimeError("secret internals at 0xdeadbeef")

    monkeypatch.setattr(tasks, "get", explode)
    reply = http.get("/v1/tasks/anything")
    error = _error(reply, 500, "internal_error")
    assert error["message"] == "internal error"
    for leak in ("secret", "Traceback", "RuntimeError", "0xdeadbeef"):
        assert leak not in reply.text


def test_method_not_allowed_is_json(make_http):
    _error(make_http().delete("/v1/tasks"), 405, "method_not_allowed")


# bodies bounded by what a worker takes, and by what they build ----------------------------
# The largest message the fleet's workers take, in these tests.
MESSAGE_BYTES = 64 * 1024


@pytest.fixture
def limited_http(redis_server, moto_server, request):
    # No worker runs: a chat body that were queued would answer 504 at once.
    settings = api_settings(
        redis_server, moto_server, request.node.name, max_body_objects=200, sync_timeout_s=1
    )
    fleet = settings.fleet.model_copy(update={"max_message_bytes": MESSAGE_BYTES})
    client = TestClient(
        create_app(settings.model_copy(update={"fleet": fleet})),
        raise_server_exceptions=False,
        base_url="http://localhost",
    )
    yield client
    client.close()


def _text(chars: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x" * chars}]}


def _chat(chars: int) -> dict[str, Any]:
    return {"model": "m", **_text(chars)}


def _nothing_queued(http: Any) -> None:
    redis = http.app.state.ctx.client.redis
    assert not redis.keys("vlmq.*") and not redis.keys("vlmq:task:*")
    assert not redis.keys("vlmq:job:*")


def test_task_and_chat_bodies_are_bounded_by_what_a_worker_takes(limited_http):
    http = limited_http
    # Larger than a worker's message: refused before it is parsed, by its Content-Length or
    # while it streams in.
    over = _error(http.post("/v1/tasks", json=_text(MESSAGE_BYTES)), 413, "body_too_large")
    assert f"{MESSAGE_BYTES:,} bytes" in over["message"]
    chat = _error(
        http.post("/v1/chat/completions", json=_chat(MESSAGE_BYTES)), 413, "body_too_large"
    )
    assert chat["type"] == "invalid_request_error"  # OpenAI's error object

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"y" * MESSAGE_BYTES
        yield b'"}]}'

    streamed = http.post(
        "/v1/tasks", content=chunks(), headers={"content-type": "application/json"}
    )
    _error(streamed, 413, "body_too_large")
    # A smaller body whose message (base64: 4/3 of it) a worker would not take: refused once
    # built, before anything is queued; a batch with one such item queues nothing.
    near = MESSAGE_BYTES * 7 // 8
    _error(http.post("/v1/tasks", json=_text(near)), 413, "request_too_large")
    chat = _error(http.post("/v1/chat/completions", json=_chat(near)), 413, "request_too_large")
    assert chat["type"] == "invalid_request_error"
    batch = {"requests": [_text(10), _text(near)], "lane": "bulk"}
    refused = _error(http.post("/v1/tasks:batch", json=batch), 413, "request_too_large")
    assert refused["message"].startswith("item 1:")
    _nothing_queued(http)
    # What fits is taken.
    fits = wire.largest_request(MESSAGE_BYTES) - 400
    assert http.post("/v1/tasks", json=_text(fits)).status_code == 202
    (message,) = http.app.state.ctx.client.redis.lrange("vlmq.text.interactive", 0, -1)
    assert MESSAGE_BYTES - 2048 < len(message) <= MESSAGE_BYTES


def test_a_body_is_bounded_in_what_it_builds(limited_http):
    http = limited_http
    # More JSON objects and arrays than max_body_objects (200): refused while parsing.
    turns = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 250}
    error = _error(http.post("/v1/chat/completions", json=turns), 413, "body_too_large")
    assert "more than 200 JSON objects and arrays" in error["message"]
    # More content parts than a request takes: refused before any turn is built, naming the
    # field (400 on the OpenAI route, 422 on vlmq's).
    parts = [{"role": "user", "content": ["x"] * (MAX_PARTS + 1)}]
    error = _error(http.post("/v1/tasks", json={"messages": parts}), 422, "invalid_request")
    assert error["param"] == "messages" and f"at most {MAX_PARTS}" in error["message"]
    chat = http.post("/v1/chat/completions", json={"model": "m", "messages": parts})
    assert _error(chat, 400, "invalid_request")["param"] == "messages"
    # A batch's parts in all, whatever its number of requests.
    per_item = [{"role": "user", "content": ["x"] * MAX_PARTS}]
    batch = {"requests": [{"messages": per_item}] * (MAX_BATCH_PARTS // MAX_PARTS + 1)}
    error = _error(http.post("/v1/tasks:batch", json=batch), 422, "invalid_request")
    assert f"at most {MAX_BATCH_PARTS}" in error["message"]
    _nothing_queued(http)
