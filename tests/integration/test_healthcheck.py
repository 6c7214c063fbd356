"""`vlmq healthcheck worker` against a real redis-server and a real (noop) worker service."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support.services import free_port, wait_until
from vlmq.config.keys import Keys
from vlmq.config.settings import BatchPolicy, FleetSettings, Settings
from vlmq.workers.engine.noop import NoopEngine
from vlmq.workers.fleet.service import WorkerService


def healthcheck(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLMQ_REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "vlmq", "healthcheck", "worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def beat(at: float) -> str:
    return json.dumps({"modalities": ["text"], "pid": 1, "at": at, "batches": 0, "model": "m"})


def test_a_running_worker_is_healthy_and_a_stopped_one_is_not(redis_server, tmp_path):
    settings = Settings(
        redis_url=redis_server.url,
        results_url=f"file://{tmp_path / 'results'}",
        batch={"text": BatchPolicy(max_batch_size=4, max_wait_s=0.01, token_budget=10**6)},
        fleet=FleetSettings(lease_s=3.0),
    )
    service = WorkerService(settings, ["text"], NoopEngine()).setup()
    service.start()
    try:
        done = healthcheck(redis_server.url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("ok: ") and f"@{socket.gethostname()}:" in done.stdout
        # The exact name works too; another name does not.
        assert healthcheck(redis_server.url, "--name", service.name).returncode == 0
        assert healthcheck(redis_server.url, "--name", "text@elsewhere:1").returncode == 1
    finally:
        service.stop()
    # A clean stop removes the entry: nothing of this host is left.
    done = healthcheck(redis_server.url)
    assert done.returncode == 1 and "no heartbeat" in done.stdout


def test_a_stale_or_foreign_heartbeat_is_unhealthy(redis_server):
    client = redis_server.connect()
    key = Keys().workers()
    host = socket.gethostname()
    client.hset(key, "image@other-host:7", beat(time.time()))
    assert healthcheck(redis_server.url).returncode == 1  # another host's worker

    client.hset(key, f"text@{host}:42", beat(time.time() - 300))
    done = healthcheck(redis_server.url)
    assert done.returncode == 1 and "last beat" in done.stdout  # a kill -9 leaves a stale entry
    assert healthcheck(redis_server.url, "--max-age", "600").returncode == 0

    # A restarted worker (new pid) beats again: the freshest entry counts.
    client.hset(key, f"text@{host}:43", beat(time.time()))
    assert healthcheck(redis_server.url).returncode == 0
    # --hostname checks another host's name part.
    assert healthcheck(redis_server.url, "--hostname", "other-host").returncode == 0


@pytest.mark.private_redis
def test_an_unreadable_entry_or_a_down_redis_is_unhealthy(redis_server):
    client = redis_server.connect()
    client.hset(Keys().workers(), f"text@{socket.gethostname()}:1", "not json")
    assert healthcheck(redis_server.url).returncode == 1
    url = redis_server.url
    redis_server.kill()
    done = healthcheck(url, "--timeout", "1")
    assert done.returncode == 1 and "Redis unreachable" in done.stdout


def test_the_api_healthcheck_follows_a_real_server(redis_server, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "VLMQ_REDIS_URL": redis_server.url,
        "VLMQ_RESULTS_URL": f"file://{tmp_path / 'results'}",
    }
    url = f"http://127.0.0.1:{port}/healthz"

    def probe(target: str = url) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "vlmq", "healthcheck", "api", "--url", target]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert probe().returncode == 1  # nothing listens yet
    server = subprocess.Popen(
        [sys.executable, "-m", "vlmq", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: probe().returncode == 0, timeout=60, what="vlmq serve")
        done = probe(f"http://127.0.0.1:{port}/no-such-path")
        assert done.returncode == 1 and "404" in done.stdout
    finally:
        server.terminate()
        server.wait(10)
    assert probe().returncode == 1
