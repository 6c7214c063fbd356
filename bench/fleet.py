"""The fleet's own cost, side by side in one run on one machine.

    python -m bench.fleet [--quick] [--workdir .vlmq/bench] [--write bench/README.md]

Starts its own ``redis-server`` (never the one on 6379) and a ``file://``
results store in a temporary folder, then measures:

1. enqueue: ``Client.submit_many`` (pipelined Celery messages) vs a plain
   Celery ``send_task`` loop, and checks the messages are valid Celery ones;
2. drain: one real no-op worker process vs a raw redis-py ``BRPOP`` loop;
3. fleet vs in-process: one real ``hf`` worker vs ``Engine.run`` in this
   process on the ``small`` checkpoint, never running at the same time;
4. status reads of many tasks in one round trip;
5. the batching gain (batch size 1 vs 16) in-process and through the fleet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.common import machine, replace_section, run_in_batches, wait_for, workload
from vlmq.config.keys import Keys
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings, Settings
from vlmq.config.wire import TASK_NAME, decode_message
from vlmq.producers.client import Client
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "vlmq.text"
NEW_TOKENS = 16
FLEET_BATCH = 16


@dataclass(frozen=True)
class Sizes:
    enqueue: int  # tasks through submit_many
    send_task: int  # tasks through Celery's send_task loop
    raw_drain: int  # strings through the raw BRPOP loop
    fleet_drain: int  # tasks through the no-op worker
    status: int  # tasks read back in one round trip
    model_requests: int  # requests through the small checkpoint
    repeats: int  # runs of the short measurements (the best one counts)


FULL = Sizes(20_000, 2_000, 20_000, 20_000, 10_000, 64, 3)
QUICK = Sizes(2_000, 500, 1_000, 1_000, 2_000, 16, 1)


@dataclass
class Report:
    enqueue: list[tuple[str, int, float]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    drain: list[tuple[str, int, float]] = field(default_factory=list)
    status: list[tuple[str, int, float]] = field(default_factory=list)
    model: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    repeats: int = 1


# --- the embedded services ------------------------------------------------


@dataclass
class Bench:
    """One private Redis, one file results store and the worker processes started."""

    tmp: Path
    url: str
    settings: Settings
    client: Client
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def flush(self) -> None:
        self.client.redis.flushdb()

    def env(self, batch_size: int, max_wait_s: float, extra: dict[str, str]) -> dict[str, str]:
        policy = {"max_batch_size": batch_size, "max_wait_s": max_wait_s, "token_budget": 10**6}
        return {
            **os.environ,
            "VLMQ_REDIS_URL": self.url,
            "VLMQ_RESULTS_URL": self.settings.results_url,
            "VLMQ_BATCH": json.dumps({m: policy for m in ("text", "image", "video")}),
            **extra,
        }

    def start_worker(self, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"worker-{len(self.procs)}.log").open("wb")
        command = [sys.executable, "-m", "vlmq", "worker", "--modality", "text", *args]
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes]) -> str:
        path = self.tmp / f"worker-{self.procs.index(proc)}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop_workers(self) -> None:
        for proc in self.procs:
            _stop(proc)
        self.client.redis.delete(Keys().workers())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # in case it was paused
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextmanager
def services() -> Iterator[Bench]:
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-fleet-") as name:
        tmp = Path(name)
        server = LocalRedis(tmp / "redis").start()
        bench: Bench | None = None
        try:
            settings = Settings(redis_url=server.url, results_url=f"file://{tmp / 'results'}")
            bench = Bench(tmp, server.url, settings, Client(settings))
            yield bench
        finally:
            if bench is not None:
                bench.stop_workers()
            server.stop()


def _alive_and(bench: Bench, proc: subprocess.Popen[bytes], check: Callable[[], bool]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"worker exited with {proc.returncode}:\n{bench.log_tail(proc)}")
    return check()


def _registered(bench: Bench) -> bool:
    return bool(bench.client.redis.hlen(Keys().workers()) >= 1)


def _finished(bench: Bench, job: str) -> bool:
    return bench.client.state.jobs.get(job).finished


def _text_items(n: int, prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}{i}",
            "messages": [{"role": "user", "content": f"describe the queue in task {i}"}],
            "max_new_tokens": NEW_TOKENS,
        }
        for i in range(n)
    ]


# --- 1. enqueue -----------------------------------------------------------


def _celery_app(url: str) -> Any:
    from celery import Celery

    app = Celery("vlmq-bench", broker=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
    )
    return app


def _time_submit_many(bench: Bench, n: int) -> tuple[str, float]:
    items = _text_items(n, "e")
    started = time.perf_counter()
    job = bench.client.submit_many(items)
    return job, time.perf_counter() - started


def _time_send_task(url: str, n: int) -> float:
    app = _celery_app(url)
    request = {"messages": [{"role": "user", "content": "hello from send_task"}]}
    try:
        app.send_task(TASK_NAME, kwargs={"request": request}, queue=QUEUE)  # connect first
        started = time.perf_counter()
        for _ in range(n):
            app.send_task(TASK_NAME, kwargs={"request": request}, queue=QUEUE)
        return time.perf_counter() - started
    finally:
        app.close()


def _job_queue(bench: Bench, job: str) -> str:
    """The list a job's messages went to (as recorded in its first task's status)."""
    first = next(bench.client.job_task_ids(job))
    return bench.client.state.tasks.get(first)["queue"]


def _expected_lengths(job_queue: str, sent: int, enqueued: int) -> dict[str, int]:
    if job_queue == QUEUE:
        return {QUEUE: sent + enqueued}
    return {QUEUE: sent, job_queue: enqueued}


def _check_messages(bench: Bench, job: str, sent: int, enqueued: int) -> list[str]:
    """Count both producers' messages, decode a sample of each as a worker would."""
    r, sample = bench.client.redis, 200
    job_queue = _job_queue(bench, job)
    ours = r.lrange(job_queue, 0, sample - 1)  # LPUSH: vlmq's, the newest, at the head
    theirs = r.lrange(QUEUE, -sample, -1)  # Celery's were sent first: at the tail
    mine, celery = (set(json.loads(raw)["headers"]) for raw in (ours[0], theirs[0]))
    decoded = [decode_message(raw) for raw in [*ours, *theirs]]
    for message in decoded:
        assert message.task_name == TASK_NAME, message.task_name
        Request.model_validate({**message.request, "id": message.task_id})
    expected = _expected_lengths(job_queue, sent, enqueued)
    lengths = {name: int(r.llen(name)) for name in expected}
    assert lengths == expected, f"queue lengths {lengths}, expected {expected}"
    held = ", ".join(f"`{name.replace(job, '<job>')}` {n:,}" for name, n in lengths.items())
    return [
        f"messages per list: {held} (as many as were enqueued)",
        f"{len(decoded)} sampled messages (both producers) decode with "
        "`config.wire.decode_message` as `vlmq.generate` tasks whose request validates",
        _header_note(mine, celery),
    ]


