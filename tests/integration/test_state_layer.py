"""The state layer against a real Redis: every call that is not safe to repeat answers a retry
of itself with its first reply and changes nothing more; the pull names every message's task
one way; a fed task's copy never runs once it ended; the named leases, worker records, job
key lifetimes and the feeder's byte window.

(Lost replies through a real connection reset are tests/faults/test_lost_replies.py's.)"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest

from vlmq.broker.scripts import REPLAYED, Call
from vlmq.broker.state.tasks import Move, start_move
from vlmq.config.ids import message_tag
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.config.status import TaskState
from vlmq.config.wire import encode_message
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client

KEYS = Keys()


def _text(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"line {n}"}]


def _start(client: Client, limit: int = 50) -> list[Any]:
    deliveries = client.state.intake("text").pull(limit, 60).deliveries
    moves = [
        Move(d.task_id, TaskState.RUNNING, {"worker": "w"}, d.token, "started_at", True)
        for d in deliveries
    ]
    client.state.tasks.start(moves)
    return deliveries


# replays ------------------------------------------------------------------------------------


def test_a_call_repeated_with_its_id_answers_its_first_reply_and_changes_nothing(settings):
    client = Client(settings)
    job = client.submit_many([_text(n) for n in range(4)])
    deliveries = client.state.intake("text").pull(10, 60).deliveries
    starts = [
        Move(d.task_id, TaskState.RUNNING, {}, d.token, "started_at", True) for d in deliveries
    ]
    call = Call()
    first = client.state.tasks.moves(starts, call=call)
    again = client.state.tasks.moves(starts, call=call)
    assert first == again and all(m.moved for m in again)
    assert {client.state.tasks.get(d.task_id)["attempts"] for d in deliveries} == {"1"}
    ends = [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in deliveries]
    first = client.state.tasks.settle(ends)
    again = client.state.tasks.settle(ends)  # safe to repeat by construction
    assert all(m.held and m.moved for m in first)
    assert all(m.held and not m.moved and m.previous == "succeeded" for m in again)
    status = client.status(job)
    assert (status["total"], status["counts"]["succeeded"], status["state"]) == (4, 4, "completed")


def test_a_new_call_is_a_new_call(settings):
    client = Client(settings)
    tenants = client.state.tenants
    assert tenants.take_rate("t", 0.001, 2) == 0.0
    assert tenants.take_rate("t", 0.001, 2) == 0.0  # another call: a second token
    assert tenants.take_rate("t", 0.001, 2) > 0.0


def test_a_start_this_delivery_made_counts_once(settings):
    client = Client(settings)
    client.submit(_text(0))
    (delivery,) = client.state.intake("text").pull(1, 60).deliveries
    start = [Move(delivery.task_id, TaskState.RUNNING, {}, delivery.token, "started_at", True)]
    assert client.state.tasks.start(start)[0].moved
    assert client.state.tasks.start(start)[0].moved  # read as moved: this delivery's own
    assert client.state.tasks.get(delivery.task_id)["attempts"] == "1"
    client.state.leases.give_back({delivery.task_id: delivery.token})
    (again,) = client.state.intake("text").pull(1, 60).deliveries
    restart = [Move(again.task_id, TaskState.RUNNING, {}, again.token, "started_at", True)]
    assert client.state.tasks.start(restart)[0].moved  # a new delivery: a new attempt
    assert client.state.tasks.get(delivery.task_id)["attempts"] == "2"


def test_replayed_commands_are_the_ones_not_safe_to_repeat():
    assert {"pull", "transition", "submit", "enqueue", "register_feed", "feed"} <= REPLAYED
    safe = {"settle", "renew", "ack", "give_back", "reap", "seal", "release_feed"}
    assert safe.isdisjoint(REPLAYED)


def test_replies_are_kept_for_the_configured_time(settings):
    client = Client(
        settings.model_copy(
            update={"fleet": settings.fleet.model_copy(update={"replay_ttl_s": 42})}
        )
    )
    client.submit(_text(0))
    (key,) = client.redis.keys(KEYS.call("*"))
    assert 0 < client.redis.ttl(key) <= 42


# identity ----------------------------------------------------------------------------------


def _push(client: Client, message: str, queue: str = "vlmq.text") -> None:
    client.redis.lpush(queue, message)


def _body(request: dict[str, Any]) -> str:
    return json.dumps(request)


def test_a_copy_naming_a_task_it_is_not_fails_alone_and_leaves_that_task_alone(settings):
    victim_client = Client(settings, tenant="victim")
    victim = victim_client.submit(_text(1), lane="bulk")
    forged = encode_message(_body({"messages": _text(666)}), victim, "vlmq.text")
    _push(victim_client, forged)
    pulled = {d.task_id: d for d in victim_client.state.intake("text").pull(10, 60).deliveries}
    assert victim in pulled and pulled[victim].token == 1
    assert pulled[victim].raw != forged
    (other,) = [t for t in pulled if t != victim]
    assert other.startswith("invalid-")
    assert victim_client.redis.hget(KEYS.task(victim), "deliveries") == "1"


def test_a_nested_id_before_the_header_id_names_nobody_else(settings):
    client = Client(settings)
    victim = client.submit(_text(1), lane="bulk")
    (taken,) = client.state.intake("text").pull(1, 60).deliveries  # the victim is held now
    assert taken.task_id == victim
    raw = json.dumps(
        {
            "body": "W1tdLHt9LHt9XQ==",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"trace": {"id": victim}, "id": "mine", "task": "vlmq.generate"},
            "properties": {"body_encoding": "base64"},
        },
        separators=(",", ":"),  # the nested '"id":"' is the first in the text
    )
    _push(client, raw)
    (mine,) = client.state.intake("text").pull(1, 60).deliveries
    assert mine.task_id == "mine"
    assert client.redis.hget(KEYS.task(victim), "deliveries") == "1"


def test_a_plain_messages_first_pull_owns_its_id(settings):
    client = Client(settings)
    first = encode_message(_body({"messages": _text(1)}), "shared-id", "vlmq.text")
    second = encode_message(_body({"messages": _text(2)}), "shared-id", "vlmq.text")
    _push(client, first)
    (owner,) = client.state.intake("text").pull(1, 60).deliveries
    assert owner.task_id == "shared-id"
    assert client.redis.hget(KEYS.task("shared-id"), "tag") == message_tag(first)
    _push(client, second)
    (other,) = client.state.intake("text").pull(1, 60).deliveries
    assert other.task_id.startswith("invalid-")


def test_ids_of_dots_name_no_task(settings):
    client = Client(settings)
    for task_id in (".", "..", "..."):
        _push(client, encode_message(_body({"messages": _text(1)}), task_id, "vlmq.text"))
    pulled = client.state.intake("text").pull(10, 60).deliveries
    assert len(pulled) == 3 and all(d.task_id.startswith("invalid-") for d in pulled)


# fed tasks ----------------------------------------------------------------------------------


def _lines(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"c{i}", "messages": _text(i)}) for i in range(n)]


@pytest.mark.parametrize("lane", ["bulk", "interactive"])
def test_a_copy_of_an_ended_fed_task_is_dropped_on_either_lane(settings, lane):
    client = Client(settings)
    submit_jsonl(client, _lines(3), "fed", lane=lane)
    queue = KEYS.queue("text", lane) if lane == "interactive" else KEYS.job_queue("text", "fed")
    copies: list[str] = client.redis.lrange(queue, 0, -1)  # type: ignore[assignment]
    assert len(copies) == 3
    assert client.cancel("fed") == 3
    for copy in copies:
        _push(client, copy, queue)
    pull = client.state.intake("text").pull(10, 60)
    assert pull.deliveries == [] and pull.dropped == 6
    assert client.status("fed")["counts"]["cancelled"] == 3


def test_a_task_cancelled_while_held_is_let_go_at_start(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(2), "held", lane="interactive")
    deliveries = client.state.intake("text").pull(10, 60).deliveries
    assert client.cancel("held") == 2  # still queued while held: cancelled, folded
    starts = [
        Move(d.task_id, TaskState.RUNNING, {}, d.token, "started_at", True) for d in deliveries
    ]
    replies = client.state.tasks.moves(starts)
    assert [r.moved for r in replies] == [False, False]
    assert all(r.current == "ended" for r in replies)
    status = client.status("held")
    assert (status["total"], status["counts"]["cancelled"], status["state"]) == (2, 2, "cancelled")


def test_a_run_its_live_holder_outlived_is_counted_once_and_read_at_pull(
    settings: Settings,
) -> None:
    """Issue 38: a holder whose lease lapsed while it ran says so when its settle is refused;
    the next pull reads the count (the poison verdict counts attempts less outlived runs)."""
    client = Client(settings)
    task = client.submit(_text(0))
    intake, leases, tasks = client.state.intake("text"), client.state.leases, client.state.tasks
    (first,) = intake.pull(1, 0).deliveries  # its lease lapses at once: a starved holder
    start = Move(task, TaskState.RUNNING, {}, first.token, "started_at", True)
    assert tasks.moves([start])[0].moved
    assert tasks.outlived({task: first.token}) == 0  # still its delivery: nothing outlived
    assert leases.reap() == 1
    (second,) = intake.pull(1, 0).deliveries  # another worker's now
    assert second.status.get("outlived") is None
    assert tasks.outlived({task: first.token}) == 1
    assert tasks.outlived({task: first.token}) == 0  # a resend counts nothing
    assert leases.reap() == 1
    (third,) = intake.pull(1, 60).deliveries
    assert third.status["outlived"] == "1"
    assert tasks.outlived({task: second.token}) == 1
    assert tasks.outlived({task: first.token}) == 0  # older than one counted: not again
    leases.give_back({task: third.token})
    (fourth,) = intake.pull(1, 60).deliveries
    assert fourth.status["outlived"] == "2"


# pre-start deaths -----------------------------------------------------------------------------


def test_going_alone_is_counted_once_per_delivery_whose_holder_died(settings: Settings) -> None:
    client = Client(settings)
    task = client.submit(_text(0))
    intake, leases = client.state.intake("text"), client.state.leases
    (d,) = intake.pull(1, 0).deliveries
    assert client.state.tasks.mark_alone(task, d.token) == 1
    assert client.state.tasks.mark_alone(task, d.token) == 1  # a retry: the same delivery
    assert client.state.tasks.mark_alone(task, d.token + 1) == 1  # not this task's delivery
    assert leases.reap() == 1  # its holder died
    (d,) = intake.pull(1, 60).deliveries
    assert d.status["alone"] == "1"
    assert client.state.tasks.mark_alone(task, d.token) == 2
    # Given back this time (a clean return, not a death): its going alone is taken off, once.
    assert leases.give_back({task: d.token}) == 1
    assert leases.give_back({task: d.token}) == 0  # a resend changes nothing
    (d,) = intake.pull(1, 60).deliveries
    assert (d.status["alone"], d.status["returns"]) == ("1", "1")


# named leases, worker records, job keys -------------------------------------------------------


def test_a_named_lease_is_the_owners_alone(settings):
    client = Client(settings)
    named = client.state.named
    token = named.take("vlmq:lock:x", 30)
    assert token is not None and named.take("vlmq:lock:x", 30) is None
    assert named.renew("vlmq:lock:x", "not-the-owner", 30) is False
    named.release("vlmq:lock:x", "not-the-owner")
    assert named.held("vlmq:lock:x")
    assert named.renew("vlmq:lock:x", token, 30) is True
    named.release("vlmq:lock:x", token)
    assert not named.held("vlmq:lock:x")


def test_a_named_lease_outlives_its_ttl_while_held(settings):
    client = Client(settings)
    named = client.state.named
    with named.holding("vlmq:lock:y", 1) as held:
        assert held
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # three times its ttl, renewed meanwhile
            assert named.held("vlmq:lock:y")
            time.sleep(0.1)
    assert not named.held("vlmq:lock:y")


def test_silent_workers_records_are_pruned(settings):
    client = Client(settings)
    records = client.state.workers
    records.announce("dead", {"at": 0}, forget_after_s=3600)
    client.redis.zadd(KEYS.workers_heard(), {"dead": 1.0})  # heard from long ago
    assert records.announce("live", {"at": 1}, forget_after_s=60) == 1
    assert set(records.all()) == {"live"}
    records.retire("live")
    assert records.all() == {} and client.redis.zcard(KEYS.workers_heard()) == 0


def test_a_jobs_keys_get_their_ttl_again_while_it_runs(settings):
    fleet = settings.fleet.model_copy(update={"task_ttl_s": 1000})
    client = Client(settings.model_copy(update={"fleet": fleet}))
    job = client.submit_many([_text(n) for n in range(2)])
    for key in (KEYS.job(job), KEYS.job_tasks(job)):
        client.redis.expire(key, 5)  # most of its ttl went by
    deliveries = _start(client)
    ends = [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in deliveries]
    client.state.tasks.settle(ends[:1])  # a settle gives them their ttl again
    assert client.redis.ttl(KEYS.job(job)) > 900
    assert client.redis.ttl(KEYS.job_tasks(job)) > 900


def test_the_feeder_fills_a_window_by_bytes(settings: Settings) -> None:
    fleet = settings.fleet.model_copy(update={"feed_window_bytes": 6000})
    client = Client(settings.model_copy(update={"fleet": fleet}))
    report = submit_jsonl(client, _lines(50), "bytes")
    # Messages of ~1.3 kB: four or five fit the byte window, far below the count window.
    assert 3 <= report.enqueued <= 6
    assert client.status("bytes")["total"] == 50


def test_a_task_that_names_a_channel_is_published_there_when_it_ends(settings):
    client = Client(settings)
    channel = KEYS.finished_channel("api-1")
    pubsub = client.redis.pubsub()
    pubsub.subscribe(channel)
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    queued = client.queued(client_request := _request(), "interactive")
    line = replace(queued, fields={**queued.fields, "notify": channel, "quota": "q"})
    client.state.jobs.enqueue(client.tenant, [line])
    (d,) = _start(client)
    client.state.tasks.settle([Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at")])
    message = pubsub.get_message(timeout=5)
    assert message is not None and message["data"] == client_request.id
    client.state.tasks.settle([Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at")])
    assert pubsub.get_message(timeout=0.5) is None  # a resent settle moves nothing: once
    pubsub.close()


def _request() -> Any:
    from vlmq.producers.client import as_request

    return as_request(_text(0))


# what a pull, a renew and a settle cost Redis ------------------------------------------------


def _calls(client: Client, command: str) -> int:
    return int(client.redis.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_pull_fills_its_batch_from_one_job_in_one_round(settings):
    """An empty plain bulk queue leaves its share of a round to the tenants: the job's list is
    popped once for the whole batch, not in halves (16, 8, 4, 2, 1, 1: six rounds, each
    popping every fixed list again)."""
    client = Client(settings)
    client.submit_many([_text(n) for n in range(40)])
    intake = client.state.intake("text")
    client.redis.config_resetstat()
    assert len(intake.pull(32, 60).deliveries) == 32
    # Each fixed list (both lanes' priority lists) is popped once and found empty; the job's
    # list once.
    assert _calls(client, "rpop") == len(intake.lists) + 1


def test_a_pull_that_took_nothing_keeps_no_reply(settings):
    """An idle worker polls many times a second: a pull that changed nothing keeps no reply
    for a retry (running it again is the same pull); one that took work keeps its reply."""
    client = Client(settings)
    intake = client.state.intake("text")
    assert intake.pull(32, 60).deliveries == []
    assert client.redis.keys(KEYS.call("*")) == []
    client.submit_many([_text(0)])
    client.redis.delete(*client.redis.keys(KEYS.call("*")))  # the submission's own
    assert len(intake.pull(32, 60).deliveries) == 1
    assert len(client.redis.keys(KEYS.call("*"))) == 1


def test_an_idle_pull_runs_no_script_until_a_list_it_reads_has_a_message(settings):
    """An idle worker's polls ask whether anything waits (EXISTS over its lists, with Redis's
    time) instead of running the pull script each time; the message that arrives is taken by
    the next poll, on either lane and through a tenant's job list."""
    client = Client(settings)
    intake = client.state.intake("text")
    assert intake.pull(32, 60).deliveries == []  # the first runs the script: now idle
    client.redis.config_resetstat()
    for _ in range(5):
        idle = intake.pull(32, 60)
        assert idle.deliveries == [] and idle.now > 0
    assert _calls(client, "fcall") == 0
    assert _calls(client, "exists") == 5
    client.submit_many([_text(0)])  # a bulk job: its list hangs off the tenants' set
    assert len(intake.pull(32, 60).deliveries) == 1
    assert intake.pull(32, 60).deliveries == []  # idle again: the script ran and took none
    client.submit(_text(1))  # interactive lane
    assert len(intake.pull(32, 60).deliveries) == 1


