"""A draining worker against a real Redis: ``hand_back`` (lua/intake.lua) returns held tasks,
started or not, to the head of their queues in one call; the old holder is fenced out (a late
start, renew or settle of its delivery is refused); a hand-back is a return, never a death
(no dead letter, no run alone); and a loop's drain hands back what will not finish while
another loop takes it at once, every task ending exactly once."""

from __future__ import annotations

import time
from typing import Any

from tests.integration.test_continuous_driver import _batches_of
from tests.integration.test_continuous_driver import _text as _line
from tests.integration.test_fleet_loop import RecordingEngine, Running, make_loop
from tests.support.continuous import StepEngine
from tests.support.services import wait_until
from vlmq.broker.connection import create_redis
from vlmq.broker.state.intake import Delivery
from vlmq.broker.state.tasks import Move
from vlmq.config.status import TaskState
from vlmq.producers.client import Client
from vlmq.stores.urls import open_store
from vlmq.workers.fleet.loop import BatchLoop
from vlmq.workers.fleet.service import compose_loop
from vlmq.workers.fleet.work import Work


def _named_loop(settings: Any, engine: Any, name: str) -> BatchLoop:
    store = open_store(settings.results_url, settings.s3_endpoint_url)
    return compose_loop(settings, ["text"], engine, name, create_redis(settings), store)


def _text(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"line {n}"}]


def _start(client: Client, deliveries: list[Delivery]) -> None:
    moves = [
        Move(d.task_id, TaskState.RUNNING, {"worker": "a"}, d.token, "started_at", True)
        for d in deliveries
    ]
    assert all(m.moved for m in client.state.tasks.start(moves))


def _ends(deliveries: list[Delivery]) -> list[Move]:
    return [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in deliveries]


def test_handed_back_tasks_go_to_the_head_of_the_queue_and_the_old_holder_is_fenced(settings):
    client = Client(settings)
    first = [client.submit(_text(n)) for n in range(3)]
    intake, leases, tasks = client.state.intake("text"), client.state.leases, client.state.tasks
    held = intake.pull(3, 60).deliveries
    _start(client, held[:2])  # two running, one prefetched
    later = client.submit(_text(9))  # queued behind them
    tokens = {d.task_id: d.token for d in held}
    assert leases.hand_back(tokens) == 3
    assert leases.hand_back(tokens) == 0  # safe to repeat: no longer held
    assert {tasks.get(t)["state"] for t in first} == {"queued"}  # the starts undone
    # Late moves of the old holder's: refused, whether or not someone pulled the tasks again.
    assert not any(m.held for m in tasks.settle(_ends(held)))
    assert set(leases.renew(tokens, 60)) == set(tokens)  # lost to this holder
    again = intake.pull(3, 60).deliveries
    assert {d.task_id for d in again} == set(first)  # at the head: before the later task
    assert later not in {d.task_id for d in again}
    for d in again:
        work = Work(d, status=dict(d.status))
        # Not a death: no attempt kept, no prestart death, so it runs batched, not alone.
        assert work.first_run, d.status
        assert work.prestart_deaths == 0, d.status
        assert d.token == tokens[d.task_id] + 2  # the old delivery's token is spent
    assert not any(m.held for m in tasks.settle(_ends(held)))
    _start(client, again)
    won = tasks.settle(_ends(again))
    assert all(m.held and m.moved for m in won)
    for task in first:
        status = tasks.get(task)
        assert status["state"] == "succeeded" and status["attempts"] == "1", status


def test_a_hand_back_undoes_the_starts_in_the_job_counters(settings):
    client = Client(settings)
    job = client.submit_many([_text(n) for n in range(5)])
    held = client.state.intake("text").pull(5, 60).deliveries
    _start(client, held[:3])
    assert client.status(job)["counts"]["running"] == 3
    assert client.state.leases.hand_back({d.task_id: d.token for d in held}) == 5
    counts = client.status(job)["counts"]
    assert (counts["queued"], counts["running"]) == (5, 0), counts
    assert client.cancel(held[0].task_id) == 1  # queued again: a cancel stops it
    engine = RecordingEngine()
    with Running(make_loop(settings, engine)):
        wait_until(lambda: client.status(job)["finished"], what="the job")
    counts = client.status(job)["counts"]
    assert (counts["succeeded"], counts["cancelled"]) == (4, 1), counts
    assert sorted(engine.ran) == sorted(d.task_id for d in held[1:])


