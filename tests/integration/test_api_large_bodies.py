"""Large bodies against a real ``vlmq serve`` process: what a 30 MB body costs it in memory
(its peak RSS from /proc, reset before each body), and whether ``/healthz`` keeps answering
while the body is read, parsed and refused or queued.

The chat body is the one that took an API process to 2.5 GB and held its event loop 15 s:
30.8 MB of a million one-word turns. The other is 30 MB of text, a valid task."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_api_streaming import PeakRss
from tests.support.services import vlmq_serve

MiB = 1024 * 1024
# What serving one 30 MB body may cost the process, and how long /healthz may take
# meanwhile (on b0b2365: 2.4 GB and 15 s for the chat body).
GROWTH_ALLOWED = 512 * MiB
HEALTHZ_WITHIN_S = 2.0


def _many_turns(size: int) -> bytes:
    turn = b'{"role":"user","content":"xy"},'
    return (
        b'{"model":"m","messages":['
        + turn * (size // len(turn))
        + b'{"role":"user","content":"xy"}]}'
    )


def _text_task(size: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x" * size}]}).encode()


@pytest.fixture
def api_process(redis_server: Any, tmp_path: Path) -> Iterator[tuple[str, PeakRss]]:
    env = {
        **os.environ,
        "VLMQ_REDIS_URL": redis_server.url,
        "VLMQ_RESULTS_URL": f"file://{tmp_path}/results",
        # No worker runs: a chat body that were queued would answer 504 at once.
        "VLMQ_API__SYNC_TIMEOUT_S": "1",
    }
    env.pop("VLMQ_API__API_KEYS", None)
    with vlmq_serve(tmp_path, env, timeout_s=30) as (url, process):
        yield url, PeakRss(process.pid)


class HealthProbe:
    """``/healthz`` asked over and over on a thread; the slowest answer it got."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _probe(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                assert client.get(f"{self.url}/healthz").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.answers += 1
                self._stop.wait(0.02)


def _post(url: str, path: str, body: bytes, peak: PeakRss) -> tuple[httpx.Response, int, float]:
    """The answer to ``body``, what the process grew by, and the slowest /healthz meanwhile."""
    start = peak.reset()
    with HealthProbe(url) as probe:
        reply = httpx.post(
            f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120
        )
    assert probe.answers > 0
    return reply, peak.peak() - start, probe.slowest


def test_a_30_mb_body_costs_what_it_weighs_and_healthz_answers_meanwhile(api_process, redis_server):
    url, peak = api_process
    redis = redis_server.connect()
    reply, grew, slowest = _post(url, "/v1/chat/completions", _many_turns(30_800_000), peak)
    assert grew < GROWTH_ALLOWED, f"grew {grew / MiB:.0f} MiB"
    assert slowest < HEALTHZ_WITHIN_S, f"/healthz took {slowest:.2f} s"
    assert reply.status_code == 413, reply.text
    error = reply.json()["error"]
    assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
    assert not redis.keys("vlmq.text*") and not redis.keys("vlmq:task:*")

    # 30 MB of text is a valid task: queued, in a message a worker takes.
    reply, grew, slowest = _post(url, "/v1/tasks", _text_task(30_000_000), peak)
    assert grew < GROWTH_ALLOWED, f"grew {grew / MiB:.0f} MiB"
    assert slowest < HEALTHZ_WITHIN_S, f"/healthz took {slowest:.2f} s"
    assert reply.status_code == 202, reply.text
    (message,) = redis.lrange("vlmq.text.interactive", 0, -1)
    assert 40_000_000 < len(message) <= 64 * MiB