def _header_note(mine: set[str], celery: set[str]) -> str:
    if mine == celery:
        return "vlmq's message headers have the same keys as Celery's"
    only_celery = ", ".join(f"`{k}`" for k in sorted(celery - mine)) or "none"
    only_mine = ", ".join(f"`{k}`" for k in sorted(mine - celery)) or "none"
    return (
        f"header keys: Celery's message also carries {only_celery} (optional in protocol 2); "
        f"only vlmq's carries {only_mine}"
    )


def measure_enqueue(bench: Bench, sizes: Sizes, report: Report) -> list[str]:
    bench.client.submit_many(_text_items(10, "warm"))  # imports, connection
    sent = took = float("inf")
    for _ in range(sizes.repeats):  # the last round's messages stay for the checks
        bench.flush()
        sent = min(sent, _time_send_task(bench.url, sizes.send_task))
        job, elapsed = _time_submit_many(bench, sizes.enqueue)
        took = min(took, elapsed)
    report.enqueue += [
        ("vlmq `Client.submit_many` (pipelined, with status hashes)", sizes.enqueue, took),
        ("Celery `app.send_task(..., queue='vlmq.text')` loop", sizes.send_task, sent),
    ]
    report.checks = _check_messages(bench, job, sizes.send_task + 1, sizes.enqueue)
    _progress(
        f"enqueue: vlmq {sizes.enqueue / took:,.0f}/s, send_task {sizes.send_task / sent:,.0f}/s"
    )
    return list(bench.client.job_task_ids(job))


# --- 4. status reads --------------------------------------------------------


