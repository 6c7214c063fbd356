"""A big bulk job's cost in Redis, side by side with raw LPUSH/BRPOP, in one run.

    python -m bench.jobs [--lines 1000000] [--workers 2] [--processes 2] [--repeats 1]
        [--against PATH] [--write bench/README.md]

Writes a JSONL file of ``--lines`` lines (text, image URLs and video URLs, a third each),
then, each on a fresh ``redis-server`` of its own (AOF everysec, as LocalRedis runs it):

* **raw**: the same lines LPUSHed in pipelined chunks of 2,000 and BRPOPed one by one by
  one client; nothing is kept per finished task.
* **vlmq**: ``vlmq submit`` (the validation pass in ``--processes`` processes, the staged
  input in a ``file://`` store, the first window fed) and ``--workers`` no-op worker
  processes that drain it, their feeders refilling the window.
* **against** (``--against PATH``, a checkout of another commit: ``git worktree add PATH
  fabb227``): the same, with that checkout's ``vlmq submit`` and workers, in the same run.

Measured: peak Redis memory while queued (``used_memory`` sampled every 50 ms, above the
empty server's), bytes per finished task (``used_memory`` after the drain, above the empty
server's, and ``MEMORY USAGE`` of every key the job left), Redis CPU per task over enqueue +
pull + settle (``INFO cpu``, the main thread: what caps a Redis), the enqueue rate (lines
counted in the job per second) and the drain rate (tasks per second).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_py

from bench.common import machine, replace_section, spread
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
JOB = "bench-job"


@dataclass
class Figures:
    peak_queued_bytes: int = 0
    finished_bytes_per_task: float = 0.0
    job_keys_bytes_per_task: float = 0.0
    cpu_us_per_task: float = 0.0
    replies_kept_bytes: int = 0
    enqueue_per_s: float = 0.0
    drain_per_s: float = 0.0


@dataclass
class Run:
    raw: list[Figures] = field(default_factory=list)
    vlmq: list[Figures] = field(default_factory=list)
    against: list[Figures] = field(default_factory=list)


def write_input(path: Path, lines: int, seed: int = 7) -> None:
    """A third text, a third an image URL, a third a video URL; ~230-byte lines."""
    rng = random.Random(seed)
    words = [
        "what",
        "is",
        "shown",
        "here",
        "describe",
        "the",
        "colour",
        "count",
        "objects",
        "read",
        "any",
        "text",
    ]
    with path.open("w", encoding="utf-8") as out:
        for i in range(lines):
            question = " ".join(rng.choice(words) for _ in range(8))
            kind = ("text", "image", "video")[i % 3]
            content: list[dict[str, str]] | str
            if kind == "text":
                content = question
            else:
                ext = "jpg" if kind == "image" else "mp4"
                url = f"https://media.example.com/{kind}s/{i % 5000:06d}.{ext}"
                content = [{"type": kind, kind: url}, {"type": "text", "text": question}]
            line = {
                "custom_id": f"request-{i:08d}",
                "messages": [{"role": "user", "content": content}],
                "max_new_tokens": 32,
            }
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def _cpu_s(redis: redis_py.Redis) -> float:
    info = redis.info("cpu")
    return float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"])


def _used(redis: redis_py.Redis) -> int:
    return int(redis.info("memory")["used_memory"])


@contextmanager
def _server(tmp: Path, name: str) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp / name).start()
    try:
        yield server
    finally:
        server.stop()


class _Sampler:
    """The peak of ``used_memory`` while it runs."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        self.redis = redis_py.Redis.from_url(url)
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, _used(self.redis))

    def __enter__(self) -> _Sampler:
        self.peak = _used(self.redis)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _used(self.redis))


