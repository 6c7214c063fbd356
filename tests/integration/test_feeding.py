"""Jobs at scale: staged input fed a window at a time, exactly once; validation; compact state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.integration.test_fleet_loop import RecordingEngine, Running, make_loop
from tests.support.services import wait_until
from vlmq.broker.feeding import Feeder
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.bulk import feeder_for, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.commands import submit as submit_command
from vlmq.producers.export import iter_errors, iter_results, job_summary
from vlmq.stores.urls import open_store

KEYS = Keys()


def _line(i: int) -> str:
    return json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"q {i}"}]})


def _with_fleet(settings: Settings, **fleet: object) -> Settings:
    return settings.model_copy(update={"fleet": settings.fleet.model_copy(update=fleet)})


def _live(client: Client, job_id: str) -> int:
    queued, running, unfed = client.redis.hmget(KEYS.job(job_id), "queued", "running", "unfed")
    return int(queued or 0) + int(running or 0) - int(unfed or 0)


def _redis_now(client: Client) -> float:
    seconds, micros = client.redis.time()
    return float(seconds) + float(micros) / 1e6


@contextmanager
def _feeding(client: Client, interval_s: float = 0.02) -> Iterator[Feeder]:
    """A fleet feeder on its own thread, as each worker runs one."""
    stop = threading.Event()
    feeder = feeder_for(client)

    def run() -> None:
        while not stop.wait(interval_s):
            feeder.run_once()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield feeder
    finally:
        stop.set()
        thread.join(10)


def test_the_window_holds_redis_flat_while_a_job_ten_times_it_drains(settings):
    settings = _with_fleet(settings, feed_window=100)
    client = Client(settings)
    report = submit_jsonl(client, [_line(i) for i in range(1000)], "big", chunk=40)
    # Every line is counted from the start; only the first window is in Redis.
    assert (report.valid, report.enqueued) == (1000, 100)
    summary = job_summary(client, "big")
    assert (summary["total"], summary["counts"]["queued"]) == (1000, 1000)
    assert client.redis.llen(KEYS.job_queue("text", "big")) == 100
    peak_keys, peak_live = 0, 0
    with Running(make_loop(settings, RecordingEngine(delay_s=0.002))), _feeding(client):
        deadline = time.monotonic() + 120
        while job_summary(client, "big")["state"] != "completed":
            assert time.monotonic() < deadline, "the job did not drain"
            # (the replies kept for retries, Keys.call, live a minute whatever the job)
            calls = len(client.redis.keys(KEYS.call("*")))
            peak_keys = max(peak_keys, client.redis.dbsize() - calls)
            peak_live = max(peak_live, _live(client, "big"))
            time.sleep(0.01)
    assert peak_live <= 100
    # Task hashes are the window's; the rest is a fixed number of keys.
    assert peak_keys <= 100 + 40
    assert client.redis.hlen(KEYS.job_custom_ids("big")) == 1000
    assert len({r["custom_id"] for r in iter_results(client, "big")}) == 1000


_SLOW_FEEDER = """
import sys, time
from vlmq.config.settings import Settings
from vlmq.broker.state.feeds import Feeds
from vlmq.producers.bulk import feeder_for
from vlmq.producers.client import Client

original = Feeds.feed
def slow(self, *args, **kwargs):
    reply = original(self, *args, **kwargs)
    print("fed", flush=True)
    time.sleep(0.05)
    return reply
