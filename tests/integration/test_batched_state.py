"""What the scripts batch per call keeps exact, against a real Redis: a settle's usage counted
per group or per task alike, folds written at the end of a call (a task twice in one call
included), the in-flight bookkeeping kept wide and left without its anchor, and the pull's
fast identity path refusing a tag that stands for a digest."""

from __future__ import annotations

import json
from typing import Any

from vlmq.broker.state.tasks import Move
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState
from vlmq.config.usage import TaskUsage
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client

KEYS = Keys()


def _lines(n: int, prefix: str = "c") -> list[str]:
    return [
        json.dumps({"custom_id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"{i}"}]})
        for i in range(n)
    ]


def _pull(client: Client, limit: int = 50) -> list[Any]:
    return list(client.state.intake("text").pull(limit, 60).deliveries)


def _succeed(delivery: Any, token: int | None = None) -> Move:
    url = f"file:///r/{delivery.task_id}.json"
    fields = {"worker": "w", "result_url": url}
    token = token or delivery.token
    return Move(delivery.task_id, TaskState.SUCCEEDED, fields, token, "finished_at")


def _usage_of(redis: Any, key: str) -> dict[str, int]:
    return {k: int(v) for k, v in redis.hgetall(key).items()}


def test_usage_counts_what_moved_whether_summed_per_group_or_per_task(settings):
    team_a = Client(settings, tenant="team-a")
    team_b = Client(settings, tenant="team-b")
    submit_jsonl(team_a, _lines(4, "a"), "job-a")
    submit_jsonl(team_b, _lines(4, "b"), "job-b")
    held = _pull(team_a)
    assert len(held) == 8
    job_of = {d.task_id: d.status["job_id"] for d in held}
    moves, usage = [], []
    for n, d in enumerate(held):
        stale = n == 0  # a superseded holder: its group is counted task by task
        moves.append(_succeed(d, token=d.token + 5 if stale else None))
        # Wrong job hints on every other task: the hash's job is what counts.
        hint = job_of[d.task_id] if n % 2 else "no-such-job"
        usage.append(TaskUsage("m", "text", 10 + n, 100 * n, 0.5, n, 7, job_id=hint))
    replies = team_a.state.tasks.settle(moves, usage)
    assert [r.held for r in replies] == [False] + [True] * 7
    again = team_a.state.tasks.settle(moves, usage)  # a retry counts nothing more
    assert not any(r.moved for r in again)

    redis = team_a.redis
    for job, tenant in (("job-a", "team-a"), ("job-b", "team-b")):
        counted = [n for n, d in enumerate(held) if n > 0 and job_of[d.task_id] == job]
        want = {
            "m|text|prompt_tokens": sum(10 + n for n in counted),
            "m|text|completion_tokens": sum(100 * n for n in counted),
            "m|text|requests": len(counted),
            "m|text|model_us": 500_000 * len(counted),
            "m|text|gpu_us": sum(counted),
            "m|text|cost_ucents": 7 * len(counted),
        }
        assert _usage_of(redis, KEYS.job_usage(job)) == want
        assert _usage_of(redis, KEYS.usage(tenant)) == want


def test_a_groups_sums_count_once_when_every_task_moved(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(5), "job")
    held = _pull(client)
    usage = [TaskUsage("m", "text", 3, 4, 0.25, 5, 6, job_id=d.status["job_id"]) for d in held]
    assert all(r.moved for r in client.state.tasks.settle([_succeed(d) for d in held], usage))
    assert _usage_of(client.redis, KEYS.job_usage("job")) == {
        "m|text|prompt_tokens": 15,
        "m|text|completion_tokens": 20,
        "m|text|requests": 5,
        "m|text|model_us": 1_250_000,
        "m|text|gpu_us": 25,
        "m|text|cost_ucents": 30,
    }


def test_a_task_twice_in_one_settle_ends_once(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(3), "job")
    held = _pull(client)
    first = held[0]
    moves = [_succeed(first), *(_succeed(d) for d in held[1:]), _succeed(first)]
    replies = client.state.tasks.settle(moves)
    assert [(r.held, r.moved) for r in replies] == [(True, True)] * 3 + [(True, False)]
    assert replies[-1].previous == "succeeded"
    status = client.status("job")
    assert (status["counts"]["succeeded"], status["state"]) == (3, "completed")
    for d in held:  # folded: the claim records the delivery whose result it has
        assert client.state.tasks.get(d.task_id)["deliveries"] == str(d.token)
    assert not client.redis.exists(*(KEYS.task(d.task_id) for d in held))


def test_a_cancel_and_a_settle_fold_into_the_claims_in_one_call(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(4), "job")
    held = _pull(client, 2)
    cancels = [
        Move(task_id, TaskState.CANCELLED, {}, stamp="finished_at")
        for task_id in client.job_task_ids("job")
        if task_id not in {d.task_id for d in held}
    ]
    assert all(m.moved for m in client.state.tasks.moves(cancels))
    assert all(r.moved for r in client.state.tasks.settle([_succeed(d) for d in held]))
    states = sorted(client.state.tasks.get(t)["state"] for t in client.job_task_ids("job"))
    assert states == ["cancelled", "cancelled", "succeeded", "succeeded"]


def test_the_bookkeeping_is_kept_wide_and_left_without_its_anchor(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(6), "job")
    held = _pull(client, 3)
    redis = client.redis
    encodings = {
        key: redis.object("encoding", key)
        for key in (KEYS.inflight(), KEYS.leases(), KEYS.lease_queue())
    }
    assert encodings[KEYS.leases()] == "skiplist"
    assert encodings[KEYS.inflight()] == encodings[KEYS.lease_queue()] == "hashtable"
    assert redis.zcard(KEYS.leases()) == redis.hlen(KEYS.inflight()) == 3
    assert all(":" not in member for member in redis.zrange(KEYS.leases(), 0, -1))
    held += _pull(client)  # a second pull: already wide, nothing added
    assert redis.zcard(KEYS.leases()) == 6
    client.state.tasks.settle([_succeed(d) for d in held])
    assert not redis.exists(KEYS.inflight(), KEYS.leases(), KEYS.lease_queue())


def test_a_tag_that_stands_for_a_digest_names_no_task(settings):
    client = Client(settings)
    plain = {"headers": {"id": "victim", "task": "vlmq.generate"}, "body": "W1tdLHt9LHt9XQ=="}
    raw = json.dumps({**plain, "content-type": "application/json"}, separators=(",", ":"))
    client.redis.lpush("vlmq.text", raw)
    (victim,) = _pull(client)
    digest = str(client.redis.hget(KEYS.task("victim"), "tag"))
    assert digest.startswith("sha1:")
    client.state.leases.give_back({victim.task_id: victim.token})
    forged = {**plain, "properties": {"delivery_tag": digest}, "content-type": "application/json"}
    client.redis.lpush("vlmq.text", json.dumps(forged, separators=(",", ":")))
    pulled = {d.task_id: d for d in _pull(client)}
    assert pulled["victim"].raw == raw
    (other,) = [t for t in pulled if t != "victim"]
    assert other.startswith("invalid-")


def test_a_user_denied_object_still_pulls_with_the_bookkeeping_compact(settings):
    admin = Client(settings).redis
    admin.acl_setuser(
        "no-object",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-object"],
    )
    try:
        url = settings.redis_url.replace("redis://", "redis://no-object:pw@", 1)
        client = Client(settings.model_copy(update={"redis_url": url}))
        submit_jsonl(client, _lines(3), "job")
        held = _pull(client)
        assert len(held) == 3
        assert admin.object("encoding", KEYS.leases()) == "listpack"
        assert all(r.moved for r in client.state.tasks.settle([_succeed(d) for d in held]))
    finally:
        admin.acl_deluser("no-object")
