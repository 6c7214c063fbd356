"""The lost-replies drill: every process reaches Redis through a proxy that loses a share of
the replies to every command that writes (the command ran, the reply never came), and what
the fleet did must be as if nothing was lost.

Producers of every kind work through the proxy at once: ``vlmq submit`` on the bulk lane and
on the interactive lane, the HTTP API (``POST /v1/tasks``, in this process), the Python
client (``submit_many``, and a cancel of a job while it runs), and two ``vlmq worker``
processes drain it all. Then every invariant is counted, each violation a write applied twice
or a result lost:

* every job ended, with its total equal to its lines and its counts adding up to its total;
* every task that succeeded has exactly one readable result object whose id is its own;
* every task of the cancelled job either succeeded or was cancelled, and none that was
  cancelled ran (no result object, never started);
* every task that ran once has one attempt; the tenant's quota is back to 0.

Used by tests/faults/test_reply_drill.py (CI size) and ``python -m bench.faults --drill
replies`` (the full figures in docs/reliability.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.support.faults.harness import batch_policy
from tests.support.fleet import Processes, write_jsonl
from tests.support.replydrop import ReplyDropProxy, Rule
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.producers.api.app import create_app
from vlmq.producers.client import Client

__all__ = ["DrillFigures", "DrillSizes", "run_reply_drill"]

KEYS = Keys()
# The drill's tenant has a quota, so its queued work is counted (and must return to 0).
TENANTS = {"default_quota": {"max_queued_tasks": 10**9}}


@dataclass(frozen=True)
class DrillSizes:
    """The CI size (bench.faults sets the full one): ~600 writes through the proxy, so one in
    twenty lost is ~30 lost replies (at 60 bulk lines and batches of 4 it was ~11, one over
    the drill's floor of 10, and 9 in one run: a drill that lost too few to mean much)."""

    bulk_lines: int = 120
    interactive_lines: int = 60
    api_tasks: int = 40
    client_tasks: int = 40
    cancelled_tasks: int = 40
    drop_share: float = 0.05
    seed: int = 7
    worker_delay_s: float = 0.05
    batch_size: int = 2


@dataclass
class DrillFigures:
    commands: int = 0
    replies_dropped: int = 0
    jobs: int = 0
    tasks: int = 0
    writes_applied_twice: int = 0
    results_lost: int = 0
    cancelled_that_ran: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_reply_drill(
    fleet: Processes, proxy: ReplyDropProxy, workdir: Path, sizes: DrillSizes = DrillSizes()
) -> DrillFigures:
    """Run the drill through ``proxy`` (already up, in front of ``fleet``'s Redis)."""
    started = time.monotonic()
    rule = proxy.add(
        Rule("every write", _writes, nth=None, probability=sizes.drop_share, seed=sizes.seed)
    )
    via = {
        "VLMQ_REDIS_URL": proxy.url_for(fleet.redis_url),
        "VLMQ_TENANTS": json.dumps(TENANTS),
        # Small batches: many pulls, starts and settles, each a reply that may be lost.
        "VLMQ_BATCH": batch_policy(sizes.batch_size),
    }
    client = fleet.client(proxy.url_for(fleet.redis_url), tenants=TENANTS)
    jobs = _produce(fleet, client, via, workdir, sizes)
    workers = [
        fleet.worker(name, delay_s=sizes.worker_delay_s, env=via, wait=False)
        for name in ("drill-a", "drill-b")
    ]
    check = fleet.client()  # the checks read Redis directly
    wait_until(
        lambda: all(check.status(job).get("finished") for job in jobs),
        timeout=120,
        what="every job of the drill ended",
    )
    for worker in workers:
        fleet.terminate(worker)
    figures = _check(check, jobs, sizes)
    figures.commands = proxy.commands_seen
    figures.replies_dropped = rule.dropped
    figures.seconds = round(time.monotonic() - started, 1)
    return figures


# What changes Redis: every vlmq script, a transaction's EXEC, and plain writes. (Reads are
# not lost on purpose: losing one tells nothing about writes, and a pipeline of thousands of
# reads would never see all its replies.)
_WRITES = frozenset(
    {
        b"FCALL",
        b"EVAL",
        b"EVALSHA",
        b"EXEC",
        b"SET",
        b"SETEX",
        b"HSET",
        b"HSETNX",
        b"HDEL",
        b"HINCRBY",
        b"INCR",
        b"LPUSH",
        b"RPUSH",
        b"LTRIM",
        b"ZADD",
        b"ZREM",
        b"DEL",
        b"EXPIRE",
        b"SADD",
    }
)


def _writes(args: Any) -> bool:
    return bool(args) and bytes(args[0]).upper() in _WRITES


def _produce(
    fleet: Processes, client: Client, via: dict[str, str], workdir: Path, sizes: DrillSizes
) -> dict[str, int]:
    """Every producer at work; job id -> its lines."""
    jobs: dict[str, int] = {}
    for job, lane, lines in (
        ("drill-bulk", "bulk", sizes.bulk_lines),
        ("drill-interactive", "interactive", sizes.interactive_lines),
    ):
        path = write_jsonl(workdir / f"{job}.jsonl", lines, prefix=job)
        extra = ["--priority", "interactive"] if lane == "interactive" else []
        proc = fleet.run(f"submit-{job}", "submit", str(path), "--job", job, *extra, env=via)
        assert proc.returncode == 0, fleet.log(proc)
        jobs[job] = lines
    texts = [[{"role": "user", "content": f"client {i}"}] for i in range(sizes.client_tasks)]
    jobs[client.submit_many(texts, job_id="drill-client")] = sizes.client_tasks
    texts = [[{"role": "user", "content": f"cancel {i}"}] for i in range(sizes.cancelled_tasks)]
    jobs[client.submit_many(texts, job_id="drill-cancelled")] = sizes.cancelled_tasks
    client.cancel("drill-cancelled")
    api = create_app(client.settings, client)
    with TestClient(api, base_url="http://localhost") as http:
        batch = [
            {"messages": [{"role": "user", "content": f"api {i}"}]} for i in range(sizes.api_tasks)
        ]
        reply = http.post("/v1/tasks:batch", json={"requests": batch})
        assert reply.status_code == 202, reply.text
        jobs[reply.json()["job_id"]] = sizes.api_tasks
    return jobs


def _check(client: Client, jobs: dict[str, int], sizes: DrillSizes) -> DrillFigures:
    figures = DrillFigures(jobs=len(jobs))
    for job, lines in jobs.items():
        status = client.status(job)
        figures.tasks += status["total"]
        if status["total"] != lines:
            figures.writes_applied_twice += abs(status["total"] - lines)
            figures.violations.append(f"{job}: total {status['total']} of {lines} lines")
        if status["done"] != status["total"]:
            figures.violations.append(f"{job}: {status['done']} done of {status['total']}")
        for task_id in client.job_task_ids(job):
            _check_task(client, job, task_id, figures)
    queued = client.state.tenants.queued(client.tenant)
    if queued.tasks != 0:
        figures.writes_applied_twice += abs(queued.tasks)
        figures.violations.append(f"the tenant's quota holds {queued.tasks} queued tasks")
    return figures


def _check_task(client: Client, job: str, task_id: str, figures: DrillFigures) -> None:
    status = client.state.tasks.get(task_id)
    state = status.get("state")
    if state == "succeeded":
        record = client.result(task_id)
        if not isinstance(record, dict) or record.get("id") != task_id:
            figures.results_lost += 1
            figures.violations.append(f"{job}/{task_id}: no readable result")
        if status.get("attempts") not in (None, "1") and status.get("deliveries") == "1":
            figures.writes_applied_twice += 1
            figures.violations.append(f"{job}/{task_id}: {status['attempts']} attempts, one run")
    elif state == "cancelled":
        if status.get("started_at") or status.get("result_url") or status.get("result_key"):
            figures.cancelled_that_ran += 1
            figures.violations.append(f"{job}/{task_id}: cancelled, yet it ran")
    else:
        figures.violations.append(f"{job}/{task_id}: {state}")
