"""Issue 23, exactly once under retries: a reply lost to a connection reset.

Every vlmq process opens Redis with redis-py's ``Retry`` on ConnectionError
(vlmq/broker/connection.py), so a command whose reply a reset lost is sent again and runs twice.
Each test puts a :class:`~tests.support.replydrop.ReplyDropProxy` between one process (a real
``vlmq worker``, the ``vlmq submit`` CLI, or a Client / the API's rate limiter in this process)
and Redis, loses the reply of one command, and checks that what the user sees is as if it had
run once. Everything else (the test's own reads, other processes) reaches Redis directly.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import TERMINAL_STATES, Processes, write_jsonl
from tests.support.replydrop import ReplyDropProxy, Rule
from tests.support.services import wait_until
from vlmq.config.errors import QuotaExceeded
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState
from vlmq.producers.api.limits import RateLimiter
from vlmq.producers.bulk import feeder_for, submit_jsonl


@pytest.fixture
def proxy(redis_server: Any) -> Iterator[ReplyDropProxy]:
    with ReplyDropProxy(redis_server.port) as running:
        yield running


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(redis_server.url, moto_server, tmp_path)
    yield processes
    processes.stop()


def _via(proxy: ReplyDropProxy, fleet: Processes) -> dict[str, str]:
    """A process's environment with its Redis behind the proxy."""
    return {"VLMQ_REDIS_URL": proxy.url_for(fleet.redis_url)}


def _wait_job(client: Any, job_id: str, timeout: float = 30) -> dict[str, Any]:
    wait_until(lambda: client.status(job_id).get("finished"), timeout=timeout, what=job_id)
    status: dict[str, Any] = client.status(job_id)
    return status


def _submitted(fleet: Processes, path: Path, job_id: str, *extra: str, **env: str) -> None:
    proc = fleet.run(f"submit-{job_id}", "submit", str(path), "--job", job_id, *extra, env=env)
    assert proc.returncode == 0, fleet.log(proc)


