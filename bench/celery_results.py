"""What Celery results cost: Redis bytes and CPU per task, worker CPU and drain rate with the
result backend on vs off, side by side, one run.

For each mode, alternating, ``--repeats`` times: a fresh redis-server (no AOF), one
``vlmq worker --engine noop --modality text`` hosted in Celery (as in production) with
``VLMQ_CELERY__ENABLED`` true or false and the result backend on database 1 of the same
server, then N plain ``send_task`` messages (Celery protocol 2, ``ignore_result`` false: what a
web app's ``send_task`` writes, pushed in one pipeline) to ``vlmq.text``. The run ends when
the queue and the in-flight hash are empty and, with the backend on, every task's meta reads
SUCCESS (STARTED is written too: ``track_started``, the default). Redis CPU is
``used_cpu_user + used_cpu_sys`` from ``INFO cpu`` over push and drain (the final meta reads
are measured and taken out); bytes are ``used_memory`` after minus before; worker CPU is the
worker process's user + system time over the same span; the drain rate is N over push to
the end (results readable by a client), and over the tasks' first start to last finish.

    python -m bench.celery_results                 # 5,000 tasks, 3 repeats, writes bench/README.md
    python -m bench.celery_results --tasks 1000 --repeats 1 --write ''
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
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import command_line, replace_section
from vlmq.config.keys import Keys
from vlmq.config.wire import encode_message

ROOT = Path(__file__).resolve().parents[1]
MARKER = "celery-results"
KEYS = Keys()
QUEUE = KEYS.queue("text")
BATCH = 64


@dataclass
class Run:
    mode: str
    tasks: int
    drain_per_s: float  # push to every result readable
    engine_drain_per_s: float  # first start to last finish
    redis_us_per_task: float
    redis_bytes_per_task: float
    worker_us_per_task: float


@dataclass
class Report:
    tasks: int
    repeats: int
    runs: list[Run] = field(default_factory=list)
    hooks: list[Hooks] = field(default_factory=list)

    def of(self, mode: str) -> list[Run]:
        return [r for r in self.runs if r.mode == mode]


def _redis_cpu_s(redis: Any) -> float:
    info = redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _messages(n: int) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        task_id = str(uuid.uuid4())
        request = {"messages": [{"role": "user", "content": f"describe task {i}"}]}
        out.append((task_id, encode_message(request, task_id, QUEUE, ignore_result=False)))
    return out


def _start_worker(url: str, backend: str, enabled: bool, log: Path) -> subprocess.Popen[bytes]:
    policy = {"max_batch_size": BATCH, "max_wait_s": 0.005, "token_budget": 10**6}
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLMQ_REDIS_URL": url,
        "VLMQ_RESULTS_URL": f"file://{log.parent / 'results'}",
        "VLMQ_BATCH": json.dumps({m: policy for m in ("text", "image", "video")}),
        "VLMQ_CELERY__ENABLED": "true" if enabled else "false",
        "VLMQ_CELERY__RESULT_BACKEND": backend,
    }
    command = [sys.executable, "-m", "vlmq", "worker", "--engine", "noop", "--modality", "text"]
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(check: Any, what: str, timeout_s: float = 600, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def _all_succeeded(backend: Any, ids: list[str]) -> bool:
    for start in range(0, len(ids), 2000):
        chunk = [f"celery-task-meta-{t}" for t in ids[start : start + 2000]]
        for raw in backend.mget(chunk):
            if raw is None or json.loads(raw)["status"] != "SUCCESS":
                return False
    return True


def measure(mode: str, tasks: int, workdir: Path) -> Run:
    from tests.support.services import RedisServer

    server = RedisServer(workdir / "redis", appendonly=False).start()
    redis = server.connect()
    backend_url = server.url.rsplit("/", 1)[0] + "/1"
    backend = redis.__class__.from_url(backend_url, decode_responses=True)
    worker = _start_worker(server.url, backend_url, mode == "on", workdir / "worker.log")
    try:
        _wait(lambda: redis.hlen(KEYS.workers()) >= 1, "the worker", 120)
        messages = _messages(tasks)
        ids = [task_id for task_id, _ in messages]
        memory_before = int(redis.info("memory")["used_memory"])
        cpu_before, worker_before = _redis_cpu_s(redis), _process_cpu_s(worker.pid)
        started = time.perf_counter()
        pipe = redis.pipeline(transaction=False)
        for _, raw in messages:
            pipe.lpush(QUEUE, raw)
        pipe.execute()
        _wait(lambda: redis.llen(QUEUE) == 0 and redis.hlen(KEYS.inflight()) == 0, "the drain")
        reads_s = 0.0
        if mode == "on":
            while True:
                before = _redis_cpu_s(redis)
                done = _all_succeeded(backend, ids)
                reads_s += _redis_cpu_s(redis) - before
                if done:
                    break
                time.sleep(0.02)
        ended = time.perf_counter()
        cpu_s = _redis_cpu_s(redis) - cpu_before - reads_s
        worker_s = _process_cpu_s(worker.pid) - worker_before
        memory = int(redis.info("memory")["used_memory"]) - memory_before
        pipe = redis.pipeline(transaction=False)
        for task_id in ids:
            pipe.hmget(KEYS.task(task_id), "state", "started_at", "finished_at")
        rows: list[list[str]] = pipe.execute()
    finally:
        worker.terminate()
        worker.wait(60)
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if any(state != "succeeded" for state, _, _ in rows):
        raise RuntimeError(f"{mode}: not every task succeeded")
    engine_s = max(float(r[2]) for r in rows) - min(float(r[1]) for r in rows)
    return Run(
        mode,
        tasks,
        tasks / (ended - started),
        tasks / engine_s,
        cpu_s / tasks * 1e6,
        memory / tasks,
        worker_s / tasks * 1e6,
    )


@dataclass
class Hooks:
    """The observer alone: what recording costs per task, apart from the loop's own work."""

    tasks: int
    hook_us: float  # the loop's and settle threads' share: received, started, settled
    writer_us: float  # the results thread: meta built, encoded, pipelined
    redis_us: float


