"""Test tiers are folders: unit (no services), integration (real Redis / S3
server), e2e (real worker processes), faults (fault drills and hostile input).
Markers are applied by path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlmq.workers.testing.services import MotoServer, RedisServer

TIERS = ("unit", "integration", "e2e", "faults")
# Tiers that run several real processes against deadlines on a shared 2-core
# machine: one rerun absorbs a scheduling stall; a rerun is reported (-rR), so
# a test that needs it is visible, never silent.
RERUN_TIERS = ("e2e", "faults")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if any(tier in parts for tier in RERUN_TIERS):
            item.add_marker(pytest.mark.flaky(reruns=1))


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
