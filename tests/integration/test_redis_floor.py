"""bench.redis_floor's designs keep the guarantees they are a floor for.

A floor that skipped a check would be cheaper than any real design: each model must name a
message by its id and the tag its task was created with, count a delivery as the fencing
token, refuse a superseded holder's start and settle, and acknowledge every lease; the model of
vlmq's redesign (``lean``) must also do what it claims of vlmq's features.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.redis_floor import JOB, Floor, message, new_tasks

DESIGNS = ("hash", "fields", "lean")


@pytest.fixture
def redis(redis_server):
    connection = redis_server.connect()
    yield connection
    connection.close()


def _counters(redis: Any) -> dict[str, int]:
    counts = redis.hmget(f"floor:job:{JOB}", "queued", "running", "succeeded")
    return dict(zip(("queued", "running", "succeeded"), map(int, counts), strict=True))


@pytest.mark.parametrize("design", DESIGNS)
def test_every_task_runs_once_and_is_acknowledged(redis, design):
    floor, work = Floor(redis, design), new_tasks(40)
    assert floor.enqueue(work) == 40
    batches = []
    while held := floor.pull(16):
        batches.append(held)
    assert [len(b) for b in batches] == [16, 16, 8]
    assert sorted(i for b in batches for i, _ in b) == sorted(t[0] for t in work)
    assert {token for b in batches for _, token in b} == {"1"}
    for n, held in enumerate(batches):
        assert floor.start(held, f"b{n}") == [1] * len(held)
    for held in batches:
        assert floor.settle(held) == [1] * len(held)
    assert _counters(redis) == {"queued": 0, "running": 0, "succeeded": 40}
    assert redis.hlen(Floor.INFLIGHT) == 0
    assert redis.zcard(Floor.LEASES) == 0


@pytest.mark.parametrize("design", DESIGNS)
def test_a_superseded_holder_neither_starts_nor_settles(redis, design):
    floor, work = Floor(redis, design), new_tasks(1)
    floor.enqueue(work)
    [first] = floor.pull(1)
    floor.requeue(*work[0][::2])  # the reaper gives its copy back
    [second] = floor.pull(1)
    assert (first[1], second[1]) == ("1", "2")
    assert floor.start([first], "old") == [0]
    assert floor.start([second], "new") == [1]
    assert floor.settle([first]) == [0]
    assert floor.settle([second]) == [1]
    assert _counters(redis)["succeeded"] == 1


@pytest.mark.parametrize("design", DESIGNS)
def test_a_message_with_another_tag_is_not_taken(redis, design):
    floor, work = Floor(redis, design), new_tasks(1)
    floor.enqueue(work)
    task_id = work[0][0]
    redis.delete(Floor.QUEUE, Floor.JOB_LIST)
    floor.requeue(task_id, message(task_id, "forged"))
    assert floor.pull(1) == []
    assert redis.hlen(Floor.INFLIGHT) == 0


def test_the_lean_design_keeps_vlmqs_features(redis):
    """The design that models vlmq's redesign does what vlmq does past the guarantees: one
    task per id while it lives or succeeded, fair share's zsets, origins, the completion list,
    usage, the quota and a finish check."""
    floor, work = Floor(redis, "lean"), new_tasks(20)
    assert floor.enqueue(work) == 20
    assert floor.enqueue(work[:5]) == 0  # live: a line with its id is skipped
    held = floor.pull(32)
    assert len(held) == 20
    assert redis.hget("floor:origins", held[0][0]) == Floor.JOB_LIST
    assert redis.hget("floor:origin-zsets", held[0][0]) == Floor.ACTIVE
    assert floor.pull(32) == []  # its list emptied: it leaves fair share's zsets
    assert redis.zcard(Floor.ACTIVE) == 0 and redis.zcard(Floor.CLASS_ACTIVE) == 0
    assert floor.start(held, "b0") == [1] * 20
    assert floor.settle(held) == [1] * 20
    assert redis.lrange(f"floor:job:{JOB}:finished", 0, -1) == [i for i, _ in held]
    usage = redis.hgetall(f"floor:usage:{Floor.TENANT}")
    assert usage["noop|text|requests"] == "20" and usage["noop|text|tokens_out"] == "320"
    assert redis.hget(f"floor:quota:{Floor.TENANT}", "tasks") == "0"
    assert redis.hexists(f"floor:job:{JOB}", "finished_at")
    assert floor.enqueue(work[:5]) == 0  # succeeded: skipped too
    record = redis.hget(Floor.STATES + JOB, work[0][0])
    assert record.startswith("succeeded 1 1 " + work[0][1] + " b0 ")
    assert record.endswith(f" text custom {work[0][0]}")


def test_a_lean_chunk_queues_an_id_once(redis):
    floor, [task] = Floor(redis, "lean"), new_tasks(1)
    assert floor.enqueue([task, task]) == 1
    assert redis.llen(Floor.JOB_LIST) == 1


def test_a_lean_pull_retried_answers_its_first_reply(redis):
    """A pull whose reply was lost, sent again under its call id, takes nothing more and
    answers the tasks its first run took (its kept reply is what it costs)."""
    floor, work = Floor(redis, "lean"), new_tasks(10)
    floor.enqueue(work)
    call = Floor.call_key()
    first = floor.pull(4, call)
    assert len(first) == 4
    assert floor.pull(4, call) == first
    assert redis.llen(Floor.JOB_LIST) == 6
