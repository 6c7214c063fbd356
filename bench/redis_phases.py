"""Redis's cost per task, phase by phase, with one client: what each script costs.

    python -m bench.redis_phases [--tasks 4000] [--batch 32] [--enqueue fed|ids] [--repeats 3]
        [--against CHECKOUT] [--label NAME] [--instructions] [--write bench/README.md]

On a fresh ``redis-server`` (AOF everysec) per run, one client (no worker processes, so nothing
else competes for the CPU) takes ``--tasks`` text tasks through the state layer as a worker
does: enqueue (``--enqueue fed``: a bulk job fed from its staged input; ``ids``:
``submit_many``), pull in batches of ``--batch``, renew every lease once, start each batch and
settle it with a success and its usage; then, on the same server, the raw reference: the same
count of ~1 KB strings ``LPUSH``ed in pipelined chunks and ``BRPOP``ed one per call. Each phase
is Redis's main-thread CPU (``INFO cpu``) per task. With ``--against`` a checkout of another
commit runs the same in the same round (the rounds alternate which goes first).

``--instructions`` counts the instructions redis-server executes per task instead
(``valgrind --tool=callgrind``, one run: deterministic, so a change of a few percent shows
where CPU time on a shared machine cannot; system calls are not counted, so raw BRPOP's cost,
mostly the kernel's, is not comparable there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from bench.common import command_line, machine, replace_section, spread

ROOT = Path(__file__).resolve().parents[1]
MARKER = "redis-phases"
PHASES = ("enqueue", "pull", "renew", "start", "settle", "raw LPUSH", "raw BRPOP")
VLMQ_PHASES = ("enqueue", "pull", "start", "settle")

# Runs inside the tree under test (its vlmq first on sys.path); prints {phase: cost} as JSON.
_PROBE = r"""
import glob, json, subprocess, sys, tempfile, time
from pathlib import Path
from vlmq.config.settings import Settings
from vlmq.broker.state.tasks import Move
from vlmq.config.status import TaskState
from vlmq.config.usage import TaskUsage
from vlmq.producers.bulk import submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.localredis import LocalRedis
try:
    from vlmq.broker.state.tasks import start_move as _start_move
    def start_move(d, modality):
        return _start_move(d.task_id, d.token, "w@host:1", modality, d.status)
except ImportError:  # a tree from before start_move: its worker wrote worker and modality
    def start_move(d, modality):
        fields = {"worker": "w@host:1", "modality": modality}
        return Move(d.task_id, TaskState.RUNNING, fields, d.token, "started_at", True)

tasks, batch, how, counting = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

class Callgrind(LocalRedis):
    def command(self):
        out = f"--callgrind-out-file={self.workdir}/cg.out"
        return ["valgrind", "--tool=callgrind", out, "--dump-instr=no", *super().command()]

def cpu(server, redis):
    if not counting:
        info = redis.info("cpu")
        return float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"])
    before = set(glob.glob(f"{server.workdir}/cg.out*"))
    subprocess.run(["callgrind_control", "-d", str(server.process.pid)], check=True,
                   capture_output=True)
    for _ in range(600):
        new = set(glob.glob(f"{server.workdir}/cg.out*")) - before
        if new:
            time.sleep(0.3)
            for line in Path(new.pop()).read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    cpu.total = getattr(cpu, "total", 0) + int(line.split()[1])
                    return cpu.total
        time.sleep(0.05)
    raise RuntimeError("callgrind wrote no dump")

with tempfile.TemporaryDirectory() as tmp:
    server = (Callgrind if counting else LocalRedis)(Path(tmp) / "redis").start(timeout_s=60)
    try:
        client = Client(Settings(redis_url=server.url, results_url=f"file://{tmp}/results"))
        redis, state, out = client.redis, client.state, {}
        state.leases.renew({"warm-up": 1}, 30)  # the scripts loaded
        items = [
            {"custom_id": f"c{i}", "max_new_tokens": 16,
             "messages": [{"role": "user", "content": f"describe the queue in task {i}"}]}
            for i in range(tasks)
        ]
        last = cpu(server, redis)
        def phase(name):
            global last
            now = cpu(server, redis)
            out[name], last = (now - last) / tasks, now
        if how == "ids":
            client.submit_many(items, "job1")
        else:
            submit_jsonl(client, (json.dumps(item) for item in items), "job1")
        phase("enqueue")
        intake, pulls = state.intake("text"), []
        while (pulled := intake.pull(batch, 30)).deliveries:
            pulls.append(pulled.deliveries)
        phase("pull")
        for ds in pulls:
            state.leases.renew({d.task_id: d.token for d in ds}, 30)
        phase("renew")
        for ds in pulls:
            redis.time()  # as the worker's start reads Redis's clock first
            state.tasks.start([start_move(d, "text") for d in ds])
        phase("start")
        for ds in pulls:
            moves = [
                Move(d.task_id, TaskState.SUCCEEDED,
                     {"worker": "w@host:1", "batch_id": "b" * 32, "error_code": None,
                      "error_message": None, "result_url": f"file:///r/{d.task_id}.{d.token}.json"},
                     d.token, "finished_at")
                for d in ds
            ]
            state.tasks.settle(moves, [TaskUsage("noop", "text", 10, 16, 0.001) for _ in ds])
        phase("settle")
        if redis.hget("vlmq:job:job1", "succeeded") != str(tasks):
            raise RuntimeError("not every task succeeded")
        redis.flushall()
        phase("flush")
        body = "x" * 1000
        pipe = redis.pipeline(transaction=False)
        for start in range(0, tasks, 2000):
            pipe.lpush("raw", *[f"{i}:{body}" for i in range(start, min(tasks, start + 2000))])
            pipe.execute()
        phase("raw LPUSH")
        for _ in range(tasks):
            redis.brpop(["raw"], timeout=1)
        phase("raw BRPOP")
        print(json.dumps(out))
    finally:
        server.stop()
