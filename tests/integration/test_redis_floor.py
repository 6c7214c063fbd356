"""bench.redis_floor's designs keep the guarantees they are a floor for.

A floor that skipped a check would be cheaper than any real design: each model must name a
message by its id and the tag its task was created with, count a delivery as the fencing
token, refuse a superseded holder's start and settle, and acknowledge every lease.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.redis_floor import JOB, Floor, message, new_tasks

DESIGNS = ("hash", "fields")


@pytest.fixture
def redis(redis_server):
    connection = redis_server.connect()
    yield connection
    connection.close()


def _counters(redis: Any) -> dict[str, int]:
    return {k: int(v) for k, v in redis.hgetall(f"floor:job:{JOB}").items()}


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
    redis.lpush(Floor.QUEUE, work[0][2])  # the reaper gives its copy back
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
    redis.delete(Floor.QUEUE)
    redis.lpush(Floor.QUEUE, message(task_id, "forged"))
    assert floor.pull(1) == []
    assert redis.hlen(Floor.INFLIGHT) == 0