def _best_ms(call: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def measure_status(bench: Bench, ids: list[str], report: Report) -> None:
    states = bench.client.statuses(ids)
    assert len(states) == len(ids) and all(s.value == "queued" for s in states)
    report.status += [
        (
            "`client.statuses(ids)` (state only, one pipelined round trip)",
            len(ids),
            _best_ms(lambda: bench.client.statuses(ids)),
        ),
        (
            "`client.state.tasks.many(ids)` (full hashes, one pipelined round trip)",
            len(ids),
            _best_ms(lambda: bench.client.state.tasks.many(ids)),
        ),
    ]
    _progress(f"status: {report.status[0][2]:.0f} ms / {report.status[1][2]:.0f} ms")


# --- 2. drain ---------------------------------------------------------------


def measure_raw_brpop(bench: Bench, n: int) -> float:
    r = redis.Redis.from_url(bench.url)
    key = "bench:raw"
    pipe = r.pipeline(transaction=False)
    for start in range(0, n, 2000):
        pipe.lpush(key, *[f"message-{i}" for i in range(start, min(n, start + 2000))])
    pipe.execute()
    started = time.perf_counter()
    for _ in range(n):
        if r.brpop([key], timeout=1) is None:
            raise RuntimeError("the raw list ran dry")
    return time.perf_counter() - started


def _drain_seconds(bench: Bench, ids: Sequence[str]) -> float:
    rows = bench.client.state.tasks.many(ids, ("state", "started_at", "finished_at"))
    bad = [row for row in rows if row.get("state") != "succeeded"]
    if bad:
        raise RuntimeError(f"{len(bad)} tasks did not succeed, e.g. {bad[0]}")
    started = min(float(row["started_at"]) for row in rows)
    return max(float(row["finished_at"]) for row in rows) - started


def measure_fleet_drain(bench: Bench, n: int, celery: bool) -> float:
    bench.flush()
    job = bench.client.submit_many(_text_items(n, "d"))
    ids = list(bench.client.job_task_ids(job))
    host = "--celery" if celery else "--no-celery"
    proc = bench.start_worker(bench.env(32, 0.005, {}), "--engine", "noop", host)
    try:
        wait_for(lambda: _alive_and(bench, proc, lambda: _finished(bench, job)), 300, "the drain")
    finally:
        bench.stop_workers()
    return _drain_seconds(bench, ids)


def measure_drain(bench: Bench, sizes: Sizes, report: Report) -> None:
    bench.flush()
    raw = min(measure_raw_brpop(bench, sizes.raw_drain) for _ in range(sizes.repeats))
    report.drain.append(("raw redis-py `BRPOP` loop, one message per call", sizes.raw_drain, raw))
    _progress(f"drain: raw BRPOP {sizes.raw_drain / raw:,.0f}/s")
    for celery, label in ((False, "`--no-celery`"), (True, "Celery host (default)")):
        took = measure_fleet_drain(bench, sizes.fleet_drain, celery)
        name = f"`vlmq worker --engine noop` {label}, batch 32"
        report.drain.append((name, sizes.fleet_drain, took))
        _progress(f"drain: fleet {label} {sizes.fleet_drain / took:,.0f}/s")


# --- 3 and 5. the small checkpoint: in-process vs fleet ---------------------


def _model_dir(workdir: Path) -> Path:
    model_dir = workdir / "qwen2_5_vl-small"
    if not (model_dir / "config.json").exists():
        from vlmq.workers.demo.tiny import build_tiny_model

        _progress(f"building the small checkpoint in {model_dir}")
        build_tiny_model(model_dir, "qwen2_5_vl", size="small")
    return model_dir


def _items(requests: Sequence[Request]) -> list[dict[str, Any]]:
    """Request dicts without ids, so every submission gets fresh task ids."""
    return [
        r.model_dump(mode="json", exclude={"id", "job_id"}, exclude_none=True) for r in requests
    ]


def _in_process_engine(model_dir: Path, max_batch_size: int) -> Any:
    import torch

    from vlmq.workers.engine import Engine

    torch.set_num_threads(1)
    settings = EngineSettings(
        max_new_tokens_default=NEW_TOKENS,
        fixed_output_length=True,
        max_batch_size=max_batch_size,
        torch_threads=1,
    )
    return Engine(str(model_dir), settings, MediaSettings()).setup()


def _time_engine(engine: Any, requests: list[Request], batch_size: int) -> float:
    took, results = run_in_batches(engine, requests, batch_size)
    _check_records([r.model_dump(mode="json") for r in results])
    _progress(f"in-process bs={batch_size}: {len(requests) / took:.2f} req/s")
    return took


def _check_records(records: Sequence[dict[str, Any]]) -> None:
    failed = [r for r in records if r.get("status") != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].get('error')}")
    short = [r for r in records if r["usage"]["completion_tokens"] != NEW_TOKENS]
    if short:
        raise RuntimeError(f"{len(short)} requests generated != {NEW_TOKENS} tokens")


