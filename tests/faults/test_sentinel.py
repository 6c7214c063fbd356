"""Redis Sentinel: real failovers under a running job, and the connection paths they rely on.

The failover drills run a master, two replicas (each replicating through a link the drill
pauses, then cuts when the master's host dies), three sentinels (down-after 1000 ms, quorum
2), moto's S3 and a real no-op ``vlmq worker``; docs/reliability.md has the figures.
"""

from __future__ import annotations

import time

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError
from redis.sentinel import Sentinel

from tests.support.faults.failover import SentinelHarness, sentinel_failover
from tests.support.sentinel import DataNode
from tests.support.services import wait_until
from vlmq.broker.connection import create_redis
from vlmq.broker.scripts import Scripts, Wait
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.workers.fleet.celery_app import make_app

# From the kill to the first task settled on the new master: sentinel detection
# (down-after 1000 ms) + election + promotion, then the worker's reconnect. Measured 2.2-2.5 s
# (up to 2.9 s with three drills at once on 2 cores).
FAILOVER_BOUND_S = 15


@pytest.fixture
def drill(tmp_path, moto_server):
    with SentinelHarness(tmp_path, moto=moto_server) as h:
        yield h


def _no_loss(figures, tasks):
    assert figures["terminal"] == figures["succeeded"] == tasks
    assert figures["result_objects"] == tasks  # one object per task
    assert figures["lost"] == 0 and figures["disagreeing"] == 0
    assert figures["orphan_objects"] == 0
    assert figures["worker_alive"]


def test_failover_without_wait_repairs_the_lost_settles(drill):
    figures = sentinel_failover(drill, tasks=300)
    print("\nfailover, WAIT off:", figures)
    _no_loss(figures, 300)
    assert figures["first_settle_on_new_master_after_s"] < FAILOVER_BOUND_S
    # Replication was paused until a settle reached the master: at least that one is lost.
    assert figures["terminal_statuses_lost"] >= 1
    # Acknowledged settles lost with their pull kept are all repaired from their stored
    # objects (the model does not run again); none is re-run.
    assert figures["repaired"] >= 1 and figures["rerun_other"] == 0
    assert figures["duplicate_executions"] == 0


def test_failover_with_wait_loses_no_acknowledged_settle(drill):
    figures = sentinel_failover(drill, tasks=300, wait_replicas=1)
    print("\nfailover, WAIT 1:", figures)
    _no_loss(figures, 300)
    assert figures["first_settle_on_new_master_after_s"] < FAILOVER_BOUND_S
    # Statuses the master had but no replica got were not acknowledged yet (their WAIT was
    # pending): their own worker settles them again on the new master. Nothing to repair.
    assert figures["repaired_total"] == 0 and figures["rerun_other"] == 0
    assert figures["terminal_statuses_lost"] == (
        figures["settled_by_retry"] + figures["rerun_pull_lost"]
    )


def test_celery_host_follows_the_failover(tmp_path, moto_server):
    """A Celery-hosted worker (kombu's sentinel transport) answers a control ping before
    and after a failover; a task published through the app lands on the current master."""
    with SentinelHarness(tmp_path, moto=moto_server) as h:
        proc = h.worker("--modality", "text", "--engine", "noop", "--name", "celery-ha")
        h.wait_registered("celery-ha")
        app = make_app(h.settings)
        assert wait_until(lambda: _pong(app), timeout=60, what="a pong")
        cluster = h.cluster
        old = cluster.master_port()
        assert old is not None
        app.send_task("vlmq.nothing", queue="vlmq-ha-probe")
        assert cluster.node(old).connect().llen("vlmq-ha-probe") == 1
        cluster.fail_master(old)
        new = cluster.wait_failover(old)
        app.send_task("vlmq.nothing", queue="vlmq-ha-probe")
        assert cluster.node(new).connect().llen("vlmq-ha-probe") >= 1
        # The test's own control connection to the dead master fails once; the worker's
        # consumer reconnected through the sentinels and answers.
        assert wait_until(lambda: _pong(app), timeout=60, what="a pong after the failover")
        assert proc.poll() is None
        app.close()


def _pong(app: Celery) -> list:
    try:
        return app.control.ping(timeout=1.0)
    except (redis.ConnectionError, OperationalError, OSError):
        return []


def test_a_demoted_master_is_dropped_for_the_new_one(tmp_path, monkeypatch):
    """READONLY from the node the pool holds (a master demoted to replica) drops that
    connection and resolves the master again, within the same call."""
    master = DataNode(tmp_path / "m").start()
    replica = DataNode(tmp_path / "r", replicaof=master.port).start()
    try:
        wait_until(lambda: replica.connect().info("replication")["master_link_status"] == "up")
        answers = [("127.0.0.1", replica.port)]  # the sentinels' stale answer first

        def discover_master(self, service_name):
            return answers.pop(0) if answers else ("127.0.0.1", master.port)

        monkeypatch.setattr(Sentinel, "discover_master", discover_master)
        client = create_redis(Settings(redis_url="redis+sentinel://127.0.0.1:1/vlmq"))
        assert client.set("k", "v")  # READONLY on the replica, then the master
        answers.append(("127.0.0.1", replica.port))
        client.connection_pool.disconnect()
        pipe = client.pipeline(transaction=False)
        pipe.set("k2", "v2")
        pipe.get("k")
        assert pipe.execute() == [True, "v"]
        answers.append(("127.0.0.1", replica.port))
        client.connection_pool.disconnect()
        assert Scripts(client, Keys())("reap", Keys().bookkeeping(), [10]) == 0
    finally:
        replica.kill()
        master.kill()


@pytest.mark.private_redis
def test_wait_reports_missing_replicas_without_failing(redis_server, caplog):
    """A lone master: WAIT 1 times out with 0 replicas; the script's reply still comes back,
    the shortfall is reported. A library Redis lost (restart, failover) is loaded again."""
    client = redis_server.connect()
    scripts = Scripts(client, Keys())
    bookkeeping = Keys().bookkeeping()
    short: list[int] = []
    wait = Wait(1, 50, on_short=short.append)
    started = time.monotonic()
    assert scripts("reap", bookkeeping, [10], wait=wait) == 0
    assert time.monotonic() - started >= 0.04 and short == [0]
    assert "not yet on 1 replica(s)" in caplog.text
    client.function_flush()
    assert scripts("reap", bookkeeping, [10], wait=wait) == 0
    assert short == [0, 0]
    # Each call met "Function not found" first (the library had not been loaded, then was
    # flushed): its WAIT ran, the library was loaded, and the pair ran again.
    assert int(client.info("commandstats")["cmdstat_wait"]["calls"]) == 4
    assert scripts("reap", bookkeeping, [10], wait=wait) == 0
    assert int(client.info("commandstats")["cmdstat_wait"]["calls"]) == 5
    # WAIT for 0 replicas: the plain call.
    assert scripts("reap", bookkeeping, [10], wait=Wait(0, 50)) == 0
    assert int(client.info("commandstats")["cmdstat_wait"]["calls"]) == 5


def test_wait_on_a_replica_is_satisfied(tmp_path):
    master = DataNode(tmp_path / "m").start()
    replica = DataNode(tmp_path / "r", replicaof=master.port).start()
    try:
        wait_until(lambda: replica.connect().info("replication")["master_link_status"] == "up")
        client = create_redis(Settings(redis_url=master.url))
        short: list[int] = []
        wait = Wait(1, 2000, short.append)
        assert Scripts(client, Keys())("reap", Keys().bookkeeping(), [10], wait=wait) == 0
        assert short == []
    finally:
        replica.kill()
        master.kill()
