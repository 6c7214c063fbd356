"""Test tiers are folders: unit (no services), integration (real Redis / S3 server), e2e (real
worker processes), faults (fault drills and hostile input), vllm (the vLLM engine in its own
environment). Markers are applied by path.

Expensive things start once per run and are shared: the tiny checkpoints (``checkpoint``, built
once per family, size and seed, even across pytest-xdist workers), moto's S3 server, and one
Redis server whose databases are handed out one per test (``redis_server``). A test that kills,
restarts, reconfigures or measures its Redis is marked ``private_redis`` and gets a server of
its own.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from filelock import FileLock

from tests.support.services import MotoServer, RedisServer
from tests.support.zygote import ZYGOTE
from vlmq.broker.connection import create_redis
from vlmq.config.settings import Settings

TIERS = ("unit", "integration", "e2e", "faults", "vllm")
# Tiers that run several real processes against deadlines on a shared 2-core
# machine: one rerun absorbs a scheduling stall; a rerun is reported (-rR), so
# a test that needs it is visible, never silent.
RERUN_TIERS = ("e2e", "faults")
# The budget of one test (setup, call and teardown); longer ones are listed at the end.
TEST_BUDGET_S = 60.0
# Databases of the shared Redis: one per test that uses it (a run has ~400 such tests).
SHARED_DATABASES = 4096


def pytest_configure(config: pytest.Config) -> None:
    _interruptible_children()


def pytest_unconfigure(config: pytest.Config) -> None:
    ZYGOTE.close()  # (started by a test's first `python -m vlmq`, if any)


def _interruptible_children() -> None:
    """Tests interrupt the CLI with SIGINT and expect it to stop. A run started in the
    background by a shell without job control (``make test &``, nohup) has SIGINT ignored,
    every child inherits that across exec, and an interrupted ``vlmq submit`` would go on. A
    Python handler is reset to the default across exec, so children start interruptible;
    this process gets what Python would have installed itself."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if any(tier in parts for tier in RERUN_TIERS):
            item.add_marker(pytest.mark.flaky(reruns=1))


# ---------------------------------------------------------------------------------------------
# the per-test time budget
# ---------------------------------------------------------------------------------------------

_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``VLMQ_TEST_DURATIONS`` (tests/tiers.py), this run's durations go into that folder
    (pytest-xdist's controller sees every test's reports; its workers write nothing)."""
    folder = os.environ.get("VLMQ_TEST_DURATIONS")
    if not folder or os.environ.get("PYTEST_XDIST_WORKER") or not _SPENT:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = Path(folder) / f"{os.getpid()}.json"
    out.write_text(json.dumps(_SPENT), encoding="utf-8")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    over = sorted(((s, n) for n, s in _SPENT.items() if s > TEST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over the {TEST_BUDGET_S:.0f} s budget", yellow=True)
        for spent, nodeid in over:
            terminalreporter.line(f"{spent:7.1f}s {nodeid}")


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


class Checkpoints:
    """Tiny checkpoints built once per run (per family, size and seed) in a folder every
    pytest-xdist worker of the run shares, under a lock. Builds are deterministic and
    byte-identical (tests/unit/test_tiny_models.py checks it), so sharing one is the same as
    building it again. Tests read them; none may write into them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def __call__(self, family: str = "qwen2_5_vl", size: str = "tiny", seed: int = 0) -> Path:
        folder = self.root / f"{family}-{size}-{seed}"
        done = self.root / f"{folder.name}.built"
        with FileLock(str(folder) + ".lock"):
            if not done.exists():
                from vlmq.workers.demo.tiny import build_tiny_model  # torch: only when used

                build_tiny_model(folder, family, size, seed=seed)
                done.touch()
        return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """``checkpoint(family, size, seed)``: the path of that tiny checkpoint, built once a run."""
    # tests/tiers.py gives all the tiers of a run one folder; else the basetemp's parent,
    # common to every xdist worker of a run and new for each run.
    given = os.environ.get("VLMQ_TEST_CHECKPOINTS")
    if given:
        return Checkpoints(Path(given))
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return Checkpoints(shared / "checkpoints")


# ---------------------------------------------------------------------------------------------
# Redis and S3
# ---------------------------------------------------------------------------------------------


class RedisDatabase:
    """One database of the run's shared Redis server: what a test without a server of its
    own gets (its ``url`` names the database; every vlmq process reaches it through that)."""

    def __init__(self, server: RedisServer, db: int) -> None:
        self.server = server
        self.db = db
        self.port = server.port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    def connect(self) -> redis.Redis:
        return create_redis(Settings(redis_url=self.url))


class _SharedRedis:
    def __init__(self, workdir: Path) -> None:
        self.server = _DatabasesRedis(workdir).start()
        self._numbers = itertools.count(1)  # 0 is left empty

    def database(self) -> RedisDatabase:
        db = next(self._numbers)
        if db >= SHARED_DATABASES:
            raise RuntimeError(f"more than {SHARED_DATABASES} tests used the shared Redis")
        return RedisDatabase(self.server, db)


class _DatabasesRedis(RedisServer):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, appendonly=False)

    def command(self) -> list[str]:
        return [*super().command(), "--databases", str(SHARED_DATABASES)]


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_SharedRedis]:
    shared = _SharedRedis(tmp_path_factory.mktemp("shared-redis"))
    yield shared
    shared.server.kill()


@pytest.fixture
def redis_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh, empty database of the run's shared Redis; for a test marked
    ``private_redis`` (it kills, restarts or reconfigures its Redis, or reads server-wide
    figures), a redis-server of its own."""
    if request.node.get_closest_marker("private_redis"):
        server = RedisServer(tmp_path / "redis").start()
        yield server
        server.kill()
        return
    shared: _SharedRedis = request.getfixturevalue("shared_redis")
    database = shared.database()
    yield database
    _flush(database)


def _flush(database: RedisDatabase) -> None:
    """Free the database's memory for the rest of the run (the worker processes a test
    started are stopped by then)."""
    connection = database.connect()
    connection.flushdb()
    connection.close()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    server = MotoServer().start()
    yield server
    server.stop()