def measure_hooks(tasks: int, workdir: Path) -> Hooks:
    """CeleryResults' hooks for ``tasks`` plain messages, in batches of BATCH, against a
    fresh redis-server (the backend on database 1): thread CPU of the callers and of the
    results thread, and Redis CPU, per task."""
    from tests.support.services import RedisServer
    from vlmq.config.settings import CelerySettings, Settings
    from vlmq.config.wire import decode_envelope
    from vlmq.workers.fleet.celery_results import CeleryResults, results_app

    server = RedisServer(workdir / "redis", appendonly=False).start()
    redis = server.connect()
    backend = server.url.rsplit("/", 1)[0] + "/1"
    settings = Settings(redis_url=server.url, celery=CelerySettings(result_backend=backend))
    results = CeleryResults(results_app(settings), None, "bench")
    try:
        messages = _messages(tasks)
        envelopes = [decode_envelope(raw) for _, raw in messages]
        records = [_record(task_id) for task_id, _ in messages]
        writer = results._writer
        writer.submit(lambda: None).result()  # the thread exists
        results.app.backend.client.ping()  # connected: not part of the figure
        cpu, writer_cpu = _redis_cpu_s(redis), writer.submit(time.thread_time).result()
        hook_s = 0.0
        for start in range(0, tasks, BATCH):
            began = time.thread_time()
            results.received(envelopes[start : start + BATCH])
            results.started([task_id for task_id, _ in messages[start : start + BATCH]])
            results.settled(records[start : start + BATCH])
            hook_s += time.thread_time() - began
        writer_s = writer.submit(time.thread_time).result() - writer_cpu
        redis_s = _redis_cpu_s(redis) - cpu
        stored = int(redis.info("keyspace").get("db1", {}).get("keys", 0))
        if stored != tasks:
            raise RuntimeError(f"{stored} of {tasks} results stored")
    finally:
        results.close()
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    per = 1e6 / tasks
    return Hooks(tasks, hook_s * per, writer_s * per, redis_s * per)


