"""The fleet's ceiling: one Redis driven by 2-16 no-op workers, beside a raw consumer.

    python -m bench.ceiling [--workers 2,4,8,16] [--tasks 20000] [--batch 32]
        [--enqueue fed|ids] [--repeats 3] [--against CHECKOUT] [--commands N]
        [--write bench/README.md]

For each worker count N, in each round, on one fresh ``redis-server`` (AOF everysec, as the
compose file runs it), one after the other:

* **raw**: the tasks' count of ~1 KB strings ``LPUSH``ed in pipelined chunks of 2,000, then
  N consumer processes each ``BRPOP`` one message per call until the list is empty (each
  imports torch and transformers first: a worker's footprint, see the note above _FOOTPRINT);
* **vlmq**: N ``vlmq worker --engine noop --no-celery`` processes (with the same footprint)
  start and register, are paused (SIGSTOP), the tasks are enqueued (``--enqueue fed``: a
  bulk job through ``submit_jsonl``, its tasks fed from the staged input, as ``vlmq submit``
  and the API's batches do; ``ids``: ``Client.submit_many``), and the workers resumed; each
  pulls batches of ``--batch``, starts, "runs" and settles them, writing a result object per
  task to a local folder, until the job has finished;
* **against** (``--against PATH``, a checkout of another commit): the same with that
  checkout's code, in the same round;
* **celery** (``--celery``): what vlmq replaces, plain Celery on its own Redis transport: N
  Celery worker processes (solo pool, late acks, prefetching a batch, a no-op task; the same
  footprint), paused while the tasks are sent one ``send_task`` each, then resumed until the
  queue and kombu's unacked hash are empty; once with results ignored, once with each
  task's result in the Redis result backend (a status per task, as vlmq keeps).

Redis CPU is the server's main thread (``INFO cpu``: what caps one Redis) over enqueue and
drain, per task; the whole process's (``/proc/<pid>/stat``: the AOF's background fsync
included) is reported beside it. The drain rate is the tasks over the seconds from the go to
the last task done (raw: the last pop; vlmq: the job's ``finished_at``); ``busy`` is the main
thread's CPU over those seconds, the share of one core Redis spent; ``ceiling`` is what one
Redis core would do at that cost: 1 s over the CPU per task. Before the drain, the registered
workers idle for ``--idle-s``: Redis CPU per idle worker per second (they poll an empty queue).
``--commands N`` lists each drain's N costliest commands by Redis's own count
(``INFO commandstats``, reset at the go): where a change of the scripts moved the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_py

from bench.common import (
    command_line,
    machine,
    main_thread_cpu,
    push_raw,
    replace_section,
    spread,
    wait_for,
)
from bench.redis_floor import DESIGNS as FLOOR_DESIGNS
from bench.redis_floor import Floor, new_tasks
from vlmq.config.keys import Keys
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
MARKER = "ceiling"
JOB = "ceiling"
RAW_KEY = "raw"
RAW_GO = "raw:go"
RAW_READY = "raw:ready"
_TICKS = os.sysconf("SC_CLK_TCK")

# Every consumer process carries a vlmq worker's footprint (_FOOTPRINT): the raw and floor ones
# import torch and transformers (~550 MB resident), as the no-op workers do, before they say
# they are ready. On this 2-core VM, Redis's CPU per command rises with its neighbours'
# resident memory even while they sleep: 8,000 pipelined LPUSHes cost 2.2-2.6 us each beside 16
# sleeping `import redis` processes or none, 3.7-10.1 beside 16 sleeping ones with torch and
# transformers imported (2 runs of 3 each). Raw beside small consumers and vlmq beside its
# workers compared the machine, not the designs, by 1.5-3x at 8-16 processes.
_FOOTPRINT = "import torch, transformers\n"
READY_S = 300  # 16 consumers importing torch on 2 cores
# `python -m vlmq` after the footprint: the vlmq workers carry it too (a noop worker imports
# no torch of its own: workers/fleet/service.py, _gpu_name), as a model worker does.
_VLMQ_MAIN = "import runpy\nrunpy.run_module('vlmq', run_name='__main__')\n"

# A raw consumer: says it is ready, waits for the go, then pops one message per call until the
# list stays empty for half a second; prints how many it popped and when the last one came.
_RAW_CONSUMER = (
    _FOOTPRINT
    + r"""
