"""The worker core against a real Redis and S3 server, in-process: task ids the pull script
and Python agree on, webhooks at least once and only signed, memory headroom in the API."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.test_fleet_loop import RecordingEngine, Running, make_loop
from tests.support.services import wait_until
from tests.support.webhook_receiver import HookReceiver
from tests.support.without_torch import run_without_torch
from vlmq.config.ids import valid_id
from vlmq.config.keys import Keys
from vlmq.config.settings import ApiSettings, Settings, WebhookSettings
from vlmq.config.wire import encode_message
from vlmq.producers.api.app import create_app
from vlmq.producers.client import Client
from vlmq.workers.fleet.webhooks import WebhookSender

_MESSAGE = {"messages": [{"role": "user", "content": "hello"}]}


def _with_header_id(raw: str, header_id: str) -> str:
    message = json.loads(raw)
    message["headers"]["id"] = header_id
    return json.dumps(message)


def _invalid(raw: str) -> str:
    return "invalid-" + hashlib.sha1(raw.encode()).hexdigest()


def test_the_pull_script_and_python_agree_on_the_task_id(settings: Settings) -> None:
    client = Client(settings)
    good = encode_message(_MESSAGE, "plain-id.1", "vlmq.text")
    body = base64.b64encode(json.dumps([[], {"request": _MESSAGE}, {}]).encode()).decode()
    cases = {
        # raw entry -> the id both sides must use, and whether it runs
        good: ("plain-id.1", "succeeded"),
        _with_header_id(good, 'quote"inside'): (None, "failed"),
        _with_header_id(good, "back\\slash"): (None, "failed"),
        _with_header_id(good, "x" * 129): (None, "failed"),
        _with_header_id(good, "colon:id"): (None, "failed"),
        # JSON escapes the Lua pattern cannot read: decoded, a plain id; both sides agree.
        good.replace('"id":"plain-id.1"', '"id":"\\u0041bc"', 1): ("Abc", "succeeded"),
        # An "id" in clear text before the headers names nothing: the header id and the
        # delivery tag are the first message's, so it is that message again (a copy,
        # re-serialised), dropped while that one is held: it runs once.
        json.dumps({"id": "spoof", **json.loads(good)}): ("plain-id.1", "succeeded"),
        # No JSON, no headers, a number for an id.
        "not even json": (None, "failed"),
        json.dumps({"body": body, "content-type": "application/json"}): (None, "failed"),
        _with_header_id(good, 42): (None, "failed"),  # type: ignore[arg-type]
    }
    for raw in cases:
        client.redis.lpush("vlmq.text", raw)
    expected = {(task or _invalid(raw)): state for raw, (task, state) in cases.items()}
    with Running(make_loop(settings, RecordingEngine(), ("text",))):
        wait_until(
            lambda: all(client.status(t)["state"] == s for t, s in expected.items()),
            what="every message settled under its id",
        )
    for task, state in expected.items():
        status = client.status(task)
        if state == "failed":
            assert status["error_code"] == "invalid_request", (task, status)
        assert client.result(task)["id"] == task  # a result record under the same id


def test_the_lua_id_rule_is_the_schema_pattern(settings: Settings) -> None:
    """lua/common.lua plain() and config/ids.py accept exactly the same ids."""
    client = Client(settings)
    intake = client.state.intake("text")
    ids = ["a", "A-b_c.9", "x" * 128, "x" * 129, "a b", "a:b", "é", "a/b", "", "a\tb", "-."]
    ids += [".", "..", "...", ".a."]
    for task_id in ids:
        client.redis.lpush("vlmq.text", encode_message(_MESSAGE, task_id, "vlmq.text"))
    pulled = [d.task_id for d in intake.pull(len(ids), 0).deliveries]
    lua_plain = [not task.startswith("invalid-") for task in pulled]
    python_plain = [valid_id(task_id) for task_id in ids]
    assert lua_plain == python_plain


def test_webhooks_need_a_signing_secret(settings: Settings) -> None:
    receiver = HookReceiver()
    client = Client(settings)
    try:
        conversation = [{"role": "user", "content": "x"}]
        client.submit_many([conversation], job_id="unsigned", webhook_url=receiver.url)
        hooks = WebhookSettings(allow_private_addresses=True)  # no secret
        loop = make_loop(settings, RecordingEngine(), reap_interval_s=0.05, webhooks=hooks)
        with Running(loop):
            wait_until(
                lambda: client.redis.hget(Keys().job("unsigned"), "webhook_status"),
                what="the refusal recorded",
            )
        status = client.redis.hget(Keys().job("unsigned"), "webhook_status")
        assert status == "refused: no signing secret"
        assert receiver.requests_seen == 0
    finally:
        receiver.close()


def test_a_stopping_sender_gives_its_event_back(settings: Settings) -> None:
    receiver = HookReceiver(stall=1, stall_s=30)
    client = Client(settings)
    state = client.state
    try:
        conversation = [{"role": "user", "content": "x"}]
        client.submit_many([conversation], job_id="handed-over", webhook_url=receiver.url)
        state.redis.lpush(Keys().events(), "handed-over")
        hooks = WebhookSettings(secret="k", allow_private_addresses=True, timeout_s=1)
        first = WebhookSender(state, hooks, workers=1)
        assert first.poll() == 1
        wait_until(lambda: receiver.requests_seen == 1, what="the first attempt under way")
        first.close()  # stops after the attempt under way; gives the event back
        wait_until(lambda: client.redis.llen(Keys().events()) == 1, what="the event returned")
        second = WebhookSender(state, hooks, workers=1)
        assert second.poll() == 1
        wait_until(lambda: receiver.received, what="delivery by the second sender")
        second.close()
        assert client.redis.zcard(Keys().events_leased()) == 0
    finally:
        receiver.close()


class _TLSHook(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []  # noqa: RUF012 - a test handler's shared record

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        _TLSHook.hits.append(self.headers["Host"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tls_hook(tmp_path: Path) -> Iterator[tuple[int, ssl.SSLContext]]:
    from tests.unit.test_media_fetch import tls_material

    cert_pem, key_pem = tls_material.__wrapped__()  # type: ignore[attr-defined]
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TLSHook)
    server.socket = server_context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trust = ssl.create_default_context(cadata=cert_pem.decode())
    _TLSHook.hits = []
    yield server.server_port, trust
    server.shutdown()


def test_https_webhooks_go_to_the_checked_address(
    settings: Settings, tls_hook: tuple[int, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: the name resolves to the checked address once, elsewhere after; the
    TLS connection still goes where the check said (SNI and certificate for the name)."""
    port, trust = tls_hook
    answers = iter(["127.0.0.1", "203.0.113.9"])  # the second answer is never asked for
    real = socket.getaddrinfo

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "media.test":
            address = next(answers)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    hooks = WebhookSettings(secret="k", allow_private_addresses=True, timeout_s=5)
    sender = WebhookSender(Client(settings).state, hooks, tls_context=trust)
    assert sender._post(f"https://media.test:{port}/hook", b"{}") == 204
    assert _TLSHook.hits == [f"media.test:{port}"]
    sender.close()