def measure_raw(tmp: Path, path: Path, lines: int) -> Figures:
    with _server(tmp, "raw") as server:
        redis = redis_py.Redis.from_url(server.url)
        base, cpu = _used(redis), _cpu_s(redis)
        figures = Figures()
        with _Sampler(server.url) as sampler:
            started = time.perf_counter()
            pipe = redis.pipeline(transaction=False)
            with path.open("rb") as source:
                chunk: list[bytes] = []
                for line in source:
                    chunk.append(line)
                    if len(chunk) == 2000:
                        pipe.lpush("raw", *chunk)
                        pipe.execute()
                        chunk = []
                if chunk:
                    pipe.lpush("raw", *chunk)
                    pipe.execute()
            figures.enqueue_per_s = lines / (time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(lines):
                if redis.brpop(["raw"], timeout=5) is None:
                    raise RuntimeError("the raw list ran dry")
            figures.drain_per_s = lines / (time.perf_counter() - started)
        figures.peak_queued_bytes = sampler.peak - base
        figures.finished_bytes_per_task = (_used(redis) - base) / lines
        figures.cpu_us_per_task = (_cpu_s(redis) - cpu) / lines * 1e6
        return figures


def _env(tree: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a vlmq process of ``tree``'s code (this checkout's, or another's)."""
    env = {**os.environ, **extra}
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree)
    return env


def _start_workers(
    tmp: Path,
    url: str,
    results: str,
    n: int,
    extra: dict[str, str] | None = None,
    tree: Path = ROOT,
) -> list[subprocess.Popen[bytes]]:
    batch = {
        m: {"max_batch_size": 64, "max_wait_s": 0.005, "token_budget": 10**7}
        for m in ("text", "image", "video")
    }
    env = _env(
        tree,
        {
            **(extra or {}),
            "VLMQ_REDIS_URL": url,
            "VLMQ_RESULTS_URL": results,
            "VLMQ_BATCH": json.dumps(batch),
        },
    )
    procs = []
    for i in range(n):
        log = (tmp / f"worker-{i}.log").open("wb")
        command = [sys.executable, "-m", "vlmq", "worker", "--modality", "text,image,video"]
        command += ["--engine", "noop", "--no-celery"]
        procs.append(subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=log))
        log.close()
    return procs


def _submit(tmp: Path, url: str, results: str, path: Path, processes: int, tree: Path) -> None:
    """``vlmq submit`` of ``tree``'s code, to its end (the first window fed)."""
    env = _env(tree, {"VLMQ_REDIS_URL": url, "VLMQ_RESULTS_URL": results})
    command = [sys.executable, "-m", "vlmq", "submit", str(path), "--job", JOB]
    command += ["--processes", str(processes)]
    with (tmp / "submit.log").open("wb") as log:
        done = subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=log, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vlmq submit failed: see {tmp}/submit.log")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_vlmq(
    tmp: Path, path: Path, lines: int, workers: int, processes: int, tree: Path = ROOT
) -> Figures:
    tmp.mkdir(parents=True, exist_ok=True)
    with _server(tmp, "vlmq") as server:
        settings = Settings(redis_url=server.url, results_url=f"file://{tmp / 'results'}")
        client = Client(settings)
        redis = client.redis
        redis.ping()
        base, cpu = _used(redis), _cpu_s(redis)
        figures = Figures()
        with _Sampler(server.url) as sampler:
            started = time.perf_counter()
            _submit(tmp, server.url, settings.results_url, path, processes, tree)
            figures.enqueue_per_s = lines / (time.perf_counter() - started)
            procs = _start_workers(tmp, server.url, settings.results_url, workers, tree=tree)
            try:
                started = time.perf_counter()
                deadline = started + max(600.0, lines / 200)
                while redis.hget(Keys().job(JOB), "finished_at") is None:
                    if time.perf_counter() > deadline:
                        raise TimeoutError("the job did not drain")
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"a worker exited: see {tmp}/worker-*.log")
                    time.sleep(0.05)
                figures.drain_per_s = lines / (time.perf_counter() - started)
            finally:
                _stop(procs)
        succeeded = int(redis.hget(Keys().job(JOB), "succeeded") or 0)
        if succeeded != lines:
            raise RuntimeError(f"{succeeded} of {lines} tasks succeeded")
        redis.delete(Keys().workers(), f"{Keys().workers()}:heard")
        figures.peak_queued_bytes = sampler.peak - base
        figures.finished_bytes_per_task = (_used(redis) - base) / lines
        job_keys = list(redis.scan_iter(Keys().job(JOB) + "*", count=1000))
        figures.job_keys_bytes_per_task = (
            sum(int(redis.memory_usage(k) or 0) for k in job_keys) / lines
        )
        figures.cpu_us_per_task = (_cpu_s(redis) - cpu) / lines * 1e6
        # The replies kept for retries (vlmq/broker/scripts.py): a minute's worth, whatever the job.
        calls = list(redis.scan_iter(Keys().call("*"), count=1000))
        figures.replies_kept_bytes = sum(int(redis.memory_usage(k) or 0) for k in calls)
        return figures


