"""The fleet with real worker processes, a real Redis and moto's S3 server."""

from __future__ import annotations

import json
import signal
from typing import Any

from tests.support.faults.inject import Faults
from tests.support.samples import save_image, save_video
from tests.support.services import wait_until
from vlmq.broker.state.usage import usage_report
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client


def _policy(size: int, wait: float = 0.05) -> dict:
    return {"max_batch_size": size, "max_wait_s": wait, "token_budget": 10**6}


def _client(env: dict[str, str]) -> Client:
    return Client(
        Settings(
            redis_url=env["VLMQ_REDIS_URL"],
            results_url=env["VLMQ_RESULTS_URL"],
            s3_endpoint_url=env["VLMQ_S3_ENDPOINT_URL"],
        )
    )


def _ready(client: Client, count: int) -> bool:
    return client.redis.hlen(Keys().workers()) >= count


def _pointed(client: Client, ids: list[str]) -> list[str]:
    """The store key each task's status points at (its winning delivery's object)."""
    urls = [s["result_url"] for s in client.state.tasks.many(ids, ("result_url",))]
    return [client.store.key_of(url) for url in urls]


def _job_finished(client: Client, job: str) -> bool:
    return client.status(job)["finished"]


def test_mixed_submission_end_to_end_through_s3(fleet, fleet_env, tiny_model, tmp_path):
    save_image(tmp_path / "a.png", size=(64, 64), seed=1)
    save_video(tmp_path / "v.mp4", n_frames=8, size=(64, 64), fps=4, seed=2)
    env = {"VLMQ_MODEL": str(tiny_model)}
    for modality in ("text", "image", "video"):
        fleet.start("--modality", modality, "--name", f"{modality}-worker", env=env)
    client = _client(fleet_env)
    wait_until(lambda: _ready(client, 3), timeout=120, what="3 workers")
    # Each worker record names its GPU and price (no CUDA here: 'cpu'; no price set: 0).
    for record in client.state.workers.all().values():
        assert record["cost"] == {"gpu": "cpu", "gpu_hour_price": 0.0, "currency": "USD"}
    image = {"type": "image", "image": str(tmp_path / "a.png")}
    video = {"type": "video", "video": str(tmp_path / "v.mp4")}
    items = (
        [
            {"custom_id": f"t{i}", "messages": [{"role": "user", "content": f"hi {i}"}]}
            for i in range(6)
        ]
        + [
            {"custom_id": f"i{i}", "messages": [{"role": "user", "content": [image, "what?"]}]}
            for i in range(4)
        ]
        + [
            {"custom_id": f"v{i}", "messages": [{"role": "user", "content": [video, "what?"]}]}
            for i in range(3)
        ]
        + [
            {
                "custom_id": "bad",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": str(tmp_path / "missing.png")}],
                    }
                ],
            }
        ]
    )
    job = client.submit_many(items, name="e2e")
    wait_until(lambda: _job_finished(client, job), timeout=240, what="job")
    status = client.status(job)
    assert status["counts"]["succeeded"] == 13 and status["counts"]["failed"] == 1
    ids = list(client.job_task_ids(job))
    keys = client.store.keys(job)
    assert sorted(keys) == sorted(_pointed(client, ids))
    for task_id in ids:
        record = client.result(task_id)
        modality = record["modality"]
        assert record["worker"].startswith(f"{modality}-worker"), record  # routing
        if record["custom_id"] == "bad":
            assert record["error"]["code"] == "media_fetch_failed"
        else:
            assert record["status"] == "succeeded" and record["usage"]["completion_tokens"] > 0
            assert record["batch_size"] >= 1 and record["model"] == str(tiny_model)
    # Usage, counted as each task settled, is the sum over the result objects (real engine).
    records = [client.result(task_id) for task_id in ids]
    expected = {
        "requests": len(records),
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in records),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in records),
    }
    assert expected["prompt_tokens"] > 0
    job_usage = usage_report(client.redis, client.keys, job_id=job)["totals"]
    (tenant,) = usage_report(client.redis, client.keys)["tenants"]
    for totals in (job_usage, tenant["totals"]):
        assert {k: totals[k] for k in expected} == expected
        assert totals["model_seconds"] > 0
        # GPU time charged per result (real engine: measured, split by tokens) sums exactly.
        assert totals["gpu_us"] == sum(r["cost"]["gpu_us"] for r in records) > 0
        assert totals["cost_ucents"] == sum(r["cost"]["ucents"] for r in records)
    assert tenant["tenant"] == "default" and {r["tenant"] for r in records} == {"default"}


def _submit_text(client: Client, n: int, marker: str = "") -> str:
    def text(i: int) -> str:
        return f"task {i} {marker}" if marker and i == 0 else f"task {i}"

    items = [
        {"custom_id": f"c{i}", "messages": [{"role": "user", "content": text(i)}]} for i in range(n)
    ]
    return client.submit_many(items)


NOOP = ("--modality", "text", "--engine", "noop")
BATCH16 = {"VLMQ_BATCH": json.dumps({m: _policy(16) for m in ("text", "image", "video")})}


def _in_engine(client: Client, ids: list[str], worker: str) -> bool:
    """Some request is inside ``worker``'s engine right now (running, attempted)."""
    fields = ("state", "attempts", "worker")
    return any(
        s.get("state") == "running" and s.get("worker") == worker and s.get("attempts")
        for s in client.state.tasks.many(ids, fields)
    )