def _hf_env(bench: Bench, model_dir: Path, batch_size: int) -> dict[str, str]:
    extra = {
        "VLMQ_MODEL": str(model_dir),
        "VLMQ_ENGINE__FIXED_OUTPUT_LENGTH": "true",
        "VLMQ_ENGINE__MAX_NEW_TOKENS_DEFAULT": str(NEW_TOKENS),
        "VLMQ_ENGINE__MAX_BATCH_SIZE": str(batch_size),
        "VLMQ_ENGINE__TORCH_THREADS": "1",
    }
    return bench.env(batch_size, 0.05, extra)


def _run_job(bench: Bench, proc: subprocess.Popen[bytes], items: list[dict[str, Any]]) -> float:
    started = time.perf_counter()
    job = bench.client.submit_many(items)
    wait_for(lambda: _alive_and(bench, proc, lambda: _finished(bench, job)), 600, "a job", 0.005)
    took = time.perf_counter() - started
    _check_records([bench.client.result(i) for i in bench.client.job_task_ids(job)])
    _progress(f"fleet: {len(items)} requests in {took:.2f}s")
    return took


@contextmanager
def hf_worker(
    bench: Bench, model_dir: Path, batch_size: int, warm_up: list[Request]
) -> Iterator[subprocess.Popen[bytes]]:
    """One real ``hf`` worker process, loaded and warmed up, stopped on exit."""
    bench.flush()
    env = _hf_env(bench, model_dir, batch_size)
    proc = bench.start_worker(env, "--engine", "hf", "--no-celery")
    try:
        wait_for(lambda: _alive_and(bench, proc, lambda: _registered(bench)), 300, "the worker")
        _run_job(bench, proc, _items(warm_up))
        yield proc
    finally:
        bench.stop_workers()


