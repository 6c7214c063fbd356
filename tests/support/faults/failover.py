"""A Redis Sentinel failover in the middle of a job, with real worker processes.

:class:`SentinelHarness` is the fault harness (moto's S3, real ``vlmq worker`` processes) on a
:class:`~tests.support.sentinel.SentinelCluster` instead of a single redis-server: every
process gets the ``redis+sentinel://`` URL. :func:`sentinel_failover` kills the master's host
(replication paused until a settle reaches the master, then the links cut, dropping what they
hold, and SIGKILL) while a no-op worker drains a job, and measures what
the failover cost: how long until a task settled on the new master, which terminal statuses
the asynchronous replication lost, and how each of those tasks ended (its stored result
settled again by the repair, re-run, or settled by its own worker's retry because that settle
had not been acknowledged yet). Used by ``tests/faults/test_sentinel.py`` (CI size).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import redis

from tests.support.faults.harness import Harness, batch_policy
from tests.support.faults.scenarios import _delivery_figures
from tests.support.sentinel import DataNode, SentinelCluster
from tests.support.services import MotoServer, wait_until
from vlmq.broker.state import State
from vlmq.config.keys import Keys
from vlmq.config.status import TERMINAL
from vlmq.producers.localredis import LocalRedis

__all__ = ["SentinelHarness", "sentinel_failover"]

TERMINAL_STATES = {s.value for s in TERMINAL}


class SentinelHarness(Harness):
    """The fault harness on a master, two replicas and three sentinels."""

    def __init__(
        self, workdir: Path, link_delay_s: float = 0.0, moto: MotoServer | None = None
    ) -> None:
        super().__init__(workdir, moto=moto)
        self.cluster = SentinelCluster(workdir / "sentinel", link_delay_s=link_delay_s)
        # Harness starts, addresses and kills ``redis``: the cluster stands in for it.
        self.redis = self.cluster  # type: ignore[assignment]

    def __enter__(self) -> SentinelHarness:
        self.start()
        return self


def _snapshot(node: DataNode, ids: list[str]) -> list[dict[str, str]]:
    """State and delivery count of every task, read from one node directly."""
    with node.connect() as conn:
        return State(conn, Keys()).tasks.many(ids, ("state", "deliveries", "finished_at"))


def _stuck(h: SentinelHarness, job: str, ids: list[str], worker: Any) -> str:
    """What a drill that did not finish looks like (for its failure message)."""
    states: dict[str, int] = {}
    for status in h.statuses(ids):
        states[status.get("state", "?")] = states.get(status.get("state", "?"), 0) + 1
    roles = {}
    for node in h.cluster.nodes:
        try:
            with node.connect() as conn:
                info = conn.info("replication")
            roles[node.port] = (info.get("role"), info.get("connected_slaves"))
        except redis.RedisError:
            roles[node.port] = ("down", None)
    log = h.workdir / "logs" / "worker-0.log"
    tail = log.read_text(errors="replace").splitlines()[-40:]
    return (
        f"job {job} did not finish: task states {states}, job {h.client.status(job)['counts']}, "
        f"worker alive {worker.poll() is None}, nodes {roles}; worker log tail:\n" + "\n".join(tail)
    )


def _what_the_master_had(node: DataNode, ids: list[str]) -> list[dict[str, str]]:
    """The dead master's data, loaded from its AOF by a redis-server of its own on another
    port (the sentinels know nothing of it)."""
    restored = LocalRedis(node.workdir).start()
    try:
        with redis.Redis(port=restored.port, decode_responses=True) as conn:
            return State(conn, Keys()).tasks.many(ids, ("state", "deliveries", "finished_at"))
    finally:
        restored.stop()


def _latest(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    """Of two reads of one task's status on one master, the later (terminal, or more
    deliveries)."""
    if (b.get("state") in TERMINAL_STATES, _deliveries(b)) > (
        a.get("state") in TERMINAL_STATES,
        _deliveries(a),
    ):
        return b
    return a


def _deliveries(status: dict[str, str]) -> int:
    value = status.get("deliveries") or "0"
    return int(value) if value.isdigit() else 0


def _guarded(fn: Any, default: Any) -> Any:
    """``fn()``, or ``default`` while Redis is failing over."""
    try:
        return fn()
    except redis.RedisError:
        return default


def _pulled_not_settled(conn: redis.Redis, ids: list[str]) -> dict[str, int]:
    """Tasks delivered and not yet terminal, with their delivery counts."""
    rows = State(conn, Keys()).tasks.many(ids, ("state", "deliveries"))
    return {
        task: _deliveries(row)
        for task, row in zip(ids, rows, strict=True)
        if _deliveries(row) and row.get("state") not in TERMINAL_STATES
    }


def _any_settled(conn: redis.Redis, ids: list[str]) -> bool:
    rows = State(conn, Keys()).tasks.many(ids, ("state",))
    return any(row.get("state") in TERMINAL_STATES for row in rows)


def _pause_before_a_kept_pull_settles(
    cluster: SentinelCluster, master: redis.Redis, replicas: list[DataNode], ids: list[str]
) -> None:
    """Pauses replication and returns once the master has settled, after the pause, a task
    whose pull every replica holds: the lost settle the repair must mend. Under load a
    replica can lag by a whole pull (its links still carrying it at the pause); then the
    pause is lifted and taken again."""
    for _ in range(40):
        cluster.pause_replication()
        time.sleep(0.1)  # a chunk being written when the links paused lands
        held = _pulled_not_settled(master, ids)
        for node in replicas:
            with node.connect() as conn:
                kept = _pulled_not_settled(conn, list(held))
            held = {task: n for task, n in held.items() if kept.get(task) == n}
        if held:
            settled = functools.partial(_any_settled, master, list(held))
            try:
                wait_until(settled, timeout=10, interval=0.001, what="a kept pull settled")
                return
            except TimeoutError:
                pass
        cluster.resume_replication()
        time.sleep(0.2)
    raise TimeoutError("no task pulled before a pause settled after it in 40 tries")


def _first_settle_after(h: SentinelHarness, ids: list[str], at: float) -> float | None:
    rows = _guarded(lambda: h.client.state.tasks.many(ids, ("finished_at",)), [])
    after = [float(r["finished_at"]) for r in rows if r.get("finished_at")]
    after = [t for t in after if t > at]
    return min(after) if after else None


def sentinel_failover(
    h: SentinelHarness,
    tasks: int = 300,
    delay_s: float = 0.1,
    wait_replicas: int = 0,
    lease_s: float = 10.0,
    kill_after: float = 1 / 3,
) -> dict[str, Any]:
    """One no-op worker drains ``tasks``; once ``kill_after`` of them are done the master's
    host dies. ``wait_replicas`` > 0 turns on WAIT after each settle."""
    env = {
        "VLMQ_FLEET__LEASE_S": str(lease_s),
        "VLMQ_BATCH": batch_policy(16),
        # A WAIT for a replica behind a slow link takes its round trip: room for it.
        "VLMQ_FLEET__REDIS_SOCKET_TIMEOUT_S": "5",
    }
    if wait_replicas:
        env["VLMQ_FLEET__SETTLE_WAIT_REPLICAS"] = str(wait_replicas)
        env["VLMQ_FLEET__SETTLE_WAIT_TIMEOUT_MS"] = "3000"
    worker = h.noop_worker("ha", delay_s, **env)
    h.wait_registered("ha")
    job, ids = h.submit_text(tasks)
    wait_until(
        lambda: h.client.status(job)["done"] >= tasks * kill_after, timeout=120, what="progress"
    )
    cluster = h.cluster
    old = cluster.master_port() or cluster.master.port
    replicas = [n for n in cluster.nodes if n.port != old]
    # Replication stops (the links hold what they carry); right after the master settles a
    # task whose pull every replica already holds, the master's host dies. That settle, and
    # whatever else the master wrote since the pause, reached no replica.
    with cluster.node(old).connect() as conn:
        _pause_before_a_kept_pull_settles(cluster, conn, replicas, ids)
        at_kill = State(conn, Keys()).tasks.many(ids, ("state", "deliveries"))
        killed_at = cluster.fail_master(old)
    killed_mono = time.monotonic()
    # Nothing reaches a replica after the cut until one is promoted: what each has now is
    # what the new master starts from.
    kept = {n.port: _snapshot(n, ids) for n in replicas}
    new = cluster.wait_failover(old, timeout_s=60)
    promoted_s = time.monotonic() - killed_mono
    first = wait_until(
        lambda: _first_settle_after(h, ids, killed_at), timeout=90, what="a settle after it"
    )
    assert first is not None
    try:
        h.wait_job(job, timeout=180)
    except TimeoutError as exc:
        raise TimeoutError(_stuck(h, job, ids, worker)) from exc
    # What the dead master had: its AOF holds every write it applied (written before the
    # reply; everysec only defers the fsync, and a killed process loses no page cache).
    # (Its AOF may miss the last writes when an fsync held them back; the statuses read just
    # before the kill miss what came in the milliseconds after: take both.)
    before = [
        _latest(a, b)
        for a, b in zip(_what_the_master_had(cluster.node(old), ids), at_kill, strict=True)
    ]
    figures = _delivery_figures(h, job, ids)
    final = h.statuses(ids)
    pointed = h.pointed_objects(final)
    outcome = {"repaired": 0, "rerun_pull_lost": 0, "rerun_other": 0, "settled_by_retry": 0}
    lost = 0
    for was, now_kept, end, (_, record) in zip(before, kept[new], final, pointed, strict=True):
        if was.get("state") not in TERMINAL_STATES or now_kept.get("state") in TERMINAL_STATES:
            continue
        lost += 1
        ran_in = int((record or {}).get("deliveries") or 0)
        if ran_in < _deliveries(end):
            outcome["repaired"] += 1
        elif _deliveries(now_kept) < _deliveries(was):
            outcome["rerun_pull_lost"] += 1
        elif ran_in == _deliveries(end) == _deliveries(was):
            outcome["settled_by_retry"] += 1
        else:
            outcome["rerun_other"] += 1
    repaired_total = sum(
        1
        for end, (_, record) in zip(final, pointed, strict=True)
        if record is not None and int(record.get("deliveries") or 0) < _deliveries(end)
    )
    log = (h.workdir / "logs" / "worker-0.log").read_text(encoding="utf-8", errors="replace")
    return {
        **figures,
        "wait_replicas": wait_replicas,
        "link_delay_s": cluster.link_delay_s,
        "promoted_after_s": round(promoted_s, 2),
        "first_settle_on_new_master_after_s": round(first - killed_at, 2),
        "terminal_at_kill": sum(s.get("state") in TERMINAL_STATES for s in before),
        "terminal_statuses_lost": lost,
        **outcome,
        "repaired_total": repaired_total,
        "short_waits": log.count("not yet on"),
        "worker_alive": worker.poll() is None,
    }