def test_kill9_mid_batch_loses_nothing_and_duplicates_nothing(fleet, fleet_env):
    client = _client(fleet_env)
    job = _submit_text(client, 240)
    ids = list(client.job_task_ids(job))
    for name in ("victim-1", "victim-2"):  # kill -9 twice inside a batch, then restart
        worker = fleet.start(
            *NOOP, "--noop-delay", "0.4", "--no-celery", "--name", name, env=BATCH16
        )
        wait_until(
            lambda n=name: _in_engine(client, ids, n), timeout=60, what="a batch inside the engine"
        )
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    fleet.start(*NOOP, "--noop-delay", "0.05", env=BATCH16)
    wait_until(lambda: _job_finished(client, job), timeout=120, what="job after kills")
    status = client.status(job)
    assert status["counts"] == {
        "queued": 0,
        "running": 0,
        "succeeded": 240,
        "failed": 0,
        "cancelled": 0,
        "expired": 0,
    }
    assert sorted(client.store.keys(job)) == sorted(_pointed(client, ids))  # one object each
    attempts = [int(s["attempts"]) for s in client.state.tasks.many(ids)]
    assert max(attempts) >= 2  # the killed batches ran again
    assert client.redis.hlen(Keys().inflight()) == 0


def test_sigterm_finishes_or_returns_in_flight_work(fleet, fleet_env):
    client = _client(fleet_env)
    job = _submit_text(client, 64)
    worker = fleet.start(*NOOP, "--noop-delay", "1.0", env=BATCH16)
    wait_until(lambda: client.status(job)["counts"]["running"] > 0, timeout=60, what="running")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    counts = client.status(job)["counts"]
    assert counts["running"] == 0, counts  # nothing half-done
    assert client.redis.hlen(Keys().inflight()) == 0  # nothing held by the dead worker
    assert counts["succeeded"] + counts["queued"] == 64
    fleet.start(*NOOP, env=BATCH16)
    wait_until(lambda: _job_finished(client, job), timeout=60, what="job")
    assert client.status(job)["counts"]["succeeded"] == 64


def _deaths_until_finished(fleet: Any, client: Client, job: str, env: dict, most: int) -> int:
    """Start a worker after each one that dies, until ``job`` finishes; how many died."""
    deaths = 0
    while not _job_finished(client, job):
        worker = fleet.start(*NOOP, env=env)
        wait_until(
            lambda w=worker: w.poll() is not None or _job_finished(client, job),
            timeout=60,
            what="a crash or the end of the job",
        )
        if worker.poll() is not None:
            deaths += 1
        assert deaths <= most, "the crashing request kept looping"
    return deaths


def _only_the_poison_dead_lettered(client: Client, job: str, deaths: int) -> None:
    status = client.status(job)
    assert status["counts"]["succeeded"] == 5 and status["counts"]["failed"] == 1, (
        status["counts"],
        deaths,
    )
    poison = next(i for i in client.job_task_ids(job) if client.status(i)["custom_id"] == "c0")
    assert client.result(poison)["error"]["code"] == "dead_lettered"
    assert client.redis.llen(Keys().dead_letters()) == 1


def test_a_request_that_kills_its_worker_is_dead_lettered(fleet, fleet_env):
    client = _client(fleet_env)
    job = _submit_text(client, 6, marker="CRASH-ME")
    env = {**BATCH16, **Faults(crash_marker="CRASH-ME").env()}
    deaths = _deaths_until_finished(fleet, client, job, env, most=5)
    _only_the_poison_dead_lettered(client, job, deaths)
    assert deaths == 3  # the first batch, then the suspect alone twice


def test_a_request_that_kills_its_worker_before_it_starts_is_isolated(fleet, fleet_env):
    """A request whose preparation kills its worker (a native decoder crash, an OOM kill
    while decoding) takes its batch down twice; then each is prepared alone, least-tried
    first, so the batch-mates run and it alone dies, three more times, and is dead-lettered:
    not its batch."""
    client = _client(fleet_env)
    job = _submit_text(client, 6, marker="CRASH-ME")
    env = {**BATCH16, **Faults(prepare_crash_marker="CRASH-ME").env()}
    deaths = _deaths_until_finished(fleet, client, job, env, most=7)
    _only_the_poison_dead_lettered(client, job, deaths)
    assert deaths == 5  # the batch twice, then the suspect alone three times


def test_a_stuck_batch_makes_the_worker_exit_and_its_work_move_on(fleet, fleet_env):
    client = _client(fleet_env)
    job = _submit_text(client, 20)
    stuck = fleet.start(
        *NOOP,
        "--noop-delay",
        "30",
        "--no-celery",
        env={**BATCH16, "VLMQ_FLEET__BATCH_TIME_LIMIT_S": "1.5"},
    )
    assert stuck.wait(60) == 70  # the watchdog's exit code: intake is never wedged
    fleet.start(*NOOP, "--noop-delay", "0.05", env=BATCH16)
    wait_until(lambda: _job_finished(client, job), timeout=90, what="the job elsewhere")
    assert client.status(job)["counts"]["succeeded"] == 20