import sys, time, redis
r = redis.Redis.from_url(sys.argv[1])
r.lpush(sys.argv[3], "1")
r.brpop([sys.argv[2]], timeout=0)
n, last = 0, time.time()
while r.brpop([sys.argv[4]], timeout=0.5) is not None:
    n, last = n + 1, time.time()
print(n, last)
"""
)

# A consumer of a floor design (bench/redis_floor.py, ``--floor``): says it is ready, waits
# for the go, then pulls, starts and settles batches until the job's every task succeeded;
# prints how many it settled and when the last one was.
_FLOOR_CONSUMER = (
    _FOOTPRINT
    + r"""
import sys, time, redis
from bench.redis_floor import JOB, Floor
url, design, batch, tasks, ready, go = sys.argv[1:7]
r = redis.Redis.from_url(url, decode_responses=True)
floor = Floor(r, design)
r.lpush(ready, "1")
r.brpop([go], timeout=0)
n, last, batches = 0, time.time(), 0
while True:
    held = floor.pull(int(batch))
    if not held:
        if int(r.hget(f"floor:job:{JOB}", "succeeded") or 0) >= int(tasks):
            break
        time.sleep(0.005)
        continue
    batches += 1
    floor.start(held, f"{r.client_id()}.{batches}")
    n, last = n + sum(floor.settle(held)), time.time()
print(n, last)
"""
)

# Plain Celery, for comparison (``--celery``): Celery's own Redis transport as a Celery app
# runs it reliably (late acks: a message stays in kombu's unacked hash until its task
# returned), a no-op task, one solo worker process each, prefetching a batch. No gossip,
# mingle, heartbeats or remote control (vlmq workers use none of them). With results ('1')
# each task's result goes to the Redis result backend on the same server (what a web app that
# reads ``AsyncResult`` needs: a status per task). Says it is ready; at its shutdown prints
# how many tasks it ran and when the last one returned.
CELERY_QUEUE = "celery-ceiling"
_CELERY_APP = r"""
from celery import Celery
def celery_app(url, batch, results):
    app = Celery("ceiling", broker=url, backend=url if results else None)
    app.conf.update(
        task_acks_late=True, worker_prefetch_multiplier=batch, task_ignore_result=not results,
        worker_enable_remote_control=False, worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, task_default_queue="celery-ceiling",
        worker_redirect_stdouts=False,
        task_serializer="json", result_serializer="json", accept_content=["json"])
    @app.task(name="noop")
    def noop(text):
        return len(text)
    return app
"""
_CELERY_WORKER = (
    _FOOTPRINT
    + _CELERY_APP
    + r"""
import sys, time, redis
from celery.signals import task_postrun, worker_ready, worker_shutdown
url, batch, results, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
app = celery_app(url, batch, results)
done = [0, 0.0]
def count(**_):
    done[0], done[1] = done[0] + 1, time.time()
