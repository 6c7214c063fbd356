from __future__ import annotations

import os

import pytest

from tests.support.services import MotoServer, RedisServer


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
