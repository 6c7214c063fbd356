"""Issue 38: a command whose Redis or object-store call fails gives up in one line (what
failed, whether the job is safe, that rerunning the same command resumes it) and exits 75
(EX_TEMPFAIL), never with a traceback; and rerunning it does resume. Redis's replies are lost
through the fault tier's reply-dropping proxy (the command ran, its connection closed); the
store is an S3 endpoint nothing listens on."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes, write_jsonl
from tests.support.replydrop import ReplyDropProxy, Rule, script_name
from tests.support.services import wait_until
from vlmq.producers.failures import EXIT_OUTAGE

LINES = 12


@pytest.fixture
def proxy(redis_server: Any) -> Iterator[ReplyDropProxy]:
    with ReplyDropProxy(redis_server.port) as running:
        yield running


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    # A submit that gave up holds its job open for its submitter lease: 3 s here (300 s by
    # default), so a job resumed by a second run finishes within the test.
    processes = Processes(
        redis_server.url, moto_server, tmp_path, VLMQ_FLEET__SUBMITTER_LEASE_S="3"
    )
    yield processes
    processes.stop()


def _scripts(**options: Any) -> Rule:
    """Replies to every vlmq script call."""
    return Rule("scripts", lambda args: script_name(args) is not None, nth=None, **options)


def _gave_up_in_one_line(fleet: Processes, proc: Any, service: str, rerun: str) -> None:
    log = fleet.log(proc)
    assert proc.returncode == EXIT_OUTAGE, log
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, log
    assert errors[0].startswith(f"Error: {service} failed ("), errors[0]
    assert f"rerun `{rerun}" in errors[0] and errors[0].endswith("to resume"), errors[0]


def _finished_once(fleet: Processes, job_id: str) -> None:
    client = fleet.client()
    try:
        wait_until(lambda: client.status(job_id).get("finished"), timeout=30, what=job_id)
    except TimeoutError:
        raise AssertionError(client.status(job_id)) from None
    status = client.status(job_id)
    assert status["counts"]["succeeded"] == LINES == status["total"], status
    deliveries = [client.status(t).get("deliveries") for t in client.job_task_ids(job_id)]
    assert deliveries == ["1"] * LINES, deliveries


def test_a_submit_that_loses_redis_says_so_in_one_line_and_resumes(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """Every script reply lost, six times over (all of redis-py's tries of the first script
    call): the submit gives up in one line naming the job; the same command run again
    resumes the job, which finishes with each line run once."""
    path = write_jsonl(tmp_path / "in.jsonl", LINES)
    rule = proxy.add(_scripts(probability=1.0, limit=6))
    via = {"VLMQ_REDIS_URL": proxy.url_for(fleet.redis_url)}
    args = ("submit", str(path), "--job", "lost-redis")
    failed = fleet.run("submit-1", *args, env=via)
    assert rule.dropped == 6
    _gave_up_in_one_line(fleet, failed, "Redis", f"vlmq {' '.join(args)}")
    assert "job lost-redis is safe" in fleet.log(failed)
    fleet.worker("w")
    again = fleet.run("submit-2", *args, env=via)
    assert again.returncode == 0, fleet.log(again)
    _finished_once(fleet, "lost-redis")


def test_commands_with_one_script_reply_in_three_lost_end_in_one_line_or_succeed(
    fleet: Processes, proxy: ReplyDropProxy, tmp_path: Path
) -> None:
    """1 in 3 script replies lost on the command's connections: submit --wait, status,
    cancel of nothing queued. Each run either succeeds or gives up in one line; rerun until
    it succeeds, the job has run each line once."""
    proxy.add(_scripts(probability=1 / 3, seed=38))
    via = {"VLMQ_REDIS_URL": proxy.url_for(fleet.redis_url)}
    fleet.worker("w")
    path = write_jsonl(tmp_path / "in.jsonl", LINES)
    commands = [
        ("submit", str(path), "--job", "third-lost", "--wait"),
        ("status", "third-lost"),
        ("cancel", "third-lost"),
    ]
    for n, args in enumerate(commands):
        for attempt in range(6):
            proc = fleet.run(f"cmd-{n}-{attempt}", *args, env=via)
            if proc.returncode == 0:
                break
            _gave_up_in_one_line(fleet, proc, "Redis", f"vlmq {' '.join(args)}")
        assert proc.returncode == 0, fleet.log(proc)
    _finished_once(fleet, "third-lost")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_results_with_the_store_down_say_so_in_one_line(fleet: Processes, tmp_path: Path) -> None:
    """The S3 endpoint down under ``vlmq results``: one line naming the store, the job safe;
    with the store back, the same command writes every result."""
    client = fleet.client()
    job = client.submit_many(
        [[{"role": "user", "content": f"t {i}"}] for i in range(LINES)], job_id="store-down"
    )
    fleet.worker("w")
    _finished_once(fleet, job)
    out = tmp_path / "out.jsonl"
    args = ("results", job, "-o", str(out))
    down = {"VLMQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}"}
    failed = fleet.run("results-down", *args, env=down)
    _gave_up_in_one_line(fleet, failed, "the object store", f"vlmq {' '.join(args)}")
    assert f"job {job} is safe" in fleet.log(failed)
    again = fleet.run("results-up", *args)
    assert again.returncode == 0, fleet.log(again)
    assert len(out.read_text(encoding="utf-8").splitlines()) == LINES