def _record(task_id: str) -> dict[str, Any]:
    return {
        "id": task_id,
        "status": "succeeded",
        "output": "a short answer of a few words",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 12, "completion_tokens": 7},
        "result_url": f"s3://bucket/results/_tasks/{task_id}.1.json",
    }


def _spread(values: list[float], digits: int = 0) -> str:
    fmt = f"{{:,.{digits}f}}"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(low)}-{fmt.format(high)})"


ROWS = (
    ("drain, push to every result readable, tasks/s", "drain_per_s", 0),
    ("drain, first start to last finish, tasks/s", "engine_drain_per_s", 0),
    ("Redis CPU, us/task", "redis_us_per_task", 1),
    ("Redis memory, bytes/task", "redis_bytes_per_task", 0),
    ("worker CPU, us/task", "worker_us_per_task", 0),
)


def _hooks_table(hooks: list[Hooks]) -> list[str]:
    rows = [
        ("received + started + settled (loop and settle threads)", "hook_us"),
        ("results thread (meta, encode, pipeline)", "writer_us"),
        ("Redis CPU", "redis_us"),
    ]
    return [
        "| the observer alone, per task | us (median, min-max) |",
        "| --- | ---: |",
        *(f"| {label} | {_spread([getattr(h, k) for h in hooks], 1)} |" for label, k in rows),
    ]


def render(report: Report, command: str) -> str:
    off, on = report.of("off"), report.of("on")
    rows = []
    for label, pick, digits in ROWS:
        a = [getattr(r, pick) for r in off]
        b = [getattr(r, pick) for r in on]
        ratio = statistics.median(b) / statistics.median(a)
        rows.append(f"| {label} | {_spread(a, digits)} | {_spread(b, digits)} | {ratio:.2f}x |")
    load = os.getloadavg()[0]
    return "\n".join(
        [
            "## Celery results: the result backend on vs off (issue 25)",
            "",
            f"Command: `{command}`",
            "",
            f"{report.tasks:,} plain `send_task` messages (`ignore_result` false) to "
            f"`vlmq.text`, one `vlmq worker --engine noop` hosted in Celery (batch {BATCH}, "
            "local results folder), the backend on database 1 of the same redis-server; "
            f"{report.repeats} runs of each, alternating; median (min-max); load average "
            f"{load:.1f} at the end. On: STARTED and SUCCESS per task (Celery's meta: a SET "
            "with the expiry and a PUBLISH each, pipelined per batch on the worker's results "
            "thread; STARTED after an MGET, so it never hides a result).",
            "",
            "| figure | backend off | backend on | on / off |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
            f"The observer's own cost, measured apart ({report.hooks[0].tasks:,} tasks in "
            f"batches of {BATCH} through `CeleryResults`' hooks against a fresh redis-server, "
            f"{len(report.hooks)} runs; thread CPU time, so the machine's load counts less):",
            "",
            *_hooks_table(report.hooks),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", default="bench/README.md")
    args = parser.parse_args(argv)
    report = Report(args.tasks, args.repeats)
    for repeat in range(args.repeats):
        for mode in ("off", "on"):
            run = measure(mode, args.tasks, Path(tempfile.mkdtemp(prefix="vlmq-celery-bench-")))
            report.runs.append(run)
            print(
                f"[{repeat + 1}/{args.repeats}] {mode}: {run.drain_per_s:,.0f} tasks/s, "
                f"{run.redis_us_per_task:.1f} us Redis CPU, {run.redis_bytes_per_task:,.0f} B, "
                f"{run.worker_us_per_task:,.0f} us worker CPU per task",
                flush=True,
            )
        hooks = measure_hooks(args.tasks, Path(tempfile.mkdtemp(prefix="vlmq-celery-bench-")))
        report.hooks.append(hooks)
        print(
            f"[{repeat + 1}/{args.repeats}] hooks: {hooks.hook_us:.1f} + {hooks.writer_us:.1f} us "
            f"worker CPU, {hooks.redis_us:.1f} us Redis CPU per task",
            flush=True,
        )
    command = command_line("bench.celery_results", argv)
    body = render(report, command.strip())
    print(body)
    if args.write:
        replace_section(Path(args.write), MARKER, body)


if __name__ == "__main__":
    main()
