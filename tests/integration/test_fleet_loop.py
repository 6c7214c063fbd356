"""The batch loop against a real Redis and moto's S3 server, with a recording engine."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, ClassVar

import pytest
import redis as redis_py
from celery import Celery

from tests.support.services import wait_until
from vlmq.broker.connection import create_redis
from vlmq.broker.state.intake import Intake, Leases
from vlmq.config.keys import Keys
from vlmq.config.schemas import Request, Result
from vlmq.config.settings import BatchPolicy
from vlmq.config.status import TaskState
from vlmq.config.wire import decode_message
from vlmq.producers.client import Client
from vlmq.stores.urls import open_store
from vlmq.workers.fleet.service import compose_loop


class RecordingEngine:
    """Answers every request; remembers what ran; can be told to fail."""

    model_name = "recording"

    def __init__(self, fail: bool = False, delay_s: float = 0.0) -> None:
        self.fail = fail
        self.delay_s = delay_s
        self.ran: list[str] = []
        self.batches: list[int] = []

    def run(self, requests, worker=None, token_budget=None):
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batches.append(len(requests))
        self.ran += [r.id for r in requests]
        if self.fail:
            raise RuntimeError("boom")
        return [
            Result(
                id=r.id,
                custom_id=r.custom_id,
                job_id=r.job_id,
                status="succeeded",
                model="recording",
                modality=r.modality,
                output=f"echo:{r.custom_id}",
                batch_size=len(requests),
                worker=worker,
            )
            for r in requests
        ]


def _conversation(kind: str, n: int) -> list[dict[str, Any]]:
    if kind == "text":
        return [{"role": "user", "content": f"question {n}"}]
    part = {"type": kind, kind: f"/media/{n}.{'png' if kind == 'image' else 'mp4'}"}
    return [{"role": "user", "content": [part, {"type": "text", "text": f"q{n}"}]}]


def make_loop(
    settings, engine, modalities=("text", "image", "video"), observers=(), webhooks=None, **fleet
):
    """A loop as a worker composes it; ``fleet`` overrides FleetSettings fields."""
    update = {"fleet": settings.fleet.model_copy(update=fleet)}
    if webhooks is not None:
        update["webhooks"] = webhooks
    settings = settings.model_copy(update=update)
    store = open_store(settings.results_url, settings.s3_endpoint_url)
    redis = create_redis(settings)
    return compose_loop(settings, list(modalities), engine, "w1", redis, store, observers)


class Running:
    """A loop run as WorkerService runs it: the batch loop on one thread, its heartbeat (lease
    renewals, every third of a lease) on another. Without the heartbeat a loop holds nothing
    past its first batch: it sees its renewals stalled and stops pulling (renewals.py)."""

    def __init__(self, loop):
        self.loop = loop
        self.thread = threading.Thread(target=loop.run_forever, daemon=True)
        self.stopped = threading.Event()
        self.beat = threading.Thread(target=self._heartbeat, daemon=True)

    def _heartbeat(self):
        interval = max(0.2, self.loop.fleet.lease_s / 3)
        while not self.stopped.wait(interval):
            try:
                self.loop.heartbeat()
            except redis_py.RedisError:  # a test that stops Redis: waited out, as the service does
                continue

    def __enter__(self):
        self.loop.heartbeat()
        self.thread.start()
        self.beat.start()
        return self.loop

    def __exit__(self, *exc):
        self.stopped.set()
        self.beat.join(10)
        self.loop.stop()
        self.thread.join(10)
        self.loop.shutdown(10)


def _intake_and_leases(client: Client) -> tuple[Intake, Leases]:
    return client.state.intake("text"), client.state.leases


def _job_done(client, job_id):
    return client.status(job_id)["finished"]


def test_mixed_job_end_to_end_through_s3(settings):
    client = Client(settings)
    items = [
        {"messages": _conversation(kind, n), "custom_id": f"{kind}-{n}"}
        for kind in ("text", "image", "video")
        for n in range(10)
    ]
    job = client.submit_many(items)
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: _job_done(client, job), timeout=30, what="job")
    status = client.status(job)
    assert status["total"] == 30
    assert status["counts"]["succeeded"] == 30
    assert status["counts"]["queued"] == status["counts"]["running"] == 0
    keys = client.store.keys(job)
    assert len(keys) == 30
    ids = list(client.job_task_ids(job))
    record = client.result(ids[0])
    assert record["status"] == "succeeded" and record["output"].startswith("echo:")
    assert {"queued_at", "finished_at"} <= set(record["timings"])
    assert sorted(engine.ran) == sorted(ids)  # each ran exactly once
    assert max(engine.batches) <= 8


def test_routing_keeps_classes_apart(settings):
    client = Client(settings)
    video = client.submit(_conversation("video", 1))
    text = client.submit(_conversation("text", 1))
    engine = RecordingEngine()
    with Running(make_loop(settings, engine, modalities=("text",))):
        wait_until(lambda: client.status(text)["state"] == "succeeded", what="text task")
    assert client.status(video)["state"] == "queued"
    assert video not in engine.ran
    assert client.redis.llen(Keys().queue("video", "interactive")) == 1


def test_a_raising_batch_fails_each_request_and_acks(settings):
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(12)])
    with Running(make_loop(settings, RecordingEngine(fail=True))):
        wait_until(lambda: _job_done(client, job), what="job")
    status = client.status(job)
    assert status["counts"]["failed"] == 12
    record = client.result(next(client.job_task_ids(job)))
    assert record["error"]["code"] == "internal_error"
    assert "boom" not in json.dumps(record)
    assert client.redis.hlen(Keys().inflight()) == 0


def test_cancelled_and_expired_tasks_never_run(settings):
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(10)])
    ids = list(client.job_task_ids(job))
    assert client.cancel(ids[0]) == 1
    expired = client.submit(_conversation("text", 99), expires_in_s=0.001)
    assert client.cancel(job) == 9
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.status(expired)["state"] == "expired", what="expiry")
        wait_until(lambda: client.redis.llen("vlmq.text") == 0, what="queue drained")
    assert engine.ran == []
    assert client.status(job)["counts"]["cancelled"] == 10
    assert client.cancel(ids[0]) == 0  # already terminal


def test_duplicate_publication_gives_one_result(settings):
    client = Client(settings)
    task = client.submit(_conversation("text", 1), lane="bulk")
    raw: str = client.redis.lindex("vlmq.text", 0)  # type: ignore[assignment]
    client.redis.lpush("vlmq.text", raw, raw)  # delivered three times in all
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.redis.llen("vlmq.text") == 0, what="drain")
        wait_until(lambda: client.redis.hlen(Keys().inflight()) == 0, what="acks")
    assert engine.ran == [task]
    assert client.status(task)["state"] == "succeeded"
    assert len(client.store.keys("_tasks")) == 1


def test_plain_celery_send_task_is_served(settings):
    app = Celery(broker=settings.redis_url)
    app.conf.update(task_serializer="json", accept_content=["json"])
    request = {"messages": _conversation("image", 5), "custom_id": "from-celery"}
    sent = app.send_task("vlmq.generate", kwargs={"request": request}, queue="vlmq.image")
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(
            lambda: Client(settings).status(sent.id)["state"] == "succeeded", what="celery task"
        )
    assert engine.ran == [sent.id]
    record = Client(settings).result(sent.id)
    assert record["custom_id"] == "from-celery"


def test_our_messages_are_valid_celery_messages(settings):
    client = Client(settings)
    client.submit(_conversation("text", 1), custom_id="x", lane="bulk")
    raw: str = client.redis.lindex("vlmq.text", 0)  # type: ignore[assignment]
    message = decode_message(raw)
    assert message.task_name == "vlmq.generate"
    assert Request.model_validate(message.request).custom_id == "x"
    # kombu itself can decode the envelope and body
    from kombu.transport.virtual import Message as KombuMessage

    class _Channel:
        codecs: ClassVar[dict] = {}

        @staticmethod
        def decode_body(body, encoding):
            import base64

            return base64.b64decode(body)

    parsed = KombuMessage(json.loads(raw), channel=_Channel())
    assert parsed.headers["task"] == "vlmq.generate"
    assert parsed.decode()[1]["request"]["custom_id"] == "x"


def test_unacked_messages_of_a_dead_worker_come_back_then_dead_letter(settings):
    client = Client(settings)
    task = client.submit(_conversation("text", 1), lane="bulk")
    intake, leases = _intake_and_leases(client)
    for delivery in (1, 2, 3):  # three workers "die" while running it
        got = wait_until(lambda: intake.pull(8, 0).deliveries, what="redelivery")
        assert [d.token for d in got] == [delivery]
        client.redis.hincrby(Keys().task(task), "attempts", 1)
        assert leases.reap() == 1
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.status(task)["state"] == "failed", what="dead letter")
    assert engine.ran == []
    assert client.status(task)["error_code"] == "dead_lettered"
    dead = json.loads(client.redis.lindex(Keys().dead_letters(), 0))  # type: ignore[arg-type]
    assert dead["task_id"] == task and "3 times" in dead["reason"]


def test_a_held_but_never_run_request_is_not_counted_as_an_attempt(settings):
    client = Client(settings)
    task = client.submit(_conversation("text", 1), lane="bulk")
    intake, leases = _intake_and_leases(client)
    for _ in range(5):  # pulled and lost five times, never handed to an engine
        wait_until(lambda: intake.pull(8, 0).deliveries, what="redelivery")
        leases.reap()
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.status(task)["state"] == "succeeded", what="success")
    assert engine.ran == [task]


def _pulled(intake: Intake, lease_s: float = 30) -> Any:
    (delivery,) = wait_until(lambda: intake.pull(8, lease_s).deliveries, what="a delivery")
    return delivery


def test_clean_give_backs_and_hand_ons_are_not_deaths(settings):
    """A task given back cleanly and handed on, more often than the bound on deliveries
    without a start, had no holder die: it runs (issue 37, 9)."""
    client = Client(settings)
    task = client.submit(_conversation("image", 1), lane="bulk")
    prepare, leases = client.state.intake("image", role="prepare"), client.state.leases
    for _ in range(3):  # prepare workers stopping: each gives it back
        delivery = _pulled(prepare)
        leases.give_back({task: delivery.token})
    delivery = _pulled(prepare)
    prepared = Keys().prepared_queue("image", "bulk")
    assert leases.hand_on(prepared, {task: delivery.token}) == {task: "on"}
    delivery = _pulled(client.state.intake("image"))  # a GPU worker stopping gives it back
    leases.give_back({task: delivery.token})
    engine = RecordingEngine()
    with Running(make_loop(settings, engine, max_unstarted_deliveries=4)):
        wait_until(lambda: client.status(task)["state"] in ("succeeded", "failed"), what="end")
    assert client.status(task)["state"] == "succeeded", client.status(task)
    assert engine.ran == [task]


def test_a_delivery_alone_that_was_returned_is_not_counted_as_a_death_alone(settings):
    """Its holders died twice before starting it, so it goes alone; each time alone it was
    given back or handed on, never died: it is not dead-lettered as a killer (issue 37, 9)."""
    client = Client(settings)
    task = client.submit(_conversation("image", 1), lane="bulk")
    prepare, leases = client.state.intake("image", role="prepare"), client.state.leases
    for _ in range(2):  # two prepare workers died holding it
        _pulled(prepare, lease_s=0)
        assert leases.reap() == 1
    for _ in range(3):  # alone, then given back
        delivery = _pulled(prepare)
        client.state.tasks.mark_alone(task, delivery.token)
        leases.give_back({task: delivery.token})
    delivery = _pulled(prepare)
    client.state.tasks.mark_alone(task, delivery.token)
    prepared = Keys().prepared_queue("image", "bulk")
    assert leases.hand_on(prepared, {task: delivery.token}) == {task: "on"}
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.status(task)["state"] in ("succeeded", "failed"), what="end")
    assert client.status(task)["state"] == "succeeded", client.status(task)
    assert engine.ran == [task]


def test_redelivered_requests_run_alone(settings):
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(6)])
    intake, leases = _intake_and_leases(client)
    for delivery in intake.pull(3, 0).deliveries:  # three ran on a worker that died
        client.redis.hincrby(Keys().task(delivery.task_id), "attempts", 1)
    leases.reap()
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: _job_done(client, job), what="job")
    assert sorted(engine.batches) == [1, 1, 1, 3]


def test_unknown_ids_are_unknown(settings):
    client = Client(settings)
    assert client.status("no-such-id")["state"] == TaskState.UNKNOWN.value
    assert client.statuses(["a", "b"]) == [TaskState.UNKNOWN, TaskState.UNKNOWN]


def test_validation_errors_name_the_field_and_enqueue_nothing(settings):
    from vlmq.config.errors import InvalidRequest

    client = Client(settings)
    good = {"messages": _conversation("text", 1)}
    bad = {"messages": [{"role": "user", "content": [{"type": "image"}]}]}
    with pytest.raises(InvalidRequest) as info:
        client.submit_many([good, bad])
    assert "item 1" in info.value.message and "messages" in info.value.message
    assert client.redis.llen("vlmq.text") == 0


def test_bulk_jobs_share_workers_fairly_and_interactive_goes_first(settings):
    client = Client(settings)
    big = client.submit_many([_conversation("text", n) for n in range(200)])
    small = client.submit_many([_conversation("text", n) for n in range(16)])
    urgent = [client.submit(_conversation("text", n)) for n in range(3)]
    engine = RecordingEngine(delay_s=0.01)
    with Running(make_loop(settings, engine)):
        wait_until(lambda: _job_done(client, small), what="the small job")
        big_done = client.status(big)["done"]
    assert engine.ran[:3] == urgent  # the interactive lane is served first
    assert big_done <= 40, big_done  # the small job did not wait behind the big one
    active = client.redis.zrange(Keys().active_jobs("text", "default"), 0, -1)
    assert set(active) <= {f"vlmq.text.job.{big}"}


def _one_job(client: Client) -> list[str]:
    return [client.submit_many([_conversation("text", n) for n in range(1000)])]


def _twenty_jobs(client: Client) -> list[str]:
    return [
        client.submit_many([_conversation("text", 50 * j + n) for n in range(50)])
        for j in range(20)
    ]


@pytest.mark.parametrize("first_jobs", [_one_job, _twenty_jobs], ids=["one-job", "twenty-jobs"])
def test_fair_share_across_tenants_before_jobs(settings, first_jobs):
    """A tenant with 1,000 queued tasks and one with 10 submitted after it: the second
    finishes first. With the first tenant's tasks in 20 jobs, sharing by job alone would give
    the second tenant 1 of 22 shares (done after ~150 of the first's tasks in pulls of 16);
    sharing by tenant first gives it a third of each pull, then the room left."""
    text = BatchPolicy(max_batch_size=16, max_wait_s=0.01, token_budget=32768)
    settings = settings.model_copy(update={"batch": {**settings.batch, "text": text}})
    first, second = Client(settings, tenant="team-a"), Client(settings, tenant="team-b")
    first_ids = first_jobs(first)
    small = second.submit_many([_conversation("text", n) for n in range(10)])
    engine = RecordingEngine(delay_s=0.002)
    with Running(make_loop(settings, engine)):
        wait_until(lambda: _job_done(second, small), timeout=120, what="team-b's job")
        first_done = sum(first.status(job)["done"] for job in first_ids)
    # Two pulls of 16 for team-b's 10, plus the pipeline's prefetched batches of team-a's.
    assert first_done <= 64, first_done
    assert second.status(small)["tenant"] == "team-b"
    assert first.status(first_ids[0])["tenant"] == "team-a"


def test_an_existing_task_id_is_refused(settings):
    from vlmq.config.errors import InvalidRequest

    client = Client(settings)
    request = Request.model_validate({"messages": _conversation("text", 1)})
    client.submit_many([request])
    with pytest.raises(InvalidRequest, match="already exists"):
        client.submit_many([request])
    with pytest.raises(InvalidRequest, match="already exists"):
        client.submit(request)


def test_the_class_token_budget_reaches_the_engine(settings):
    class BudgetEngine(RecordingEngine):
        budgets: ClassVar[list] = []

        def run(self, requests, worker=None, token_budget=None):
            BudgetEngine.budgets.append(token_budget)
            return super().run(requests, worker)

    client = Client(settings)
    job = client.submit_many([_conversation("image", n) for n in range(3)])
    policies = dict(settings.batch)
    policies["image"] = policies["image"].model_copy(update={"token_budget": 1234})
    loop = make_loop(settings.model_copy(update={"batch": policies}), BudgetEngine())
    with Running(loop):
        wait_until(lambda: _job_done(client, job), what="job")
    assert BudgetEngine.budgets == [1234]
