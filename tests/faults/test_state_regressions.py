"""Issue 23: state that must not move once it ended, records that must not outlive their
worker, and work a live worker holds, each against real ``vlmq worker`` processes."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes, write_jsonl
from tests.support.services import wait_until
from vlmq.config.keys import Keys

INTERACTIVE = Keys().queue("text", "interactive")
# A dead worker's heartbeat record is gone within this long (about 6 of the tests' 3 s leases).
PRUNED_WITHIN_S = 20.0


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(redis_server.url, moto_server, tmp_path)
    yield processes
    processes.stop()


def _submit_interactive(fleet: Processes, path: Path, job_id: str) -> None:
    submit = fleet.run("submit", "submit", str(path), "--job", job_id, "--priority", "interactive")
    assert submit.returncode == 0, fleet.log(submit)


def test_cancelled_interactive_fed_tasks_never_run(fleet: Processes, tmp_path: Path) -> None:
    """Defect 2, cancel. A job submitted with ``vlmq submit --priority interactive`` is fed
    into the interactive lane; cancelled before any worker ran it, its tasks are folded
    (their hashes gone), and the pull, which reads a hash-less copy as ended only on a job's
    own list, runs them anyway: cancelled -> succeeded, the job's counts above its total.
    Expected: every task stays cancelled and the job counts 4 cancelled, 0 succeeded."""
    client = fleet.client()
    _submit_interactive(fleet, write_jsonl(tmp_path / "in.jsonl", 4), "cancel-me")
    task_ids = list(client.job_task_ids("cancel-me"))
    assert len(task_ids) == 4
    assert client.cancel("cancel-me") == 4
    fleet.worker("w-cancelled")
    fleet.wait_drained(INTERACTIVE)
    status = client.status("cancel-me")
    assert status["counts"]["succeeded"] == 0, status["counts"]
    assert (status["total"], status["counts"]["cancelled"]) == (4, 4)
    assert set(fleet.states(client, task_ids).values()) == {"cancelled"}


def test_a_stale_copy_of_a_finished_interactive_fed_task_is_dropped(
    fleet: Processes, tmp_path: Path
) -> None:
    """Defect 2, a stale copy. A copy of a finished fed task of the interactive lane (what a
    lease lapse leaves when the holder still settles first, or a second publish; pushed here
    by hand, deterministically) is pulled as a new task: it runs again with delivery 1,
    overwrites the task's result object and counts a second success in the job. Expected:
    the copy is dropped; the task's status, result object and the job's counts do not
    move."""
    client = fleet.client()
    _submit_interactive(fleet, write_jsonl(tmp_path / "in.jsonl", 1), "stale")
    (copy,) = fleet.redis.lrange(INTERACTIVE, 0, -1)
    (task_id,) = client.job_task_ids("stale")
    worker = fleet.worker("w-stale")
    wait_until(lambda: client.status("stale")["finished"], timeout=20, what="the job")
    before, result = client.status(task_id), client.result(task_id)
    assert before["state"] == "succeeded" and result is not None
    fleet.redis.lpush(INTERACTIVE, copy)
    fleet.wait_drained(INTERACTIVE)
    assert fleet.terminate(worker) == 0  # its settles are done
    status = client.status("stale")
    assert (status["total"], status["counts"]["succeeded"]) == (1, 1), status["counts"]
    assert client.status(task_id) == before
    assert client.result(task_id) == result


def test_a_dead_workers_heartbeat_record_is_pruned(fleet: Processes) -> None:
    """Defect 10. ``vlmq:workers`` keeps the heartbeat record of every worker that died
    without a clean stop, for ever (no TTL, no pruning): ``healthcheck`` and the fleet's
    rates keep counting it. Expected: once a worker is killed -9, its record is gone within
    PRUNED_WITHIN_S (about six of its leases) while another worker runs."""
    doomed = fleet.worker("w-doomed")
    fleet.worker("w-survivor")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    records = Keys().workers()

    def pruned() -> bool:
        return not fleet.redis.hexists(records, "w-doomed")

    try:
        wait_until(pruned, timeout=PRUNED_WITHIN_S, what="the dead worker's record pruned")
    except TimeoutError:
        pytest.fail(f"w-doomed is still in {records} {PRUNED_WITHIN_S:.0f} s after kill -9")
    assert fleet.redis.hexists(records, "w-survivor")


def test_live_workers_keep_the_work_they_hold(
    redis_server: Any, moto_server: Any, tmp_path: Path
) -> None:
    """The live-holder lapse. With 6 s leases, 3 s batches and two live workers (no clock
    skew), some of 60 tasks were taken from the live worker holding them (its log said
    "requeued ... messages whose worker stopped renewing" every 3 s): work a live worker
    holds, prefetched or running, is not renewed in time. Expected: every task is delivered
    once, and no worker requeues anything."""
    fleet = Processes(redis_server.url, moto_server, tmp_path, VLMQ_FLEET__LEASE_S="6")
    try:
        client = fleet.client()
        items = [[{"role": "user", "content": f"task {i}"}] for i in range(60)]
        job = client.submit_many(items, job_id="held")
        task_ids = list(client.job_task_ids(job))
        workers = [fleet.worker(name, delay_s=3, wait=False) for name in ("w-one", "w-two")]
        for name, proc in zip(("w-one", "w-two"), workers, strict=True):
            fleet.wait_registered(name, proc)
        wait_until(lambda: client.status(job)["finished"], timeout=45, what="the job")
        deliveries = [client.status(task_id).get("deliveries") for task_id in task_ids]
        again = sum(1 for d in deliveries if d != "1")
        requeued = [
            line
            for proc in workers
            for line in fleet.log(proc).splitlines()
            if re.search(r"requeued \d+ messages", line)
        ]
        assert client.status(job)["counts"]["succeeded"] == 60
        assert again == 0, f"{again} of 60 tasks delivered more than once; {requeued[:5]}"
        assert not requeued
    finally:
        fleet.stop()