def test_an_idle_intake_says_whether_anything_waits_and_pulls_it_without_a_second_probe(
    settings: Settings,
) -> None:
    client = Client(settings)
    intake = client.state.intake("text")
    assert intake.waiting()  # not idle yet: a pull may find something
    assert intake.pull(32, 60).deliveries == []
    assert not intake.waiting()
    client.submit(_text(0))
    client.redis.config_resetstat()
    assert intake.waiting()
    assert len(intake.pull(32, 60).deliveries) == 1
    assert _calls(client, "exists") == 1  # the pull ran the script at once


def test_a_renew_extends_this_holders_leases_and_names_the_rest(settings):
    client = Client(settings)
    client.submit_many([_text(n) for n in range(3)])
    mine, theirs, gone = client.state.intake("text").pull(3, 5).deliveries
    client.redis.hincrby(KEYS.task(theirs.task_id), "deliveries", 1)  # delivered again since
    client.state.leases.ack({gone.task_id: gone.token})  # no longer in flight
    held = {d.task_id: d.token for d in (mine, theirs, gone)}
    lost = client.state.leases.renew(held, 600)
    assert sorted(lost) == sorted([theirs.task_id, gone.task_id])
    seconds, _ = client.redis.time()
    assert (client.redis.zscore(KEYS.leases(), mine.task_id) or 0) > seconds + 500
    their_lease = client.redis.zscore(KEYS.leases(), theirs.task_id)
    assert their_lease is not None and their_lease < seconds + 10  # not extended
    assert client.redis.zscore(KEYS.leases(), gone.task_id) is None


