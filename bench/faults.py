"""The fault suite at full size; writes docs/reliability.md.

    python -m bench.faults [--quick] [--write docs/reliability.md]
    python -m bench.faults --drill replies [--repeats 3] [--quick] [--write docs/reliability.md]
    python -m bench.faults --drill prepare [--repeats 3] [--write docs/reliability.md]
    python -m bench.faults --drill stall [--repeats 3] [--write docs/reliability.md]

Real redis-server, moto's S3 server behind a breakable TCP proxy, and real
``vlmq worker`` processes (the no-op engine for delivery faults, the tiny
Qwen2.5-VL checkpoint for engine faults), on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine, replace_section
from tests.support.faults import scenarios, worker_core
from tests.support.faults.harness import Harness, faketime_library

FULL = {
    "kill_tasks": 2000,
    "kills": 5,
    "redis_tasks": 1000,
    "s3_tasks": 600,
    "outage_s": 30.0,
    "skew_tasks": 600,
    "full_tasks": 2000,
    "full_s": 20.0,
}
QUICK = {
    "kill_tasks": 240,
    "kills": 2,
    "redis_tasks": 200,
    "s3_tasks": 150,
    "outage_s": 6.0,
    "skew_tasks": 200,
    "full_tasks": 300,
    "full_s": 4.0,
}


def _run(
    name: str, fn: Callable[[Harness], dict[str, Any]], appendonly: bool = True
) -> dict[str, Any]:
    started = time.monotonic()
    with Harness(Path(tempfile.mkdtemp(prefix="vlmq-faults-")), appendonly=appendonly) as h:
        figures = fn(h)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print(f"{name}: {json.dumps(figures)}", flush=True)
    return figures


def run(sizes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    from vlmq.workers.demo.tiny import build_tiny_model

    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen", "qwen2_5_vl"))
    return {
        "1. kill -9 storm": _run(
            "kill", lambda h: scenarios.kill_storm(h, sizes["kill_tasks"], sizes["kills"])
        ),
        "2a. Redis restart, AOF everysec": _run(
            "redis", lambda h: scenarios.redis_restart(h, sizes["redis_tasks"])
        ),
        "2b. Redis restart, persistence off": _run(
            "redis-off",
            lambda h: scenarios.redis_restart_without_persistence(h, sizes["redis_tasks"]),
            appendonly=False,
        ),
        "3. S3 endpoint down": _run(
            "s3", lambda h: scenarios.s3_outage(h, sizes["s3_tasks"], sizes["outage_s"])
        ),
        "4a. poison request in a batch of 16": _run(
            "poison", lambda h: scenarios.poison_in_batch(h, model, 16)
        ),
        "4b. request that kills its worker": _run("crash", scenarios.crash_request),
        "5. simulated OOM above 4 rows": _run(
            "oom", lambda h: scenarios.oom_halving(h, model, 16, 4)
        ),
        "6. SIGTERM during a batch": _run("sigterm", scenarios.sigterm_mid_batch),
        "7. same task published 3 times": _run("dup", scenarios.double_publish),
        **worker_core_runs(sizes),
    }


def worker_core_runs(sizes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The worker core's faults (issue 10): skew, fencing, duplicates, input, Redis, limits."""
    runs: dict[str, dict[str, Any]] = {}
    if faketime_library() is not None:
        runs["8. clocks 20 s ahead and behind, lease 6 s"] = _run(
            "skew", lambda h: worker_core.clock_skew(h, sizes["skew_tasks"])
        )
    runs |= {
        "9. a holder cut off from Redis past its lease": _run(
            "cut-off", worker_core.cut_off_holder
        ),
        "10. one message in two classes' queues": _run(
            "two-queues", worker_core.duplicates_in_two_queues
        ),
        "11. malformed messages from any producer": _run(
            "malformed", worker_core.malformed_messages
        ),
        "12. Redis at maxmemory (noeviction), then room": _run(
            "full", lambda h: worker_core.redis_full(h, sizes["full_tasks"], sizes["full_s"])
        ),
        "13. Redis read-only for 3 s": _run("read-only", worker_core.redis_read_only),
        "14. a bug in settling (injected once)": _run("settle", worker_core.settle_errors),
        "15. 4 suspects of 1 s each, limit 2.5 s per call": _run(
            "time-limit", worker_core.time_limit_per_engine_call
        ),
        "16. a webhook sender killed mid-delivery": _run(
            "webhook", worker_core.webhook_sender_dies
        ),
        "17. a bug in the heartbeat (injected)": _run("heartbeat", worker_core.heartbeat_error),
    }
    return runs


REPLY_DRILL_FULL = {
    "bulk_lines": 3000,
    "interactive_lines": 1000,
    "api_tasks": 500,
    "client_tasks": 1000,
    "cancelled_tasks": 1000,
    "batch_size": 4,
}


