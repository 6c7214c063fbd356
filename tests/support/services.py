"""Real services for tests: a private redis-server and moto's S3 HTTP server.

Each runs on a free loopback port so a test can kill and restart it; nothing
relies on a Redis the machine may already run on 6379.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import redis

from vlmq.broker.connection import create_redis
from vlmq.config.settings import Settings
from vlmq.producers.localredis import LocalRedis, free_port

__all__ = ["MotoServer", "RedisServer", "free_port", "wait_until"]

T = TypeVar("T")


def wait_until(
    predicate: Callable[..., T],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until truthy or the deadline passes (no bare sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer(LocalRedis):
    """A private redis-server a test may kill and restart (same port, same data dir)."""

    def __init__(self, workdir: Path, appendonly: bool = True) -> None:
        super().__init__(workdir, appendonly=appendonly)

    def connect(self) -> redis.Redis:
        """A connection as every vlmq process opens one (``create_redis``)."""
        return create_redis(Settings(redis_url=self.url))

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


class MotoServer:
    """moto's S3 over HTTP on loopback (boto3 reaches it via endpoint_url)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        wait_until(self._answers, timeout=30, what="moto server")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def s3(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@contextmanager
def vlmq_serve(
    workdir: Path, env: Mapping[str, str], timeout_s: float = 60
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``vlmq serve`` process on a free port, run in ``workdir`` (no .env of the
    checkout; its output in ``serve.log`` there): its URL and process, once it answers
    ``/healthz``; terminated on exit."""
    import httpx

    def answers() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (workdir / "serve.log").open("wb") as log:
        command = [sys.executable, "-m", "vlmq", "serve", "--port", str(port)]
        process = subprocess.Popen(
            command, cwd=workdir, env=dict(env), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_until(answers, timeout=timeout_s, what="vlmq serve")
            yield url, process
        finally:
            process.terminate()
            process.wait(10)
