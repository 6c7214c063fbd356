"""Jobs at scale: concurrent submitters, content ids, fair share, depth counters, bounds, TTLs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_fleet_loop import RecordingEngine, Running, make_loop
from tests.support.services import wait_until
from vlmq.broker.feeding import FeedCounts
from vlmq.broker.queues import lane_depths, queue_depth, queue_lists
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.bulk import feeder_for, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.export import job_summary


def _line(i: int, custom_id: bool = True) -> str:
    body: dict = {"messages": [{"role": "user", "content": f"question {i}"}]}
    if custom_id:
        body["custom_id"] = f"c{i}"
    return json.dumps(body)


def _counts(client: Client, job_id: str) -> dict:
    return job_summary(client, job_id)


def _submit_process(settings: Settings, path: Path, job_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLMQ_REDIS_URL": settings.redis_url}
    command = [sys.executable, "-m", "vlmq", "submit", str(path), "--job", job_id]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_concurrent_submits_of_one_file_enqueue_each_line_once(settings, tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(_line(i) for i in range(5000)) + "\n")
    procs = [_submit_process(settings, path, "twice") for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    client = Client(settings)
    summary = _counts(client, "twice")
    assert summary["total"] == 5000 and summary["counts"]["queued"] == 5000
    assert client.redis.hlen(Keys().job_custom_ids("twice")) == 5000
    assert client.redis.llen(Keys().job_queue("text", "twice")) == 5000
    assert queue_depth(client.redis, Keys(), ["text"]) == {"text": 5000}


def test_concurrent_retries_of_failed_lines_keep_the_counters_exact(settings):
    client = Client(settings)
    lines = [_line(i) for i in range(40)]
    submit_jsonl(client, lines, "retry")
    with Running(make_loop(settings, RecordingEngine(fail=True))):
        wait_until(lambda: _counts(client, "retry")["state"] == "completed", what="all failed")
    # Two submitters retry the same failed lines, chunk by chunk, interleaved.
    reports = [submit_jsonl(client, lines, "retry", feed_first_window=False) for _ in range(2)]
    feeder = feeder_for(client, chunk=10)
    counts = [FeedCounts(), FeedCounts()]
    for _ in range(4):
        for report, count in zip(reports, counts, strict=True):
            assert report.feed_id is not None
            fed = feeder.feed(report.feed_id, most=10)
            count.enqueued += fed.enqueued
            count.skipped += fed.skipped
    assert counts[0].enqueued + counts[1].enqueued == 40
    assert counts[0].skipped + counts[1].skipped == 40
    summary = _counts(client, "retry")
    assert summary["total"] == 40
    assert summary["counts"]["failed"] == 0 and summary["counts"]["queued"] == 40


def test_a_job_is_not_finished_while_another_submitter_adds(settings):
    settings = settings.model_copy(
        update={"fleet": settings.fleet.model_copy(update={"submitter_lease_s": 4.0})}
    )
    client = Client(settings)
    adding = client.open_job("two-sources")  # a second submitter, still adding (then crashes)
    submit_jsonl(client, [_line(i) for i in range(5)], "two-sources")
    loop = make_loop(settings, RecordingEngine(), reap_interval_s=0.05)
    with Running(loop):
        wait_until(lambda: _counts(client, "two-sources")["done"] == 5, what="the lines ran")
        assert client.redis.hget(Keys().job("two-sources"), "finished_at") is None
        assert client.redis.llen(Keys().events()) == 0
        assert adding  # never seals: its lease lapses, and the housekeeping finishes the job
        wait_until(
            lambda: _counts(client, "two-sources")["state"] == "completed",
            timeout=20,
            what="the job finished once the crashed submitter's lease lapsed",
        )


def test_lines_without_custom_id_are_recognised_by_content_after_an_edit(settings):
    client = Client(settings)
    lines = [_line(i, custom_id=False) for i in range(10)]
    assert submit_jsonl(client, lines, "edited").enqueued == 10
    edited = [_line(99, custom_id=False), *lines]  # a line inserted at the top
    again = submit_jsonl(client, edited, "edited")
    assert (again.enqueued, again.skipped) == (1, 10)
    duplicated = submit_jsonl(client, [_line(5, custom_id=False)] * 2, "dup")
    assert (duplicated.enqueued, duplicated.errors) == (1, 1)


def test_fair_share_serves_every_job_within_jobs_over_batch_pulls(settings):
    client = Client(settings)
    jobs = [
        client.submit_many([[{"role": "user", "content": f"{j}-{n}"}] for n in range(5)])
        for j in range(20)
    ]
    intake = client.state.intake("text")
    batch = 6
    served: set[str] = set()
    for _ in range(math.ceil(len(jobs) / batch)):
        pulled = intake.pull(batch, lease_s=60)
        served |= {d.status.get("job_id", "") for d in pulled.deliveries}
    assert served == set(jobs)


@pytest.mark.private_redis
def test_queue_depth_is_counted_not_listed(settings):
    client = Client(settings)
    for j in range(30):
        client.submit_many([[{"role": "user", "content": f"{j}-{n}"}] for n in range(3)])
    client.submit([{"role": "user", "content": "now"}])
    keys = Keys()
    assert queue_depth(client.redis, keys, ["text"]) == {"text": 91}
    # The one interactive task on its lane, the jobs' tasks on the bulk lane.
    assert lane_depths(client.redis, keys, ["text"]) == {"text": {"interactive": 1, "bulk": 90}}
    intake, leases = client.state.intake("text"), client.state.leases
    pulled = intake.pull(20, lease_s=60)
    assert queue_depth(client.redis, keys, ["text"]) == {"text": 71}
    assert lane_depths(client.redis, keys, ["text"]) == {"text": {"interactive": 0, "bulk": 71}}
    leases.give_back({d.task_id: d.token for d in pulled.deliveries})
    assert queue_depth(client.redis, keys, ["text"]) == {"text": 91}
    # The depth read is a fixed number of commands whatever the number of active jobs.
    client.redis.config_resetstat()
    queue_depth(client.redis, keys, ["text"])
    stats = client.redis.info("commandstats")
    calls = {name: v["calls"] for name, v in stats.items() if "config" not in name}
    assert calls == {"cmdstat_llen": len(queue_lists(keys, "text")), "cmdstat_hget": 1}


def test_bad_lines_are_counted_and_their_records_capped(settings):
    settings = settings.model_copy(
        update={"fleet": settings.fleet.model_copy(update={"max_line_errors": 50})}
    )
    client = Client(settings)
    lines = ["{not json"] * 3000 + [_line(1)]
    report = submit_jsonl(client, lines, "junk")
    assert report.errors == 3000
    assert client.redis.hlen(Keys().job_errors("junk")) == 50
    assert _counts(client, "junk")["errors"] == 3000


def test_every_key_a_job_leaves_behind_expires_or_is_bounded(settings):
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(12)] + ["{bad"], "ttl")
    client.submit_many([[{"role": "user", "content": "single chunk"}]], job_id="single")
    client.submit([{"role": "user", "content": "interactive"}])
    with Running(make_loop(settings, RecordingEngine())):
        wait_until(lambda: _counts(client, "ttl")["state"] == "completed", what="the job")
        wait_until(lambda: _counts(client, "single")["state"] == "completed", what="single")
    keys = Keys()
    # Bounded by what is in flight or by the number of classes / workers, not by history.
    bounded = {
        keys.inflight(),
        keys.leases(),
        keys.lease_queue(),
        keys.lease_active(),
        keys.job_depth(),
        keys.workers(),
        keys.events(),
        keys.events_leased(),
        keys.job_expiry(),
        keys.jobs_submitting(),
        keys.job_numbers(),
        keys.feeds(),
        *(keys.active_tenants(m) for m in ("text", "image", "video")),
        *(keys.active_jobs(m, "default") for m in ("text", "image", "video")),
        keys.quota("default"),  # one per tenant
        keys.usage("default"),  # one per tenant, models x modalities x metrics fields
        keys.usage_tenants(),
        keys.libraries(),  # one field per vlmq version used in the last week
    }
    unbounded = [
        k for k in client.redis.scan_iter("*") if k not in bounded and client.redis.ttl(k) == -1
    ]
    assert unbounded == []
    assert client.redis.exists(keys.job_errors("ttl"), keys.job_custom_ids("ttl")) == 2


def test_dead_letters_are_trimmed_and_keep_only_the_head_of_a_message(settings):
    settings = settings.model_copy(
        update={"fleet": settings.fleet.model_copy(update={"max_dead_letters": 3})}
    )
    client = Client(settings)
    keys = Keys()
    tasks = [client.submit([{"role": "user", "content": "A" * 100_000}]) for _ in range(6)]
    raw = client.redis.lrange(keys.queue("text", "interactive"), 0, 0)[0]
    for task in tasks:  # delivered again and again without ever starting: dead-lettered
        client.redis.hset(keys.task(task), "deliveries", 50)
    with Running(make_loop(settings, RecordingEngine())):
        wait_until(
            lambda: all(client.status(t).get("state") == "failed" for t in tasks),
            what="the messages dead-lettered",
        )
    letters = [json.loads(v) for v in client.redis.lrange(keys.dead_letters(), 0, -1)]
    assert len(letters) == 3
    assert all(len(letter["message"]) == 4096 for letter in letters)
    assert all(letter["message_chars"] == len(raw) for letter in letters)


def test_a_chunks_lines_about_one_medium_are_enqueued_together(settings):
    client = Client(settings)
    lines = [
        json.dumps(
            {
                "custom_id": f"{clip}-{question}",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video", "video": f"/m/clip-{clip}.mp4"},
                            {"type": "text", "text": f"question {question}"},
                        ],
                    }
                ],
            }
        )
        for question in range(3)
        for clip in range(4)  # interleaved: every clip's first question, then the second...
    ]
    submit_jsonl(client, lines, "affinity")
    queued = client.redis.lrange(Keys().job_queue("video", "affinity"), 0, -1)[::-1]
    custom_ids = [client.status(json.loads(m)["headers"]["id"])["custom_id"] for m in queued]
    clips = [c.split("-")[0] for c in custom_ids]
    assert clips == sorted(clips)  # grouped by clip, in pull order
    assert [c.split("-")[1] for c in custom_ids[:3]] == ["0", "1", "2"]  # else file order
