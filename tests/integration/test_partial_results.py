"""Results while a job runs: each finished line once, in the order they finished, from a
position a rerun passes back (``--after``) or a cursor file keeps (``--follow``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.integration.test_fleet_loop import Running, make_loop
from tests.support.gated_engine import GatedEngine
from tests.support.services import wait_until
from vlmq.broker.state.tasks import Move
from vlmq.config.keys import Keys
from vlmq.config.status import TaskState
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.cli import cli
from vlmq.producers.client import Client
from vlmq.producers.export import job_summary
from vlmq.producers.finished import iter_finished
from vlmq.producers.follow import Cursor, cursor_path, follow

LINES = 300
FAILING = frozenset(f"c{i}" for i in range(0, LINES, 37))


def _lines(n: int = LINES) -> list[str]:
    lines = [
        json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
        for i in range(n)
    ]
    lines.insert(5, "{not json")  # an invalid line: it ends the error file
    return lines


@pytest.fixture
def env(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("VLMQ_RESULTS_URL", settings.results_url)
    monkeypatch.setenv("VLMQ_S3_ENDPOINT_URL", str(settings.s3_endpoint_url))
    return settings


def _read(out: Path, *extra: str) -> tuple[list[str], str]:
    result = CliRunner().invoke(cli, ["results", "job-p", "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8").splitlines(), result.output


def _step(client: Client, engine: GatedEngine, batches: int) -> None:
    """Let ``batches`` more batches run and wait until what ran has settled."""
    engine.release(batches)

    def settled() -> bool:
        done = client.state.jobs.get("job-p").done
        return engine.permits._value == 0 and done >= len(set(engine.ran))

    wait_until(settled, what="released batches settled")


def test_reads_while_running_give_each_finished_line_once_and_add_up_to_the_final_read(
    env: Any, tmp_path: Path
) -> None:
    client = Client(env)
    engine = GatedEngine(FAILING)
    submit_jsonl(client, _lines(), "job-p")
    pieces: list[list[str]] = []
    after = 0
    with Running(make_loop(env, engine)):
        for read in range(5):
            _step(client, engine, 5)
            lines, said = _read(tmp_path / f"read{read}.jsonl", "--after", str(after))
            assert not client.state.jobs.get("job-p").finished  # read while it runs
            assert lines and "still to come" in said, said
            after = int(re.search(r"--after (\d+)", said).group(1))  # type: ignore[union-attr]
            pieces.append(lines)
        engine.open()
        wait_until(lambda: job_summary(client, "job-p")["state"] == "completed", what="job")
    last, said = _read(tmp_path / "last.jsonl", "--after", str(after))
    assert "every line of the job read" in said
    pieces.append(last)
    whole, _ = _read(tmp_path / "whole.jsonl")
    union = [line for piece in pieces for line in piece]
    assert union == whole  # the same lines, in the same (completion) order
    records = [json.loads(line) for line in whole]
    ids = [r.get("custom_id") for r in records]
    assert len(ids) == len(set(ids)) == LINES + 1  # every line once, the invalid one too
    failed = {r["custom_id"] for r in records[:-1] if r.get("status") == "failed"}
    assert failed == FAILING
    assert "line" in records[-1] and records[-1]["error"]["code"] == "invalid_request"
    # In the order they finished: the order their settles listed them in.
    listed = client.redis.lrange(Keys().job_finished("job-p"), 0, -1)
    assert [r["id"] for r in records[:-1]] == listed and sorted(listed) == sorted(engine.ran)


def test_follow_resumes_from_its_cursor_without_a_line_twice(env: Any, tmp_path: Path) -> None:
    client = Client(env)
    engine = GatedEngine(FAILING)
    submit_jsonl(client, _lines(), "job-p")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"

    class Interrupted(Exception):
        pass

    def stop(writer: Any, position: int) -> None:
        raise Interrupted

    with Running(make_loop(env, engine)):
        _step(client, engine, 10)
        with pytest.raises(Interrupted):
            follow(client, "job-p", [out, errors], "openai", progress=stop, poll_s=0.01)
        cursor = Cursor.load(cursor_path(out))
        assert cursor is not None and cursor.position > 0 and not cursor.complete
        # A stop after lines were written but before the cursor was saved: they go again.
        with out.open("a", encoding="utf-8") as half:
            half.write('{"custom_id": "c-half-writ')
        _step(client, engine, 5)
        engine.open()
        writer, final = follow(client, "job-p", [out, errors], "openai", poll_s=0.01)
    assert final.complete and writer.ok + writer.failed > 0
    # A rerun of a complete follow writes nothing more.
    again, _ = follow(client, "job-p", [out, errors], "openai", poll_s=0.01)
    assert (again.ok, again.failed) == (0, 0)
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    failures = [json.loads(line) for line in errors.read_text().splitlines()]
    assert all(line["response"]["status_code"] == 200 for line in outputs)
    ids = [line["custom_id"] for line in outputs + failures]
    assert len(ids) == len(set(ids)) == LINES + 1
    whole_out, whole_err = tmp_path / "whole.jsonl", tmp_path / "whole-errors.jsonl"
    _read(whole_out, "--errors", str(whole_err), "--format", "openai")
    assert out.read_text() == whole_out.read_text()
    assert errors.read_text() == whole_err.read_text()


def test_the_cli_follow_writes_a_running_job_to_its_end(env: Any, tmp_path: Path) -> None:
    client = Client(env)
    engine = GatedEngine()
    submit_jsonl(client, _lines(40), "job-p")
    with Running(make_loop(env, engine)):
        _step(client, engine, 2)
        engine.open()
        lines, said = _read(tmp_path / "f.jsonl", "--follow", "--poll", "0.01")
    assert "every line of the job read" in said
    assert len({json.loads(line)["custom_id"] for line in lines}) == len(lines) == 41
    assert Cursor.load(cursor_path(tmp_path / "f.jsonl")).complete  # type: ignore[union-attr]


def _start(client: Client) -> list[Any]:
    deliveries = client.state.intake("text").pull(50, 60).deliveries
    moves = [
        Move(d.task_id, TaskState.RUNNING, {"worker": "w"}, d.token, "started_at", True)
        for d in deliveries
    ]
    client.state.tasks.start(moves)
    return deliveries


def test_a_task_settled_again_or_by_a_fenced_out_holder_is_listed_once(settings: Any) -> None:
    client = Client(settings)
    submit_jsonl(client, _lines(6)[:5] + _lines(6)[6:], "job-s")
    deliveries = _start(client)
    assert len(deliveries) == 6
    ends = [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in deliveries]
    client.state.tasks.settle(ends[:4])
    client.state.tasks.settle(ends[:4])  # a retried settle
    stale = [Move(m.task_id, TaskState.FAILED, {}, (m.token or 0) - 1, "finished_at") for m in ends]
    client.state.tasks.settle(stale)  # a superseded holder's: refused
    client.state.tasks.settle(ends)
    listed = client.redis.lrange(Keys().job_finished("job-s"), 0, -1)
    assert listed == [d.task_id for d in deliveries]
    assert client.redis.ttl(Keys().job_finished("job-s")) > 0  # it expires with the job
    records = [f.record for f in iter_finished(client, "job-s") if f.record is not None]
    assert [r["custom_id"] for r in records] == [f"c{i}" for i in range(6)]


def test_a_cancel_lists_the_tasks_it_ends_with_the_jobs_lifetime(settings: Any) -> None:
    client = Client(settings)
    submit_jsonl(client, _lines(8)[:5] + _lines(8)[6:], "job-c")
    assert client.cancel("job-c") == 8
    key = Keys().job_finished("job-c")
    assert client.redis.llen(key) == 8 and client.redis.ttl(key) > 0
    records = [f.record for f in iter_finished(client, "job-c") if f.record is not None]
    assert {r["status"] for r in records} == {"cancelled"} and len(records) == 8


def test_a_line_failed_then_submitted_again_is_read_once_with_its_new_result(
    settings: Any,
) -> None:
    client = Client(settings)
    lines = _lines(4)[:4]  # c0..c3
    submit_jsonl(client, lines, "job-r")
    first = _start(client)
    client.state.tasks.settle(
        [Move(d.task_id, TaskState.FAILED, {}, d.token, "finished_at") for d in first]
    )
    submit_jsonl(client, lines, "job-r")  # the failed ones run again
    second = _start(client)
    client.state.tasks.settle(
        [Move(d.task_id, TaskState.SUCCEEDED, {}, d.token, "finished_at") for d in second]
    )
    finished = list(iter_finished(client, "job-r"))
    assert [f.position for f in finished] == list(range(1, 9))
    records = [f.record for f in finished if f.record is not None]
    assert [r["status"] for r in records] == ["succeeded"] * 4  # the failed entries skipped
