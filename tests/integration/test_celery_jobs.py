"""A job seen from Celery (``vlmq.celery.submit_many``): its tasks as a GroupResult in order,
its progress from ``AsyncResult(job_id).info``, and Celery's revoke of a job, of a task no
worker has seen, and of a running one (mapped to vlmq's cancel: ``WorkerService.revoke``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.result import GroupResult

from tests.integration.test_fleet_loop import RecordingEngine, Running, _conversation, make_loop
from vlmq.celery import submit_many
from vlmq.config.keys import Keys
from vlmq.config.settings import BatchPolicy
from vlmq.config.status import TaskState
from vlmq.config.wire import encode_message
from vlmq.producers.client import Client
from vlmq.workers.fleet.celery_results import CeleryResults
from vlmq.workers.fleet.service import WorkerService, fleet_state
from vlmq.workers.testing.services import wait_until


@pytest.fixture
def app(settings) -> Iterator[Celery]:
    app = Celery("webapp", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(result_serializer="json", accept_content=["json"], set_as_current=False)
    yield app
    gc.collect()  # results a get() subscribed for unsubscribe while Redis is still up
    app.close()


def _results(settings) -> CeleryResults:
    state = fleet_state(Client(settings).redis, settings.fleet)
    return CeleryResults.for_settings(settings, "w1", state)


def _items(n: int) -> list[dict]:
    return [{"messages": _conversation("text", i), "custom_id": f"c{i}"} for i in range(n)]


def test_a_job_is_a_group_result_with_progress(settings, app):
    policy = BatchPolicy(max_batch_size=2, max_wait_s=0.01, token_budget=10**6)
    settings = settings.model_copy(update={"batch": {"text": policy}})
    view = submit_many(Client(settings), _items(6), app=app)
    assert app.AsyncResult(view.id).state == "PROGRESS"
    seen: list[dict] = []
    results = _results(settings)
    loop = make_loop(settings, RecordingEngine(delay_s=0.2), ("text",), [results])
    with Running(loop):
        wait_until(
            lambda: seen.append(app.AsyncResult(view.id).info) or 0 < seen[-1]["done"] < 6,
            timeout=30,
            what="a job in progress",
        )
        outputs = view.get(timeout=30)
    assert [o["output"] for o in outputs] == [f"echo:c{i}" for i in range(6)]
    assert [o["id"] for o in outputs] == [r.id for r in view.results]
    assert GroupResult.restore(view.id, app=app).results == view.results
    wait_until(lambda: app.AsyncResult(view.id).state == "SUCCESS", what="the job's meta")
    info = app.AsyncResult(view.id).info
    assert (info["done"], info["total"], info["state"]) == (6, 6, "completed")


def test_revoke_a_job_an_unseen_task_and_a_running_one(settings, app):
    client = Client(settings)
    view = submit_many(client, _items(3), app=app)
    service = WorkerService(settings, ["text"], RecordingEngine())
    service.celery_results = _results(settings)
    keys = Keys()
    # A task that runs: revoke does not stop it.
    running = client.submit(_conversation("text", 9))
    client.state.tasks.transition(running, TaskState.RUNNING)
    done = service.revoke([view.id, "unseen-1", running, "bad id!"])
    assert done == {
        view.id: "job: 3 queued tasks cancelled",
        "unseen-1": "cancelled",
        running: "not queued (running or ended): not stopped",
        "bad id!": "not a vlmq id",
    }
    service.celery_results.close()  # every write done
    assert [r.state for r in view.results] == ["REVOKED"] * 3
    assert app.AsyncResult("unseen-1").state == "REVOKED"
    assert app.AsyncResult(view.id).info["state"] == "cancelled"
    # The unseen task's hash is made cancelled, with the task ttl: its message is dropped.
    assert client.redis.ttl(keys.task("unseen-1")) > 0
    client.redis.lpush(keys.queue("image"), encode_message({"messages": []}, "unseen-1", "q"))
    pull = client.state.intake("image").pull(10, 30)
    assert pull.deliveries == [] and pull.dropped == 1
    # Safe to repeat: the second revoke moves nothing more.
    assert service.revoke(["unseen-1"]) == {
        "unseen-1": "not queued (running or ended): not stopped"
    }
