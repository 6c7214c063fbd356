"""Multi-tenancy against a real Redis and moto S3: two tenants' keys and an admin key
through the HTTP API (TestClient, and a real uvicorn server with the official ``openai``
client), per-tenant quotas of queued tasks and tokens, the per-tenant rate limit shared by
API processes, the keyless server's Host check, crafted ids, and the answers to a Redis that
refuses a command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.integration.test_api_support import (
    FAIL_MARKER,
    api_settings,
    uvicorn_server,
    wait_for_state,
    worker_loop,
)
from tests.support.services import wait_until
from vlmq.broker.state.tasks import Move
from vlmq.config.errors import InvalidRequest, QuotaExceeded
from vlmq.config.settings import Settings, TenantQuota, TenantSettings
from vlmq.config.status import TaskState
from vlmq.producers.api.app import create_app
from vlmq.producers.api.openai.batch_records import BatchRecords
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.cli import cli
from vlmq.producers.client import Client, as_request
from vlmq.producers.preflight.accumulator import Preflight

KEY_A = "team-a-key-0123456789"
KEY_B = "team-b-key-0123456789"
KEY_ADMIN = "admin-key-0123456789"
KEY_PLAIN = "plain-key-0123456789"
KEY_PLAIN_2 = "plain-key-2-0123456789"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
ADMIN = {"Authorization": f"Bearer {KEY_ADMIN}"}
TENANT_KEYS: dict[str, Any] = {
    "tenant_keys": {KEY_A: "team-a", KEY_B: "team-b"},
    "admin_keys": [KEY_ADMIN],
}

TASK = {"messages": [{"role": "user", "content": "hi"}]}
CRAFTED_IDS = ["J:custom_ids", "x:y", "a" * 200]


def _line(custom_id: str, content: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
    return json.dumps({**request, "body": body})


# Two lines that run and one that fails: a finished batch has an output and an error file.
LINES = "\n".join([_line("a1", "one"), _line("a2", "two"), _line("bad", FAIL_MARKER)]).encode()


def _batch_body(file_id: str) -> dict[str, str]:
    return {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }


def _settings(
    redis_server: Any,
    moto_server: Any,
    request: Any,
    quotas: dict[str, TenantQuota] | None = None,
    tenant: str = "default",
    **api: Any,
) -> Settings:
    base = api_settings(redis_server, moto_server, request.node.name, **api)
    tenants = TenantSettings(quotas=quotas or {})
    return base.model_copy(update={"tenant": tenant, "tenants": tenants})


@pytest.fixture
def make_http() -> Iterator[Any]:
    """TestClients on apps of given settings (entered: the app's lifespan runs)."""
    clients: list[TestClient] = []

    def make(settings: Settings, **kwargs: Any) -> TestClient:
        client = TestClient(
            create_app(settings),
            base_url=kwargs.pop("base_url", "http://localhost"),
            raise_server_exceptions=False,
            **kwargs,
        )
        clients.append(client.__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _ok(reply: Any, status: int = 200) -> Any:
    assert reply.status_code == status, reply.text
    return reply.json()


def _error(reply: Any, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return body["error"]


def _quota(client: Client, tenant: str) -> dict[str, int]:
    raw: dict[str, str] = client.redis.hgetall(client.keys.quota(tenant))  # type: ignore[assignment]
    return {k: int(v) for k, v in raw.items()}


# 1. isolation ---------------------------------------------------------------------
@dataclass
class Seeded:
    """Tenant A's work: finished (a task, a batch with its files) and still queued."""

    done_task: str
    file_id: str
    done_batch: str
    output_file: str
    error_file: str
    queued_task: str
    job_id: str
    job_task: str
    pending_batch: str


def _seed(http: Any, settings: Settings) -> Seeded:
    """Tenant A's work through ``http`` (a TestClient or an httpx client of a real server)."""
    done = _ok(http.post("/v1/tasks", json=TASK, headers=A), 202)["id"]
    upload = {"files": {"file": ("a.jsonl", LINES)}, "data": {"purpose": "batch"}}
    file_id = _ok(http.post("/v1/files", headers=A, **upload))["id"]
    done_batch = _ok(http.post("/v1/batches", json=_batch_body(file_id), headers=A))["id"]
    with worker_loop(settings):
        wait_for_state(lambda: _ok(http.get(f"/v1/tasks/{done}", headers=A)), {"succeeded"})
        finished = wait_for_state(
            lambda: _ok(http.get(f"/v1/batches/{done_batch}", headers=A)), {"completed"}
        )
    assert finished["output_file_id"] and finished["error_file_id"]
    # Then, with no worker, work that stays queued.
    queued = _ok(http.post("/v1/tasks", json=TASK, headers=A), 202)["id"]
    job = _ok(http.post("/v1/tasks:batch", json={"requests": [TASK, TASK]}, headers=A), 202)
    pending = _ok(http.post("/v1/batches", json=_batch_body(file_id), headers=A))["id"]
    wait_for_state(lambda: _ok(http.get(f"/v1/batches/{pending}", headers=A)), {"in_progress"})
    return Seeded(
        done_task=done,
        file_id=file_id,
        done_batch=done_batch,
        output_file=finished["output_file_id"],
        error_file=finished["error_file_id"],
        queued_task=queued,
        job_id=job["job_id"],
        job_task=job["task_ids"][0],
        pending_batch=pending,
    )


def _reads(s: Seeded) -> list[tuple[str, str, dict[str, Any]]]:
    """Every read of A's work: (method, path, request arguments)."""
    return [
        ("GET", f"/v1/tasks/{s.queued_task}", {}),
        ("GET", f"/v1/tasks/{s.job_task}", {}),
        ("GET", f"/v1/tasks/{s.done_task}", {}),
        ("GET", f"/v1/tasks/{s.done_task}/result", {}),
        ("GET", f"/v1/tasks/{s.done_task}/result", {"params": {"presign": "true"}}),
        ("GET", f"/v1/tasks/{s.done_task}/result", {"params": {"format": "openai"}}),
        ("GET", f"/v1/jobs/{s.job_id}", {}),
        ("GET", f"/v1/files/{s.file_id}", {}),
        ("GET", f"/v1/files/{s.file_id}/content", {}),
        ("GET", f"/v1/batches/{s.pending_batch}", {}),
        ("GET", f"/v1/batches/{s.done_batch}", {}),
        ("GET", f"/v1/files/{s.output_file}", {}),
        ("GET", f"/v1/files/{s.output_file}/content", {}),
        ("GET", f"/v1/files/{s.error_file}/content", {}),
    ]


def _changes(s: Seeded) -> list[tuple[str, str, dict[str, Any]]]:
    """Every change of A's work, and a batch of B's own over A's file."""
    return [
        ("POST", f"/v1/tasks/{s.queued_task}/cancel", {}),
        ("POST", f"/v1/tasks/{s.job_task}/cancel", {}),
        ("POST", f"/v1/jobs/{s.job_id}/cancel", {}),
        ("POST", f"/v1/batches/{s.pending_batch}/cancel", {}),
        ("POST", f"/v1/batches/{s.done_batch}/cancel", {}),
        ("POST", "/v1/batches", {"json": _batch_body(s.file_id)}),
    ]


def _snapshot(http: Any, s: Seeded) -> dict[str, Any]:
    """What B's attempts must leave as it was, read by the admin."""
    job = _ok(http.get(f"/v1/jobs/{s.job_id}", headers=ADMIN))
    pending = _ok(http.get(f"/v1/batches/{s.pending_batch}", headers=ADMIN))
    return {
        "queued": _ok(http.get(f"/v1/tasks/{s.queued_task}", headers=ADMIN))["status"],
        "job_task": _ok(http.get(f"/v1/tasks/{s.job_task}", headers=ADMIN))["status"],
        "job": (job["state"], job["counts"]),
        "pending": (pending["status"], pending["cancelling_at"], pending["request_counts"]),
        "done": _ok(http.get(f"/v1/batches/{s.done_batch}", headers=ADMIN))["status"],
        "batches": sorted(b["id"] for b in _ok(http.get("/v1/batches", headers=ADMIN))["data"]),
        "content": http.get(f"/v1/files/{s.file_id}/content", headers=ADMIN).content,
    }


def _check_isolation(http: Any, s: Seeded) -> None:
    """B gets 404 for every read and change of A's work and changes nothing; A and the admin
    read all of it; lists are per tenant."""
    before = _snapshot(http, s)
    assert before["queued"] == before["job_task"] == "queued"
    assert before["pending"][0] == "in_progress" and before["content"] == LINES
    attempts = _reads(s) + _changes(s)
    assert len(attempts) >= 13  # the "13 cross-key reads or changes", and more
    succeeded = []
    for method, path, kwargs in attempts:
        reply = http.request(method, path, headers=B, **kwargs)
        if reply.status_code != 404 or reply.json()["error"]["code"] != "not_found":
            succeeded.append((method, path, reply.status_code, reply.text[:200]))
    assert succeeded == []
    assert _snapshot(http, s) == before  # nothing changed

    # B sees none of A's files or batches in its lists, and its own.
    own = _ok(
        http.post(
            "/v1/files", headers=B, files={"file": ("b.jsonl", b"{}\n")}, data={"purpose": "batch"}
        )
    )
    b_task = _ok(http.post("/v1/tasks", json=TASK, headers=B), 202)["id"]
    assert [f["id"] for f in _ok(http.get("/v1/files", headers=B))["data"]] == [own["id"]]
    assert _ok(http.get("/v1/batches", headers=B))["data"] == []
    assert _ok(http.get(f"/v1/tasks/{b_task}", headers=B))["status"] == "queued"
    # ... and A none of B's.
    _error(http.get(f"/v1/files/{own['id']}", headers=A), 404, "not_found")
    _error(http.get(f"/v1/tasks/{b_task}", headers=A), 404, "not_found")
    a_files = {s.file_id, s.output_file, s.error_file}
    assert {f["id"] for f in _ok(http.get("/v1/files", headers=A))["data"]} == a_files
    a_batches = {s.done_batch, s.pending_batch}
    assert {b["id"] for b in _ok(http.get("/v1/batches", headers=A))["data"]} == a_batches

    # A reads all of its own; the admin reads A's and B's.
    for method, path, kwargs in _reads(s):
        for headers in (A, ADMIN):
            reply = http.request(method, path, headers=headers, **kwargs)
            assert reply.status_code == 200, (path, reply.text)
    presigned = _ok(
        http.get(f"/v1/tasks/{s.done_task}/result", params={"presign": "true"}, headers=A)
    )
    assert json.loads(httpx.get(presigned["url"]).content)["id"] == s.done_task
    assert _ok(http.get(f"/v1/tasks/{b_task}", headers=ADMIN))["status"] == "queued"
    admin_files = {f["id"] for f in _ok(http.get("/v1/files", headers=ADMIN))["data"]}
    assert admin_files == a_files | {own["id"]}
    admin_batches = {b["id"] for b in _ok(http.get("/v1/batches", headers=ADMIN))["data"]}
    assert admin_batches == a_batches

    # The owner's changes work (the admin's too).
    assert _ok(http.post(f"/v1/tasks/{s.queued_task}/cancel", headers=A))["cancelled"] is True
    assert _ok(http.post(f"/v1/jobs/{s.job_id}/cancel", headers=A))["cancelled"] == 2
    assert _ok(http.post(f"/v1/batches/{s.pending_batch}/cancel", headers=A))["status"] in (
        "cancelling",
        "cancelled",
    )
    assert _ok(http.post(f"/v1/tasks/{b_task}/cancel", headers=ADMIN))["cancelled"] is True


def test_tenants_see_only_their_own_work_over_http(redis_server, moto_server, request, make_http):
    settings = _settings(redis_server, moto_server, request, **TENANT_KEYS)
    http = make_http(settings)
    _check_isolation(http, _seed(http, settings))


def test_tenants_see_only_their_own_work_with_the_openai_client(redis_server, moto_server, request):
    settings = _settings(redis_server, moto_server, request, **TENANT_KEYS)
    with (
        uvicorn_server(create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=20) as http,
    ):
        s = _seed(http, settings)

        def oai(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)

        a, b, admin = oai(KEY_A), oai(KEY_B), oai(KEY_ADMIN)
        attempts = [
            lambda: b.files.retrieve(s.file_id),
            lambda: b.files.content(s.file_id),
            lambda: b.files.retrieve(s.output_file),
            lambda: b.files.content(s.output_file),
            lambda: b.files.content(s.error_file),
            lambda: b.batches.retrieve(s.pending_batch),
            lambda: b.batches.retrieve(s.done_batch),
            lambda: b.batches.cancel(s.pending_batch),
            lambda: b.batches.create(
                input_file_id=s.file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ]
        succeeded = 0
        for attempt in attempts:
            try:
                attempt()
                succeeded += 1
            except openai.NotFoundError:
                pass
        assert succeeded == 0
        assert {f.id for f in b.files.list()} == set() and b.batches.list().data == []
        # The owner and the admin, through the same client.
        assert a.files.content(s.file_id).content == LINES
        assert a.batches.retrieve(s.pending_batch).status == "in_progress"
        output = a.files.content(s.output_file).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in output) == ["a1", "a2"]
        assert {x.id for x in a.batches.list().data} == {s.done_batch, s.pending_batch}
        assert admin.batches.retrieve(s.done_batch).status == "completed"
        assert {s.file_id, s.output_file} <= {f.id for f in admin.files.list()}
        # The tasks and jobs surface over the real server, with everything else.
        _check_isolation(http, s)


# 7. one tenant: as before -----------------------------------------------------------
def test_api_keys_alone_share_everything_as_before(redis_server, moto_server, request, make_http):
    settings = _settings(redis_server, moto_server, request, api_keys=[KEY_PLAIN, KEY_PLAIN_2])
    http = make_http(settings)
    one, two = ({"Authorization": f"Bearer {key}"} for key in (KEY_PLAIN, KEY_PLAIN_2))
    task = _ok(http.post("/v1/tasks", json=TASK, headers=one), 202)["id"]
    job = _ok(http.post("/v1/tasks:batch", json={"requests": [TASK]}, headers=one), 202)
    upload = {"files": {"file": ("a.jsonl", LINES)}, "data": {"purpose": "batch"}}
    file_id = _ok(http.post("/v1/files", headers=one, **upload))["id"]
    batch = _ok(http.post("/v1/batches", json=_batch_body(file_id), headers=one))["id"]
    # The Python client acts as the default tenant too.
    client = Client(settings)
    own = client.submit(TASK)
    for headers in (one, two):
        assert _ok(http.get(f"/v1/tasks/{task}", headers=headers))["status"] == "queued"
        assert _ok(http.get(f"/v1/tasks/{own}", headers=headers))["status"] == "queued"
        assert _ok(http.get(f"/v1/jobs/{job['job_id']}", headers=headers))["total"] == 1
        assert http.get(f"/v1/files/{file_id}/content", headers=headers).content == LINES
        assert _ok(http.get(f"/v1/batches/{batch}", headers=headers))["id"] == batch
        assert [f["id"] for f in _ok(http.get("/v1/files", headers=headers))["data"]] == [file_id]
        assert [b["id"] for b in _ok(http.get("/v1/batches", headers=headers))["data"]] == [batch]
    assert _ok(http.post(f"/v1/tasks/{task}/cancel", headers=two))["cancelled"] is True
    assert _ok(http.post(f"/v1/jobs/{job['job_id']}/cancel", headers=two))["cancelled"] == 1
    assert _ok(http.post(f"/v1/tasks/{own}/cancel", headers=one))["cancelled"] is True
    assert client.status(job["job_id"])["tenant"] == "default"


def test_records_from_before_tenants_belong_to_the_default_tenant(
    redis_server, moto_server, request, make_http
):
    settings = _settings(redis_server, moto_server, request, api_keys=[KEY_PLAIN], **TENANT_KEYS)
    http = make_http(settings)
    client = Client(settings)
    # A batch record and a task hash written before tenants: no 'tenant' field.
    fields = {
        "id": "batch_old",
        "input_file_id": "file-old",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "created_at": "1700000000",
        "metadata": "{}",
        "submitted_at": "1700000000",
    }
    BatchRecords(client).create("batch_old", fields)
    client.redis.hset(client.keys.task("old-task"), mapping={"state": "queued", "modality": "text"})
    plain = {"Authorization": f"Bearer {KEY_PLAIN}"}
    for headers in (plain, ADMIN):
        assert _ok(http.get("/v1/batches/batch_old", headers=headers))["id"] == "batch_old"
        assert _ok(http.get("/v1/tasks/old-task", headers=headers))["status"] == "queued"
    _error(http.get("/v1/batches/batch_old", headers=A), 404, "not_found")
    _error(http.get("/v1/tasks/old-task", headers=A), 404, "not_found")
    assert _ok(http.get("/v1/batches", headers=A))["data"] == []


# 2. quotas -------------------------------------------------------------------------
def test_the_task_quota_refuses_and_recovers_over_http(
    redis_server, moto_server, request, make_http
):
    quotas = {"team-a": TenantQuota(max_queued_tasks=3)}
    settings = _settings(redis_server, moto_server, request, quotas=quotas, **TENANT_KEYS)
    http = make_http(settings)
    client: Client = http.app.state.ctx.client
    ids = [_ok(http.post("/v1/tasks", json=TASK, headers=A), 202)["id"] for _ in range(3)]
    refused = http.post("/v1/tasks", json=TASK, headers=A)
    error = _error(refused, 429, "quota_exceeded")
    assert "max_queued_tasks" in error["message"] and "team-a" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    _error(
        http.post("/v1/tasks:batch", json={"requests": [TASK]}, headers=A), 429, "quota_exceeded"
    )
    assert _quota(client, "team-a") == {"tasks": 3}
    assert client.redis.llen("vlmq.text.interactive") == 3  # nothing of the refused went in
    # Another tenant has its own quota (none here), and its own counts.
    _ok(http.post("/v1/tasks:batch", json={"requests": [TASK] * 5}, headers=B), 202)
    assert _quota(client, "team-b") == {"tasks": 5}

    # Recovers as tasks leave the queue: a cancel ...
    _ok(http.post(f"/v1/tasks/{ids[0]}/cancel", headers=A))
    assert _quota(client, "team-a") == {"tasks": 2}
    _ok(http.post("/v1/tasks", json=TASK, headers=A), 202)
    # ... a batch that would pass it is refused whole, one that fits is taken ...
    _ok(http.post(f"/v1/tasks/{ids[1]}/cancel", headers=A))
    _error(
        http.post("/v1/tasks:batch", json={"requests": [TASK, TASK]}, headers=A),
        429,
        "quota_exceeded",
    )
    job = _ok(http.post("/v1/tasks:batch", json={"requests": [TASK]}, headers=A), 202)
    assert _quota(client, "team-a") == {"tasks": 3}
    _ok(http.post(f"/v1/jobs/{job['job_id']}/cancel", headers=A))
    assert _quota(client, "team-a") == {"tasks": 2}
    # ... and a start (queued -> running), as a worker pulls and starts them.
    deliveries = client.state.intake("text").pull(50, 60).deliveries
    assert len(deliveries) == 2 + 5
    assert _quota(client, "team-a") == {"tasks": 2}  # pulled is not started: still queued
    starts = [
        Move(d.task_id, TaskState.RUNNING, {"worker": "w"}, d.token, "started_at", True)
        for d in deliveries
    ]
    assert all(moved.moved for moved in client.state.tasks.moves(starts))
    assert _quota(client, "team-a") == {"tasks": 0} and _quota(client, "team-b") == {"tasks": 0}
    batch = _ok(http.post("/v1/tasks:batch", json={"requests": [TASK] * 3}, headers=A), 202)
    assert batch["count"] == 3 and _quota(client, "team-a") == {"tasks": 3}


def test_queued_work_that_runs_leaves_the_quota_exactly(
    redis_server, moto_server, request, make_http
):
    body = {**TASK, "max_new_tokens": 8}
    quotas = {"team-a": TenantQuota(max_queued_tasks=6, max_queued_tokens=10**6)}
    settings = _settings(redis_server, moto_server, request, quotas=quotas, **TENANT_KEYS)
    http = make_http(settings)
    client: Client = http.app.state.ctx.client
    ids = [_ok(http.post("/v1/tasks", json=body, headers=A), 202)["id"] for _ in range(2)]
    job = _ok(http.post("/v1/tasks:batch", json={"requests": [body] * 2}, headers=A), 202)
    jsonl = [json.dumps({"custom_id": f"c{n}", **body}) for n in range(2)]
    submit_jsonl(client, jsonl, "fed-job", tenant="team-a")
    queued = _quota(client, "team-a")
    assert queued["tasks"] == 6 and queued["tokens"] > 0
    _error(http.post("/v1/tasks", json=body, headers=A), 429, "quota_exceeded")
    with worker_loop(settings):
        for task_id in ids + job["task_ids"]:
            wait_for_state(
                lambda t=task_id: _ok(http.get(f"/v1/tasks/{t}", headers=A)), {"succeeded"}
            )
        wait_for_state(
            lambda: _ok(http.get("/v1/jobs/fed-job", headers=A)), {"completed"}, key="state"
        )
    # Counted once in and once out, whatever the path (interactive, bulk job, feed).
    assert _quota(client, "team-a") == {"tasks": 0, "tokens": 0}
    _ok(http.post("/v1/tasks", json=body, headers=A), 202)


def _estimate(settings: Settings, body: dict[str, Any]) -> int:
    estimate = Preflight(settings).estimate(as_request(body))
    return estimate.prompt_tokens + estimate.output_tokens


def test_the_token_quota_counts_the_estimate(redis_server, moto_server, request, make_http):
    big = {**TASK, "max_new_tokens": 200}
    small = {**TASK, "max_new_tokens": 1}
    probe = _settings(redis_server, moto_server, request)
    est, est_small = _estimate(probe, big), _estimate(probe, small)
    assert est > 4 * est_small
    quotas = {"team-a": TenantQuota(max_queued_tokens=2 * est + est // 2)}
    settings = _settings(redis_server, moto_server, request, quotas=quotas, **TENANT_KEYS)
    http = make_http(settings)
    client: Client = http.app.state.ctx.client
    first, second = (_ok(http.post("/v1/tasks", json=big, headers=A), 202)["id"] for _ in range(2))
    assert _quota(client, "team-a") == {"tasks": 2, "tokens": 2 * est}
    error = _error(http.post("/v1/tasks", json=big, headers=A), 429, "quota_exceeded")
    assert "max_queued_tokens" in error["message"]
    # Tokens, not tasks: a small one still fits.
    third = _ok(http.post("/v1/tasks", json=small, headers=A), 202)["id"]
    assert _quota(client, "team-a") == {"tasks": 3, "tokens": 2 * est + est_small}
    _ok(http.post(f"/v1/tasks/{first}/cancel", headers=A))
    assert _quota(client, "team-a") == {"tasks": 2, "tokens": est + est_small}
    _error(
        http.post("/v1/tasks:batch", json={"requests": [big, big]}, headers=A),
        429,
        "quota_exceeded",
    )
    fourth = _ok(http.post("/v1/tasks", json=big, headers=A), 202)["id"]
    for task_id in (second, third, fourth):
        _ok(http.post(f"/v1/tasks/{task_id}/cancel", headers=A))
    assert _quota(client, "team-a") == {"tasks": 0, "tokens": 0}
    # A bulk job counts its tasks' estimate, and gives it back when cancelled.
    job = _ok(http.post("/v1/tasks:batch", json={"requests": [big, big]}, headers=A), 202)
    assert _quota(client, "team-a") == {"tasks": 2, "tokens": 2 * est}
    _ok(http.post(f"/v1/jobs/{job['job_id']}/cancel", headers=A))
    assert _quota(client, "team-a") == {"tasks": 0, "tokens": 0}
    # A JSONL submission counts the validation pass's estimate.
    lines = [json.dumps({"custom_id": f"c{n}", **big}) for n in range(3)]
    with pytest.raises(QuotaExceeded, match="max_queued_tokens"):
        submit_jsonl(client, lines, "too-many-tokens", tenant="team-a")
    assert _quota(client, "team-a") == {"tasks": 0, "tokens": 0}
    submit_jsonl(client, lines[:2], "fits", tenant="team-a")
    assert _quota(client, "team-a") == {"tasks": 2, "tokens": 2 * est}
    assert client.cancel("fits") == 2
    assert _quota(client, "team-a") == {"tasks": 0, "tokens": 0}
    # A tenant without a token quota counts no tokens (no estimate is taken).
    _ok(http.post("/v1/tasks", json=big, headers=B), 202)
    assert _quota(client, "team-b") == {"tasks": 1}


def test_the_python_client_and_the_cli_act_as_the_settings_tenant(
    redis_server, moto_server, request, make_http, tmp_path
):
    quotas = {"team-a": TenantQuota(max_queued_tasks=2)}
    settings = _settings(
        redis_server, moto_server, request, quotas=quotas, tenant="team-a", **TENANT_KEYS
    )
    client = Client(settings)
    first = client.submit(TASK)
    client.submit(TASK)
    with pytest.raises(QuotaExceeded, match="max_queued_tasks") as refused:
        client.submit(TASK)
    assert refused.value.code == "quota_exceeded"
    with pytest.raises(QuotaExceeded):
        client.submit_many([TASK], job_id="over")
    with pytest.raises(QuotaExceeded):
        submit_jsonl(client, [json.dumps(TASK)], "over-too")
    assert client.redis.llen("vlmq.text.interactive") == 2
    assert not client.state.jobs.exists("over")
    # Another tenant's client has its own quota.
    other = Client(settings, tenant="team-b").submit(TASK)
    # The API shows each client's tasks to its tenant's key only.
    http = make_http(settings)
    assert _ok(http.get(f"/v1/tasks/{first}", headers=A))["status"] == "queued"
    _error(http.get(f"/v1/tasks/{first}", headers=B), 404, "not_found")
    assert _ok(http.get(f"/v1/tasks/{other}", headers=B))["status"] == "queued"

    # `vlmq submit` with VLMQ_TENANT: refused with exit code 1 and the reason, no traceback.
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"custom_id": f"c{n}", **TASK}) for n in range(2)))
    env = {
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
        "VLMQ_TENANT": "team-a",
        "VLMQ_TENANTS__QUOTAS": json.dumps({"team-a": {"max_queued_tasks": 3}}),
    }
    runner = CliRunner()
    result = runner.invoke(cli, ["submit", str(path), "--job", "cli-job"], env=env)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "quota" in result.output and "max_queued_tasks" in result.output
    assert "Traceback" not in result.output
    crafted = runner.invoke(cli, ["submit", str(path), "--job", "J:custom_ids"], env=env)
    assert crafted.exit_code == 1 and isinstance(crafted.exception, SystemExit)
    assert "job id: must be 1-128" in crafted.output
    # Once a task left the queue, the same file (one line fewer) goes in, as team-a's.
    assert client.cancel(first) == 1
    path.write_text(json.dumps({"custom_id": "c0", **TASK}) + "\n")
    result = runner.invoke(cli, ["submit", str(path), "--job", "cli-job"], env=env)
    assert result.exit_code == 0, result.output
    assert client.status("cli-job")["tenant"] == "team-a"
    assert _ok(http.get("/v1/jobs/cli-job", headers=A))["total"] == 1
    _error(http.get("/v1/jobs/cli-job", headers=B), 404, "not_found")
    assert _quota(client, "team-a") == {"tasks": 2}


def test_a_batch_at_or_past_the_quota(redis_server, moto_server, request, make_http):
    quotas = {"team-a": TenantQuota(max_queued_tasks=2)}
    settings = _settings(redis_server, moto_server, request, quotas=quotas, **TENANT_KEYS)
    http = make_http(settings)
    client: Client = http.app.state.ctx.client
    upload = {"files": {"file": ("a.jsonl", LINES)}, "data": {"purpose": "batch"}}
    file_id = _ok(http.post("/v1/files", headers=A, **upload))["id"]
    # Three valid lines would pass a quota of two: the batch fails, nothing is enqueued.
    batch = _ok(http.post("/v1/batches", json=_batch_body(file_id), headers=A))["id"]
    failed = wait_for_state(lambda: _ok(http.get(f"/v1/batches/{batch}", headers=A)), {"failed"})
    assert failed["errors"]["data"][0]["code"] == "quota_exceeded"
    assert _quota(client, "team-a").get("tasks", 0) == 0
    # A tenant already at its quota is refused at once.
    tasks = [_ok(http.post("/v1/tasks", json=TASK, headers=A), 202)["id"] for _ in range(2)]
    refused = http.post("/v1/batches", json=_batch_body(file_id), headers=A)
    _error(refused, 429, "quota_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    assert {b["id"] for b in _ok(http.get("/v1/batches", headers=A))["data"]} == {batch}
    # Once its tasks left, a batch that fits runs.
    for task_id in tasks:
        _ok(http.post(f"/v1/tasks/{task_id}/cancel", headers=A))
    small = {
        "files": {"file": ("s.jsonl", _line("s1", "x").encode())},
        "data": {"purpose": "batch"},
    }
    small_id = _ok(http.post("/v1/files", headers=A, **small))["id"]
    fits = _ok(http.post("/v1/batches", json=_batch_body(small_id), headers=A))["id"]
    wait_for_state(lambda: _ok(http.get(f"/v1/batches/{fits}", headers=A)), {"in_progress"})
    assert _quota(client, "team-a")["tasks"] == 1


def test_the_rate_limit_is_per_tenant_and_shared_by_api_processes(
    redis_server, moto_server, request, make_http
):
    quotas = {"team-b": TenantQuota(rate_limit_per_s=0.01, rate_limit_burst=2)}
    settings = _settings(
        redis_server,
        moto_server,
        request,
        quotas=quotas,
        rate_limit_per_s=0.01,
        rate_limit_burst=4,
        **TENANT_KEYS,
    )
    first, second = make_http(settings), make_http(settings)  # two API processes
    assert first.app.state.ctx is not second.app.state.ctx
    answers = [
        (first if n % 2 else second).get("/v1/tasks/x", headers=A).status_code for n in range(4)
    ]
    assert answers == [404] * 4
    for http in (first, second):  # the tenant's one bucket is empty in both
        limited = http.get("/v1/tasks/x", headers=A)
        _error(limited, 429, "rate_limited")
        assert int(limited.headers["retry-after"]) >= 1
    # team-b has its own bucket, of its quota's size.
    assert [first.get("/v1/tasks/x", headers=B).status_code for _ in range(2)] == [404, 404]
    _error(second.get("/v1/tasks/x", headers=B), 429, "rate_limited")
    # The admin (the default tenant) has the API's size, untouched by either.
    assert [second.get("/v1/tasks/x", headers=ADMIN).status_code for _ in range(4)] == [404] * 4
    assert first.get("/healthz").status_code == 200  # probes are never limited


# 5. keys and unauthenticated callers ---------------------------------------------------
def test_unauthenticated_callers_are_rate_limited_per_address(redis_server, moto_server, request):
    settings = _settings(
        redis_server,
        moto_server,
        request,
        unauthenticated_rate_limit_per_s=0.01,
        unauthenticated_rate_limit_burst=3,
        **TENANT_KEYS,
    )
    app = create_app(settings)

    def from_address(address: str) -> TestClient:
        return TestClient(
            app, base_url="http://localhost", raise_server_exceptions=False, client=(address, 5000)
        )

    guesser, other = from_address("10.0.0.1"), from_address("10.0.0.2")
    wrong = {"Authorization": "Bearer not-a-key-0123456789"}
    answers = [guesser.get("/v1/batches", headers=wrong).status_code for _ in range(2)]
    answers.append(guesser.get("/v1/batches").status_code)  # no key at all counts the same
    assert answers == [401, 401, 401]
    limited = guesser.get("/v1/batches", headers=wrong)
    _error(limited, 429, "rate_limited")
    assert int(limited.headers["retry-after"]) >= 1
    _error(
        guesser.get("/v1/batches", headers={"Authorization": f"Bearer {KEY_A[:-1]}"}),
        429,
        "rate_limited",
    )
    # A valid key from the same address is its tenant's, not the address's.
    assert guesser.get("/v1/batches", headers=A).status_code == 200
    # Another address has its own bucket.
    _error(other.get("/v1/batches", headers=wrong), 401, "unauthorized")
    assert guesser.get("/healthz").status_code == 200


# 3. the keyless server's Host check -------------------------------------------------
@pytest.mark.parametrize(
    "base_url",
    ["http://localhost", "http://localhost:8000", "http://127.0.0.1:1234", "http://[::1]:8000"],
)
def test_a_keyless_server_answers_loopback_host_names(
    redis_server, moto_server, request, make_http, base_url
):
    http = make_http(_settings(redis_server, moto_server, request), base_url=base_url)
    assert http.get("/healthz").status_code == 200
    _error(http.get("/v1/tasks/x"), 404, "not_found")
    assert http.post("/v1/tasks", json=TASK).status_code == 202


def test_a_keyless_server_refuses_other_host_names(redis_server, moto_server, request, make_http):
    settings = _settings(redis_server, moto_server, request)
    http = make_http(settings, base_url="http://evil.example")
    for method, path in (("GET", "/healthz"), ("GET", "/v1/batches"), ("POST", "/v1/tasks")):
        error = _error(http.request(method, path, json=TASK), 400, "invalid_host")
        assert "loopback" in error["message"]
    local = make_http(settings)
    for host in ("localhost.evil.example", "127.0.0.1.nip.io", "evil.example:8000", "10.0.0.1"):
        _error(local.get("/v1/batches", headers={"Host": host}), 400, "invalid_host")
    client: Client = http.app.state.ctx.client
    assert client.redis.llen("vlmq.text.interactive") == 0
    # A real server: DNS rebinding sends the page's name as the Host.
    with uvicorn_server(create_app(settings)) as url:
        port = url.rsplit(":", 1)[1]
        rebound = httpx.get(f"{url}/v1/batches", headers={"Host": f"evil.example:{port}"})
        _error(rebound, 400, "invalid_host")
        assert httpx.get(f"{url}/v1/batches").status_code == 200
        assert (
            httpx.get(f"{url}/v1/batches", headers={"Host": f"localhost:{port}"}).status_code == 200
        )


def test_a_keyed_server_answers_any_host_name(redis_server, moto_server, request, make_http):
    settings = _settings(redis_server, moto_server, request, **TENANT_KEYS)
    http = make_http(settings, base_url="http://api.example.com")
    assert http.get("/v1/batches", headers=A).status_code == 200
    _error(http.get("/v1/batches"), 401, "unauthorized")


# 4. crafted ids ---------------------------------------------------------------------
def test_crafted_ids_are_404_before_forming_a_key(
    redis_server, moto_server, request, make_http, monkeypatch
):
    settings = _settings(redis_server, moto_server, request)
    http = make_http(settings)
    client: Client = http.app.state.ctx.client
    # A job whose internal hashes exist: J and J:custom_ids (its claims).
    lines = [json.dumps({"custom_id": f"c{n}", **TASK}) for n in range(2)]
    submit_jsonl(client, lines, "J")
    assert client.redis.exists(client.keys.job_custom_ids("J"))
    assert _ok(http.get("/v1/jobs/J"))["total"] == 2
    looked_up: list[str] = []
    from vlmq.producers.api import jobs

    real_summary, real_task = jobs.job_summary, client.state.tasks.get

    def summary(c: Client, job_id: str) -> Any:
        looked_up.append(job_id)
        return real_summary(c, job_id)

    def task(task_id: str) -> Any:
        looked_up.append(task_id)
        return real_task(task_id)

    monkeypatch.setattr(jobs, "job_summary", summary)
    monkeypatch.setattr(client.state.tasks, "get", task)
    for crafted in CRAFTED_IDS:
        for method, path in (
            ("GET", f"/v1/jobs/{crafted}"),
            ("POST", f"/v1/jobs/{crafted}/cancel"),
            ("GET", f"/v1/tasks/{crafted}"),
            ("GET", f"/v1/tasks/{crafted}/result"),
            ("POST", f"/v1/tasks/{crafted}/cancel"),
        ):
            _error(http.request(method, path), 404, "not_found")
    assert looked_up == []
    assert _ok(http.get("/v1/jobs/J"))["counts"]["queued"] == 2  # nothing was cancelled
    assert looked_up == ["J"]
    # The Python client refuses such a job id: no key is formed from it either.
    for crafted in CRAFTED_IDS:
        with pytest.raises(InvalidRequest, match="job id"):
            client.submit_many([TASK], job_id=crafted)
        with pytest.raises(InvalidRequest, match="job id"):
            submit_jsonl(client, [json.dumps(TASK)], crafted)
        with pytest.raises(InvalidRequest, match="job id"):
            client.open_job(crafted)
        with pytest.raises(InvalidRequest):
            client.submit(TASK, job_id=crafted)
    assert not client.redis.keys("vlmq:job:x*") and not client.redis.keys("vlmq:job:aaa*")


def test_a_job_id_of_another_tenant_is_not_reopened(redis_server, moto_server, request):
    settings = _settings(redis_server, moto_server, request)
    Client(settings, tenant="team-a").submit_many([TASK], job_id="shared")
    with pytest.raises(InvalidRequest, match="another tenant"):
        Client(settings, tenant="team-b").submit_many([TASK], job_id="shared")
    assert Client(settings).status("shared")["total"] == 1


def _fed_job(client: Client, job_id: str, tenant: str) -> list[dict[str, Any]]:
    """Job ``job_id`` of ``tenant``: two fed tasks run to the end; their result records."""
    lines = [json.dumps({"custom_id": f"c{n}", **TASK}) for n in range(2)]
    submit_jsonl(client, lines, job_id, tenant=tenant)
    wait_for_state(lambda: client.status(job_id), {"completed"}, key="state")
    return [client.result(task_id) for task_id in client.job_task_ids(job_id)]


def test_a_reused_job_id_is_its_new_tenants_on_a_worker_that_ran_the_old_job(
    redis_server, moto_server, request
):
    """A job id names another job once its records expired, perhaps another tenant's: the
    worker that ran the first attributes the second's tasks to the second's tenant (the
    tenant a pull resolves is the one its result records and its frame-store folder take),
    never to the one it saw before."""
    settings = _settings(redis_server, moto_server, request)
    settings = settings.model_copy(
        update={"fleet": settings.fleet.model_copy(update={"task_ttl_s": 2})}
    )
    client = Client(settings)
    with worker_loop(settings):
        first = _fed_job(client, "reused", "team-a")
        assert {record["tenant"] for record in first} == {"team-a"}
        wait_until(
            lambda: not client.redis.exists(client.keys.job("reused")),
            timeout=20,
            what="the first job's hash to expire",
        )
        second = _fed_job(client, "reused", "team-b")
    assert {record["tenant"] for record in second} == {"team-b"}
    assert {record["id"] for record in first}.isdisjoint(r["id"] for r in second)


# 6. Redis errors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (
            redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
            500,
            "internal_error",
        ),
        (redis.ResponseError("ERR unknown command"), 500, "internal_error"),
        (redis.ConnectionError("Connection refused"), 503, "broker_unavailable"),
        (redis.TimeoutError("Timeout reading"), 503, "broker_unavailable"),
        (
            redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica"),
            503,
            "broker_unavailable",
        ),
        (redis.exceptions.OutOfMemoryError("OOM command not allowed"), 503, "broker_unavailable"),
    ],
)
def test_redis_errors_by_kind(
    redis_server, moto_server, request, make_http, monkeypatch, exc, status, code
):
    http = make_http(_settings(redis_server, moto_server, request))

    def refuse(task_id: str) -> Any:
        raise exc

    monkeypatch.setattr(http.app.state.ctx.client.state.tasks, "get", refuse)
    reply = http.get("/v1/tasks/anything")
    error = _error(reply, status, code)
    for leak in ("WRONGTYPE", "READONLY", "OOM", "refused", "Traceback"):
        assert leak not in reply.text
    if status == 500:
        assert error["message"] == "internal error"


@pytest.mark.private_redis
def test_a_real_wrongtype_reply_is_a_500(redis_server, moto_server, request, make_http):
    http = make_http(_settings(redis_server, moto_server, request))
    client: Client = http.app.state.ctx.client
    client.redis.set(client.keys.task("clobbered"), "not a hash")
    error = _error(http.get("/v1/tasks/clobbered"), 500, "internal_error")
    assert error["message"] == "internal error"
    redis_server.kill()
    _error(http.get("/v1/tasks/clobbered"), 503, "broker_unavailable")