def test_a_lost_settle_reply_keeps_every_result(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """Defect 1 (data loss). The settle's reply is lost: the retry finds the fed tasks it just
    folded (their hashes gone) and reads them as held by another delivery, so the worker
    deletes the result objects it had just made their results; the job says completed and
    every result of that batch is missing. Expected: every task of the completed job has its
    result object."""
    client = fleet.client()
    _submitted(fleet, write_jsonl(tmp_path / "in.jsonl", 6), "settle-lost")
    settle = proxy.add(Rule.script("settle"))
    worker = fleet.worker("w-settle", env=_via(proxy, fleet))
    status = _wait_job(client, "settle-lost")
    assert fleet.terminate(worker) == 0  # everything it did after that settle is done
    assert settle.dropped == 1
    assert status["state"] == "completed" and status["counts"]["succeeded"] == 6
    task_ids = list(client.job_task_ids("settle-lost"))
    assert len(task_ids) == 6
    results = {task_id: client.result(task_id) for task_id in task_ids}
    missing = [task_id for task_id, record in results.items() if record is None]
    assert not missing, f"{len(missing)} of 6 result objects are gone"
    assert {r["status"] for r in results.values() if r is not None} == {"succeeded"}


def test_a_lost_register_feed_reply_counts_the_lines_once(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """Defect 4, register_feed. ``vlmq submit``'s feed registration runs twice: the job counts
    every line twice (total 8 of 4 lines) and never finishes. Expected: total 4, and the job
    completes once its 4 lines ran."""
    client = fleet.client()
    rule = proxy.add(Rule.script("register_feed"))
    _submitted(fleet, write_jsonl(tmp_path / "in.jsonl", 4), "feed-lost", **_via(proxy, fleet))
    assert rule.dropped == 1
    status = client.status("feed-lost")
    assert (status["total"], status["counts"]["queued"]) == (4, 4)
    fleet.worker("w-feed")
    status = _wait_job(client, "feed-lost", timeout=20)
    assert status["state"] == "completed" and status["counts"]["succeeded"] == 4


def test_a_lost_submit_reply_enqueues_each_task_once(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    """Defect 4, submit (``Client.submit_many``, ids the caller's). The retried submit writes
    every task again: the job's total doubles, its task list and queue hold each task twice.
    Expected: 3 tasks counted, listed and queued once each."""
    rule = proxy.add(Rule.script("submit"))
    items = [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    fleet.client(proxy.url_for(fleet.redis_url)).submit_many(items, job_id="submit-lost")
    assert rule.dropped == 1
    client = fleet.client()
    assert client.status("submit-lost")["total"] == 3
    assert len(list(client.job_task_ids("submit-lost"))) == 3
    assert fleet.redis.llen(Keys().job_queue("text", "submit-lost")) == 3


def test_a_lost_enqueue_reply_enqueues_an_interactive_job_once(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    """Defect 4, the interactive enqueue (``submit_many(lane="interactive")``; a MULTI at
    fabb227, a script since). The retried enqueue writes the chunk again: total 6 of 3, the
    job can never finish. Expected: 3 tasks counted, listed and queued once each."""
    rule = proxy.add(Rule.script("enqueue"))
    items = [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    via = fleet.client(proxy.url_for(fleet.redis_url))
    via.submit_many(items, job_id="exec-lost", lane="interactive")
    assert rule.dropped == 1
    client = fleet.client()
    assert client.status("exec-lost")["total"] == 3
    assert len(list(client.job_task_ids("exec-lost"))) == 3
    assert fleet.redis.llen(Keys().queue("text", "interactive")) == 3


def test_a_lost_enqueue_reply_leaves_no_phantom_task_in_the_quota(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    """Defect 4, the interactive enqueue (``Client.submit``). The retried enqueue counts the
    task twice in its tenant's quota; the task runs once, and the tenant keeps a phantom
    queued task for good. Expected: with a quota of 1 queued task, once the first task ran
    the tenant may submit another."""
    quota = {"default_quota": {"max_queued_tasks": 1}}
    rule = proxy.add(Rule.script("enqueue"))
    first = fleet.client(proxy.url_for(fleet.redis_url), tenants=quota).submit(
        [{"role": "user", "content": "one"}]
    )
    assert rule.dropped == 1
    client = fleet.client(tenants=quota)
    fleet.worker("w-quota")
    wait_until(lambda: client.status(first)["state"] in TERMINAL_STATES, timeout=20)
    fleet.wait_drained(Keys().queue("text", "interactive"))
    assert client.status(first)["state"] == "succeeded"
    try:
        client.submit([{"role": "user", "content": "two"}])
    except QuotaExceeded as exc:
        pytest.fail(f"nothing is queued, yet: {exc.message}")


def test_a_lost_start_reply_counts_one_attempt(fleet: Processes, proxy: ReplyDropProxy) -> None:
    """Defect 4, the worker's start (queued -> running, one attempt). The retried start
    counts a second attempt for one run (three such losses dead-letter a healthy task).
    Expected: a task that ran once has attempts 1."""
    client = fleet.client()
    task_id = client.submit([{"role": "user", "content": "once"}])
    start = proxy.add(Rule.script("start"))  # ("transition" at fabb227)
    fleet.worker("w-start", env=_via(proxy, fleet))
    wait_until(lambda: client.status(task_id)["state"] in TERMINAL_STATES, timeout=20)
    assert start.dropped == 1
    status = client.status(task_id)
    assert status["state"] == "succeeded"
    assert status.get("attempts") == "1"


def test_a_lost_cancel_reply_still_answers_cancelled(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    """Defect 4, cancel. The retried cancel finds the task already cancelled (by its own
    first run) and answers that nothing was cancelled. Expected: ``cancel`` answers 1."""
    task_id = fleet.client().submit([{"role": "user", "content": "cancel me"}])
    rule = proxy.add(Rule.script("transition"))
    answered = fleet.client(proxy.url_for(fleet.redis_url)).cancel(task_id)
    assert rule.dropped == 1
    assert fleet.client().status(task_id)["state"] == "cancelled"
    assert answered == 1


def test_a_lost_rate_reply_spends_one_token(fleet: Processes, proxy: ReplyDropProxy) -> None:
    """Defect 4, the API's rate limit. The retried ``rate`` spends a second token for one
    request. Expected: a tenant with a burst of 2 (and no refill to speak of) may make two
    requests."""
    settings = fleet.settings(
        proxy.url_for(fleet.redis_url),
        tenants={"default_quota": {"rate_limit_per_s": 0.001, "rate_limit_burst": 2}},
    )
    rule = proxy.add(Rule.script("rate"))
    limiter = RateLimiter(settings, fleet.client(settings.redis_url).state.tenants)
    assert limiter.take_tenant("default") == 0.0
    assert rule.dropped == 1
    assert limiter.take_tenant("default") == 0.0, "the second request of a burst of 2 refused"


def test_an_interrupted_submit_leaves_a_job_that_finishes(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """Defect 8. ``vlmq submit`` is interrupted (Ctrl-C) after its feed was registered and
    its first chunk fed (the feed's reply held back so the interrupt lands there): the fleet
    runs every line, but the job was never sealed and stays ``validating`` for good.
    Expected: the job ends (completed, or cancelled) once the fleet has drained."""
    client = fleet.client()
    hold = proxy.add(Rule.script("feed", hold=True))
    env = {**_via(proxy, fleet), "VLMQ_FLEET__REDIS_SOCKET_TIMEOUT_S": "30"}
    path = write_jsonl(tmp_path / "in.jsonl", 3)
    submit = fleet.start("submit", "submit", str(path), "--job", "interrupted", env=env)
    hold.wait_dropped(1, timeout=20)  # the first chunk is in Redis; its reply is held
    submit.send_signal(signal.SIGINT)
    assert submit.wait(20) != 0, fleet.log(submit)
    hold.release()
    fleet.worker("w-interrupted")
    fleet.wait_drained(Keys().job_queue("text", "interrupted"), timeout=20)
    try:
        status = _wait_job(client, "interrupted", timeout=10)
    except TimeoutError:
        status = client.status("interrupted")
        pytest.fail(f"the job never ends: {status['state']}, {status['counts']}")
    assert status["state"] in ("completed", "cancelled")
    assert status["done"] == status["total"]


# Every command that is not safe to repeat, and the one MULTI left: the reply of one call is
# lost, redis-py sends it again, and what Redis holds is as if it had run once. (The ones safe
# to repeat by construction, renew, ack, give_back, reap, seal and the event leases, carry no
# call id: a second run of theirs changes nothing more.)


def _state(proxy: ReplyDropProxy, fleet: Processes) -> Any:
    return fleet.client(proxy.url_for(fleet.redis_url)).state


def _texts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"x {i}"}] for i in range(n)]


def test_a_lost_pull_reply_delivers_the_same_messages_once(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    client = fleet.client()
    client.submit_many(_texts(3), job_id="pulled")
    rule = proxy.add(Rule.script("pull"))
    pull = _state(proxy, fleet).intake("text").pull(10, 60)
    assert rule.dropped == 1
    assert sorted(d.token for d in pull.deliveries) == [1, 1, 1]
    assert fleet.redis.hlen(Keys().inflight()) == 3
    assert fleet.redis.llen(Keys().job_queue("text", "pulled")) == 0


def test_a_lost_settle_reply_in_process_reads_as_this_holders(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    client = fleet.client()
    client.submit_many(_texts(3), job_id="settled")
    from vlmq.broker.state.tasks import Move

    deliveries = client.state.intake("text").pull(10, 60).deliveries
    rule = proxy.add(Rule.script("settle"))
    ends = [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in deliveries]
    replies = _state(proxy, fleet).tasks.settle(ends)
    assert rule.dropped == 1
    # The answer is the resend's: its own first run's effect, read as this holder's.
    assert all(r.held and not r.moved and r.previous == "succeeded" for r in replies)
    status = client.status("settled")
    assert (status["total"], status["counts"]["succeeded"]) == (3, 3)


def test_a_lost_dead_letter_reply_records_one_letter(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    rule = proxy.add(Rule.script("dead_letter"))
    _state(proxy, fleet).tasks.dead_letter('{"task_id": "t"}', 100)
    assert rule.dropped == 1
    assert fleet.redis.llen(Keys().dead_letters()) == 1


def test_lost_feed_replies_feed_each_line_once(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """take_feeds, feed and drop_feed: a feeder behind the proxy loses one reply of each."""
    client = fleet.client()
    lines = [json.dumps({"custom_id": f"c{i}", "messages": m}) for i, m in enumerate(_texts(5))]
    report = submit_jsonl(client, lines, "fed", feed_first_window=False)
    rules = [proxy.add(Rule.script(name)) for name in ("take_feeds", "feed")]
    via = fleet.client(proxy.url_for(fleet.redis_url))
    assert feeder_for(via).run_once() == 5
    assert [r.dropped for r in rules] == [1, 1]
    assert fleet.redis.llen(Keys().job_queue("text", "fed")) == 5
    status = client.status("fed")
    assert (status["total"], status["counts"]["queued"]) == (5, 5)
    # A second job's feed dropped (its job cancelled): its lines are counted cancelled once.
    report = submit_jsonl(client, lines, "dropped", feed_first_window=False)
    assert report.feed_id is not None
    rule = proxy.add(Rule.script("drop_feed"))
    answered = via.state.feeds.drop("dropped", report.feed_id, TaskState.CANCELLED)
    assert rule.dropped == 1 and answered == 5
    status = client.status("dropped")
    assert (status["total"], status["counts"]["cancelled"]) == (5, 5)


def test_a_lost_take_events_reply_loses_no_event(fleet: Processes, proxy: ReplyDropProxy) -> None:
    for job in ("a", "b"):
        fleet.redis.lpush(Keys().events(), job)
    rule = proxy.add(Rule.script("take_events"))
    taken = _state(proxy, fleet).events.take(1, 60)
    assert rule.dropped == 1 and taken == ["a"]
    assert fleet.redis.lrange(Keys().events(), 0, -1) == ["b"]
    assert fleet.redis.zrange(Keys().events_leased(), 0, -1) == ["a"]


def test_a_lost_exec_reply_of_the_line_errors_writes_them_once(
    fleet: Processes, proxy: ReplyDropProxy
) -> None:
    """The one MULTI of the state layer (a job's first line errors): safe to repeat."""
    from vlmq.config.jsonl import LineError

    rule = proxy.add(Rule.command("EXEC"))
    errors = [LineError(n, f"c{n}", "invalid_request", "bad") for n in range(3)]
    _state(proxy, fleet).jobs.record_line_errors("j", errors, 10)
    assert rule.dropped == 1
    assert fleet.redis.hlen(Keys().job_errors("j")) == 3
