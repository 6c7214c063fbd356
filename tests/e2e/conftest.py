from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.zygote import vlmq_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(checkpoint):
    return checkpoint("qwen2_5_vl")


def vlmq(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
    """A real ``vlmq`` process (the console script's module entry point), forked from the
    test process's zygote where it can be (tests/support/zygote.py)."""
    return vlmq_process(
        [sys.executable, "-m", "vlmq", *args], {**os.environ, **(env or {})}, cwd=ROOT, **kwargs
    )


def fleet_environment(redis_url: str, moto: Any, bucket: str, media_root: Path) -> dict[str, str]:
    """What a fleet process of these tests runs with: this Redis, this bucket on moto, short
    leases and reaps, local media from ``media_root``."""
    moto.s3().create_bucket(Bucket=bucket)
    return {
        "VLMQ_REDIS_URL": redis_url,
        "VLMQ_RESULTS_URL": f"s3://{bucket}/results",
        "VLMQ_S3_ENDPOINT_URL": moto.endpoint,
        "VLMQ_FLEET__LEASE_S": "3",
        "VLMQ_FLEET__REAP_INTERVAL_S": "0.5",
        "VLMQ_MEDIA__LOCAL_ROOTS": json.dumps([str(media_root)]),
        "VLMQ_ENGINE__TORCH_THREADS": "1",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }


@pytest.fixture
def fleet_env(redis_server, moto_server, tmp_path, request):
    bucket = f"fleet-{abs(hash(request.node.name)) % 10**8}"
    return fleet_environment(redis_server.url, moto_server, bucket, tmp_path)


class Fleet:
    """Worker processes a test can start, kill -9 and stop."""

    def __init__(self, env):
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = vlmq(
            "worker",
            *args,
            env={**self.env, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def fleet(fleet_env):
    running = Fleet(fleet_env)
    yield running
    running.stop()