def _reply_drill_sizes(seed: int, quick: bool) -> Any:
    """The drill's sizes: the CI size (``--quick``) or the full one."""
    from tests.support.reply_drill import DrillSizes

    return DrillSizes(seed=seed) if quick else DrillSizes(seed=seed, **REPLY_DRILL_FULL)


def reply_drill(repeats: int, quick: bool) -> list[dict[str, Any]]:
    """The lost-replies drill (tests/support/reply_drill.py), ``repeats`` seeds."""
    from tests.support.fleet import Processes
    from tests.support.reply_drill import run_reply_drill
    from tests.support.replydrop import ReplyDropProxy
    from tests.support.services import MotoServer, RedisServer

    # moto's server takes any credentials; this process reads results through it too.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    runs = []
    for seed in range(repeats):
        workdir = Path(tempfile.mkdtemp(prefix="vlmq-reply-drill-"))
        sizes = _reply_drill_sizes(seed, quick)
        redis, moto = RedisServer(workdir / "redis").start(), MotoServer().start()
        fleet = Processes(redis.url, moto, workdir)
        try:
            with ReplyDropProxy(redis.port) as proxy:
                figures = run_reply_drill(fleet, proxy, workdir, sizes).as_dict()
        finally:
            fleet.stop()
            redis.kill()
            moto.stop()
        figures["violations"] = len(figures["violations"])
        print(f"reply drill, seed {seed}: {json.dumps(figures)}", flush=True)
        runs.append(figures)
    return runs


PREPARE_DRILL = {"batch_mates": 7, "restart_tasks": 12, "revokes": 20}
PREPARE_OUTAGE_S = 4.0


