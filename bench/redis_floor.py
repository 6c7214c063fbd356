"""The floor under vlmq's Redis cost per task: the least state a task can keep, side by side.

    python -m bench.redis_floor [--tasks 4000] [--batch 32] [--repeats 3] [--instructions]
        [--write bench/README.md]

What would a task cost Redis if the state layer kept only what its guarantees need, and what
would vlmq's redesign around a field per task cost? Three models (``bench/floor/*.lua``, four
small scripts each, nothing else), run phase by phase as ``bench.redis_phases`` runs vlmq (one
client, no worker processes):

* **hash per task**: the task's status is a hash, as in vlmq: created with its ttl at enqueue
  (state, job, class, queue, expiry, tag, custom_id, delivery count), its tag checked and a
  delivery counted at pull (the fencing token) with the message in the in-flight hash and a
  lease, a fenced move to running with an attempt at start, a fenced move to succeeded with its
  result's url at settle with the acknowledgements; the job's counters once per call.
* **field per task**: the same guarantees with each task's state one field of its job's hash
  (state, delivery count, attempts, tag in one value), so every read and write of a call is
  one command per job, and a batch's start time and worker one record of the batch.

Both leave out what vlmq does beyond that: fair share across tenants and jobs, quotas,
usage, one task per custom_id (claims), replies kept for a lost reply's retry, folding a
finished task into its job, the completion list, finish checks and events, prepared lanes,
copies of a task already held, messages of other Celery producers. The third puts them back:

* **field per task, features kept** (``lean``): the redesign docs/broker.md lays out, as lean
  scripts. A task's whole status is one field of its job's state hash ('state token attempts
  tag batch queued_at modality custom_id'), which is also the job's claims (a live or
  succeeded task's id is skipped when fed again); messages on the job's own list, served by
  fair share (the class's tenants, each tenant's jobs, least recently served first, an empty
  list leaving its zset) after the fixed lists a GPU worker drains first; a live holder's copy
  dropped at the pull; each held task's origin list and zset; the pull's rows with the
  message and the status the worker decides on; kept replies for the feed, pull and settle;
  the job's and quota's counters, the completion list, usage per job and tenant, the job
  keys' ttls and a finish check once per call. Not modelled: the interactive lane's single
  tasks (hashes, as now), events and notifications, a task's own ttl (a job's fields expire
  together), cancel, expiry and the reaper (off the per-task path).

Each run has its own fresh ``redis-server`` (AOF everysec) and, on it, the raw reference (~1
KB strings ``LPUSH``ed in pipelined chunks of 2,000, ``BRPOP``ed one per call); vlmq runs
through ``bench.redis_phases``'s probe (a fed bulk job). Redis CPU is the main thread's (``INFO
cpu``) per task; each design is also given over the raw consumer on its own server.
``--instructions`` counts the instructions redis-server executes per task instead (callgrind,
one round: deterministic; the raw reference is left out there, its cost being mostly the
kernel's, which callgrind does not count). ``python -m bench.ceiling --floor`` runs the same
designs as a fleet: N consumer processes against one Redis.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import redis as redis_py

from bench.common import command_line, machine, main_thread_cpu, push_raw, replace_section, spread
from bench.redis_phases import run_probe
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "floor"
MARKER = "redis-floor"
PHASES = ("enqueue", "pull", "start", "settle")
DESIGNS = {
    "hash": "floor: hash per task",
    "fields": "floor: field per task",
    "lean": "field per task, features kept",
}
VLMQ = "vlmq"
JOB = "job1"
CHUNK = 2000  # tasks per enqueue call, as vlmq's feed applies a chunk of its input
LEASE_S = 30
TTL_S = 3600


def message(task_id: str, tag: str) -> str:
    """A ~1 KB Celery-like message: headers (id, job) and properties before the body, as
    vlmq's encoder puts them."""
    headers = {"id": task_id, "job": JOB, "task": "vlmq.run"}
    properties = {"delivery_tag": tag}
    wire = {"headers": headers, "properties": properties, "body": "x" * 900}
    return json.dumps(wire, separators=(",", ":"))


