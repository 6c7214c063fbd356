"""Fault scenarios of the prepare tier and of Celery records (issue 37), with real processes
(:class:`~tests.support.fleet.Processes`: ``vlmq worker --role prepare`` with a tiny
checkpoint's config files, no-op GPU workers, a web app's Celery app); each returns its
figures. CI runs them small (``tests/faults/test_prepare_tier.py``); ``python -m bench.faults
--drill prepare`` at full size (docs/reliability.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from celery import Celery

from tests.support.faults.harness import batch_policy
from tests.support.faults.inject import EXIT_INJECTED_CRASH, Faults
from tests.support.fleet import Processes
from tests.support.samples import save_image
from tests.support.services import wait_until

__all__ = [
    "failure_of",
    "handed_on",
    "killer_in_the_prepare_tier",
    "photo_request",
    "photos",
    "prepare_worker",
    "redis_restart_under_prepare_workers",
    "revokes_heard_by_prepare_workers",
]

GENERATE = "vlmq.generate"
KILLER_MARKER = "CRASH-ME"


def photos(fleet: Processes, count: int) -> list[Path]:
    """``count`` small photos in the fleet's media root."""
    media = fleet.workdir / "media"
    return [save_image(media / f"photo-{n}.png", size=(320, 240), seed=n) for n in range(count)]


def photo_request(photo: Path, text: str) -> dict[str, Any]:
    part = {"type": "image", "image": str(photo)}
    return {"messages": [{"role": "user", "content": [part, text]}], "max_new_tokens": 4}


def prepare_worker(
    fleet: Processes,
    name: str,
    env: dict[str, str] | None = None,
    celery: bool = False,
    wait: bool = True,
) -> Any:
    """``vlmq worker --role prepare`` (Celery-hosted with ``celery``); with ``wait``, returned
    once its heartbeat record is in Redis."""
    hosting = () if celery else ("--no-celery",)
    args = ("--log-level", "info", "worker", "--role", "prepare", *hosting, "--name", name)
    proc = fleet.start(name, *args, env=env)
    if wait:
        fleet.wait_registered(name, proc, timeout=60)
    return proc


def handed_on(fleet: Processes) -> int:
    """Image and video tasks handed on and not pulled by a GPU worker since (the prepared
    lists): with no GPU worker running, it only grows, so a wait on it sees no task in between
    (reaped back to its queue, not pulled yet) as done."""
    pipe = fleet.redis.pipeline(transaction=False)
    for modality in ("image", "video"):
        for lane in ("bulk", "interactive"):
            pipe.llen(fleet.keys.prepared_queue(modality, lane))
    return sum(pipe.execute())


def failure_of(result: Any, timeout: float) -> tuple[Any, ...]:
    """The ``args`` of the exception ``result.get()`` raises (its code and message for a vlmq
    task that failed); ``("no failure",)`` when it returns."""
    try:
        result.get(timeout=timeout)
    except Exception as exc:
        return tuple(exc.args)
    return ("no failure",)


def killer_in_the_prepare_tier(
    fleet: Processes, app: Celery, batch_mates: int, env: dict[str, str], most_deaths: int
) -> dict[str, Any]:
    """A photo whose preparing kills the prepare worker (``os._exit``, as a decoder crash),
    sent with ``batch_mates`` others through Celery; a supervisor starts another prepare
    worker after each death until every task is handed on (at most ``most_deaths``), then a
    no-op GPU worker runs them."""
    queue = fleet.keys.queue("image")
    shots = photos(fleet, batch_mates + 1)
    mates = [
        app.send_task(GENERATE, kwargs={"request": photo_request(p, "Describe it.")}, queue=queue)
        for p in shots[:batch_mates]
    ]
    killer_request = photo_request(shots[-1], KILLER_MARKER)
    killer = app.send_task(GENERATE, kwargs={"request": killer_request}, queue=queue)
    crashing = {**env, **Faults(prepare_crash_marker=KILLER_MARKER).env()}
    started, deaths, total = time.monotonic(), 0, batch_mates + 1
    while handed_on(fleet) < total:
        proc = prepare_worker(fleet, f"prep-{deaths}", env=crashing, wait=False)
        wait_until(
            lambda p=proc: p.poll() is not None or handed_on(fleet) == total,
            timeout=60,
            what="a death or everything handed on",
        )
        if proc.poll() is not None:
            if proc.returncode != EXIT_INJECTED_CRASH:
                raise AssertionError(fleet.log(proc)[-2000:])
            deaths += 1
        if deaths > most_deaths:
            raise AssertionError(f"the killer took {deaths} prepare workers down, and goes on")
    handed_on_s = time.monotonic() - started
    fleet.worker("gpu-1", modality="image", env=env)
    outputs = [r.get(timeout=60) for r in mates]
    error = failure_of(killer, timeout=60)
    client = fleet.client()
    deliveries = [int(client.status(r.id).get("deliveries") or 0) for r in mates]
    return {
        "batch_mates": batch_mates,
        "prepare_worker_deaths": deaths,
        "batch_mates_succeeded": sum(o["id"] == r.id for o, r in zip(outputs, mates, strict=True)),
        "most_deliveries_of_a_batch_mate": max(deliveries),
        "killer_celery_state": killer.state,
        "killer_error": error[0],
        "killer_reason": error[1] if len(error) > 1 else "",
        "dead_letters": fleet.redis.llen(fleet.keys.dead_letters()),
        "all_handed_on_after_s": round(handed_on_s, 1),
    }


