"""Results while a job runs: a job read several times as it drains, each read from where
the last one stopped (``vlmq results --after N``), against one read after completion.

    python -m bench.partial_results [--lines 10000] [--reads 5] [--workers 1]
        [--noop-delay 0.05] [--repeats 3] [--write bench/README.md]

Per repeat, on a fresh ``redis-server``: ``vlmq submit`` of ``--lines`` text lines, then
``--workers`` no-op worker processes (each batch of up to 64 takes ``--noop-delay`` s, so
the job drains over several seconds) while this process reads the job ``--reads`` times,
each once a further 1/(reads+1) of the job has finished, each from the position the one
before reached; one more read from there after the job completed; then one whole read.

Checked: every read but the last was made while the job ran; the reads' lines, put end to
end, are byte for byte the whole read (so each finished line came once, in the same order);
every custom_id appears once. Measured: the completion-order read's rate against the
submission-order export (``iter_results``) of the same finished job, side by side, and what
the completion list costs Redis per task (``MEMORY USAGE``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import machine, replace_section, spread
from bench.jobs import JOB, _server, _stop, _submit
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.producers.export import iter_results
from vlmq.producers.finished import iter_finished
from vlmq.producers.follow import LineWriter, read_once

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    lines: int = 0
    reads_while_running: int = 0
    lines_per_read: list[int] = field(default_factory=list)
    identical: bool = False
    unique: bool = False
    completion_read_per_s: float = 0.0
    submission_read_per_s: float = 0.0
    list_bytes_per_task: float = 0.0


def write_input(path: Path, lines: int) -> None:
    with path.open("w", encoding="utf-8") as out:
        for i in range(lines):
            line = {"custom_id": f"r-{i:07d}", "messages": [{"role": "user", "content": f"q {i}"}]}
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def _read(client: Client, after: int) -> tuple[str, int, bool]:
    out = io.StringIO()
    position, complete = read_once(client, JOB, LineWriter(out.write, None, "vlmq"), after)
    return out.getvalue(), position, complete


def run_once(tmp: Path, lines: int, reads: int, workers: int, delay_s: float) -> Outcome:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "input.jsonl"
    write_input(path, lines)
    outcome = Outcome(lines=lines)
    with _server(tmp, "redis") as server:
        settings = Settings(redis_url=server.url, results_url=f"file://{tmp / 'results'}")
        client = Client(settings)
        _submit(tmp, server.url, settings.results_url, path, 1, ROOT)
        procs = _workers(tmp, server.url, settings.results_url, workers, delay_s)
        pieces: list[str] = []
        after = 0
        try:
            for read in range(1, reads + 1):
                _wait_done(client, lines * read // (reads + 1), procs, tmp)
                text, after, complete = _read(client, after)
                outcome.reads_while_running += 0 if complete else 1
                outcome.lines_per_read.append(text.count("\n"))
                pieces.append(text)
            _wait_done(client, lines, procs, tmp)
            while client.state.jobs.get(JOB).finished_at is None:
                time.sleep(0.05)
        finally:
            _stop(procs)
        text, after, complete = _read(client, after)
        outcome.lines_per_read.append(text.count("\n"))
        pieces.append(text)
        whole, _, _ = _read(client, 0)
        # The records alone (no JSON written), each order timed twice, alternated.
        for _ in range(2):
            started = time.perf_counter()
            read = sum(1 for f in iter_finished(client, JOB) if f.record is not None)
            completion = read / (time.perf_counter() - started)
            started = time.perf_counter()
            exported = sum(1 for _ in iter_results(client, JOB))
            submission = exported / (time.perf_counter() - started)
        outcome.completion_read_per_s, outcome.submission_read_per_s = completion, submission
        outcome.identical = complete and "".join(pieces) == whole
        ids = [json.loads(line)["custom_id"] for line in whole.splitlines()]
        outcome.unique = len(ids) == len(set(ids)) == lines
        used = client.redis.memory_usage(Keys().job_finished(JOB)) or 0
        outcome.list_bytes_per_task = int(used) / lines
    return outcome


def _workers(
    tmp: Path, url: str, results: str, n: int, delay_s: float
) -> list[subprocess.Popen[bytes]]:
    """bench.jobs' no-op workers, each batch taking ``delay_s``."""
    batch = {
        m: {"max_batch_size": 64, "max_wait_s": 0.005, "token_budget": 10**7}
        for m in ("text", "image", "video")
    }
    env = {**os.environ, "VLMQ_REDIS_URL": url, "VLMQ_RESULTS_URL": results}
    env["VLMQ_BATCH"] = json.dumps(batch)
    procs = []
    for i in range(n):
        command = [sys.executable, "-m", "vlmq", "worker", "--modality", "text,image,video"]
        command += ["--engine", "noop", "--no-celery", "--noop-delay", str(delay_s)]
        with (tmp / f"worker-{i}.log").open("wb") as log:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log))
    return procs


def _wait_done(client: Client, done: int, procs: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    deadline = time.monotonic() + 600
    while client.state.jobs.get(JOB).done < done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job did not reach {done} finished tasks")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a worker exited: see {tmp}/worker-*.log")
        time.sleep(0.01)


def render(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    command = (
        f"`python -m bench.partial_results --lines {args.lines} --reads {args.reads} "
        f"--workers {args.workers} --noop-delay {args.noop_delay} --repeats {args.repeats}`"
    )
    ratios = [o.completion_read_per_s / o.submission_read_per_s for o in outcomes]
    rows = [
        "| repeat | reads while running | lines per read (last: after completion) | "
        "reads end to end == whole read | each custom_id once |",
        "|---|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, 1):
        per_read = ", ".join(f"{n:,}" for n in o.lines_per_read)
        rows.append(
            f"| {i} | {o.reads_while_running} | {per_read} | "
            f"{'yes' if o.identical else 'NO'} | {'yes' if o.unique else 'NO'} |"
        )
    return "\n".join(
        [
            f"{command} on {machine()}: {args.repeats} runs, median (min-max).",
            "",
            *rows,
            "",
            f"- Reading the finished job's records (second of two alternated passes), in "
            f"completion order (`iter_finished`, what `vlmq results` writes): "
            f"{spread([o.completion_read_per_s for o in outcomes], ',.0f')} lines/s; the "
            f"submission-order export (`iter_results`) of the same job in the same run: "
            f"{spread([o.submission_read_per_s for o in outcomes], ',.0f')} lines/s "
            f"(ratio {spread(ratios, '.2f')}).",
            f"- The completion list costs Redis "
            f"{spread([o.list_bytes_per_task for o in outcomes], '.1f')} bytes per task "
            f"(`MEMORY USAGE` of the job's `:finished` list), expiring with the job.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--reads", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--noop-delay", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="vlmq-partial-") as tmp:
        for repeat in range(args.repeats):
            outcome = run_once(
                Path(tmp) / f"run{repeat}", args.lines, args.reads, args.workers, args.noop_delay
            )
            outcomes.append(outcome)
            print(outcome, file=sys.stderr)
    text = render(outcomes, args)
    print(text)
    if args.write:
        replace_section(args.write, "partial-results", "## Results while a job runs\n\n" + text)
    ok = all(o.identical and o.unique and o.reads_while_running == args.reads for o in outcomes)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