class Callgrind(LocalRedis):
    """redis-server under callgrind: ``instructions()`` is its count so far."""

    def command(self) -> list[str]:
        out = f"--callgrind-out-file={self.workdir}/cg.out"
        return ["valgrind", "--tool=callgrind", out, "--dump-instr=no", *super().command()]

    def instructions(self) -> float:
        assert self.process is not None
        before = set(glob.glob(f"{self.workdir}/cg.out*"))
        dump = ["callgrind_control", "-d", str(self.process.pid)]
        subprocess.run(dump, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(glob.glob(f"{self.workdir}/cg.out*")) - before
            if new:
                time.sleep(0.3)  # (callgrind writes the totals line last)
                for line in Path(new.pop()).read_text().splitlines():
                    if line.startswith(("summary:", "totals:")):
                        return float(line.split()[1])
            time.sleep(0.05)
        raise RuntimeError("callgrind wrote no dump")


class Phases:
    """Redis CPU per task, phase after phase, on one server; under callgrind, instructions
    per task (each dump counts from the one before)."""

    def __init__(self, redis: redis_py.Redis, tasks: int, server: LocalRedis) -> None:
        self.redis, self.tasks, self.server = redis, tasks, server
        self.out: dict[str, float] = {}
        self.last = 0.0 if isinstance(server, Callgrind) else main_thread_cpu(redis)

    def done(self, name: str) -> None:
        if isinstance(self.server, Callgrind):
            self.out[name] = self.server.instructions() / self.tasks
            return
        now = main_thread_cpu(self.redis)
        self.out[name], self.last = (now - self.last) / self.tasks, now


class Floor:
    """One floor design's four scripts on one Redis, called as vlmq's state layer is."""

    QUEUE, INFLIGHT, LEASES = "floor:queue", "floor:inflight", "floor:leases"
    # The lean design's own keys (bench/floor/lean_*.lua): a job's state hash and list, fair
    # share's zsets, the origins, completion list, usage and quota.
    STATES, JOB_LIST, TENANT = "floor:states:", f"floor:q:{JOB}", "tenant1"
    ACTIVE, CLASS_ACTIVE = f"floor:active:{TENANT}", "floor:active"
    FIXED = ("floor:interactive.prepared", "floor:interactive", "floor:bulk.prepared")

    def __init__(self, redis: redis_py.Redis, design: str) -> None:
        self.redis, self.design = redis, design
        self.scripts = {
            phase: redis.register_script((SCRIPTS / f"{design}_{phase}.lua").read_text())
            for phase in PHASES
        }
        # Loaded now, so no phase's figure includes a script's first load.
        for script in self.scripts.values():
            redis.script_load(script.script)

    @staticmethod
    def call_key() -> str:
        return f"floor:call:{uuid.uuid4().hex}"

    def enqueue(self, tasks: list[tuple[str, str, str]], job: str = JOB) -> int:
        """Creates each (id, tag, message)'s task and queues its message."""
        if self.design == "lean":
            keys = [self.STATES + job, f"floor:job:{job}", self.JOB_LIST, self.ACTIVE]
            keys += [self.CLASS_ACTIVE, "floor:depth", f"floor:quota:{self.TENANT}"]
            lean: list[str | int] = [TTL_S]
            for task_id, tag, raw in tasks:
                lean += [task_id, tag, f"custom {task_id}", raw]
            return int(self.scripts["enqueue"](keys=[*keys, self.call_key()], args=lean))
        argv: list[str | int] = [job] if self.design == "fields" else [job, TTL_S]
        for task in tasks:
            argv += task
        return int(self.scripts["enqueue"](keys=[self.QUEUE], args=argv))

    def enqueue_all(self, tasks: list[tuple[str, str, str]]) -> None:
        """Enqueues ``tasks`` a chunk of CHUNK per call, as vlmq's feed does."""
        for at in range(0, len(tasks), CHUNK):
            self.enqueue(tasks[at : at + CHUNK])

    def requeue(self, task_id: str, raw: str) -> None:
        """A reaper's give-back of a held task's copy: its lease ends, its message is queued
        again where it came from."""
        redis = self.redis
        if self.design != "lean":
            redis.lpush(self.QUEUE, raw)
            return
        redis.zrem(self.LEASES, task_id)
        redis.lpush(self.JOB_LIST, raw)
        redis.zadd(self.ACTIVE, {self.JOB_LIST: 0}, nx=True)
        redis.zadd(self.CLASS_ACTIVE, {self.ACTIVE: 0}, nx=True)

    def pull(self, count: int, call: str | None = None) -> list[tuple[str, str]]:
        """Up to ``count`` (id, token) this holder now leases (``call``: the lean design's
        call key, for a retry of the same call; a new one by default)."""
        if self.design == "lean":
            keys = [self.INFLIGHT, self.LEASES, "floor:origins", "floor:origin-zsets"]
            keys += ["floor:depth", self.CLASS_ACTIVE, call or self.call_key(), *self.FIXED]
            got = self.scripts["pull"](keys=keys, args=[count, LEASE_S, self.STATES])
            # (rows of 8: id, message, token, origin and the status the worker decides on)
            width, token = 8, 2
        else:
            keys = [self.QUEUE, self.INFLIGHT, self.LEASES]
            got = self.scripts["pull"](keys=keys, args=[count, LEASE_S])
            width, token = 2, 1
        words = [x.decode() if isinstance(x, bytes) else str(x) for x in got]
        return [(words[at], words[at + token]) for at in range(0, len(words), width)]

    def start(self, held: list[tuple[str, str]], batch_id: str, job: str = JOB) -> list[int]:
        """1 per task moved to running, 0 per fenced-out holder."""
        pairs = [x for task in held for x in task]
        if self.design == "lean":
            keys = [f"floor:batch:{batch_id}", f"floor:job:{job}"]
            args = [self.STATES, job, batch_id, "w@host:1", *pairs]
            return list(self.scripts["start"](keys=keys, args=args))
        return list(self.scripts["start"](args=[job, batch_id, *pairs]))

    def settle(self, held: list[tuple[str, str]], job: str = JOB) -> list[int]:
        """1 per task that succeeded, 0 per fenced-out holder; every lease acknowledged."""
        if self.design == "lean":
            keys = [self.INFLIGHT, self.LEASES, "floor:origins", "floor:origin-zsets"]
            keys += [f"floor:job:{job}", f"floor:job:{job}:finished", f"floor:job:{job}:usage"]
            keys += [f"floor:usage:{self.TENANT}", "floor:usage-tenants"]
            keys += [f"floor:quota:{self.TENANT}", self.call_key(), self.STATES + job]
            keys.append(self.JOB_LIST)
            args: list[str | int] = [TTL_S, self.TENANT, "noop|text"]
            for task_id, token in held:
                args += [task_id, token, 10, 16, "0.001"]
            return list(self.scripts["settle"](keys=keys, args=args))
        pairs = [x for task in held for x in task]
        keys = [self.INFLIGHT, self.LEASES]
        return list(self.scripts["settle"](keys=keys, args=[job, *pairs]))


def new_tasks(n: int) -> list[tuple[str, str, str]]:
    """``n`` (id, tag, message) with fresh ids and tags."""
    tasks = []
    for i in range(n):
        task_id, tag = f"{i}.{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        tasks.append((task_id, tag, message(task_id, tag)))
    return tasks


def run_design(design: str, tasks: int, batch: int, counting: bool) -> dict[str, float]:
    """One run of a floor design and the raw reference on a fresh server: {phase: s/task},
    or instructions per task (``counting``: no raw reference)."""
    with tempfile.TemporaryDirectory() as tmp:
        kind = Callgrind if counting else LocalRedis
        server = kind(Path(tmp) / "redis").start(timeout_s=120 if counting else 60)
        try:
            redis = redis_py.Redis.from_url(server.url)
            floor = Floor(redis, design)
            work = new_tasks(tasks)
            phases = Phases(redis, tasks, server)
            if counting:
                phases.done("setup")
            _drive(floor, work, batch, phases.done)
            if not counting:
                redis.flushall()
                phases.done("flush")
                _raw(redis, tasks, phases.done)
            return phases.out
        finally:
            server.stop()


def _drive(
    floor: Floor, work: list[tuple[str, str, str]], batch: int, done: Callable[[str], None]
) -> None:
    floor.enqueue_all(work)
    done("enqueue")
    pulls = []
    while held := floor.pull(batch):
        pulls.append(held)
    if sum(map(len, pulls)) != len(work):
        raise RuntimeError(f"{floor.design}: the pulls took {sum(map(len, pulls))} tasks")
    done("pull")
    for n, held in enumerate(pulls):
        if not all(floor.start(held, f"b{n}")):
            raise RuntimeError(f"{floor.design}: a start was refused")
    done("start")
    for held in pulls:
        if not all(floor.settle(held)):
            raise RuntimeError(f"{floor.design}: a settle was refused")
    done("settle")


def _raw(redis: redis_py.Redis, tasks: int, done: Callable[[str], None]) -> None:
    push_raw(redis, "raw", tasks)
    done("raw LPUSH")
    for _ in range(tasks):
        redis.brpop(["raw"], timeout=1)
    done("raw BRPOP")


def run_vlmq(tasks: int, batch: int, counting: bool) -> dict[str, float]:
    return run_probe(ROOT, tasks, batch, "fed", counting)


def _with_totals(run: dict[str, float]) -> dict[str, float]:
    total = sum(run[p] for p in PHASES)
    if "raw BRPOP" not in run:
        return {**run, "total": total}
    raw = run["raw LPUSH"] + run["raw BRPOP"]
    return {**run, "total": total, "raw": raw, "over raw": total / raw}


def render(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, command: str) -> str:
    names = list(runs)
    totals = {n: [_with_totals(r) for r in runs[n]] for n in names}
    scale, fmt = (1.0, ",.0f") if args.instructions else (1e6, ".1f")
    what = (
        "instructions per task (callgrind)"
        if args.instructions
        else ("us of Redis CPU per task (main thread)")
    )
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. {args.tasks:,} text tasks, batches of {args.batch}, one "
        f"client, {what}; median (min-max) of {len(runs[names[0]])} round(s), each design "
        "on its own fresh server in each round.",
        "",
        "| phase | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    labels = {p: p for p in PHASES} | {"total": "enqueue + pull + start + settle"}
    if not args.instructions:
        labels["raw"] = "raw LPUSH + BRPOP, same server"
    for row, label in labels.items():
        cells = [spread([t[row] * scale for t in totals[n]], fmt) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if not args.instructions:
        cells = [spread([t["over raw"] for t in totals[n]], ".2f") + "x" for n in names]
        lines.append("| over raw | " + " | ".join(cells) + " |")
    vlmq = statistics.median(t["total"] for t in totals[VLMQ])
    cells = [f"{vlmq / statistics.median(t['total'] for t in totals[n]):.2f}x" for n in names]
    lines.append("| vlmq over this | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--instructions", action="store_true", help="Count instructions.")
    parser.add_argument("--write", default=None, help="Markdown file to put the table in.")
    args = parser.parse_args(argv)
    runners: dict[str, Callable[[], dict[str, float]]] = {
        VLMQ: lambda: run_vlmq(args.tasks, args.batch, args.instructions)
    }
    for design, label in DESIGNS.items():
        runners[label] = functools.partial(
            run_design, design, args.tasks, args.batch, args.instructions
        )
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    repeats = 1 if args.instructions else args.repeats
    for repeat in range(repeats):
        # Each round starts with the next one, so no design always runs first.
        order = list(runners.items())
        order = order[repeat % len(order) :] + order[: repeat % len(order)]
        for name, runner in order:
            runs[name].append(runner())
            print(f"[{repeat + 1}/{repeats}] {name}: done", file=sys.stderr, flush=True)
    command = command_line("bench.redis_floor", argv)
    body = render({name: runs[name] for name in runners}, args, command.strip())
    print(body)
    if args.write:
        marker = f"{MARKER}-instructions" if args.instructions else MARKER
        replace_section(Path(args.write), marker, body)


if __name__ == "__main__":
    main()
