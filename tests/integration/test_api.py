"""The HTTP API's task and job routes against a real Redis, moto S3 and an
in-process worker loop."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.integration.test_api_support import (
    FAIL_MARKER,
    api_settings,
    wait_for_state,
    worker_loop,
)
from vlmq.producers.api.app import create_app


@pytest.fixture
def settings(redis_server, moto_server, request):
    return api_settings(redis_server, moto_server, request.node.name)


@pytest.fixture
def http(settings):
    with TestClient(
        create_app(settings), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        yield client


def _text(question: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], **fields}


def _image(n: int) -> dict[str, Any]:
    parts = [{"type": "image", "image": f"/media/{n}.png"}, {"type": "text", "text": "what?"}]
    return {"messages": [{"role": "user", "content": parts}], "custom_id": f"img-{n}"}


def test_submit_status_result_round_trip(settings, http):
    reply = http.post("/v1/tasks", json=_text("hello", custom_id="c1", max_new_tokens=8))
    assert reply.status_code == 202
    accepted = reply.json()
    assert accepted["status"] == "queued" and accepted["modality"] == "text"
    assert accepted["status_url"] == f"/v1/tasks/{accepted['id']}"
    assert http.get(accepted["status_url"]).json()["status"] == "queued"
    pending = http.get(f"{accepted['status_url']}/result")
    assert pending.status_code == 409 and pending.json()["error"]["code"] == "not_finished"
    with worker_loop(settings):
        status = wait_for_state(
            lambda: http.get(accepted["status_url"]).json(), {"succeeded", "failed"}
        )
    assert status["status"] == "succeeded" and status["custom_id"] == "c1"
    assert status["result_url"] == f"/v1/tasks/{accepted['id']}/result"
    record = http.get(status["result_url"]).json()
    assert record["output"] == "echo:c1" and record["id"] == accepted["id"]
    # The interactive lane: the message went to vlmq.text.interactive.
    assert http.app.state.ctx.client.state.tasks.get(accepted["id"])["queue"].endswith(
        ".interactive"
    )


def test_openai_chat_body_is_accepted(http):
    body = {
        "model": "any",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/x.png"}}]},
        ],
        "max_tokens": 16,
        "temperature": 0.2,
    }
    reply = http.post("/v1/tasks", json=body)
    assert reply.status_code == 202, reply.text
    assert reply.json()["modality"] == "image"
    streamed = http.post("/v1/tasks", json={**body, "stream": True})
    assert streamed.status_code == 422
    assert streamed.json()["error"]["message"].startswith("stream:")


def test_presigned_result_url_fetches_the_object(settings, http):
    task_id = http.post("/v1/tasks", json=_text("hi", custom_id="p")).json()["id"]
    with worker_loop(settings):
        wait_for_state(lambda: http.get(f"/v1/tasks/{task_id}").json(), {"succeeded"})
    signed = http.get(f"/v1/tasks/{task_id}/result", params={"presign": "true"}).json()["url"]
    assert signed.startswith(settings.s3_endpoint_url)
    assert json.loads(httpx.get(signed).content)["output"] == "echo:p"


def test_cancel_a_queued_task_and_not_a_finished_one(settings, http):
    task_id = http.post("/v1/tasks", json=_text("later")).json()["id"]
    reply = http.post(f"/v1/tasks/{task_id}/cancel").json()
    assert reply == {"id": task_id, "cancelled": True, "status": "cancelled"}
    again = http.post(f"/v1/tasks/{task_id}/cancel").json()
    assert again["cancelled"] is False
    result = http.get(f"/v1/tasks/{task_id}/result").json()
    assert result["status"] == "cancelled" and result["error"]["code"] == "cancelled"
    with worker_loop(settings) as engine:
        done = http.post("/v1/tasks", json=_text("now")).json()["id"]
        wait_for_state(lambda: http.get(f"/v1/tasks/{done}").json(), {"succeeded"})
    assert task_id not in engine.ran
    assert http.post(f"/v1/tasks/{done}/cancel").json()["cancelled"] is False


def test_unknown_ids_are_404_not_found(http):
    for path in ("/v1/tasks/nope", "/v1/tasks/nope/result", "/v1/jobs/nope"):
        reply = http.get(path)
        assert reply.status_code == 404
        assert reply.json() == {
            "error": {
                "code": "not_found",
                "message": reply.json()["error"]["message"],
                "type": "not_found_error",
                "param": None,
            }
        }
    assert http.post("/v1/tasks/nope/cancel").status_code == 404
    unrouted = http.get("/v2/elsewhere")
    assert unrouted.status_code == 404 and unrouted.json()["error"]["code"] == "not_found"


def test_tasks_batch_round_trip_with_a_failure(settings, http):
    items = [_text(f"q{n}", custom_id=f"t{n}") for n in range(5)] + [_image(1)]
    items.append(_text(FAIL_MARKER, custom_id="bad"))
    reply = http.post("/v1/tasks:batch", json={"requests": items, "name": "seven"})
    assert reply.status_code == 202, reply.text
    batch = reply.json()
    assert batch["count"] == 7 and len(set(batch["task_ids"])) == 7
    with worker_loop(settings):
        job = wait_for_state(
            lambda: http.get(batch["status_url"]).json(), {"completed"}, key="state"
        )
    assert job["counts"]["succeeded"] == 6 and job["counts"]["failed"] == 1, job
    failed = http.get(f"/v1/tasks/{batch['task_ids'][-1]}").json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"


def test_tasks_batch_is_all_or_nothing(settings, http):
    items = [_text("fine"), {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}]
    reply = http.post("/v1/tasks:batch", json={"requests": items})
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and error["message"].startswith("requests.1:")
    client = http.app.state.ctx.client
    assert client.redis.llen("vlmq.text") == 0 and not client.redis.keys("vlmq:task:*")


def test_tasks_batch_size_cap(redis_server, moto_server):
    settings = api_settings(redis_server, moto_server, "cap", max_batch_items=3)
    with TestClient(create_app(settings), base_url="http://localhost") as http:
        reply = http.post("/v1/tasks:batch", json={"requests": [_text("x")] * 4})
    assert reply.status_code == 422 and "at most 3" in reply.json()["error"]["message"]


def test_job_cancel(http):
    batch = http.post("/v1/tasks:batch", json={"requests": [_text("a"), _text("b")]}).json()
    assert http.post(f"/v1/jobs/{batch['job_id']}/cancel").json()["cancelled"] == 2
    assert http.get(batch["status_url"]).json()["counts"]["cancelled"] == 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        (_text("hi", max_new_tokens=0), "generation.max_new_tokens"),
        (_text("hi", id="mine"), "id"),
        ({"custom_id": "x"}, "messages"),
    ],
)
def test_validation_errors_name_the_field(http, body, field):
    reply = http.post("/v1/tasks", json=body)
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(f"{field}:"), error


def test_malformed_json_is_a_422_without_echo(http):
    reply = http.post(
        "/v1/tasks", content=b'{"messages": [SECRET', headers={"content-type": "application/json"}
    )
    assert reply.status_code == 422
    assert "SECRET" not in reply.text and reply.json()["error"]["code"] == "invalid_request"


def test_metrics_count_routes(http):
    http.get("/v1/tasks/abc")
    http.get("/v1/tasks/def")
    text = http.get("/metrics").text
    assert "vlmq_api_requests_total{" in text and "vlmq_api_request_seconds_bucket{" in text
    routes = http.get("/metrics", params={"format": "json"}).json()["routes"]
    assert routes["GET /v1/tasks/{task_id}"]["count"] == 2
    assert routes["GET /v1/tasks/{task_id}"]["rejected"] == 2


def test_healthz_and_openapi(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json()["checks"] == {"redis": "ok", "store": "ok", "layout": "ok"}
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/tasks", "/v1/tasks:batch", "/v1/batches", "/v1/files"} <= set(paths)


def test_the_app_module_never_imports_torch_or_workers():
    code = (
        "import sys\n"
        "from vlmq.config.settings import Settings\n"
        "from vlmq.producers.api.app import create_app\n"
        "import vlmq.producers.serve\n"
        "create_app(Settings())\n"
        "banned = {'torch', 'transformers'}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned\n"
        "             or m.startswith('vlmq.workers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_refuses_a_public_address_without_keys(monkeypatch):
    from click.testing import CliRunner

    from vlmq.producers.cli import cli

    monkeypatch.delenv("VLMQ_API__API_KEYS", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "refusing to serve without API keys" in result.output