@contextmanager
def paused(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """SIGSTOP the worker, so it takes no CPU at all while the parent measures."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def measure_pair(
    bench: Bench, engine: Any, model_dir: Path, requests: list[Request], bs: int, repeats: int
) -> tuple[float, float]:
    """In-process and fleet runs taken in turns (never at once); the best of each."""
    inproc = fleet = float("inf")
    with hf_worker(bench, model_dir, bs, requests[:2]) as proc:
        for _ in range(repeats):
            with paused(proc):
                inproc = min(inproc, _time_engine(engine, requests, bs))
            fleet = min(fleet, _run_job(bench, proc, _items(requests)))
    _progress(
        f"bs={bs}: in-process {len(requests) / inproc:.2f}, fleet {len(requests) / fleet:.2f}"
    )
    return inproc, fleet


def measure_model(bench: Bench, sizes: Sizes, workdir: Path, report: Report, gain: bool) -> None:
    model_dir = _model_dir(workdir)
    requests = workload("text", sizes.model_requests, workdir / "media")
    batch_sizes = [FLEET_BATCH, 1] if gain else [FLEET_BATCH]
    bench.stop_workers()
    engine = _in_process_engine(model_dir, max(batch_sizes))
    try:
        engine.run(requests[:2])  # warm-up
        for bs in batch_sizes:
            inproc, fleet = measure_pair(bench, engine, model_dir, requests, bs, sizes.repeats)
            report.model[("in-process", bs)] = (len(requests), inproc)
            report.model[("fleet", bs)] = (len(requests), fleet)
    finally:
        engine.close()


# --- the report -------------------------------------------------------------


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def _enqueue_table(report: Report) -> list[str]:
    base = _rate(*report.enqueue[-1][1:])
    lines = [
        f"**Enqueue** (text tasks, best of {report.repeats}; target: vlmq >= 10,000/s)",
        "",
        "| producer | tasks | seconds | tasks/s | vs `send_task` |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, n, took in report.enqueue:
        rate = _rate(n, took)
        lines.append(f"| {name} | {n:,} | {took:.2f} | {rate:,.0f} | {rate / base:.1f}x |")
    return [*lines, "", *[f"- {check}" for check in report.checks]]


def _drain_table(report: Report) -> list[str]:
    base = _rate(*report.drain[0][1:])
    lines = [
        f"**Drain** (raw: best of {report.repeats}; each worker: one run of a pre-filled "
        "queue, no-op engine, result and status written per task, rate = tasks / (last "
        "`finished_at` - first `started_at`); target >= 0.25x raw)",
        "",
        "| consumer | messages | seconds | messages/s | vs raw `BRPOP` |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, n, took in report.drain:
        rate = _rate(n, took)
        lines.append(f"| {name} | {n:,} | {took:.2f} | {rate:,.0f} | {rate / base:.2f}x |")
    return lines


def _model_table(report: Report) -> list[str]:
    base = _rate(*report.model[("in-process", FLEET_BATCH)])
    lines = [
        f"**Fleet vs in-process** (small qwen2_5_vl checkpoint, text, {NEW_TOKENS} new tokens "
        "fixed, 1 torch thread; in-process: `Engine.run` in chunks of the batch size in the "
        "parent; fleet: one `vlmq worker --engine hf --no-celery`, warmed up, timed from "
        "submit to job finished; the two take turns (the worker is SIGSTOPped while the "
        f"parent runs), best of {report.repeats} each; target >= 95%)",
        "",
        "| path | batch size | requests | seconds | req/s | vs in-process |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (path, bs), (n, took) in sorted(
        report.model.items(), key=lambda kv: (-kv[0][1], kv[0][0] != "in-process")
    ):
        same = _rate(*report.model[("in-process", bs)])
        rate = _rate(n, took)
        lines.append(f"| {path} | {bs} | {n} | {took:.2f} | {rate:.2f} | {rate / same:.0%} |")
    if ("fleet", 1) in report.model:
        lines += ["", _gain_line(report, base)]
    return lines


def _gain_line(report: Report, base: float) -> str:
    inproc = base / _rate(*report.model[("in-process", 1)])
    fleet = _rate(*report.model[("fleet", FLEET_BATCH)]) / _rate(*report.model[("fleet", 1)])
    return (
        f"Batching gain (batch {FLEET_BATCH} over batch 1): in-process {inproc:.2f}x, "
        f"fleet {fleet:.2f}x; the fleet keeps {fleet / inproc:.0%} of it."
    )


def _status_table(report: Report) -> list[str]:
    lines = [
        "**Status reads** (best of 3)",
        "",
        "| call | tasks | milliseconds |",
        "| --- | ---: | ---: |",
    ]
    for name, n, ms in report.status:
        lines.append(f"| {name} | {n:,} | {ms:.1f} |")
    return lines


def render(args: argparse.Namespace, report: Report, load: str) -> str:
    command = "python -m bench.fleet" + (" --quick" if args.quick else "")
    sections = [
        "## Fleet: queue overhead vs raw Redis and vs the in-process engine",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. Private `redis-server` (AOF everysec) on loopback, "
        f"`file://` results store; {load}.",
        "",
        *_enqueue_table(report),
        "",
        *_drain_table(report),
        "",
        *([*_model_table(report), ""] if report.model else []),
        *_status_table(report),
    ]
    return "\n".join(sections)


def _load() -> str:
    one, _, _ = os.getloadavg()
    return f"load average {one:.2f} at start"


def run(args: argparse.Namespace) -> str:
    import torch

    torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    workdir = Path(args.workdir).resolve()
    load = _load()
    report = Report(repeats=sizes.repeats)
    with services() as bench:
        ids = measure_enqueue(bench, sizes, report)
        measure_status(bench, ids[: sizes.status], report)
        measure_drain(bench, sizes, report)
        if not args.skip_model:
            measure_model(bench, sizes, workdir, report, gain=not args.no_gain)
    return render(args, report, f"{load}, {_load().replace('at start', 'at the end')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Small sizes (a smoke test).")
    parser.add_argument("--workdir", default=".vlmq/bench", help="Where the checkpoint is kept.")
    parser.add_argument("--skip-model", action="store_true", help="Queue figures only.")
    parser.add_argument("--no-gain", action="store_true", help="Skip the batch size 1 runs.")
    parser.add_argument("--write", default=None, help="Markdown file to put the tables in.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    table = run(args)
    print(table)
    if args.write:
        replace_section(Path(args.write), "fleet", table)


if __name__ == "__main__":
    main()
