"""The producer client's hot paths, this checkout side by side with another commit's.

    python -m bench.client_paths --against PATH [--tasks 20000] [--ids 10000] [--repeats 3]
        [--write bench/README.md]

``PATH`` is a checkout of another commit (``git worktree add PATH 9f40ae2``). For each
checkout in turn, on a fresh ``redis-server`` of its own, one process of that checkout's code
(the same measuring script, run with ``PYTHONPATH`` set to it) times:

* ``Client.submit_many`` of ``--tasks`` text requests (tasks per second; validation, the
  messages and the status hashes, one job);
* ``client.statuses(ids)`` of ``--ids`` of those tasks (milliseconds, best of five).

Rounds alternate between the checkouts (``--repeats``), so a noisy moment hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, replace_section, spread
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]

# Runs under either checkout: only what both have (Client, Settings, submit_many, statuses,
# job_task_ids).
_MEASURE = """
import itertools, json, sys, time
from vlmq.config.settings import Settings
from vlmq.producers.client import Client

url, results, tasks, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = Client(Settings(redis_url=url, results_url=results))
items = [
    {"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"describe task {i}"}],
     "max_new_tokens": 16}
    for i in range(tasks)
]
client.submit_many(items[:100])  # imports, connection
started = time.perf_counter()
job = client.submit_many(items)
submit_s = time.perf_counter() - started
wanted = list(itertools.islice(client.job_task_ids(job), ids))
best = float("inf")
for _ in range(5):
    started = time.perf_counter()
    states = client.statuses(wanted)
    best = min(best, time.perf_counter() - started)
assert len(states) == len(wanted)
print(json.dumps({"submit_per_s": tasks / submit_s, "statuses_ms": best * 1000}))
"""


def _measure(tree: Path, tmp: Path, tasks: int, ids: int) -> dict[str, float]:
    server = LocalRedis(tmp / "redis").start()
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, "-c", _MEASURE, server.url, f"file://{tmp / 'results'}"]
        command += [str(tasks), str(ids)]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
        figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
        return figures
    finally:
        server.stop()


def _commit_of(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or str(tree)


def render(runs: dict[str, list[dict[str, float]]], args: Any) -> str:
    names = list(runs)
    out = [
        f"`python -m bench.client_paths --against CHECKOUT --tasks {args.tasks} "
        f"--ids {args.ids} --repeats {args.repeats}` on {machine()}; medians (min-max), "
        "side by side, rounds alternating.",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| `Client.submit_many` (tasks/s) | "
        + " | ".join(spread([r["submit_per_s"] for r in runs[n]], ",.0f") for n in names)
        + " |",
        f"| `client.statuses` of {args.ids:,} ids (ms, best of 5) | "
        + " | ".join(spread([r["statuses_ms"] for r in runs[n]], ",.0f") for n in names)
        + " |",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--ids", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    trees = {"this checkout": ROOT, _commit_of(args.against): args.against.resolve()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-client-") as name:
        for repeat in range(args.repeats):
            for label, tree in trees.items():
                print(f"round {repeat + 1}: {label}", file=sys.stderr, flush=True)
                tmp = Path(name) / f"{repeat}-{len(runs[label])}-{abs(hash(label))}"
                runs[label].append(_measure(tree, tmp, args.tasks, args.ids))
    text = render(runs, args)
    print(text)
    if args.write is not None:
        replace_section(args.write, "bench-client-paths", text)


if __name__ == "__main__":
    main()