"""


def run_probe(tree: Path, tasks: int, batch: int, enqueue: str, counting: bool) -> dict[str, float]:
    argv = [sys.executable, "-c", _PROBE, str(tasks), str(batch), enqueue, "1" if counting else "0"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed in {tree}:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def vlmq_total(run: dict[str, float]) -> float:
    """A task's cost in vlmq's four phases (enqueue, pull, start, settle)."""
    return sum(run[p] for p in VLMQ_PHASES)


def _totals(run: dict[str, float]) -> dict[str, float]:
    vlmq = vlmq_total(run)
    raw = run["raw LPUSH"] + run["raw BRPOP"]
    return {**run, "vlmq: enqueue + pull + start + settle": vlmq, "raw: LPUSH + BRPOP": raw}


def render(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, command: str) -> str:
    scale, unit, fmt = (1.0, "instructions", ",.0f") if args.instructions else (1e6, "us", ".1f")
    names = list(runs)
    rows = list(_totals(runs[names[0]][0]))
    rows.remove("flush")
    what = "instructions per task (callgrind)" if args.instructions else "us of Redis CPU per task"
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. {args.tasks:,} text tasks ({args.enqueue}), batches of "
        f"{args.batch}, one client, {what}; median (min-max) of {len(runs[names[0]])} run(s)"
        + (", side by side." if len(names) > 1 else "."),
        "",
        "| phase | "
        + " | ".join(f"{name} ({unit})" for name in names)
        + (f" | {names[0]} / {names[1]} |" if len(names) > 1 else " |"),
        "| --- |" + " ---: |" * (len(names) + (1 if len(names) > 1 else 0)),
    ]
    for row in rows:
        values = {n: [_totals(r)[row] * scale for r in runs[n]] for n in names}
        cells = [spread(values[n], fmt) for n in names]
        if len(names) > 1:
            ratio = statistics.median(values[names[0]]) / statistics.median(values[names[1]])
            cells.append(f"{ratio:.2f}x")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if not args.instructions:
        for name in names:
            ratios = [
                _totals(r)["vlmq: enqueue + pull + start + settle"]
                / _totals(r)["raw: LPUSH + BRPOP"]
                for r in runs[name]
            ]
            lines.append("")
            lines.append(f"{name}: vlmq over raw, per task: {spread(ratios, '.2f')}x.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--enqueue", choices=("fed", "ids"), default="fed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", default=None, help="A checkout of another commit.")
    parser.add_argument("--label", default=None, help="The checkout's name in the table.")
    parser.add_argument("--instructions", action="store_true", help="Count instructions.")
    parser.add_argument("--write", default=None, help="Markdown file to put the table in.")
    args = parser.parse_args(argv)
    trees = {"this tree": ROOT}
    if args.against:
        against = Path(args.against).resolve()
        trees[args.label or f"at {against.name}"] = against
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    repeats = 1 if args.instructions else args.repeats
    for repeat in range(repeats):
        order = list(trees.items()) if repeat % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            runs[name].append(
                run_probe(tree, args.tasks, args.batch, args.enqueue, args.instructions)
            )
            print(f"[{repeat + 1}/{repeats}] {name}: done", file=sys.stderr, flush=True)
    ordered = {name: runs[name] for name in trees}
    command = command_line("bench.redis_phases", argv)
    body = render(ordered, args, command.strip())
    print(body)
    if args.write:
        marker = f"{MARKER}-instructions" if args.instructions else MARKER
        replace_section(Path(args.write), marker, body)


if __name__ == "__main__":
    main()