def render(run: Run, lines: int, workers: int, processes: int, against: str | None) -> str:
    rows = [
        ("peak Redis while queued (MB)", "peak_queued_bytes", 1e-6, ",.0f"),
        ("bytes per finished task (used_memory)", "finished_bytes_per_task", 1, ",.0f"),
        ("bytes per finished task (the job's keys)", "job_keys_bytes_per_task", 1, ",.0f"),
        ("Redis CPU per task (us, main thread)", "cpu_us_per_task", 1, ",.1f"),
        (
            "replies kept for retries at the end (kB, gone within 60 s)",
            "replies_kept_bytes",
            1e-3,
            ",.0f",
        ),
        ("enqueue (lines/s)", "enqueue_per_s", 1, ",.0f"),
        ("drain (tasks/s)", "drain_per_s", 1, ",.0f"),
    ]
    columns = [("raw LPUSH/BRPOP", run.raw), ("vlmq", run.vlmq)]
    if run.against:
        columns.insert(1, (f"vlmq at {against}", run.against))
    flag = " --against CHECKOUT" if against else ""
    out = [
        f"`python -m bench.jobs --lines {lines} --workers {workers} --processes {processes} "
        f"--repeats {len(run.vlmq)}{flag}`"
        f" on {machine()}; medians (min-max) of {len(run.vlmq)} run(s), side by side.",
        "",
        "| | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, name, scale, fmt in rows:
        cells = [spread([getattr(f, name) * scale for f in figs], fmt) for _, figs in columns]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    cpu = [f.cpu_us_per_task for f in run.vlmq]
    raw = [f.cpu_us_per_task for f in run.raw]
    out += ["", f"Redis CPU per task, vlmq over raw: {_ratio(cpu, raw)}."]
    if run.against:
        before = [f.cpu_us_per_task for f in run.against]
        drain = [f.drain_per_s for f in run.vlmq]
        drain_before = [f.drain_per_s for f in run.against]
        out.append(
            f"Against {against}: Redis CPU per task {_ratio(cpu, before)}, "
            f"drain rate {_ratio(drain, drain_before)}."
        )
    return "\n".join(out)


def _commit_of(tree: Path) -> str:
    """A checkout's commit, as its column is named."""
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or str(tree)


def _ratio(values: list[float], baseline: list[float]) -> str:
    """The median ratio of paired runs, with its spread."""
    ratios = [v / b for v, b in zip(values, baseline, strict=True) if b]
    return spread(ratios, ".2f") + "x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--processes", type=int, default=2, help="validating processes (vlmq submit: one a core)"
    )
    parser.add_argument(
        "--against", type=Path, default=None, help="a checkout of another commit to compare"
    )
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    run = Run()
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-jobs-") as name:
        tmp = Path(name)
        path = tmp / "job.jsonl"
        write_input(path, args.lines)
        for repeat in range(args.repeats):
            print(f"run {repeat + 1}: raw", file=sys.stderr, flush=True)
            run.raw.append(measure_raw(tmp, path, args.lines))
            print(f"run {repeat + 1}: vlmq", file=sys.stderr, flush=True)
            workdir = tmp / f"v{repeat}"
            run.vlmq.append(measure_vlmq(workdir, path, args.lines, args.workers, args.processes))
            if args.against is not None:
                print(f"run {repeat + 1}: {args.against}", file=sys.stderr, flush=True)
                run.against.append(
                    measure_vlmq(
                        tmp / f"a{repeat}",
                        path,
                        args.lines,
                        args.workers,
                        args.processes,
                        args.against.resolve(),
                    )
                )
    against = _commit_of(args.against) if args.against else None
    text = render(run, args.lines, args.workers, args.processes, against)
    print(text)
    if args.write is not None:
        replace_section(args.write, "bench-jobs", text)


if __name__ == "__main__":
    main()