task_postrun.connect(count, weak=False)
worker_ready.connect(lambda **_: redis.Redis.from_url(url).lpush(ready, "1"), weak=False)
worker_shutdown.connect(lambda **_: print(done[0], done[1], flush=True), weak=False)
app.worker_main(["worker", "-P", "solo", "-l", "warning", "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "-Q", "celery-ceiling"])
"""
)
# Sends the tasks as a web app does: one send_task each. The message is Celery's own envelope
# (~1.3 KB with its body base64-encoded: over the others' ~1 KB with a task number alone).
_CELERY_SEND = (
    _CELERY_APP
    + r"""
import sys
url, n, results = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
app = celery_app(url, 32, results)
with app.producer_or_acquire() as producer:
    for i in range(n):
        app.send_task("noop", args=[str(i)], producer=producer)
"""
)

# Enqueues in the tree under test (its vlmq first on sys.path): prints the job id.
_ENQUEUE = r"""
import json, sys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
url, results, how, n, job = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
client = Client(Settings(redis_url=url, results_url=results))
items = [
    {"custom_id": f"c{i}", "max_new_tokens": 16,
     "messages": [{"role": "user", "content": f"describe what the queue holds in task {i}"}]}
    for i in range(n)
]
if how == "ids":
    print(client.submit_many(items, job, chunk=2000))
else:
    from vlmq.producers.bulk import submit_jsonl
    submit_jsonl(client, (json.dumps(item) for item in items), job)
    print(job)
"""


@dataclass(frozen=True)
class Plan:
    workers: tuple[int, ...]
    tasks: int
    batch: int
    enqueue: str
    repeats: int
    idle_s: float
    against: Path | None
    against_label: str
    commands: int = 0  # the costliest commands to list per run (0: none)
    floor: bool = False  # also run bench.redis_floor's designs
    celery: bool = False  # also run plain Celery workers (late acks; with and without results)


@dataclass(frozen=True)
class Sample:
    """One consumer's run at one worker count."""

    consumer: str  # "raw", "vlmq", or the checkout's label
    workers: int
    tasks: int
    drain_s: float
    enqueue_s: float  # main-thread Redis CPU seconds over the enqueue
    dequeue_s: float  # ... over the drain
    process_s: float  # the whole redis-server process over both
    idle_us: float = 0.0  # Redis CPU per idle worker per second (vlmq only)
    # The drain's commands (INFO commandstats): name -> (calls, microseconds); a script's
    # time includes the commands it calls, which are listed too.
    commands: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def us_per_task(self) -> float:
        return (self.enqueue_s + self.dequeue_s) / self.tasks * 1e6

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.drain_s

    @property
    def busy(self) -> float:
        return self.dequeue_s / self.drain_s


@dataclass
class Report:
    plan: Plan
    samples: list[Sample] = field(default_factory=list)

    def of(self, consumer: str, workers: int) -> list[Sample]:
        return [s for s in self.samples if s.consumer == consumer and s.workers == workers]


# --- the server and its CPU -------------------------------------------------


class Meter:
    """Redis's CPU seconds so far: the main thread's (INFO) and the whole process's."""

    def __init__(self, server: LocalRedis, redis: redis_py.Redis) -> None:
        assert server.process is not None
        self.pid = server.process.pid
        self.redis = redis

    def main(self) -> float:
        return main_thread_cpu(self.redis)

    def process(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


@contextmanager
def server() -> Iterator[tuple[LocalRedis, redis_py.Redis, Meter]]:
    """A fresh redis-server (AOF everysec), a client of it and its CPU meter."""
    with tempfile.TemporaryDirectory(prefix="vlmq-ceiling-redis-") as name:
        local = LocalRedis(Path(name) / "redis").start()
        redis = redis_py.Redis.from_url(local.url, decode_responses=True)
        try:
            yield local, redis, Meter(local, redis)
        finally:
            redis.close()
            local.stop()


def _signal_all(procs: Sequence[subprocess.Popen[bytes]], signum: int) -> None:
    for proc in procs:
        proc.send_signal(signum)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    _signal_all([p for p in procs if p.poll() is None], signal.SIGCONT)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _last_done(outputs: Sequence[Sequence[str]], plan: Plan, label: str, counted: str) -> float:
    """When the last of the consumers' tasks was done, from each consumer's ``count time``
    line; fails unless their counts sum to the tasks (``counted``: what the count is of)."""
    done = sum(int(out[0]) for out in outputs)
    if done != plan.tasks:
        raise RuntimeError(f"{label}: {done} of {plan.tasks} {counted}")
    return max(float(out[1]) for out in outputs)


# --- raw LPUSH / BRPOP ---------------------------------------------------------


def measure_raw(url: str, redis: redis_py.Redis, meter: Meter, plan: Plan, n: int) -> Sample:
    redis.flushall()
    argv = [sys.executable, "-c", _RAW_CONSUMER, url, RAW_GO, RAW_READY, RAW_KEY]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE) for _ in range(n)]
    try:
        wait_for(lambda: int(redis.llen(RAW_READY)) == n, READY_S, "the raw consumers")
        cpu0, whole0 = meter.main(), meter.process()
        push_raw(redis, RAW_KEY, plan.tasks)
        cpu1 = meter.main()
        go = time.time()
        redis.lpush(RAW_GO, *["go"] * n)
        outputs = [proc.communicate(timeout=600)[0].decode().split() for proc in procs]
    finally:
        _stop(procs)
    last = _last_done(outputs, plan, "raw", "messages popped")
    cpu2, whole2 = meter.main(), meter.process()
    return Sample("raw", n, plan.tasks, last - go, cpu1 - cpu0, cpu2 - cpu1, whole2 - whole0)


# --- the floor designs (bench/redis_floor.py) --------------------------------------


def measure_floor(
    url: str, redis: redis_py.Redis, meter: Meter, plan: Plan, n: int, design: str
) -> Sample:
    redis.flushall()
    ready, go = "floor:ready", "floor:go"
    argv = [sys.executable, "-c", _FLOOR_CONSUMER, url, design, str(plan.batch)]
    argv += [str(plan.tasks), ready, go]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE) for _ in range(n)]
    try:
        wait_for(lambda: int(redis.llen(ready)) == n, READY_S, "the floor consumers")
        floor = Floor(redis, design)
        cpu0, whole0 = meter.main(), meter.process()
        floor.enqueue_all(new_tasks(plan.tasks))
        cpu1 = meter.main()
        go_at = time.time()
        redis.config_resetstat()
        redis.lpush(go, *["go"] * n)
        outputs = [proc.communicate(timeout=600)[0].decode().split() for proc in procs]
        cpu2, whole2 = meter.main(), meter.process()
        commands = _commands(redis)
    finally:
        _stop(procs)
    last = _last_done(outputs, plan, design, "tasks settled")
    label = FLOOR_DESIGNS[design]
    return Sample(
        label, n, plan.tasks, last - go_at, cpu1 - cpu0, cpu2 - cpu1, whole2 - whole0, 0.0, commands
    )