def test_a_settle_writes_no_field_it_has_no_value_for(settings):
    """A success's error fields (None) are not written as empty strings: each would cost the
    script an argument and the hash a field, and every reader takes an absent field as unset."""
    client = Client(settings)
    client.submit_many([_text(0)])
    (d,) = _start(client)
    fields = {"worker": "w", "batch_id": "b", "error_code": None, "error_message": None}
    move = Move(d.task_id, TaskState.SUCCEEDED, fields, d.token, "finished_at")
    client.state.tasks.settle([move])
    status = client.state.tasks.get(d.task_id)
    assert status["state"] == "succeeded" and status["batch_id"] == "b"
    assert "error_code" not in status and "error_message" not in status


# what a start and a settle write and read --------------------------------------------------


def test_a_start_gives_a_modality_only_to_a_task_that_came_without_one(settings):
    """A producer's task was given its modality when its hash was made; a message any Celery
    producer sent has no hash before its pull, and its start writes the modality."""
    client = Client(settings)
    made = client.submit(_text(0))
    _push(client, encode_message(_body({"messages": _text(1)}), "plain-id", "vlmq.text"))
    deliveries = client.state.intake("text").pull(10, 60).deliveries
    moves = {d.task_id: start_move(d.task_id, d.token, "w", "text", d.status) for d in deliveries}
    assert dict(moves[made].fields) == {"worker": "w"}
    assert dict(moves["plain-id"].fields) == {"worker": "w", "modality": "text"}
    assert all(r.moved for r in client.state.tasks.start(list(moves.values())))
    for task_id in (made, "plain-id"):
        status = client.state.tasks.get(task_id)
        assert (status["state"], status["modality"], status["worker"]) == ("running", "text", "w")