@pytest.mark.private_redis
def test_the_api_refuses_work_by_redis_memory(settings: Settings, redis_server: Any) -> None:
    settings = settings.model_copy(update={"api": ApiSettings(max_memory_share=0.5)})
    http = TestClient(
        create_app(settings), base_url="http://localhost", raise_server_exceptions=False
    )
    redis = redis_server.connect()
    used = int(redis.info("memory")["used_memory"])
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        redis.config_set("maxmemory", used * 3 // 2)  # about two thirds full
        refused = http.post("/v1/tasks", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "broker_full"
        assert int(refused.headers["Retry-After"]) > 0
        redis.config_set("maxmemory", 0)
        wait_until(lambda: http.post("/v1/tasks", json=body).status_code == 202, what="room")
    finally:
        redis.config_set("maxmemory", 0)
        http.close()


_NOOP_WITHOUT_TORCH = """
import threading, time
from vlmq.broker.connection import create_redis
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.stores.urls import open_store
from vlmq.workers.engine.noop import NoopEngine
from vlmq.workers.fleet.service import compose_loop

settings = Settings()
client = Client(settings)
task = client.submit({"messages": [{"role": "user", "content": "hello"}]})
store = open_store(settings.results_url, settings.s3_endpoint_url)
engine = NoopEngine(0.0).setup()
loop = compose_loop(settings, ["text"], engine, "noop", create_redis(settings), store)
threading.Thread(target=loop.run_forever, daemon=True).start()
deadline = time.monotonic() + 60
while client.status(task).get("state") != "succeeded" and time.monotonic() < deadline:
    time.sleep(0.05)
loop.stop()
print(client.status(task).get("state"), loop.parts.pricing.gpu)
"""


def test_a_noop_worker_runs_without_torch(settings: Settings) -> None:
    """The noop engine (the fault drills' and benches' workers) needs no torch: a worker
    that imported it only to name its GPU paid ~3 s of CPU a start."""
    done = run_without_torch(_NOOP_WITHOUT_TORCH, settings)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["succeeded", "cpu"], done.stderr[-3000:]
