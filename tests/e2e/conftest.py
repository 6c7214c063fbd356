from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import MotoServer, RedisServer
from workers.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def moto_server():
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    server = MotoServer().start()
    yield server
    server.stop()


def vlmq(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """A real ``vlmq`` process (the console script's module entry point)."""
    return subprocess.Popen(
        [sys.executable, "-m", "producers", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        **kwargs,
    )
