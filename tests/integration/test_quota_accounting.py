"""A tenant's queued-work counts (Keys.quota: tasks, tokens) follow its tasks exactly through
every path: single tasks, submit_many in both lanes, fed jobs (lines not fed yet included),
cancel and expiry; they return to zero when the work is gone, and a quota refuses a
submission that would pass it, then admits it once the queue drained."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.test_api_support import EchoEngine, worker_loop
from tests.integration.test_feeding import _feeding
from tests.integration.test_fleet_loop import _job_done
from tests.support.services import wait_until
from vlmq.config.errors import QuotaExceeded
from vlmq.config.settings import TenantQuota, TenantSettings
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client


def _text(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"question number {n}"}]


def _lines(count: int, prefix: str = "c") -> list[str]:
    return [json.dumps({"custom_id": f"{prefix}{n}", "messages": _text(n)}) for n in range(count)]


def _with_quota(settings: Any, **quota: Any) -> Any:
    tenants = TenantSettings(quotas={"team-a": TenantQuota(**quota)})
    fleet = settings.fleet.model_copy(update={"feed_window": 40})
    return settings.model_copy(update={"tenants": tenants, "fleet": fleet})


def _queued(client: Client) -> tuple[int, int]:
    work = client.state.tenants.queued(client.tenant)
    return work.tasks, work.tokens


def test_counts_follow_every_path_and_return_to_zero(settings):
    settings = _with_quota(settings, max_queued_tokens=10**9)  # the estimate is taken
    client = Client(settings, tenant="team-a")
    other = Client(settings, tenant="team-b")
    singles = [client.submit(_text(n)) for n in range(5)]
    client.submit_many([_text(n) for n in range(10)])
    client.submit_many([_text(n) for n in range(4)], lane="interactive")
    fed = submit_jsonl(client, _lines(300), "fed-job")  # 40 fed now, 260 wait in the store
    submit_jsonl(client, _lines(100, "x"), "cancelled-job")
    other.submit_many([_text(n) for n in range(7)])
    tasks, tokens = _queued(client)
    assert tasks == 5 + 10 + 4 + 300 + 100
    assert tokens > 0
    assert _queued(other) == (7, 0)  # team-b has no token quota: nothing estimated
    # Every task's estimate: the job's mean times its queued count, the single ones' own.
    per_task = tokens / tasks
    assert 5 < per_task < 10_000

    client.cancel(singles[0])
    client.cancel("cancelled-job")
    assert _queued(client)[0] == 5 + 10 + 4 + 300 + 100 - 1 - 100

    with worker_loop(settings, EchoEngine()), _feeding(client):
        wait_until(lambda: _job_done(client, fed.job_id), timeout=120, what="the fed job")
        wait_until(lambda: _queued(client) == (0, 0), timeout=60, what="team-a's counts at 0")
        wait_until(lambda: _queued(other) == (0, 0), timeout=60, what="team-b's counts at 0")


def test_expired_work_leaves_the_counts(settings):
    settings = _with_quota(settings)
    client = Client(settings, tenant="team-a")
    submit_jsonl(client, _lines(120), "expiring", completion_window_s=0.2)
    client.submit(_text(1), expires_in_s=0.2)
    assert _queued(client)[0] == 121
    with worker_loop(settings, EchoEngine()), _feeding(client):
        wait_until(lambda: _queued(client) == (0, 0), timeout=60, what="counts at 0")
    assert client.status("expiring")["state"] == "expired"


def test_a_quota_refuses_then_admits_once_drained(settings):
    settings = _with_quota(settings, max_queued_tasks=50)
    client = Client(settings, tenant="team-a")
    client.submit_many([_text(n) for n in range(45)])
    with pytest.raises(QuotaExceeded) as refused:
        client.submit_many([_text(n) for n in range(6)])
    assert refused.value.code == "quota_exceeded" and "max_queued_tasks" in refused.value.message
    with pytest.raises(QuotaExceeded):
        submit_jsonl(client, _lines(6), "too-much")
    assert _queued(client) == (45, 0)  # nothing of the refused ones was counted or queued
    # Another tenant is not limited by team-a's quota.
    Client(settings, tenant="team-b").submit_many([_text(n) for n in range(60)])
    with worker_loop(settings, EchoEngine()):
        wait_until(lambda: _queued(client) == (0, 0), timeout=60, what="team-a drained")
    client.submit_many([_text(n) for n in range(50)])
    assert _queued(client) == (50, 0)