# --- plain Celery (``--celery``) ------------------------------------------------------

CELERY_LABELS = {False: "celery, late acks", True: "celery, late acks + results"}


def _celery_drained(redis: redis_py.Redis) -> bool:
    """The queue and kombu's unacked hash both empty: every task ran and was acknowledged."""
    return int(redis.llen(CELERY_QUEUE)) == 0 and int(redis.hlen("unacked")) == 0


def _celery_done(redis: redis_py.Redis) -> bool:
    """Drained, and still so a moment later: a message a worker has just popped is in neither
    until its client writes the unacked entry (the workers' counts check the rest)."""
    if not _celery_drained(redis):
        return False
    time.sleep(0.2)
    return _celery_drained(redis)


def measure_celery(
    url: str, redis: redis_py.Redis, meter: Meter, plan: Plan, n: int, results: bool
) -> Sample:
    redis.flushall()
    ready, flag = "celery:ready", "1" if results else "0"
    argv = [sys.executable, "-c", _CELERY_WORKER, url, str(plan.batch), flag, ready]
    # (stderr: Celery's warnings about running as root, here in a container)
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for _ in range(n)
    ]
    try:
        wait_for(lambda: int(redis.llen(ready)) == n, READY_S, "the Celery workers")
        _signal_all(procs, signal.SIGSTOP)
        cpu0, whole0 = meter.main(), meter.process()
        send = [sys.executable, "-c", _CELERY_SEND, url, str(plan.tasks), flag]
        subprocess.run(send, check=True, capture_output=True, timeout=600)
        cpu1 = meter.main()
        go = time.time()
        redis.config_resetstat()
        _signal_all(procs, signal.SIGCONT)
        wait_for(lambda: _celery_done(redis), 900, "the drain")
        cpu2, whole2 = meter.main(), meter.process()
        commands = _commands(redis)
        for proc in procs:
            proc.terminate()
        # (each prints its banner, then its count and time last: worker_shutdown)
        outputs = [
            proc.communicate(timeout=120)[0].decode().strip().splitlines()[-1].split()
            for proc in procs
        ]
    finally:
        _stop(procs)
    last = _last_done(outputs, plan, CELERY_LABELS[results], "tasks ran")
    return Sample(
        CELERY_LABELS[results],
        n,
        plan.tasks,
        last - go,
        cpu1 - cpu0,
        cpu2 - cpu1,
        whole2 - whole0,
        0.0,
        commands,
    )


