"""Bulk jobs: streamed submit, resume, duplicates, expiry, export, webhooks, lanes."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest

from tests.integration.test_fleet_loop import RecordingEngine, Running, make_loop
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.config.settings import WebhookSettings
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.commands import write_results
from vlmq.producers.export import iter_results, job_summary


def _line(i: int, kind: str = "text", fmt: str = "vlmq") -> str:
    content: list | str = f"question {i}"
    if kind != "text":
        content = [{"type": kind, kind: f"/m/{i}.bin"}, {"type": "text", "text": "what?"}]
    if fmt == "openai":
        return json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 8,
                },
            }
        )
    return json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": content}]})


def _mixed_file(n: int) -> list[str]:
    kinds = ("text", "image", "video")
    lines = [_line(i, kinds[i % 3], "openai" if i % 2 else "vlmq") for i in range(n)]
    lines.insert(3, "{not json")
    lines.insert(
        7,
        json.dumps(
            {
                "custom_id": "bad-part",
                "messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
            }
        ),
    )
    lines.append(_line(0))  # duplicate custom_id
    return lines


def test_submit_streams_both_formats_and_records_bad_lines(settings):
    client = Client(settings)
    report = submit_jsonl(client, _mixed_file(30), "job-a", chunk=7)
    assert (report.lines, report.enqueued, report.errors) == (33, 30, 3)
    lists = {m: client.redis.llen(Keys().job_queue(m, "job-a")) for m in ("text", "image", "video")}
    assert sum(lists.values()) == 30 and all(lists.values())
    with Running(make_loop(settings, RecordingEngine())):
        wait_until(lambda: job_summary(client, "job-a")["state"] == "completed", what="job")
    summary = job_summary(client, "job-a")
    assert summary["counts"]["succeeded"] == 30 and summary["errors"] == 3
    # Finished tasks are folded into the job: no task hash is left, each status still reads.
    assert not client.redis.keys("vlmq:task:*")
    assert {client.status(t)["state"] for t in client.job_task_ids("job-a")} == {"succeeded"}
    errors = sorted(
        json.loads(v)["error"]["code"] for v in client.redis.hvals(Keys().job_errors("job-a"))
    )
    assert errors == ["duplicate_custom_id", "invalid_request", "invalid_request"]


def test_resubmitting_enqueues_only_what_is_missing_or_failed(settings):
    client = Client(settings)
    lines = [_line(i) for i in range(20)]
    first = submit_jsonl(client, lines[:8], "job-r")  # an interrupted submit
    assert first.enqueued == 8
    again = submit_jsonl(client, lines, "job-r")
    assert (again.enqueued, again.skipped, again.errors) == (12, 8, 0)
    assert job_summary(client, "job-r")["total"] == 20
    with Running(make_loop(settings, RecordingEngine(fail=True))):
        wait_until(lambda: job_summary(client, "job-r")["state"] == "completed", what="failed")
    assert job_summary(client, "job-r")["counts"]["failed"] == 20
    engine = RecordingEngine()
    retry = submit_jsonl(client, lines, "job-r")  # failed ones run again
    assert retry.enqueued == 20
    with Running(make_loop(settings, engine)):
        wait_until(lambda: job_summary(client, "job-r")["state"] == "completed", what="retry")
    summary = job_summary(client, "job-r")
    assert summary["total"] == 20
    assert summary["counts"]["succeeded"] == 20 and summary["counts"]["failed"] == 0
    assert len(list(iter_results(client, "job-r"))) == 20
    assert submit_jsonl(client, lines, "job-r").enqueued == 0


def test_cancel_and_completion_window(settings):
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(10)], "job-c")
    assert client.cancel("job-c") == 10
    submit_jsonl(client, [_line(i) for i in range(5)], "job-x", completion_window_s=0.001)
    with Running(make_loop(settings, RecordingEngine(), reap_interval_s=0.05)) as loop:
        wait_until(lambda: job_summary(client, "job-x")["state"] == "expired", what="expiry")
        wait_until(lambda: job_summary(client, "job-c")["state"] == "cancelled", what="cancel")
    assert loop.engine.ran == []
    assert job_summary(client, "job-x")["counts"]["expired"] == 5


def test_results_export_in_both_formats(settings, tmp_path):
    import io

    client = Client(settings)
    submit_jsonl(client, _mixed_file(9), "job-e")
    with Running(make_loop(settings, RecordingEngine())):
        wait_until(lambda: job_summary(client, "job-e")["state"] == "completed", what="job")
    out, err = io.StringIO(), io.StringIO()
    assert write_results(client, "job-e", out, err, "openai") == (9, 3)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"c{i}" for i in range(9))
    body = lines[0]["response"]["body"]
    assert lines[0]["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"].startswith("echo:")
    errors = [json.loads(x) for x in err.getvalue().splitlines()]
    assert all(e["response"] is None and e["error"]["code"] for e in errors)
    out = io.StringIO()
    assert write_results(client, "job-e", out, None, "vlmq") == (9, 3)
    assert len(out.getvalue().splitlines()) == 12


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.received.append((self.headers["X-Vlmq-Signature"], body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _Receiver.received = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", _Receiver.received
    server.shutdown()


def test_webhook_is_signed_and_sent_once_when_the_job_finishes(settings, receiver):
    url, received = receiver
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(6)], "job-w", webhook_url=url)
    hooks = WebhookSettings(secret="s3cret", allow_private_addresses=True)
    with Running(make_loop(settings, RecordingEngine(), reap_interval_s=0.05, webhooks=hooks)):
        wait_until(lambda: received, what="the webhook")
        wait_until(
            lambda: client.redis.hget(Keys().job("job-w"), "webhook_status"),
            what="delivery recorded",
        )
    assert len(received) == 1
    signature, body = received[0]
    expected = "sha256=" + hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    assert signature == expected
    event = json.loads(body)
    assert event["job_id"] == "job-w" and event["state"] == "completed"
    assert event["counts"]["succeeded"] == 6


def test_webhooks_to_private_addresses_are_refused_by_default(settings, receiver):
    url, received = receiver
    client = Client(settings)
    submit_jsonl(client, [_line(0)], "job-p", webhook_url=url)
    hooks = WebhookSettings(secret="s3cret", max_attempts=1)
    with Running(make_loop(settings, RecordingEngine(), reap_interval_s=0.05, webhooks=hooks)):
        wait_until(
            lambda: client.redis.hget(Keys().job("job-p"), "webhook_status"),
            what="delivery given up",
        )
    assert received == []
    assert client.redis.hget(Keys().job("job-p"), "webhook_status") == "failed"


def test_interactive_requests_overtake_a_bulk_backlog(settings):
    client = Client(settings)
    submit_jsonl(client, [_line(i) for i in range(500)], "job-big")
    engine = RecordingEngine(delay_s=0.02)
    with Running(make_loop(settings, engine)):
        wait_until(lambda: len(engine.ran) >= 16, what="bulk running")
        urgent = [client.submit([{"role": "user", "content": f"now {i}"}]) for i in range(5)]
        ran_before = len(engine.ran)  # once the last one is in its queue
        wait_until(
            lambda: all(client.status(t)["state"] == "succeeded" for t in urgent),
            what="interactive requests",
        )
    # At most what was already pulled when they were all queued (the batch running and the
    # prefetched ones: 8 each, prefetch_batches in all, and one being pulled) ran before
    # them; then they went first, ahead of the remaining backlog.
    positions = [engine.ran.index(t) for t in urgent]
    pulled = settings.worker.prefetch_batches * 8
    assert max(positions) < ran_before + pulled + 8 + len(urgent), (ran_before, positions)
    assert job_summary(client, "job-big")["done"] < 500  # the backlog was still there
