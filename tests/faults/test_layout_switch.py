"""The fleet-wide layout switch against real ``vlmq worker`` processes (vlmq/broker/layouts.py):
a worker whose version cannot read the layout in force stops, without taking or misreading
work, and what it held is left for a worker that reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes, write_jsonl
from tests.support.services import wait_until
from vlmq.broker import layouts
from vlmq.config.keys import Keys

KEYS = Keys()
NEWER = layouts.NEWEST + 1


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(redis_server.url, moto_server, tmp_path)
    yield processes
    processes.stop()


def _running(fleet: Processes) -> int:
    return sum(
        fleet.redis.hget(key, "state") == "running" for key in fleet.redis.scan_iter(KEYS.task("*"))
    )


def test_a_worker_that_cannot_read_the_layout_in_force_stops_and_loses_nothing(
    fleet: Processes, tmp_path: Path
) -> None:
    lines = write_jsonl(tmp_path / "in.jsonl", 6)
    submit = fleet.run("submit", "submit", str(lines), "--job", "layoutjob")
    assert submit.returncode == 0, fleet.log(submit)
    holder = fleet.worker("holder", delay_s=30)  # holds its batch inside the engine
    wait_until(lambda: _running(fleet) > 0, timeout=30, what="a batch running")
    record = json.loads(str(fleet.redis.hget(KEYS.workers(), "holder")))
    assert record["layouts"] == list(layouts.READS)

    # A newer fleet raised the layout while this worker was cut off (with it live, the raise
    # is refused): its next library call (a lease renewal, every lease_s / 3) is refused, and
    # it exits with the code of a setting that cannot work, not a crash's.
    fleet.redis.set(KEYS.layout(), NEWER)
    assert holder.wait(30) == 2
    assert f"layout {NEWER} is in force" in fleet.log(holder)
    held = _running(fleet)
    assert held > 0  # left as it was: a worker that reads the layout reaps it

    # A worker of this version started now stops before it loads anything or takes work.
    late = fleet.worker("late", wait=False)
    assert late.wait(30) == 2
    assert "update this process" in fleet.log(late)
    assert not fleet.redis.hexists(KEYS.workers(), "late")
    assert _running(fleet) == held

    # A worker that reads the layout in force (here: the layout put back, as this version
    # has no newer one) reaps what the stopped one held and finishes the job, once each.
    fleet.redis.delete(KEYS.layout())
    fleet.worker("reader")
    client = fleet.client()
    wait_until(
        lambda: client.status("layoutjob")["state"] == "completed",
        timeout=45,
        what="the job completed by the reader",
    )
    job = client.status("layoutjob")
    assert job["counts"]["succeeded"] == 6, job
