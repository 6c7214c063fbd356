"""What one large request body costs a ``vlmq serve`` process, this checkout side by side
with another commit's.

    python -m bench.large_bodies --against b0b2365 [--repeats 3] [--write docs/reliability.md]

``--against`` is a commit; its tree is exported (``git archive``) to a temporary folder and
its API run from there (``PYTHONPATH`` set to it). For each checkout, body and repeat: a
fresh ``redis-server`` and ``vlmq serve`` process (no worker; a chat completion answers 504
after 1 s), its peak RSS reset (``/proc/<pid>/clear_refs``), one body posted while a thread
asks ``/healthz`` every 20 ms; then the process's peak growth, the slowest ``/healthz``, the
answer and the largest message queued. The bodies, each about 30 MB:

* **turns**: ``POST /v1/chat/completions`` of a million one-word turns (30.8 MB);
* **text**: ``POST /v1/tasks`` of 30 MB of text, one turn (a valid task);
* **objects**: ``POST /v1/tasks:batch`` of ten million empty objects (30.8 MB).

Rounds alternate between the checkouts, so a noisy moment hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.common import machine, replace_section, spread
from tests.support.services import vlmq_serve
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def _turns() -> bytes:
    turn = b'{"role":"user","content":"xy"},'
    turns = turn * (30_800_000 // len(turn))
    return b'{"model":"m","messages":[' + turns + b'{"role":"user","content":"xy"}]}'


def _text() -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x" * 30_000_000}]}).encode()


def _objects() -> bytes:
    return b'{"requests":[' + b",".join([b"{}"] * 10_250_000) + b"]}"


BODIES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "turns": ("/v1/chat/completions", _turns),
    "text": ("/v1/tasks", _text),
    "objects": ("/v1/tasks:batch", _objects),
}


class _Process:
    """A process's peak resident memory (VmHWM), which Linux resets on request."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def reset(self) -> int:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.peak()

    def peak(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")


def _slowest_healthz(url: str, stop: threading.Event, slowest: list[float]) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            started = time.monotonic()
            client.get(f"{url}/healthz")
            slowest[0] = max(slowest[0], time.monotonic() - started)
            stop.wait(0.02)


def _measure(tree: Path, tmp: Path, path: str, body: bytes) -> dict[str, Any]:
    server = LocalRedis(tmp / "redis").start()
    try:
        env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "VLMQ_REDIS_URL": server.url,
            "VLMQ_RESULTS_URL": f"file://{tmp / 'results'}",
            "VLMQ_API__SYNC_TIMEOUT_S": "1",
        }
        env.pop("VLMQ_API__API_KEYS", None)
        (tmp / "serve").mkdir()
        with vlmq_serve(tmp / "serve", env, timeout_s=60) as (url, popen):
            process = _Process(popen.pid)
            start, slowest, stop = process.reset(), [0.0], threading.Event()
            probe = threading.Thread(target=_slowest_healthz, args=(url, stop, slowest))
            probe.start()
            reply = httpx.post(
                f"{url}{path}",
                content=body,
                headers={"content-type": "application/json"},
                timeout=300,
            )
            stop.set()
            probe.join()
            grew = process.peak() - start
        queued = _largest_message(server.url)
        code = reply.json().get("error", {}).get("code") if reply.status_code >= 400 else ""
        return {
            "grew_mib": grew / MiB,
            "healthz_s": slowest[0],
            "answer": f"{reply.status_code} {code}".strip(),
            "queued_mb": queued / 1e6,
        }
    finally:
        server.stop()


def _largest_message(url: str) -> int:
    client = redis.Redis.from_url(url)
    sizes = [0]
    for key in client.scan_iter("vlmq.*"):
        if client.type(key) == b"list":
            sizes += [len(m) for m in client.lrange(key, 0, -1)]
    return max(sizes)


def _export(commit: str, into: Path) -> Path:
    tree = into / commit
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def render(runs: dict[str, dict[str, list[dict[str, Any]]]], args: Any) -> str:
    out = [
        f"Command: `python -m bench.large_bodies --against {args.against} --repeats "
        f"{args.repeats}` on {machine()}; medians (min-max) of the repeats, rounds "
        "alternating between the checkouts.",
        "",
        "| body | code | peak growth (MiB) | slowest `/healthz` (s) | answer | queued (MB) |",
        "| --- | --- | ---: | ---: | --- | ---: |",
    ]
    for body in BODIES:
        for label, by_body in runs.items():
            rows = by_body[body]
            answers = sorted({r["answer"] for r in rows})
            out.append(
                f"| {body} | {label} | {spread([r['grew_mib'] for r in rows], ',.0f')} | "
                f"{spread([r['healthz_s'] for r in rows], '.2f')} | {', '.join(answers)} | "
                f"{spread([r['queued_mb'] for r in rows], '.1f')} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-bodies-") as name:
        trees = {"this checkout": ROOT, args.against: _export(args.against, Path(name))}
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            label: {body: [] for body in BODIES} for label in trees
        }
        for body, (path, make) in BODIES.items():
            raw = make()
            for repeat in range(args.repeats):
                for label, tree in trees.items():
                    print(f"{body} {repeat + 1}: {label}", file=sys.stderr, flush=True)
                    tmp = Path(name) / f"{body}-{repeat}-{abs(hash(label))}"
                    runs[label][body].append(_measure(tree, tmp, path, raw))
    text = render(runs, args)
    print(text)
    if args.write is not None:
        replace_section(args.write, "large-bodies", text)


if __name__ == "__main__":
    main()