def redis_restart_under_prepare_workers(
    fleet: Processes, server: Any, tasks: int, outage_s: float | None
) -> dict[str, Any]:
    """A prepare worker with ``tasks`` photos to prepare; Redis killed once the worker is
    busy and started again on its data after ``outage_s`` (None: as soon as the worker has
    met the outage); ``tasks`` more submitted after. Then a no-op GPU worker runs them all."""
    client = fleet.client()
    shots = photos(fleet, tasks)
    items = [{"messages": photo_request(p, "Describe it.")["messages"]} for p in shots]
    before = client.submit_many(items)
    proc = prepare_worker(fleet, "prep-1")
    prepared = fleet.keys.prepared_queue("image", "bulk")
    wait_until(lambda: fleet.redis.llen(prepared) >= 1, timeout=60, what="a first hand-on")
    server.kill()
    down = time.monotonic()
    wait_until(
        lambda: proc.poll() is not None or "retrying in" in fleet.log(proc),
        timeout=30,
        what="the prepare worker meeting the outage",
    )
    if outage_s is not None:
        time.sleep(max(0.0, outage_s - (time.monotonic() - down)))  # the outage itself
    alive_during = proc.poll() is None
    server.start()
    outage = time.monotonic() - down
    after = client.submit_many(items)
    wait_until(
        lambda: handed_on(fleet) == 2 * tasks or proc.poll() is not None,
        timeout=60,
        what="every task prepared, or the prepare worker's exit",
    )
    prepared_after_s = time.monotonic() - down - outage
    alive_after = proc.poll() is None
    fleet.worker("gpu-1", modality="image")
    for job in (before, after):
        wait_until(lambda j=job: client.status(j)["finished"], timeout=120, what="the jobs")
    counts = [client.status(job)["counts"] for job in (before, after)]
    return {
        "tasks": 2 * tasks,
        "outage_s": round(outage, 1),
        "prepare_worker_alive_during": alive_during,
        "prepare_worker_alive_after": alive_after,
        "exit_code": proc.returncode,
        "all_prepared_after_s": round(prepared_after_s, 1),
        "succeeded": sum(c["succeeded"] for c in counts),
        "failed": sum(c["failed"] for c in counts),
    }


def revokes_heard_by_prepare_workers(fleet: Processes, app: Celery, count: int) -> dict[str, Any]:
    """A Celery-hosted prepare worker and a Celery-hosted no-op GPU worker (1 s a batch of
    1, so most tasks wait): ``count`` image tasks sent, then each revoked in turn; every worker
    hears each revoke, the first cancel moves the task. How each task's Celery record ends."""
    names = ("prep-1", "gpu-1")
    procs = [prepare_worker(fleet, names[0], celery=True)]
    slow = {"VLMQ_BATCH": batch_policy(1, 0.0)}
    gpu_args = ("worker", "--engine", "noop", "--noop-delay", "1.0", "--modality", "image")
    procs.append(fleet.start(names[1], *gpu_args, "--name", names[1], env=slow))
    fleet.wait_registered(names[1], procs[1], timeout=60)
    hosts = {f"celery@{n}" for n in names}
    wait_until(
        lambda: {n for r in app.control.ping(timeout=0.5) for n in r} >= hosts,
        timeout=60,
        what="both Celery hosts",
    )
    queue = fleet.keys.queue("image")
    shots = photos(fleet, count)
    sent = [
        app.send_task(GENERATE, kwargs={"request": photo_request(p, "Describe it.")}, queue=queue)
        for p in shots
    ]
    cancelled_by: dict[str, int] = {}
    for result in sent:
        for reply in app.control.revoke(result.id, reply=True, timeout=2.0, limit=len(names)):
            for name, answer in reply.items():
                if answer.get("ok", {}).get(result.id) == "cancelled":
                    cancelled_by[name] = cancelled_by.get(name, 0) + 1
    cancelled = [r for r in sent if fleet.redis.hget(fleet.keys.task(r.id), "state") == "cancelled"]
    deadline = time.monotonic() + 15  # what is still PENDING by then is counted, not waited on
    while any(r.state == "PENDING" for r in cancelled) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "revoked": count,
        "cancelled": len(cancelled),
        "cancelled_by_the_prepare_worker": cancelled_by.get(f"celery@{names[0]}", 0),
        "cancelled_by_the_gpu_worker": cancelled_by.get(f"celery@{names[1]}", 0),
        "revoked_records": sum(r.state == "REVOKED" for r in cancelled),
        "pending_records": sum(r.state == "PENDING" for r in cancelled),
        "ran_before_their_revoke": count - len(cancelled),
    }
