"""The continuous driver (issue 14) on real Redis and S3 with ``StepEngine``, a continuous engine
double: new micro-batches go in while a long request decodes, every request is settled once,
and a redelivered request still runs alone."""

from __future__ import annotations

from typing import Any

from tests.integration.test_fleet_loop import Running, _intake_and_leases, _job_done, make_loop
from tests.support.continuous import StepEngine
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.config.settings import BatchPolicy, Settings
from vlmq.producers.client import Client


def _text(i: int, tokens: int) -> dict[str, Any]:
    return {
        "custom_id": f"r{i}",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_new_tokens": tokens,
    }


def _batches_of(settings: Settings, size: int) -> Settings:
    policy = BatchPolicy(max_batch_size=size, max_wait_s=0.02, token_budget=10**6)
    return settings.model_copy(update={"batch": {m: policy for m in ("text", "image", "video")}})


def test_new_work_goes_in_while_a_long_request_decodes(settings: Settings) -> None:
    client = Client(settings)
    lines = [_text(0, 200)] + [_text(i, 2) for i in range(1, 40)]
    job = client.submit_many(lines)
    engine = StepEngine(slots=8, step_s=0.005)  # a decode step takes time, as on a device
    with Running(make_loop(_batches_of(settings, 4), engine, ("text",))):
        wait_until(lambda: _job_done(client, job), timeout=60, what="the job")
    counts = client.status(job)["counts"]
    assert counts["succeeded"] == 40 and counts["failed"] == 0, counts
    long_id = next(t for t in client.job_task_ids(job) if client.result(t)["custom_id"] == "r0")
    last_step = {t: i for i, step in enumerate(engine.steps) for t in step}
    # Every other request went in and came out while the long one was still decoding: ten
    # micro-batches of four (or more, smaller) through an engine of eight slots, none waiting
    # for the slowest row.
    assert all(last_step[t] < last_step[long_id] for t in last_step if t != long_id)
    assert len(engine.submitted) >= 10
    assert max(len(step) for step in engine.steps) <= 8  # never past the engine's slots
    assert len(client.store.keys(job)) == 40  # one result object each
    assert client.result(long_id)["usage"]["completion_tokens"] == 200


def test_a_redelivered_request_runs_alone_in_a_continuous_engine(settings: Settings) -> None:
    client = Client(settings)
    job = client.submit_many([_text(i, 3) for i in range(12)])
    intake, leases = _intake_and_leases(client)
    suspects = []
    for delivery in intake.pull(2, 0).deliveries:  # two ran on a worker that died
        client.redis.hincrby(Keys().task(delivery.task_id), "attempts", 1)
        suspects.append(delivery.task_id)
    leases.reap()
    engine = StepEngine(slots=8)
    with Running(make_loop(_batches_of(settings, 4), engine, ("text",))):
        wait_until(lambda: _job_done(client, job), timeout=60, what="the job")
    assert client.status(job)["counts"]["succeeded"] == 12
    for suspect in suspects:
        # Submitted by itself, and the engine held nothing else while it ran.
        assert [suspect] in engine.submitted
        assert all(step == {suspect} for step in engine.steps if suspect in step)
