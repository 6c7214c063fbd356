"""Usage per tenant and per job (issue 15, part 3): counted once per task as it settles, so
the sums equal the sums over the result objects; by model and modality; through
``GET /v1/usage`` (a tenant sees its own), ``vlmq usage`` and the worker's Prometheus
counters labelled by tenant."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.integration.test_api_support import worker_loop
from tests.integration.test_fleet_loop import _job_done
from tests.support.services import wait_until
from vlmq.broker.state import State
from vlmq.broker.state.tasks import Move
from vlmq.broker.state.usage import usage_report
from vlmq.config.schemas import FinishReason, Result, Usage
from vlmq.config.settings import ApiSettings
from vlmq.config.status import TaskState
from vlmq.config.usage import TaskUsage
from vlmq.producers.api.app import create_app
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.cli import cli
from vlmq.producers.client import Client
from vlmq.workers.fleet.metrics import WorkerMetrics

KEY_A, KEY_B, ADMIN = "key-of-team-a-0123456789", "key-of-team-b-0123456789", "admin-key-0123456789"


class CountingEngine:
    """Answers with usage that differs per request (prompt: words of its text, completion:
    its number), and a generate time per batch, as a real engine's record carries."""

    model_name = "counting"

    def run(
        self, requests: Any, worker: str | None = None, token_budget: int | None = None
    ) -> list[Result]:
        return [self._answer(r, len(requests), worker) for r in requests]

    def _answer(self, request: Any, size: int, worker: str | None) -> Result:
        text = " ".join(getattr(p, "text", "") for m in request.messages for p in m.content)
        words = text.split()
        return Result(
            id=request.id,
            custom_id=request.custom_id,
            job_id=request.job_id,
            status="succeeded",
            model="counting",
            modality=request.modality,
            output="ok",
            finish_reason=FinishReason.STOP,
            usage=Usage(prompt_tokens=len(words) + 5, completion_tokens=int(words[-1]) % 7 + 1),
            batch_size=size,
            timings={"generate_s": 0.008},
            worker=worker,
        )


def _text(n: int, words: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": " ".join(["w"] * words) + f" {n}"}]


def _line(n: int) -> str:
    return json.dumps({"custom_id": f"c{n}", "messages": _text(n, words=n % 4)})


def _sums(records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "requests": len(records),
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in records),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in records),
    }


def _totals(report: dict[str, Any]) -> dict[str, int]:
    totals = report["totals"]
    return {k: totals[k] for k in ("requests", "prompt_tokens", "completion_tokens")}


def test_usage_sums_equal_the_sums_over_result_objects(settings):
    team_a, team_b = Client(settings, tenant="team-a"), Client(settings, tenant="team-b")
    fed = submit_jsonl(team_a, [_line(n) for n in range(40)], "a-fed").job_id
    single = [team_a.submit(_text(n, words=2)) for n in range(6)]
    listed = team_b.submit_many([_text(n, words=3) for n in range(25)], job_id="b-listed")
    metrics = WorkerMetrics(CollectorRegistry())
    with worker_loop(settings, CountingEngine()) as _:
        for client, job in ((team_a, fed), (team_b, listed)):
            wait_until(lambda c=client, j=job: _job_done(c, j), timeout=60, what=job)
        wait_until(
            lambda: all(team_a.status(t)["state"] == "succeeded" for t in single),
            timeout=60,
            what="team-a's single tasks",
        )

    def records(client: Client, ids: list[str]) -> list[dict[str, Any]]:
        return [client.result(task_id) for task_id in ids]

    fed_records = records(team_a, list(team_a.job_task_ids(fed)))
    single_records = records(team_a, single)
    listed_records = records(team_b, list(team_b.job_task_ids(listed)))
    assert len(fed_records) == 40 and len(listed_records) == 25
    for record in fed_records + single_records:
        assert record["tenant"] == "team-a"
        metrics.result(record)
    for record in listed_records:
        assert record["tenant"] == "team-b"
        metrics.result(record)

    redis, keys = team_a.redis, team_a.keys
    report = {t["tenant"]: t for t in usage_report(redis, keys)["tenants"]}
    assert set(report) == {"team-a", "team-b"}
    assert _totals(report["team-a"]) == _sums(fed_records + single_records)
    assert _totals(report["team-b"]) == _sums(listed_records)
    assert _totals(usage_report(redis, keys, job_id=fed)) == _sums(fed_records)
    assert _totals(usage_report(redis, keys, job_id=listed)) == _sums(listed_records)
    # By model and modality; model seconds are each task's share of its batch's time.
    (row,) = report["team-b"]["by"]
    assert (row["model"], row["modality"]) == ("counting", "text")
    expected_s = sum(0.008 / r["batch_size"] for r in listed_records)
    assert abs(row["model_seconds"] - expected_s) < 1e-3

    # A superseded holder's settle counts nothing (fenced out with its token).
    tasks = State(redis, keys).tasks
    task_id = single[0]
    stale = tasks.settle(
        [Move(task_id, TaskState.SUCCEEDED, {}, token=99, stamp="finished_at")],
        [TaskUsage("counting", "text", 1000, 1000, 1.0)],
    )
    assert stale[0].held is False
    after = usage_report(redis, keys, ["team-a"])["tenants"][0]
    assert _totals(after) == _totals(report["team-a"])

    # The worker's Prometheus counters carry the tenant.
    value = metrics.prompt_tokens.labels("text", "team-b")._value.get()
    assert value == _sums(listed_records)["prompt_tokens"]

    # GET /v1/usage: a tenant sees its own; another tenant's job is not found; admin all.
    api = settings.model_copy(
        update={
            "api": ApiSettings(tenant_keys={KEY_A: "team-a", KEY_B: "team-b"}, admin_keys=[ADMIN])
        }
    )
    with TestClient(create_app(api)) as http:

        def get(key: str, **params: Any) -> Any:
            return http.get("/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"})

        own = get(KEY_A).json()["tenants"]
        assert [t["tenant"] for t in own] == ["team-a"]
        assert _totals(own[0]) == _totals(report["team-a"])
        assert get(KEY_A, job_id=listed).status_code == 404
        assert get(KEY_A, tenant="team-b").status_code == 404
        assert _totals(get(KEY_B, job_id=listed).json()) == _sums(listed_records)
        assert [t["tenant"] for t in get(ADMIN).json()["tenants"]] == ["team-a", "team-b"]

    # vlmq usage (the CLI reads the same counters).
    env = {
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
    }
    out = CliRunner().invoke(cli, ["usage", "--tenant", "team-b", "--json"], env=env)
    assert out.exit_code == 0, out.output
    (cli_b,) = json.loads(out.output)["tenants"]
    assert _totals(cli_b) == _sums(listed_records)
    text = CliRunner().invoke(cli, ["usage", "--job", fed], env=env)
    assert text.exit_code == 0 and "40 requests" in text.output
