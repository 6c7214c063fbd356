"""Cost per result (issue 39's target): the cost fields of a job's results, summed, equal what
`vlmq usage` says, per job and per tenant, to the cent (and to the micro-cent: both are sums
of the same integers). Real Redis, moto's S3 server, an in-process worker loop."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from typing import Any

from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.integration.test_api_support import worker_loop
from tests.integration.test_fleet_loop import _job_done
from tests.integration.test_usage import CountingEngine, _line, _text
from tests.support.services import wait_until
from vlmq.config.cost import Pricing, cents, per_thousand
from vlmq.config.schemas import Result
from vlmq.config.settings import ApiSettings, CostSettings
from vlmq.producers.api.app import create_app
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.cli import cli
from vlmq.producers.client import Client

ADMIN = "admin-key-0123456789"
# A price high enough that a test's few model seconds come to whole cents.
COST = CostSettings(gpu_hour_price=4321.07, currency="EUR", gpu_name="test-gpu")


class BatchedCountingEngine(CountingEngine):
    """CountingEngine whose results name their micro-batch, as the real engines' do."""

    def run(
        self, requests: Any, worker: str | None = None, token_budget: int | None = None
    ) -> list[Result]:
        batch_id = uuid.uuid4().hex[:12]
        results = super().run(requests, worker, token_budget)
        return [r.model_copy(update={"batch_id": batch_id}) for r in results]


def _cli(settings: Any, *args: str) -> str:
    env = {
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
        "VLMQ_COST__CURRENCY": "EUR",
    }
    out = CliRunner().invoke(cli, list(args), env=env)
    assert out.exit_code == 0, out.output
    return out.output


def test_the_results_cost_sums_equal_vlmq_usage_per_job_and_tenant(settings):
    settings = settings.model_copy(update={"cost": COST})
    team_a, team_b = Client(settings, tenant="team-a"), Client(settings, tenant="team-b")
    fed = submit_jsonl(team_a, [_line(n) for n in range(45)], "a-fed").job_id
    listed_a = team_a.submit_many([_text(n, words=2) for n in range(13)], job_id="a-listed")
    listed_b = team_b.submit_many([_text(n, words=3) for n in range(27)], job_id="b-listed")
    jobs = {fed: team_a, listed_a: team_a, listed_b: team_b}
    with worker_loop(settings, BatchedCountingEngine()):
        for job, client in jobs.items():
            wait_until(lambda c=client, j=job: _job_done(c, j), timeout=60, what=job)

    records = {job: [c.result(t) for t in c.job_task_ids(job)] for job, c in jobs.items()}
    pricing = Pricing.of(COST, "cpu")
    batches: dict[str, int] = defaultdict(int)
    for job_records in records.values():
        for record in job_records:
            cost = record["cost"]
            assert (cost["currency"], cost["gpu"], cost["basis"]) == ("EUR", "test-gpu", "model")
            assert cost["ucents"] == pricing.ucents(cost["gpu_us"]) > 0
            batches[record["batch_id"]] += cost["gpu_us"]
    # Every micro-batch's 8 ms, split over its rows by tokens, whole.
    assert set(batches.values()) == {8000}

    def spent(job_records: list[dict[str, Any]]) -> int:
        return sum(r["cost"]["ucents"] for r in job_records)

    # Per job: `vlmq usage --job` (JSON and text) against the sum over its results.
    for job, job_records in records.items():
        report = json.loads(_cli(settings, "usage", "--job", job, "--json"))
        totals = report["totals"]
        assert totals["cost_ucents"] == spent(job_records)
        assert totals["cost"] == cents(spent(job_records)) != "0.00"
        assert totals["gpu_us"] == sum(r["cost"]["gpu_us"] for r in job_records)
        assert report["currency"] == "EUR"
        assert f"{cents(spent(job_records))} EUR" in _cli(settings, "usage", "--job", job)

    # Per tenant, and per model (one model: every tenant's whole).
    report = json.loads(_cli(settings, "usage", "--json"))
    tenants = {t["tenant"]: t["totals"] for t in report["tenants"]}
    a_spent = spent(records[fed]) + spent(records[listed_a])
    b_spent = spent(records[listed_b])
    assert tenants["team-a"]["cost_ucents"] == a_spent
    assert tenants["team-a"]["cost"] == cents(a_spent)
    assert tenants["team-b"]["cost"] == cents(b_spent)
    (model,) = report["models"]
    assert (model["model"], model["cost_ucents"]) == ("counting", a_spent + b_spent)
    text = _cli(settings, "usage", "--tenant", "team-b")
    assert f"{cents(b_spent)} EUR" in text

    # vlmq status JOB: the cost so far and per 1,000 requests.
    status = json.loads(_cli(settings, "status", listed_b, "--json"))["cost"]
    thousand = per_thousand(b_spent, 27)
    assert (status["cost_ucents"], status["requests"]) == (b_spent, 27)
    assert status["per_1000_requests"] == cents(thousand)
    shown = _cli(settings, "status", listed_b)
    assert f"cost so far {cents(b_spent)} EUR for 27 requests" in shown
    assert f"{cents(thousand)} EUR per 1,000 requests" in shown

    # GET /v1/usage says the same.
    api = settings.model_copy(update={"api": ApiSettings(admin_keys=[ADMIN])})
    with TestClient(create_app(api)) as http:
        got = http.get("/v1/usage", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        by_tenant = {t["tenant"]: t["totals"]["cost"] for t in got["tenants"]}
        assert by_tenant == {"team-a": cents(a_spent), "team-b": cents(b_spent)}
        assert got["currency"] == "EUR"