Feeds.feed = slow
client = Client(Settings())
feeder = feeder_for(client, chunk=25)
print("taken", feeder.state.feeds.take(5.0), flush=True)
feeder.feed(sys.argv[1])
"""


def test_a_killed_feeder_is_resumed_by_another_with_no_line_lost_or_doubled(settings):
    settings = _with_fleet(settings, feed_lease_s=1.0)
    client = Client(settings)
    report = submit_jsonl(
        client, [_line(i) for i in range(1500)], "resumed", feed_first_window=False
    )
    assert report.feed_id is not None
    env = {
        **os.environ,
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": str(settings.s3_endpoint_url),
        "VLMQ_FLEET__FEED_LEASE_S": "1.0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_FEEDER, report.feed_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    fed_chunks = 0
    while fed_chunks < 5:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode() if proc.stderr else "the feeder exited"
        fed_chunks += line.startswith(b"fed")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    cursor = int(client.redis.hget(KEYS.feed(report.feed_id), "cursor") or 0)
    assert cursor > 0, "the feeder was killed before it fed anything"
    # Another feeder takes the feed once the dead one's lease lapsed, and ends it.
    feeder = feeder_for(client)
    wait_until(lambda: feeder.run_once() > 0, timeout=15, what="the feed was taken over")
    feed_key = KEYS.feed(report.feed_id)
    wait_until(lambda: not client.redis.exists(feed_key), what="fed to the end")
    summary = job_summary(client, "resumed")
    assert summary["total"] == 1500 and summary["counts"]["queued"] == 1500
    assert client.redis.hget(KEYS.job("resumed"), "unfed") == "0"
    assert client.redis.llen(KEYS.job_queue("text", "resumed")) == 1500
    assert client.redis.hlen(KEYS.job_custom_ids("resumed")) == 1500


def test_a_chunk_read_from_a_moved_cursor_changes_nothing(settings):
    client = Client(settings)
    report = submit_jsonl(client, [_line(i) for i in range(10)], "raced", feed_first_window=False)
    assert report.feed_id is not None
    before = client.redis.hgetall(KEYS.job("raced"))
    outcome, codes = client.state.feeds.feed("raced", report.feed_id, ("7", "99"), 1, [])
    assert (outcome, codes) == ("stale", [])
    assert client.redis.hgetall(KEYS.job("raced")) == before
    assert feeder_for(client).feed(report.feed_id).enqueued == 10


@pytest.mark.private_redis
def test_a_mostly_invalid_file_fails_validation_with_bounded_redis(settings):
    client = Client(settings)
    client.redis.ping()
    baseline = client.redis.info("memory")["used_memory"]
    lines = ["{not json"] * 100_000 + [_line(i) for i in range(10)]
    report = submit_jsonl(client, lines, "junk")
    assert report.validation_error is not None and "100,000 of 100,010" in report.validation_error
    summary = job_summary(client, "junk")
    assert summary["state"] == "failed" and summary["total"] == 0
    assert summary["errors"] == 100_000
    assert client.redis.hlen(KEYS.job_errors("junk")) == settings.fleet.max_line_errors
    assert not list(client.redis.scan_iter(KEYS.task("*")))
    grown = client.redis.info("memory")["used_memory"] - baseline
    assert grown < 2 * 1024 * 1024, f"Redis grew {grown} B for a file of invalid lines"
    # Nothing of it stays staged.
    assert not client.store.keys("inputs/junk/")


def test_a_finished_task_costs_under_200_bytes_of_redis(settings, tmp_path):
    # What is measured is Redis; results go to a local store (5,000 PUTs to moto took 10 s).
    settings = settings.model_copy(update={"results_url": f"file://{tmp_path / 'results'}"})
    client = Client(settings)
    n = 5000
    submit_jsonl(client, [_line(i) for i in range(n)], "compact")
    with Running(make_loop(settings, RecordingEngine())):
        wait_until(
            lambda: job_summary(client, "compact")["state"] == "completed",
            timeout=120,
            what="the job",
        )
    assert not list(client.redis.scan_iter(KEYS.task("*")))
    job_keys = list(client.redis.scan_iter(KEYS.job("compact") + "*"))
    used = sum(int(client.redis.memory_usage(k) or 0) for k in job_keys)
    assert used / n <= 200, f"{used / n:.0f} B per finished task ({job_keys})"
    # Each result is still found from its task id alone.
    task_id = next(client.job_task_ids("compact"))
    assert client.status(task_id)["state"] == "succeeded"
    assert client.result(task_id)["status"] == "succeeded"


def test_expiry_drops_the_unfed_lines_at_once_and_the_fed_ones_at_pull(settings):
    settings = _with_fleet(settings, feed_window=50)
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(500)], "late", completion_window_s=1.0)
    deadline = float(client.redis.hget(KEYS.job("late"), "expires_at") or 0)
    wait_until(lambda: _redis_now(client) > deadline, what="the window ended")
    with Running(make_loop(settings, RecordingEngine(), reap_interval_s=0.05)):
        wait_until(lambda: job_summary(client, "late")["finished"], timeout=30, what="finished")
    summary = job_summary(client, "late")
    assert summary["state"] == "expired" and summary["counts"]["expired"] == 500
    assert summary["counts"]["succeeded"] == 0
    assert not client.redis.exists(KEYS.feeds()) or not client.redis.zcard(KEYS.feeds())


def test_cancel_of_a_fed_job_cancels_its_unfed_and_queued_lines(settings):
    settings = _with_fleet(settings, feed_window=50)
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(500)], "stop")
    assert client.cancel("stop") == 500
    summary = job_summary(client, "stop")
    assert summary["state"] == "cancelled" and summary["counts"]["cancelled"] == 500
    # A feeder finds nothing left to feed; every line is in the job's errors, fed or not.
    assert feeder_for(client).run_once() == 0
    cancelled = [r for r in iter_errors(client, "stop") if r["status"] == "cancelled"]
    assert sorted(r["custom_id"] for r in cancelled) == sorted(f"c{i}" for i in range(500))


def test_vlmq_submit_reads_its_input_from_object_storage(settings, tmp_path, monkeypatch):
    store = open_store(settings.results_url, settings.s3_endpoint_url)
    assert hasattr(store, "bucket")
    data = "\n".join(_line(i) for i in range(30)) + "\n"
    store.put_blob("incoming/requests.jsonl", data.encode())
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("VLMQ_RESULTS_URL", settings.results_url)
    monkeypatch.setenv("VLMQ_S3_ENDPOINT_URL", str(settings.s3_endpoint_url))
    source = f"{settings.results_url}/incoming/requests.jsonl"
    result = CliRunner().invoke(submit_command, [source, "--job", "from-s3"])
    assert result.exit_code == 0, result.output
    client = Client(settings)
    assert job_summary(client, "from-s3")["total"] == 30
    missing = CliRunner().invoke(submit_command, [source + ".missing", "--job", "nope"])
    assert missing.exit_code != 0 and "does not exist" in missing.output
    assert not client.state.jobs.exists("nope")


def test_vlmq_submit_exits_non_zero_when_validation_fails(settings, tmp_path, monkeypatch):
    path = Path(tmp_path / "junk.jsonl")
    path.write_text("{bad\n" * 20 + _line(1) + "\n")
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("VLMQ_RESULTS_URL", settings.results_url)
    monkeypatch.setenv("VLMQ_S3_ENDPOINT_URL", str(settings.s3_endpoint_url))
    result = CliRunner().invoke(submit_command, [str(path), "--job", "junk"])
    assert result.exit_code != 0
    assert "failed validation" in result.output and "MAX_INVALID_SHARE" in result.output


def test_validation_in_several_processes_stores_the_same_input(settings):
    client = Client(settings)
    lines = [_line(i) for i in range(5000)] + ["{bad"] * 3
    reports = [
        submit_jsonl(client, lines, f"p{n}", feed_first_window=False, processes=n) for n in (1, 2)
    ]
    assert [(r.lines, r.valid, r.errors) for r in reports] == [(5003, 5000, 3)] * 2
    stored = []
    for report in reports:
        assert report.feed_id is not None
        key = client.redis.hget(KEYS.feed(report.feed_id), "input")
        stored.append(b"".join(client.store.read_from(str(key))))
    assert stored[0] == stored[1] and stored[0].count(b"\n") == 5000


def test_vlmq_submit_refuses_local_media_no_worker_could_read(settings, tmp_path, monkeypatch):
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    image = {"type": "image", "image": "photo.png"}
    line = {"custom_id": "a", "messages": [{"role": "user", "content": [image, "what?"]}]}
    path = tmp_path / "local.jsonl"
    path.write_text(json.dumps(line) + "\n" + _line(1) + "\n")
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("VLMQ_RESULTS_URL", settings.results_url)
    monkeypatch.setenv("VLMQ_S3_ENDPOINT_URL", str(settings.s3_endpoint_url))
    monkeypatch.setenv("VLMQ_MEDIA__STAGING", "false")
    result = CliRunner().invoke(submit_command, [str(path), "--job", "local"])
    assert result.exit_code != 0
    assert "VLMQ_MEDIA__" in result.output, result.output
    client = Client(settings)
    summary = job_summary(client, "local")
    assert summary["total"] == 0 and summary["state"] == "failed"
    assert not list(client.redis.scan_iter(KEYS.task("*")))
    assert client.redis.llen(KEYS.job_queue("text", "local")) == 0


def test_a_feed_whose_input_was_removed_fails_its_lines_and_the_job_ends(settings):
    client = Client(settings)
    report = submit_jsonl(client, [_line(i) for i in range(20)], "gone", feed_first_window=False)
    assert report.feed_id is not None
    key = str(client.redis.hget(KEYS.feed(report.feed_id), "input"))
    client.store.delete(key)  # e.g. a lifecycle rule on inputs/ shorter than the job
    assert feeder_for(client).run_once() == 0
    summary = job_summary(client, "gone")
    assert summary["finished"] and summary["counts"]["failed"] == 20
    assert not client.redis.exists(KEYS.feed(report.feed_id))