# --- vlmq workers ---------------------------------------------------------------


def _env(tree: Path, url: str, results: str, batch: int) -> dict[str, str]:
    policy = {"max_batch_size": batch, "max_wait_s": 0.005, "token_budget": 10**7}
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "VLMQ_REDIS_URL": url,
        "VLMQ_RESULTS_URL": results,
        "VLMQ_BATCH": json.dumps({m: policy for m in ("text", "image", "video")}),
        "VLMQ_LOG_LEVEL": "warning",
    }


def _start_workers(
    tree: Path, env: dict[str, str], n: int, tmp: Path
) -> list[subprocess.Popen[bytes]]:
    command = [sys.executable, "-c", _FOOTPRINT + _VLMQ_MAIN, "worker", "--modality", "text"]
    command += ["--engine", "noop", "--no-celery"]
    procs = []
    for i in range(n):
        with (tmp / f"worker-{i}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def _registered(redis: redis_py.Redis, procs: Sequence[subprocess.Popen[bytes]], tmp: Path) -> bool:
    dead = [i for i, p in enumerate(procs) if p.poll() is not None]
    if dead:
        log = (tmp / f"worker-{dead[0]}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"worker {dead[0]} exited:\n{log}")
    return int(redis.hlen(Keys().workers())) >= len(procs)


def _enqueue(tree: Path, env: dict[str, str], plan: Plan) -> None:
    argv = [sys.executable, "-c", _ENQUEUE, env["VLMQ_REDIS_URL"], env["VLMQ_RESULTS_URL"]]
    argv += [plan.enqueue, str(plan.tasks), JOB]
    subprocess.run(argv, cwd=tree, env=env, check=True, capture_output=True, timeout=600)


def measure_vlmq(
    url: str, redis: redis_py.Redis, meter: Meter, plan: Plan, n: int, tree: Path, label: str
) -> Sample:
    redis.flushall()
    tmp = Path(tempfile.mkdtemp(prefix="vlmq-ceiling-"))
    env = _env(tree, url, f"file://{tmp / 'results'}", plan.batch)
    procs = _start_workers(tree, env, n, tmp)
    try:
        wait_for(lambda: _registered(redis, procs, tmp), 300, f"{n} workers to register", 0.1)
        idle0 = meter.main()
        time.sleep(plan.idle_s)
        idle_us = (meter.main() - idle0) / (n * plan.idle_s) * 1e6
        _signal_all(procs, signal.SIGSTOP)
        cpu0, whole0 = meter.main(), meter.process()
        _enqueue(tree, env, plan)
        cpu1 = meter.main()
        go = time.time()
        redis.config_resetstat()
        _signal_all(procs, signal.SIGCONT)
        wait_for(lambda: _registered(redis, procs, tmp) and _finished(redis), 900, "the drain")
        cpu2, whole2 = meter.main(), meter.process()
        done = float(redis.hget(Keys().job(JOB), "finished_at") or 0)
        commands = _commands(redis)
    finally:
        _stop(procs)
    succeeded = int(redis.hget(Keys().job(JOB), "succeeded") or 0)
    if succeeded != plan.tasks:
        raise RuntimeError(f"{label}: {succeeded} of {plan.tasks} tasks succeeded (logs: {tmp})")
    return Sample(
        label,
        n,
        plan.tasks,
        done - go,
        cpu1 - cpu0,
        cpu2 - cpu1,
        whole2 - whole0,
        idle_us,
        commands,
    )


def _commands(redis: redis_py.Redis) -> dict[str, tuple[int, int]]:
    stats: dict[str, dict[str, Any]] = redis.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
    }


def _finished(redis: redis_py.Redis) -> bool:
    return redis.hget(Keys().job(JOB), "finished_at") is not None


# --- the run -------------------------------------------------------------------------


def run(plan: Plan) -> Report:
    report = Report(plan)
    trees = [("vlmq", ROOT)]
    if plan.against is not None:
        trees.append((plan.against_label, plan.against))
    for repeat in range(plan.repeats):
        for n in plan.workers:
            # Each round alternates which vlmq goes first, so neither always follows raw.
            order = trees if repeat % 2 == 0 else trees[::-1]
            with server() as (local, redis, meter):
                samples = [measure_raw(local.url, redis, meter, plan, n)]
                for label, tree in order:
                    samples.append(measure_vlmq(local.url, redis, meter, plan, n, tree, label))
                for design in FLOOR_DESIGNS if plan.floor else ():
                    samples.append(measure_floor(local.url, redis, meter, plan, n, design))
                for results in (False, True) if plan.celery else ():
                    samples.append(measure_celery(local.url, redis, meter, plan, n, results))
            for sample in samples:
                report.samples.append(sample)
                _progress(repeat, sample)
    return report


def _progress(repeat: int, s: Sample) -> None:
    print(
        f"[{repeat + 1}] {s.consumer:>12} x{s.workers:<2}: {s.tasks_per_s:7,.0f} tasks/s, "
        f"{s.us_per_task:6.1f} us/task (enqueue {s.enqueue_s / s.tasks * 1e6:5.1f}), "
        f"busy {s.busy:4.0%}, idle {s.idle_us:,.0f} us/worker/s",
        file=sys.stderr,
        flush=True,
    )


# --- the report ------------------------------------------------------------------------


def _ratios(top: Sequence[Sample], bottom: Sequence[Sample]) -> list[float]:
    """Per round: the two samples of one round taken together."""
    return [a.us_per_task / b.us_per_task for a, b in zip(top, bottom, strict=True)]


def _row(report: Report, consumer: str, n: int) -> str:
    got = report.of(consumer, n)
    raw = report.of("raw", n)
    ratio = "1" if consumer == "raw" else spread(_ratios(got, raw), ".2f") + "x"
    cells = [
        consumer,
        str(n),
        spread([s.tasks_per_s for s in got], ",.0f"),
        spread([s.us_per_task for s in got], ".1f"),
        ratio,
        spread([s.enqueue_s / s.tasks * 1e6 for s in got], ".1f"),
        spread([s.process_s / s.tasks * 1e6 for s in got], ".1f"),
        spread([100 * s.busy for s in got], ",.0f") + " %",
        spread([1e6 / s.us_per_task for s in got], ",.0f"),
        spread([s.idle_us for s in got], ",.0f") if any(s.idle_us for s in got) else "",
    ]
    return "| " + " | ".join(cells) + " |"


def render(report: Report, command: str) -> str:
    plan = report.plan
    consumers = ["raw", "vlmq"] + ([plan.against_label] if plan.against else [])
    consumers += list(FLOOR_DESIGNS.values()) if plan.floor else []
    consumers += list(CELERY_LABELS.values()) if plan.celery else []
    how = "a bulk job fed from its staged input" if plan.enqueue == "fed" else "`submit_many`"
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. {plan.tasks:,} text tasks per run ({how}), no-op workers "
        f"(`--no-celery`, batches of {plan.batch}, local results folder); one fresh "
        f"`redis-server` (AOF everysec) per worker count and round, raw then vlmq on it; "
        f"medians (min-max) of {plan.repeats} rounds."
        + (
            " Plain Celery: one solo worker process each, late acks, prefetching a batch, "
            "one `send_task` a message."
            if plan.celery
            else ""
        ),
        "",
        "| consumer | workers | tasks/s | Redis CPU us/task (main thread) | over raw | "
        "of which enqueue | whole process us/task | busy (of a core) | ceiling, tasks/s "
        "per core | idle us/worker/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in plan.workers:
        lines += [_row(report, consumer, n) for consumer in consumers]
    if plan.commands:
        lines += ["", *_command_rows(report, consumers[1:])]
    return "\n".join(lines)


def _command_rows(report: Report, consumers: Sequence[str]) -> list[str]:
    """The drain's costliest commands per consumer and worker count, by Redis's own count of
    each command's time (a script's includes what it calls)."""
    lines = [
        f"Where the drain's Redis time goes (`INFO commandstats`, the {report.plan.commands} "
        "costliest commands; a Lua call's time (FCALL, EVALSHA) includes the commands it "
        "calls, listed again on their own; medians of the rounds):",
        "",
        "| consumer | workers | command | calls/task | us/task | us/call |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for n in report.plan.workers:
        for consumer in consumers:
            got = report.of(consumer, n)
            names = {name for s in got for name in s.commands}

            def per_task(name: str, got: list[Sample] = got) -> float:
                return statistics.median(s.commands.get(name, (0, 0))[1] / s.tasks for s in got)

            for name in sorted(names, key=per_task, reverse=True)[: report.plan.commands]:
                calls = statistics.median(s.commands.get(name, (0, 0))[0] / s.tasks for s in got)
                us = per_task(name)
                per_call = us / calls if calls else 0.0
                lines.append(
                    f"| {consumer} | {n} | {name} | {calls:.3f} | {us:.2f} | {per_call:.2f} |"
                )
    return lines


def _parse(argv: list[str] | None) -> tuple[Plan, str | None]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", default="2,4,8,16", help="Worker counts, comma-separated.")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=32, help="Batch size of each pull (16-64).")
    parser.add_argument("--enqueue", choices=("fed", "ids"), default="fed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--against", default=None, help="A checkout of another commit.")
    parser.add_argument("--label", default=None, help="The checkout's name in the table.")
    parser.add_argument("--write", default=None, help="Markdown file to put the table in.")
    parser.add_argument(
        "--commands", type=int, default=0, help="List the N costliest commands of each drain."
    )
    parser.add_argument(
        "--floor", action="store_true", help="Also run bench.redis_floor's designs."
    )
    parser.add_argument(
        "--celery",
        action="store_true",
        help="Also run plain Celery workers (its Redis transport, late acks; with and without "
        "a result per task).",
    )
    args = parser.parse_args(argv)
    against = Path(args.against).resolve() if args.against else None
    label = args.label or (f"vlmq at {against.name}" if against else "")
    workers = tuple(int(w) for w in args.workers.split(","))
    plan = Plan(
        workers,
        args.tasks,
        args.batch,
        args.enqueue,
        args.repeats,
        args.idle_s,
        against,
        label,
        args.commands,
        args.floor,
        args.celery,
    )
    return plan, args.write


def main(argv: list[str] | None = None) -> None:
    plan, write = _parse(argv)
    report = run(plan)
    command = command_line("bench.ceiling", argv)
    body = render(report, command.strip())
    print(body)
    if write:
        replace_section(Path(write), MARKER, body)


if __name__ == "__main__":
    main()