def test_a_task_handed_back_many_times_is_never_dead_lettered(settings):
    """More hand-backs, started and not, than both bounds on deaths: it still runs."""
    client = Client(settings)
    task = client.submit(_text(0))
    intake, leases = client.state.intake("text"), client.state.leases
    for n in range(6):
        (delivery,) = wait_until(lambda: intake.pull(1, 60).deliveries, what="a delivery")
        if n % 2:
            _start(client, [delivery])
        assert leases.hand_back({task: delivery.token}) == 1
    engine = RecordingEngine()
    loop = make_loop(settings, engine, max_deliveries=2, max_unstarted_deliveries=3)
    with Running(loop):
        wait_until(lambda: client.status(task)["state"] in ("succeeded", "failed"), what="end")
    assert client.status(task)["state"] == "succeeded", client.status(task)
    assert engine.ran == [task]
    assert engine.batches == [1]


def test_a_hand_back_with_a_stale_token_changes_nothing(settings):
    client = Client(settings)
    task = client.submit(_text(0))
    leases = client.state.leases
    (delivery,) = client.state.intake("text").pull(1, 60).deliveries
    assert leases.hand_back({task: delivery.token + 1}) == 0
    assert client.state.tasks.get(task)["deliveries"] == str(delivery.token)
    assert leases.hand_back({task: delivery.token}) == 1


def test_a_draining_loop_hands_back_its_running_batch_and_another_loop_runs_it_once(settings):
    """Loop A is inside a slow engine call with nothing known of its engine time: its drain
    hands the batch back at once; loop B runs it; A's engine call ends later and its settle
    is refused; every task succeeds once, on B."""
    client = Client(settings)
    ids = [client.submit(_text(n)) for n in range(6)]
    slow = RecordingEngine(delay_s=4.0)
    a = _named_loop(settings, slow, "a")
    b_engine = RecordingEngine()
    with Running(a):
        wait_until(lambda: a.parts.watch.running(), what="A's batch in its engine")
        began = time.monotonic()
        report = a.drain(25.0)
        assert not report.finishing and report.handed_back == 6
        b = _named_loop(settings, b_engine, "b")
        with Running(b):
            wait_until(
                lambda: all(client.status(t)["state"] == "succeeded" for t in ids),
                timeout=20,
                what="B ran them",
            )
            assert time.monotonic() - began < 4.0  # before A's engine call even ended
            wait_until(lambda: slow.ran, timeout=10, what="A's engine call to end")
    assert sorted(b_engine.ran) == sorted(ids)
    for task in ids:
        record = client.result(task)
        assert record["worker"] == "b" and record["attempts"] == 1, record
        assert client.status(task)["attempts"] == "1"


def test_a_batch_that_fits_the_window_finishes_on_the_draining_loop(settings):
    """With its engine time known (one batch went through) and inside the window, the
    running batch finishes and settles on A; only what it prefetched goes back."""
    client = Client(settings)
    engine = RecordingEngine(delay_s=1.0)
    a = make_loop(settings, engine, modalities=("text",))
    with Running(a):
        warm = client.submit(_text(0))
        wait_until(lambda: client.status(warm)["state"] == "succeeded", what="a first batch")
        ids = [client.submit(_text(n)) for n in range(1, 4)]
        wait_until(lambda: a.parts.watch.running(), what="the next batch in its engine")
        report = a.drain(25.0)
        assert report.finishing and report.finishing <= set(ids)
        wait_until(
            lambda: all(client.status(t)["state"] == "succeeded" for t in report.finishing),
            what="the finishing batch settled on A",
        )
    assert set(engine.ran) >= report.finishing


def test_a_continuous_engine_finishes_what_fits_and_hands_back_the_rest_at_the_window(
    settings: Any,
) -> None:
    """A continuous engine (StepEngine, one request per micro-batch): after a drain it is
    stepped for what the plan lets finish, taking nothing new; a request still decoding when
    the window ends is handed back and runs on another loop, once."""
    settings = _batches_of(settings, 1)
    client = Client(settings)
    engine = StepEngine(slots=4, step_s=0.01)
    a = _named_loop(settings, engine, "a")
    with Running(a):
        warm = client.submit_many([_line(0, 3)])
        wait_until(lambda: client.status(warm)["finished"], what="a first micro-batch")
        job = client.submit_many([_line(1, 20), _line(2, 400)])  # 0.2 s and 4 s
        ids = list(client.job_task_ids(job))
        wait_until(lambda: len(a.parts.watch.running()) == 2, what="both inside the engine")
        report = a.drain(1.0)
        assert report.finishing == set(ids)  # overdue on the average: expected any moment
    # (Running's exit: the loop returned at the window's end, its shutdown handed back the rest.)
    assert not a.parts.held.tokens()
    short, long = sorted(ids, key=lambda t: client.state.tasks.get(t).get("custom_id", ""))
    assert client.status(short)["state"] == "succeeded"
    assert client.status(long)["state"] == "queued"  # handed back at the window's end
    b = _named_loop(settings, StepEngine(slots=4), "b")
    with Running(b):
        wait_until(lambda: client.status(job)["finished"], what="the job")
    assert client.result(short)["worker"] == "a" and client.result(long)["worker"] == "b"
    assert client.result(long)["attempts"] == 1
