"""What a synchronous chat completion costs over the task it runs: ``POST /v1/chat/completions``
(the call waits on the API's one pub/sub subscription) side by side with what a client did
before it, ``POST /v1/tasks`` then polling ``GET /v1/tasks/{id}`` and reading the result.

    python -m bench.chat_latency [--calls 200] [--in-flight 1,16,64] [--poll-s 0.05]
        [--repeats 3] [--write bench/README.md]

On a fresh ``redis-server`` and a ``file://`` store, a real ``vlmq serve`` process and a real
``vlmq worker --engine noop`` process (text, batches of 32 gathered for 5 ms) serve an
asyncio ``httpx`` client in this process:

* **added latency**: one call at a time; per call, its wall time at the client minus the
  task's own queue-to-finish time (``finished_at - queued_at``, both on Redis's clock, from
  its status hash): what the HTTP round trips, the API's work before the enqueue and the
  wait's wake-up and reads cost. p50 / p90 / p99 over ``--calls`` calls;
* **calls/s with N in flight**: N client loops each making calls back to back, ``--calls``
  (at least 2N) calls in all, completed calls over the wall time; and the CPU time per call
  of the API process (from /proc), the figure a machine shared with other work moves least,
  and of the client's process (which bounds the calls/s where it grows).

Each repeat runs both ways in turn (the order alternates); figures are medians of the repeats
with their range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.common import replace_section
from tests.support.services import free_port
from vlmq.broker.connection import create_redis
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key-0123456789abcdef"
BODY = {"model": "noop", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
WAYS = ("sync", "poll")
TERMINAL = ("succeeded", "failed")


class Fleet:
    """Redis, the store, one API process and one no-op worker."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.results_url = f"file://{tmp / 'results'}"
        self.redis = create_redis(Settings(redis_url=redis_url))
        self.keys = Keys()
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        policy = {"max_batch_size": 32, "max_wait_s": 0.005, "token_budget": 10**6}
        return {
            **os.environ,
            "VLMQ_REDIS_URL": self.redis_url,
            "VLMQ_RESULTS_URL": self.results_url,
            "VLMQ_BATCH": json.dumps({m: policy for m in ("text", "image", "video")}),
            "VLMQ_API__API_KEYS": json.dumps([KEY]),
            "VLMQ_API__RATE_LIMIT_PER_S": "1000000",
            "VLMQ_API__RATE_LIMIT_BURST": "1000000",
        }

    def start(self) -> None:
        serve = [sys.executable, "-m", "vlmq", "serve", "--port", str(self.port)]
        worker = [sys.executable, "-m", "vlmq", "worker", "--modality", "text"]
        worker += ["--engine", "noop", "--no-celery"]
        for name, command in (("serve", serve), ("worker", worker)):
            log = (self.tmp / f"{name}.log").open("wb")
            self.procs.append(
                subprocess.Popen(command, cwd=ROOT, env=self.env(), stdout=log, stderr=log)
            )
            log.close()
        deadline = time.monotonic() + 120
        while not (self._answers() and self.redis.hlen(self.keys.workers())):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("the API or the worker did not start: see " + str(self.tmp))
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def api_cpu_s(self) -> float:
        """CPU seconds the API process has used (user + system, from /proc)."""
        fields = Path(f"/proc/{self.procs[0].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def queue_to_finish(self, task_id: str) -> float:
        queued, finished = self.redis.hmget(self.keys.task(task_id), "queued_at", "finished_at")
        return float(finished) - float(queued)  # type: ignore[arg-type]


@contextmanager
def fleet() -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-chat-") as name:
        tmp = Path(name)
        server = LocalRedis(tmp / "redis").start()
        running = Fleet(tmp, server.url)
        try:
            running.start()
            yield running
        finally:
            running.stop()
            server.stop()


# one call, both ways -----------------------------------------------------------------------
async def sync_call(http: httpx.AsyncClient, poll_s: float) -> str:
    reply = await http.post("/v1/chat/completions", json=BODY)
    if reply.status_code != 200:
        raise RuntimeError(f"chat completion: {reply.status_code} {reply.text[:300]}")
    return reply.headers["x-vlmq-task-id"]


async def poll_call(http: httpx.AsyncClient, poll_s: float) -> str:
    accepted = await http.post("/v1/tasks", json=BODY)
    if accepted.status_code != 202:
        raise RuntimeError(f"task: {accepted.status_code} {accepted.text[:300]}")
    task_id = accepted.json()["id"]
    while (await _get(http, f"/v1/tasks/{task_id}")).json()["status"] not in TERMINAL:
        await asyncio.sleep(poll_s)
    result = await _get(http, f"/v1/tasks/{task_id}/result", {"format": "openai"})
    if result.status_code != 200 or result.json().get("object") != "chat.completion":
        raise RuntimeError(f"result: {result.status_code} {result.text[:300]}")
    return str(task_id)


async def _get(
    http: httpx.AsyncClient, path: str, params: dict[str, str] | None = None
) -> httpx.Response:
    """A GET, sent again once if the server had closed the kept-alive connection meanwhile (a
    poll may wait past uvicorn's keep-alive on a starved machine)."""
    try:
        return await http.get(path, params=params)
    except httpx.TransportError:
        return await http.get(path, params=params)


CALLS: dict[str, Callable[[httpx.AsyncClient, float], Awaitable[str]]] = {
    "sync": sync_call,
    "poll": poll_call,
}


def _client(fleet: Fleet, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.AsyncClient(base_url=fleet.url, headers=headers, limits=limits, timeout=120)


async def added_latency(fleet: Fleet, way: str, calls: int, poll_s: float) -> list[float]:
    """Milliseconds each call took beyond its task's queue-to-finish time, one at a time."""
    call = CALLS[way]
    added = []
    async with _client(fleet, 1) as http:
        for _ in range(5):  # warm: connection, imports, the waiter's subscription
            await call(http, poll_s)
        for _ in range(calls):
            started = time.perf_counter()
            task_id = await call(http, poll_s)
            wall = time.perf_counter() - started
            added.append((wall - fleet.queue_to_finish(task_id)) * 1000)
    return added


async def throughput(
    fleet: Fleet, way: str, calls: int, in_flight: int, poll_s: float
) -> tuple[float, float, float]:
    """Completed calls per second with ``in_flight`` calls at a time, and the CPU milliseconds
    per call of the API process and of this (the client's) process."""
    call = CALLS[way]
    total = max(calls, 2 * in_flight)
    left = total

    async def loop(http: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call(http, poll_s)

    async with _client(fleet, in_flight) as http:
        api, client, started = fleet.api_cpu_s(), _own_cpu_s(), time.perf_counter()
        await asyncio.gather(*(loop(http) for _ in range(in_flight)))
        rate = total / (time.perf_counter() - started)
        per_call = 1000 / total
        return rate, (fleet.api_cpu_s() - api) * per_call, (_own_cpu_s() - client) * per_call


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# the run -------------------------------------------------------------------------------------
def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(n) for n in args.in_flight.split(",")]
    latency: dict[str, dict[str, list[float]]] = {
        w: {"p50": [], "p90": [], "p99": []} for w in WAYS
    }
    rates: dict[str, dict[int, list[float]]] = {w: {n: [] for n in levels} for w in WAYS}
    cpu: dict[str, dict[int, list[float]]] = {w: {n: [] for n in levels} for w in WAYS}
    client: dict[str, dict[int, list[float]]] = {w: {n: [] for n in levels} for w in WAYS}
    with fleet() as running:
        for repeat in range(args.repeats):
            ways = WAYS if repeat % 2 == 0 else WAYS[::-1]
            for way in ways:
                added = asyncio.run(added_latency(running, way, args.calls, args.poll_s))
                for name, share in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                    latency[way][name].append(_percentile(added, share))
                for n in levels:
                    rate, api_ms, client_ms = asyncio.run(
                        throughput(running, way, args.calls, n, args.poll_s)
                    )
                    rates[way][n].append(rate)
                    cpu[way][n].append(api_ms)
                    client[way][n].append(client_ms)
                print(
                    f"repeat {repeat + 1} {way}: added p50 {latency[way]['p50'][-1]:.1f} ms, "
                    + ", ".join(f"N={n} {rates[way][n][-1]:.0f}/s" for n in levels),
                    file=sys.stderr,
                )
    return {"latency": latency, "rates": rates, "cpu": cpu, "client": client, "levels": levels}


def _cell(values: list[float], digits: int = 1) -> str:
    median = statistics.median(values)
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def render(args: argparse.Namespace, figures: dict[str, Any], load: str) -> str:
    latency, rates, levels = figures["latency"], figures["rates"], figures["levels"]
    names = {
        "sync": "`POST /v1/chat/completions` (waits)",
        "poll": f"`POST /v1/tasks`, poll every {args.poll_s * 1000:.0f} ms, read the result",
    }
    command = "python -m bench.chat_latency"
    lines = [
        f"Command: `{command} --calls {args.calls} --in-flight {args.in_flight} "
        f"--poll-s {args.poll_s} --repeats {args.repeats}`",
        "",
        f"Machine: {os.cpu_count()} cores; one `vlmq serve` process, one `vlmq worker --engine "
        f"noop` (text, batches of 32 gathered for 5 ms), a private `redis-server`, a `file://` "
        f"store, the client in a third process; {load}. Medians of {args.repeats} repeats "
        "(range).",
        "",
        "**Added latency** (ms: a call's wall time at the client minus its task's own "
        f"queue-to-finish time; {args.calls} calls, one at a time; target: p50 <= 20 ms)",
        "",
        "| way | p50 | p90 | p99 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for way in WAYS:
        cells = " | ".join(_cell(latency[way][p]) for p in ("p50", "p90", "p99"))
        lines.append(f"| {names[way]} | {cells} |")
    lines += [
        "",
        f"**Calls per second with N in flight** ({args.calls} calls, at least 2N)",
        "",
        "| way | " + " | ".join(f"N={n}" for n in levels) + " |",
        "| --- | " + " | ".join("---:" for _ in levels) + " |",
    ]
    for way in WAYS:
        cells = " | ".join(_cell(rates[way][n], 0) for n in levels)
        lines.append(f"| {names[way]} | {cells} |")
    lines += [
        "",
        "**CPU per call** (ms, in the same runs: the API process, and the client's, which "
        "bounds the calls/s where it grows)",
        "",
        "| process, way | " + " | ".join(f"N={n}" for n in levels) + " |",
        "| --- | " + " | ".join("---:" for _ in levels) + " |",
    ]
    for process in ("cpu", "client"):
        for way in WAYS:
            cells = " | ".join(_cell(figures[process][way][n]) for n in levels)
            who = "API" if process == "cpu" else "client"
            lines.append(f"| {who}, {names[way]} | {cells} |")
    return "\n".join(lines)


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--in-flight", default="1,16,64")
    parser.add_argument("--poll-s", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", help="Replace the chat-latency section of this file")
    args = parser.parse_args()
    before = _load()
    figures = measure(args)
    load = f"load average {before:.2f} at start, {_load():.2f} at the end"
    body = render(args, figures, load)
    print(body)
    if args.write:
        replace_section(Path(args.write), "chat-latency", body)


if __name__ == "__main__":
    main()
