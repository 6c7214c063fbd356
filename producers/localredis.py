"""A private redis-server on a free port: what `vlmq demo` runs as its Redis (the test suite
and the benchmarks start theirs through it too)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TypeVar

from redis import RedisError

from vlmq.broker.connection import create_redis
from vlmq.config.errors import ConfigError
from vlmq.config.settings import Settings

__all__ = ["LocalRedis", "free_port"]

R = TypeVar("R", bound="LocalRedis")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """redis-server on a free loopback port, AOF everysec, noeviction."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = True) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError(
                "redis-server not found: install it (Debian: apt-get install redis-server) "
                "or point VLMQ_REDIS_URL at a running Redis"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The redis-server command line (subclasses add to it: a replica, a sentinel)."""
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]

    def start(self: R, timeout_s: float = 10.0) -> R:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while not self._pings():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise ConfigError(f"redis-server did not start (see {self.workdir}/redis.log)")
            time.sleep(0.05)
        return self

    def _pings(self) -> bool:
        connection = create_redis(Settings(redis_url=self.url), timeout_s=0.5)
        try:
            return bool(connection.ping())
        except RedisError:
            return False
        finally:
            connection.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
