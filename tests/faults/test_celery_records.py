"""Celery records of tasks that end before a worker reads their message, with a real
``vlmq worker`` and a web app's Celery app: a message over ``max_message_bytes``, one whose
body cannot be read, a task dead-lettered after its holders died before starting it. Each
ends FAILURE for its caller (vlmq's status says failed), never PENDING for ever; a message
that asked for no result gets none (issue 37, 2)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from tests.support.faults.prepare import failure_of
from tests.support.fleet import Processes, celery_message

pytestmark = pytest.mark.faults

MAX_MESSAGE_BYTES = 4096
GENERATE = "vlmq.generate"


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Any) -> Iterator[Processes]:
    procs = Processes(
        redis_server.url,
        moto_server,
        tmp_path,
        VLMQ_FLEET__MAX_MESSAGE_BYTES=str(MAX_MESSAGE_BYTES),
        VLMQ_FLEET__MAX_UNSTARTED_DELIVERIES="2",
    )
    yield procs
    procs.stop()


def _request(text: str) -> dict[str, Any]:
    return {"request": {"messages": [{"role": "user", "content": text}], "max_new_tokens": 4}}


def test_tasks_that_fail_before_their_message_is_read_end_failure(
    fleet: Processes, celery_app: Celery
) -> None:
    queue = fleet.keys.queue("text")
    client = fleet.client()
    doomed = celery_app.send_task(GENERATE, kwargs=_request("dies"), queue=queue)
    intake, leases = client.state.intake("text"), client.state.leases
    for _ in range(2):  # two holders died before starting it
        assert [d.task_id for d in intake.pull(8, 0).deliveries] == [doomed.id]
        assert leases.reap() == 1
    big = _request("x" * MAX_MESSAGE_BYTES)
    oversized = celery_app.send_task(GENERATE, kwargs=big, queue=queue)
    quiet = celery_app.send_task(GENERATE, kwargs=big, queue=queue, ignore_result=True)
    unreadable_id = str(uuid.uuid4())
    message = json.loads(celery_message(unreadable_id, _request("hi")["request"], queue, {}))
    message["body"] = "not base64!"
    fleet.redis.lpush(queue, json.dumps(message))
    unreadable = celery_app.AsyncResult(unreadable_id)
    control = celery_app.send_task(GENERATE, kwargs=_request("fine"), queue=queue)
    worker = fleet.worker("w1")
    assert control.get(timeout=30)["id"] == control.id
    assert failure_of(doomed, timeout=15)[0] == "dead_lettered"
    assert failure_of(oversized, timeout=15)[0] == "invalid_request"
    assert failure_of(unreadable, timeout=15)[0] == "invalid_request"
    for task in (doomed.id, oversized.id, unreadable_id, quiet.id):
        assert client.status(task)["state"] == "failed"
    assert fleet.terminate(worker) == 0  # every record it had to write is written by then
    assert not fleet.redis.exists(f"celery-task-meta-{quiet.id}")