def prepare_drill(repeats: int) -> dict[str, list[dict[str, Any]]]:
    """The prepare tier's and Celery records' faults (tests/support/faults/prepare.py), each
    on a fleet of its own (a private Redis, moto), ``repeats`` times: a photo that kills
    every prepare worker preparing it, a Redis restart under a prepare worker, Celery revokes
    heard by a prepare worker and a GPU worker."""
    from tests.support.faults import prepare
    from tests.support.fleet import Processes
    from tests.support.services import MotoServer, RedisServer
    from vlmq.workers.demo.tiny import build_tiny_model

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen", "qwen2_5_vl"))
    sizes = PREPARE_DRILL
    scenarios_run: dict[str, Callable[[Processes, Any], dict[str, Any]]] = {
        "a photo that kills the prepare worker, 7 batch-mates": lambda fleet, _: (
            prepare.killer_in_the_prepare_tier(
                fleet, fleet.celery_app(), sizes["batch_mates"], {}, most_deaths=8
            )
        ),
        "Redis killed for 4 s under a prepare worker": lambda fleet, server: (
            prepare.redis_restart_under_prepare_workers(
                fleet, server, sizes["restart_tasks"], PREPARE_OUTAGE_S
            )
        ),
        "20 Celery revokes, a prepare and a GPU worker listening": lambda fleet, _: (
            prepare.revokes_heard_by_prepare_workers(fleet, fleet.celery_app(), sizes["revokes"])
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios_run}
    for _ in range(repeats):
        for name, scenario in scenarios_run.items():
            workdir = Path(tempfile.mkdtemp(prefix="vlmq-prepare-drill-"))
            redis, moto = RedisServer(workdir / "redis"), MotoServer()
            started = time.monotonic()
            try:
                redis.start()
                moto.start()
                fleet = Processes(
                    redis.url,
                    moto,
                    workdir,
                    VLMQ_MODEL=model,
                    VLMQ_WORKER__PREPROCESS_WORKERS="2",  # pulls of 4
                )
                try:
                    figures = scenario(fleet, redis)
                finally:
                    fleet.stop()
            finally:
                redis.kill()
                moto.stop()
            figures["wall_s"] = round(time.monotonic() - started, 1)
            print(f"{name}: {json.dumps(figures)}", flush=True)
            runs[name].append(figures)
    return runs


STALL_TASKS = 60


def stall_drill(repeats: int) -> list[dict[str, Any]]:
    """The renewal-stall drill (issue 38; ``worker_core.renewal_stall``): 60 tasks, two noop
    workers with 6 s leases, one 20 s ahead with its monotonic clock shifted too (its
    heartbeat stalls), ``repeats`` times, each on a fresh Redis."""
    if faketime_library() is None:
        raise SystemExit("libfaketime is not installed (apt-get install faketime)")
    return [
        _run(f"stall, run {n}", lambda h: worker_core.renewal_stall(h, STALL_TASKS))
        for n in range(repeats)
    ]


def _stall_table(runs: list[dict[str, Any]], command: str) -> str:
    columns = ["tasks", "succeeded", "delivered_twice", "duplicate_executions", "lost", "wall_s"]
    lines = [
        f"Command: `{command}`. Machine: {machine()}. Two no-op workers (2 s batches of 4, "
        "lease 6 s, reap 0.5 s); one runs under libfaketime 20 s ahead with its monotonic "
        "clock shifted too (`FAKETIME_DONT_FAKE_MONOTONIC=0`), so its heartbeat's timed wait "
        "never returns and it renews nothing.",
        "",
        "| run | " + " | ".join(c.replace("_", " ") for c in columns) + " | by worker |",
        "| --- |" + " ---: |" * len(columns) + " --- |",
    ]
    for n, run in enumerate(runs):
        cells = " | ".join(str(run[c]) for c in columns)
        lines.append(f"| {n} | {cells} | {run['by_worker']} |")
    return "\n".join(lines)


def _prepare_table(runs: dict[str, list[dict[str, Any]]], command: str) -> str:
    lines = [
        f"Command: `{command}`. Machine: {machine()}. Lease 3 s, reap interval 0.5 s, "
        "`max_deliveries` 3, `isolate_after_prestart_deaths` 2, prepare workers pulling 4 "
        "tasks at a time (the tiny Qwen2.5-VL checkpoint's targets), no-op GPU workers; one "
        "row per run, each on a fresh Redis.",
        "",
        "| scenario | run | figures |",
        "| --- | ---: | --- |",
    ]
    for name, figures_of_runs in runs.items():
        for n, figures in enumerate(figures_of_runs):
            shown = ", ".join(f"{k}: {v}" for k, v in figures.items())
            lines.append(f"| {name} | {n} | {shown} |")
    return "\n".join(lines)


def _drill_table(runs: list[dict[str, Any]], command: str, batch_size: int) -> str:
    columns = [
        "commands",
        "replies_dropped",
        "jobs",
        "tasks",
        "writes_applied_twice",
        "results_lost",
        "cancelled_that_ran",
        "seconds",
    ]
    lines = [
        f"Command: `{command}`. Machine: {machine()}. One reply in twenty of every command that "
        "writes lost (the command ran; its connection closed before the reply), on every "
        "connection of every process: `vlmq submit` (bulk and interactive lanes), the HTTP API "
        "(`POST /v1/tasks:batch`), the Python client (a job, and one cancelled while it runs), "
        f"two no-op workers (lease 3 s, batches of {batch_size}).",
        "",
        "| seed | " + " | ".join(c.replace("_", " ") for c in columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for seed, run in enumerate(runs):
        lines.append(f"| {seed} | " + " | ".join(f"{run[c]:,}" for c in columns) + " |")
    return "\n".join(lines)


def _table(results: dict[str, dict[str, Any]], command: str) -> str:
    lines = [
        f"Command: `{command}`. Machine: {machine()}.",
        "Lease 3 s, reap interval 0.5 s, batches of 16 (no-op engine 0.1-0.5 s per batch "
        "unless noted), real `vlmq worker` processes.",
        "",
        "| scenario | figures |",
        "| --- | --- |",
    ]
    for name, figures in results.items():
        shown = ", ".join(f"{k}: {v}" for k, v in figures.items() if k != "job_counts")
        lines.append(f"| {name} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write", default=None)
    parser.add_argument("--drill", choices=["replies", "prepare", "stall"], default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.drill == "replies":
        runs = reply_drill(args.repeats, args.quick)
        command = f"python -m bench.faults --drill replies --repeats {args.repeats}"
        batch_size = _reply_drill_sizes(0, args.quick).batch_size
        table = _drill_table(runs, command + (" --quick" if args.quick else ""), batch_size)
        print(table)
        if args.write:
            replace_section(Path(args.write), "reply-drill", table)
        return
    if args.drill == "prepare":
        prepared = prepare_drill(args.repeats)
        table = _prepare_table(
            prepared, f"python -m bench.faults --drill prepare --repeats {args.repeats}"
        )
        print(table)
        if args.write:
            replace_section(Path(args.write), "prepare-drill", table)
        return
    if args.drill == "stall":
        table = _stall_table(
            stall_drill(args.repeats),
            f"python -m bench.faults --drill stall --repeats {args.repeats}",
        )
        print(table)
        if args.write:
            replace_section(Path(args.write), "stall-drill", table)
        return
    results = run(QUICK if args.quick else FULL)
    command = "python -m bench.faults" + (" --quick" if args.quick else "")
    table = _table(results, command)
    print(table)
    if args.write:
        replace_section(Path(args.write), "faults", table)


if __name__ == "__main__":
    main()
