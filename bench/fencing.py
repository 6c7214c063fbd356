"""What fencing costs: no-op drain rate and Redis CPU per task, before and after, one run.

``before`` is a git worktree of the commit before the worker core was fenced (leases on
Redis's clock, delivery tokens, one script per settle); ``after`` is this tree. For each,
alternating, ``--repeats`` times: a fresh redis-server, ``submit_many`` of N text tasks (the
tree's own client), then one ``vlmq worker --engine noop --no-celery`` process of that tree
drains them into a local results folder (so the figure is the queue layer's, not an S3
server's). Redis CPU is ``used_cpu_user + used_cpu_sys`` of the server from ``INFO cpu``,
taken before the enqueue and after the drain, divided by N: microseconds of Redis time per
task over enqueue + pull + settle. The drain rate is N over first start to last finish.

    python -m bench.fencing                     # 20,000 tasks, 3 repeats, writes bench/README.md
    python -m bench.fencing --tasks 5000 --repeats 1 --write ''
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import command_line, replace_section, spread

ROOT = Path(__file__).resolve().parents[1]
# The commit before the fencing change (issue 10's parent): the "before" of this figure.
BASELINE = "9391b24343ede119c642066e3bda887a62dc6365"
MARKER = "fencing"

# Runs inside the tree under test (its vlmq first on sys.path): enqueue, or read figures.
_PROBE = r"""
import json, sys, time
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
url, command, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = Client(Settings(redis_url=url, results_url=sys.argv[4]))
if command == "enqueue":
    items = ([{"role": "user", "content": f"task {i}"}] for i in range(n))
    print(client.submit_many(items, chunk=2000))
elif command == "finished":
    print(json.dumps(client.status(sys.argv[5])["finished"]))
else:
    job = sys.argv[5]
    ids = list(client.job_task_ids(job))
    rows = client.state.tasks.many(ids, ("state", "started_at", "finished_at"))
    done = [r for r in rows if r.get("state") == "succeeded"]
    print(json.dumps({
        "succeeded": len(done),
        "first_start": min(float(r["started_at"]) for r in done),
        "last_finish": max(float(r["finished_at"]) for r in done),
        "finished": client.status(job)["finished"],
    }))
"""


@dataclass
class Run:
    variant: str
    tasks: int
    drain_per_s: float
    redis_us_per_task: float


@dataclass
class Report:
    tasks: int
    repeats: int
    baseline: str
    runs: list[Run] = field(default_factory=list)

    def of(self, variant: str) -> list[Run]:
        return [r for r in self.runs if r.variant == variant]


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vlmq-baseline-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-f", str(path), rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path, ignore_errors=True)


def _env(tree: Path, url: str, results: str) -> dict[str, str]:
    policy = {"max_batch_size": 32, "max_wait_s": 0.005, "token_budget": 10**6}
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "VLMQ_REDIS_URL": url,
        "VLMQ_RESULTS_URL": results,
        "VLMQ_BATCH": json.dumps({m: policy for m in ("text", "image", "video")}),
    }


def _probe(tree: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, env["VLMQ_REDIS_URL"], *args],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done.stdout.strip().splitlines()[-1]


def _redis_cpu_s(redis: object) -> float:
    info = redis.info("cpu")  # type: ignore[attr-defined]
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(variant: str, tree: Path, tasks: int, workdir: Path) -> Run:
    from tests.support.services import RedisServer

    server = RedisServer(workdir / "redis", appendonly=False).start()
    results = f"file://{workdir / 'results'}"
    env = _env(tree, server.url, results)
    redis = server.connect()
    try:
        cpu_before = _redis_cpu_s(redis)
        job = _probe(tree, env, "enqueue", str(tasks), results)
        command = ["worker", "--engine", "noop", "--no-celery", "--modality", "text"]
        worker = subprocess.Popen(
            [sys.executable, "-m", "vlmq", *command],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_finished(tree, env, results, job)
        finally:
            worker.terminate()
            worker.wait(60)
        cpu_s = _redis_cpu_s(redis) - cpu_before
        figures = json.loads(_probe(tree, env, "figures", str(tasks), results, job))
        if figures["succeeded"] != tasks:
            raise RuntimeError(f"{variant}: {figures['succeeded']} of {tasks} succeeded")
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    drain_s = figures["last_finish"] - figures["first_start"]
    return Run(variant, tasks, tasks / drain_s, cpu_s / tasks * 1e6)


def _wait_finished(tree: Path, env: dict[str, str], results: str, job: str) -> None:
    """Polls the job hash only: reading every task's status on each poll would put far
    more Redis time into the figure than the drain itself."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if json.loads(_probe(tree, env, "finished", "0", results, job)):
            return
    raise TimeoutError("the drain did not finish")


def render(report: Report, command: str) -> str:
    before, after = report.of("before"), report.of("after")
    rows = []
    for label, pick in (
        ("drain, tasks/s", "drain_per_s"),
        ("Redis CPU, us/task", "redis_us_per_task"),
    ):
        b = [getattr(r, pick) for r in before]
        a = [getattr(r, pick) for r in after]
        ratio = statistics.median(a) / statistics.median(b)
        rows.append(f"| {label} | {spread(b, ',.0f')} | {spread(a, ',.0f')} | {ratio:.2f}x |")
    return "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"{report.tasks:,} text tasks, `submit_many` then one `vlmq worker --engine noop "
            f"--no-celery` (batch 32, local results folder), {report.repeats} runs of each, "
            f"alternating; median (min-max). Before: `{report.baseline[:12]}`.",
            "",
            "| figure | before fencing | after fencing | after / before |",
            "| --- | ---: | ---: | ---: |",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--write", default="bench/README.md")
    args = parser.parse_args(argv)
    report = Report(args.tasks, args.repeats, args.baseline)
    with worktree(args.baseline) as old:
        for repeat in range(args.repeats):
            for variant, tree in (("before", old), ("after", ROOT)):
                run = measure(variant, tree, args.tasks, Path(tempfile.mkdtemp()))
                report.runs.append(run)
                print(
                    f"[{repeat + 1}/{args.repeats}] {variant}: {run.drain_per_s:,.0f} tasks/s, "
                    f"{run.redis_us_per_task:.1f} us Redis CPU per task",
                    flush=True,
                )
    command = command_line("bench.fencing", argv)
    body = render(report, command.strip())
    print(body)
    if args.write:
        replace_section(Path(args.write), MARKER, body)


if __name__ == "__main__":
    main()