def test_a_settle_from_queued_takes_a_single_task_out_of_its_tenants_count(settings):
    """A settle reads a task's quota only for a move from or to queued (a task failed at its
    pull, before it started): its count still leaves the tenant's."""
    client = Client(settings)
    task_id = client.submit(_text(0))
    assert client.state.tenants.queued(client.tenant).tasks == 1
    (d,) = client.state.intake("text").pull(1, 60).deliveries
    fields = {"worker": "w", "error_code": "invalid_request", "error_message": "bad"}
    client.state.tasks.settle([Move(d.task_id, TaskState.FAILED, fields, d.token, "finished_at")])
    assert client.state.tasks.get(task_id)["state"] == "failed"
    assert client.state.tenants.queued(client.tenant).tasks == 0


def test_a_fed_task_folded_without_a_result_keeps_its_custom_id(settings):
    client = Client(settings)
    submit_jsonl(client, _lines(2), "folding")
    deliveries = _start(client)
    failed, stored = sorted(deliveries, key=lambda d: d.task_id)
    moves = [
        Move(failed.task_id, TaskState.FAILED, {"error_code": "e"}, failed.token, "finished_at"),
        Move(
            stored.task_id,
            TaskState.SUCCEEDED,
            {"result_url": "file:///r"},
            stored.token,
            "finished_at",
        ),
    ]
    custom_id = client.redis.hget(KEYS.task(failed.task_id), "custom_id")
    assert custom_id in {"c0", "c1"}
    client.state.tasks.settle(moves)
    assert not client.redis.exists(KEYS.task(failed.task_id), KEYS.task(stored.task_id))
    lost = client.state.tasks.get(failed.task_id)
    kept = client.state.tasks.get(stored.task_id)
    assert (lost["state"], lost["folded"], lost.get("deliveries")) == ("failed", "1", None)
    assert lost["custom_id"] == custom_id
    assert (kept["state"], kept["deliveries"], kept.get("custom_id")) == ("succeeded", "1", None)
