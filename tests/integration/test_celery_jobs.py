"""A job seen from Celery (``vlmq.celery.submit_many``): its tasks as a GroupResult in order,
its progress from ``AsyncResult(job_id).info``, and Celery's revoke of a job, of a task no
worker has seen, and of a running one (mapped to vlmq's cancel: ``WorkerService.revoke``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app.task import Context
from celery.result import GroupResult

from tests.integration.test_fleet_loop import RecordingEngine, Running, _conversation, make_loop
from tests.support.services import wait_until
from vlmq.celery import TaskFailed, submit_many
from vlmq.config.keys import Keys
from vlmq.config.settings import BatchPolicy, CelerySettings, Settings
from vlmq.config.status import TaskState
from vlmq.config.wire import decode_envelope, encode_message
from vlmq.producers.client import Client
from vlmq.workers.fleet.celery_results import CeleryResults
from vlmq.workers.fleet.service import WorkerService, fleet_state


@pytest.fixture
def app(settings: Settings) -> Iterator[Celery]:
    url = settings.redis_url
    app = Celery("webapp", broker=url, backend=url, set_as_current=False)
    app.conf.update(result_serializer="json", accept_content=["json"])
    yield app
    gc.collect()  # results a get() subscribed for unsubscribe while Redis is still up
    app.close()


def _results(settings: Settings) -> CeleryResults:
    state = fleet_state(Client(settings).redis, settings.fleet)
    return CeleryResults.for_settings(settings, "w1", state)


def _items(n: int) -> list[dict]:
    return [{"messages": _conversation("text", i), "custom_id": f"c{i}"} for i in range(n)]


def test_a_job_is_a_group_result_with_progress(settings, app):
    policy = BatchPolicy(max_batch_size=2, max_wait_s=0.01, token_budget=10**6)
    settings = settings.model_copy(update={"batch": {"text": policy}})
    view = submit_many(Client(settings), _items(6), app=app)
    assert app.AsyncResult(view.id).state == "PROGRESS"
    results = _results(settings)
    loop = make_loop(settings, RecordingEngine(delay_s=0.2), ("text",), [results])

    def in_progress() -> bool:
        meta = app.AsyncResult(view.id)
        return meta.state == "PROGRESS" and 0 < meta.info["done"] < 6

    with Running(loop):
        wait_until(in_progress, timeout=30, what="a job in progress")
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


def test_the_pipelined_meta_is_celerys_own(settings, app):
    """Plain ends go through one pipeline on Celery's Redis backend: the same meta as its
    ``store_result`` writes, with the expiry, published on the key's channel."""
    results = _results(settings)
    backend = results.app.backend
    context = Context(id="t1", root_id="t1", ignore_result=False, group="g", parent_id="p")
    value = {"id": "t1", "output": "x"}
    results._store_many([("t1", value, "SUCCESS", context)])
    backend.store_result("t2", value, "SUCCESS", request=Context(context.__dict__, id="t2"))
    piped, stored = backend.get_task_meta("t1"), backend.get_task_meta("t2")
    for meta in (piped, stored):
        meta.pop("date_done"), meta.pop("task_id")
    assert piped == stored and piped["group_id"] == "g" and piped["parent_id"] == "p"
    ttl = results.app.backend.client.ttl(backend.get_key_for_task("t1"))
    assert 0 < ttl <= settings.celery.result_expires_s
    # A STARTED that comes late never hides an end (a terminal state never changes).
    failure = TaskFailed("media_fetch_failed", "404")
    results._store_many([("t3", failure, "FAILURE", Context(context.__dict__, id="t3"))])
    for task_id in ("t1", "t3"):
        late = Context(context.__dict__, id=task_id)
        results._store_many([(task_id, {"pid": 1}, "STARTED", late)], unless_ended=True)
    assert backend.get_task_meta("t1")["status"] == "SUCCESS"
    assert backend.get_task_meta("t3")["status"] == "FAILURE"
    results.close()


def test_the_rpc_backend_answers_where_each_message_says(settings):
    """With ``rpc://`` the result goes to the reply queue the message names (``reply_to``):
    each app gets its own, whatever the worker's settings."""
    client_app = Celery("webapp", broker=settings.redis_url, backend="rpc://", set_as_current=False)
    client_app.conf.update(accept_content=["json"])
    sent = client_app.send_task(
        "vlmq.generate", kwargs={"request": {"messages": _conversation("text", 1)}}, queue="q"
    )
    raw = Client(settings).redis.rpop("q")
    assert isinstance(raw, str)
    envelope = decode_envelope(raw)
    assert envelope.properties["reply_to"]
    rpc = settings.model_copy(update={"celery": CelerySettings(result_backend="rpc://")})
    results = _results(rpc)
    results.received([envelope])
    results.settled([{"id": sent.id, "status": "succeeded", "output": "hi"}])
    assert sent.get(timeout=10)["output"] == "hi"
    results.close()
    client_app.close()
