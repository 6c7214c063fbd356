"""Redis Sentinel HA: what WAIT after each settle costs, and what a failover costs, in one run.

    python -m bench.ha [--tasks 10000] [--workers 2] [--repeats 3]
        [--drills 3] [--drill-tasks 300] [--write docs/reliability.md]

**Drain** (``--repeats`` of each, alternating): each measurement gets a fresh Sentinel setup
on loopback (a master, one replica replicating directly, three sentinels:
``tests.support.sentinel``), so every process goes through the ``redis+sentinel://``
URL as a deployment would. ``submit_many`` enqueues ``--tasks`` text tasks, then ``--workers``
no-op worker processes (``bench.jobs``' workers: batch 64, a local results folder) drain them,
with ``VLMQ_FLEET__SETTLE_WAIT_REPLICAS`` 0 (off) or 1 (on, ``VLMQ_FLEET__SETTLE_WAIT_TIMEOUT_MS``
1000). The drain rate is the tasks over first start to last finish (Redis's clock, from the
statuses); short WAITs are the worker log lines saying a settle was not on the replica in time.

**Failover drills** (``--drills``, WAIT off and on alternating): the scenario of
``tests/faults/test_sentinel.py`` (``tests.support.faults.failover``): a master, two
replicas, three sentinels (down-after 1000 ms), moto's S3 and one no-op worker; a third into a
job of ``--drill-tasks``, replication is paused, and right after the next settle reaches the
master its host dies (the replication links cut, dropping what they hold, then SIGKILL).
Figures: seconds from the kill to the promotion and to the first task settled on the new
master; terminal statuses the master had and the new master lost, and how those tasks ended
(repaired from their stored object, re-run, or settled again by their own worker because that
settle was not acknowledged yet); and the end state (one terminal status and one object per
task).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import machine, replace_section, spread
from bench.jobs import _start_workers, _stop
from tests.support.sentinel import SentinelCluster
from vlmq.config.settings import Settings
from vlmq.producers.client import Client

MARKER = "ha"


@dataclass
class Run:
    variant: str
    drain_per_s: float
    short_waits: int


def measure(variant: str, workdir: Path, tasks: int, workers: int) -> Run:
    results = f"file://{workdir / 'results'}"
    with SentinelCluster(workdir / "sentinel", replicas=1, links=False) as cluster:
        client = Client(Settings(redis_url=cluster.url, results_url=results))
        items = ([{"role": "user", "content": f"task {i}"}] for i in range(tasks))
        job = client.submit_many(items, chunk=2000)
        extra = {"VLMQ_FLEET__SETTLE_WAIT_REPLICAS": "1" if variant == "on" else "0"}
        procs = _start_workers(workdir, cluster.url, results, workers, extra)
        try:
            deadline = time.monotonic() + 900
            while not client.state.jobs.get(job).finished:
                if time.monotonic() > deadline:
                    raise TimeoutError("the job did not drain")
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"a worker exited: see {workdir}/worker-*.log")
                time.sleep(0.5)
        finally:
            _stop(procs)
        ids = list(client.job_task_ids(job))
        rows = client.state.tasks.many(ids, ("state", "started_at", "finished_at"))
        done = [r for r in rows if r.get("state") == "succeeded"]
        if len(done) != tasks:
            raise RuntimeError(f"{variant}: {len(done)} of {tasks} succeeded")
        first = min(float(r["started_at"]) for r in done)
        last = max(float(r["finished_at"]) for r in done)
    logs = [p.read_text(errors="replace") for p in workdir.glob("worker-*.log")]
    short = sum(text.count("not yet on") for text in logs)
    return Run(variant, tasks / (last - first), short)


def render(runs: list[Run], tasks: int, workers: int, repeats: int) -> str:
    off = [r.drain_per_s for r in runs if r.variant == "off"]
    on = [r.drain_per_s for r in runs if r.variant == "on"]
    short = sum(r.short_waits for r in runs if r.variant == "on")
    ratio = statistics.median(on) / statistics.median(off)
    each = ", ".join(f"{r.variant} {r.drain_per_s:,.0f}" for r in runs)
    return "\n".join(
        [
            f"Command: `python -m bench.ha --tasks {tasks} --workers {workers} "
            f"--repeats {repeats}` on {machine()}.",
            "",
            f"{tasks:,} text tasks, {workers} no-op workers (batch 64, local results folder), "
            "through a `redis+sentinel://` URL to a master with one replica (direct, loopback) "
            f"and three sentinels, fresh each run; {repeats} runs of each (off-on, on-off, ...); "
            f"median (min-max). Runs in order: {each}.",
            "",
            "| figure | WAIT off | WAIT 1 replica | on / off |",
            "| --- | ---: | ---: | ---: |",
            f"| drain, tasks/s | {spread(off, ',.0f')} | {spread(on, ',.0f')} | {ratio:.2f}x |",
            f"| settles whose WAIT timed out (1000 ms) | - | {short} | |",
        ]
    )


DRILL_FIGURES = (
    "promoted_after_s",
    "first_settle_on_new_master_after_s",
    "terminal_statuses_lost",
    "repaired",
    "rerun_pull_lost",
    "rerun_other",
    "settled_by_retry",
    "short_waits",
)
END_STATE = ("terminal", "result_objects", "lost", "disagreeing", "orphan_objects")


def drill(wait: bool, workdir: Path, tasks: int) -> dict[str, Any]:
    import os

    from tests.support.faults.failover import SentinelHarness, sentinel_failover

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    with SentinelHarness(workdir) as h:
        return sentinel_failover(h, tasks=tasks, wait_replicas=1 if wait else 0)


def render_drills(drills: list[tuple[bool, dict[str, Any]]], tasks: int) -> str:
    def cell(wait: bool, name: str) -> str:
        values = [d[name] for w, d in drills if w == wait]
        if name.endswith("_s"):
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
        return ", ".join(str(v) for v in values)

    runs = len(drills) // 2
    rows = [f"| {name} | {cell(False, name)} | {cell(True, name)} |" for name in DRILL_FIGURES]
    ends = []
    for wait in (False, True):
        states = {tuple(d[n] for n in END_STATE) for w, d in drills if w == wait}
        text = [", ".join(f"{n} {v}" for n, v in zip(END_STATE, s, strict=True)) for s in states]
        ends.append("; ".join(text))
    return "\n".join(
        [
            f"Command: `python -m bench.ha --drills {runs} --drill-tasks {tasks}` on {machine()}.",
            "",
            f"{tasks} text tasks, one no-op worker (batch 16, 0.1 s a batch, lease 10 s), a master "
            "and two replicas, three sentinels (down-after 1000 ms, failover-timeout 60000 ms, "
            "quorum 2); replication paused, then the master's host dies right after a settle "
            f"reached it. {runs} drill(s) of each, alternating; seconds as median (min-max), "
            "counts per drill.",
            "",
            "| figure | WAIT off | WAIT 1 replica (timeout 3000 ms) |",
            "| --- | --- | --- |",
            *rows,
            f"| end state | {ends[0]} | {ends[1]} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drills", type=int, default=3, help="failover drills of each (0: none)")
    parser.add_argument("--drill-tasks", type=int, default=300)
    parser.add_argument("--write", type=Path, default=None, help="e.g. docs/reliability.md")
    args = parser.parse_args()
    runs: list[Run] = []
    drills: list[tuple[bool, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-ha-") as name:
        for repeat in range(args.repeats):
            # off, on / on, off / ...: a drift of the machine's load favours neither side.
            for variant in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                print(f"run {repeat + 1}: WAIT {variant}", file=sys.stderr, flush=True)
                workdir = Path(name) / f"{variant}-{repeat}"
                run = measure(variant, workdir, args.tasks, args.workers)
                print(f"  {run.drain_per_s:,.0f} tasks/s", file=sys.stderr, flush=True)
                runs.append(run)
        for repeat in range(args.drills):
            for wait in (False, True):
                print(f"drill {repeat + 1}: WAIT {'on' if wait else 'off'}", file=sys.stderr)
                figures = drill(wait, Path(name) / f"drill-{wait}-{repeat}", args.drill_tasks)
                print(f"  {figures}", file=sys.stderr, flush=True)
                drills.append((wait, figures))
    sections = []
    if runs:
        sections.append((MARKER, render(runs, args.tasks, args.workers, args.repeats)))
    if drills:
        sections.append((f"{MARKER}-failover", render_drills(drills, args.drill_tasks)))
    for marker, text in sections:
        print(text + "\n")
        if args.write is not None:
            replace_section(args.write, marker, text)


if __name__ == "__main__":
    main()
