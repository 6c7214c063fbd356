"""The fault scenarios; each returns its figures. Sizes are parameters: CI
runs them small, ``bench/faults.py`` runs them at full size."""

from __future__ import annotations

import random
import signal
import time
from typing import Any

from tests.support.faults.harness import Harness
from tests.support.faults.inject import Faults
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.config.status import TERMINAL
from vlmq.config.wire import encode_message

TERMINAL_STATES = {s.value for s in TERMINAL}


def _delivery_figures(h: Harness, job: str, ids: list[str]) -> dict[str, Any]:
    """Per task: its status, the object the status points at, and whether they agree."""
    statuses = h.statuses(ids)
    pointed = h.pointed_objects(statuses)
    records = [record for _, record in pointed]
    attempts = [int(s.get("attempts") or 0) for s in statuses]
    agree = [_agrees(s, record) for s, record in zip(statuses, records, strict=True)]
    return {
        "tasks": len(ids),
        "terminal": sum(s.get("state") in TERMINAL_STATES for s in statuses),
        "succeeded": sum(s.get("state") == "succeeded" for s in statuses),
        "result_objects": sum(record is not None for record in records),
        "lost": sum(record is None for record in records),
        "disagreeing": sum(not ok for ok in agree),
        # Objects no status points at: deliveries killed between upload and settle, or
        # superseded; never read, never the task's result.
        "orphan_objects": len(set(h.objects(job)) - {key for key, _ in pointed}),
        "duplicate_executions": sum(max(0, a - 1) for a in attempts),
        "job_counts": h.client.status(job)["counts"],
    }


def _agrees(status: dict[str, str], record: dict[str, Any] | None) -> bool:
    """The object says what the hash says: succeeded or not, and by which worker."""
    if record is None:
        return False
    succeeded = record.get("status") == "succeeded"
    return succeeded == (status.get("state") == "succeeded") and record.get("worker") == status.get(
        "worker"
    )


def kill_storm(
    h: Harness, tasks: int, kills: int, seed: int = 0, delay_s: float = 0.5
) -> dict[str, Any]:
    """SIGKILL the worker ``kills`` times at random points inside batches; each
    replacement worker also picks up what its predecessor held."""
    rng = random.Random(seed)
    job, ids = h.submit_text(tasks)
    killed: list[tuple[float, list[str]]] = []
    for k in range(kills):
        name = f"victim-{k}"
        victim = h.noop_worker(name, delay_s)
        wait_until(lambda n=name: h.running_on(ids, n), timeout=120, what="a batch in flight")
        time.sleep(rng.uniform(0, delay_s))  # a random point inside the batch
        held = h.running_on(ids, name)
        h.kill(victim)
        killed.append((time.time(), held))
        victim.wait(10)
    h.noop_worker("rescuer", delay_s)
    h.wait_job(job)
    recoveries = [_recovery(h, at, held) for at, held in killed if held]
    return {
        **_delivery_figures(h, job, ids),
        "kills": kills,
        "longest_recovery_s": round(max(recoveries), 2),
        "mean_recovery_s": round(sum(recoveries) / len(recoveries), 2),
    }


def _recovery(h: Harness, killed_at: float, held: list[str]) -> float:
    """From the kill until the last task the victim held was finished elsewhere."""
    finished = h.client.state.tasks.many(held, ("finished_at",))
    return max(float(f["finished_at"]) for f in finished) - killed_at


def redis_restart(h: Harness, tasks: int, delay_s: float = 0.1) -> dict[str, Any]:
    """SIGKILL redis-server mid-run and start it again on the same data."""
    job, ids = h.submit_text(tasks)
    h.noop_worker("survivor", delay_s)
    wait_until(lambda: h.client.status(job)["done"] >= tasks // 3, timeout=120, what="progress")
    h.redis.kill()
    down_at = time.monotonic()
    h.redis.start()
    h._client = None  # a fresh connection pool for the test's own client
    done_after_restart = h.client.status(job)["done"]
    wait_until(
        lambda: h.client.status(job)["done"] > done_after_restart,
        timeout=120,
        what="consumption after the restart",
    )
    resumed_s = time.monotonic() - down_at
    h.wait_job(job)
    return {**_delivery_figures(h, job, ids), "consuming_again_after_s": round(resumed_s, 2)}


def redis_restart_without_persistence(h: Harness, tasks: int) -> dict[str, Any]:
    """What a Redis with persistence off loses on restart (documented, not a goal)."""
    job, ids = h.submit_text(tasks)
    h.noop_worker("survivor", 0.1)
    wait_until(lambda: h.client.status(job)["done"] >= tasks // 3, timeout=120, what="progress")
    h.redis.kill()
    h.redis.start()
    h._client = None
    # The worker reconnects (its heartbeat record is back) and drains what is left.
    keys = Keys()
    wait_until(
        lambda: (
            h.client.redis.hexists(keys.workers(), "survivor")
            and h.client.redis.llen(keys.queue("text")) == 0
            and h.client.redis.hlen(keys.inflight()) == 0
        ),
        timeout=60,
        what="the worker back and idle",
    )
    statuses = h.statuses(ids)
    known = sum(s.get("state") != "unknown" for s in statuses)
    objects = len(h.objects(job))
    return {
        "tasks": tasks,
        "result_objects": objects,
        "task_statuses_left": known,
        "queued_messages_left": h.client.redis.dbsize(),
        "lost_unfinished": tasks - objects,
    }


def s3_outage(h: Harness, tasks: int, outage_s: float, delay_s: float = 0.1) -> dict[str, Any]:
    """Stop the S3 endpoint the worker uses; nothing may succeed without its object."""
    assert h.proxy is not None
    job, ids = h.submit_text(tasks)
    h.noop_worker("uploader", delay_s)
    wait_until(lambda: h.client.status(job)["done"] >= tasks // 5, timeout=120, what="progress")
    h.proxy.down()
    violations, succeeded_during = 0, 0
    start_done = h.client.status(job)["counts"]["succeeded"]
    deadline = time.monotonic() + outage_s
    while time.monotonic() < deadline:
        violations += _succeeded_without_object(h, job, ids)
        time.sleep(0.5)
    succeeded_during = h.client.status(job)["counts"]["succeeded"] - start_done
    h.proxy.up()
    back_at = time.monotonic()
    h.wait_job(job)
    violations += _succeeded_without_object(h, job, ids)
    return {
        **_delivery_figures(h, job, ids),
        "outage_s": outage_s,
        "succeeded_during_outage": succeeded_during,
        "succeeded_without_object": violations,
        "finished_after_return_s": round(time.monotonic() - back_at, 2),
    }


def _succeeded_without_object(h: Harness, job: str, ids: list[str]) -> int:
    objects = set(h.objects(job))
    states = h.client.state.tasks.many(ids, ("state", "result_url"))
    store = h.client.store
    return sum(
        1
        for s in states
        if s.get("state") == "succeeded"
        and store.key_of(s.get("result_url") or "missing") not in objects
    )


def _faulty_worker(h: Harness, name: str, model: str, batch: int, faults: Faults) -> None:
    """A text worker on ``model`` that batches ``batch`` requests, with ``faults``; registered."""
    env = {
        "VLMQ_BATCH": _policy(batch, wait_s=1.0),
        "VLMQ_MODEL": model,
        "VLMQ_ENGINE__MAX_NEW_TOKENS_DEFAULT": "4",
        # Micro-batches as large as before the decode loop's in-flight default (an eighth of
        # the slots): the pulled batch is cut by length alone, a longer row joining a micro-batch
        # under half full.
        "VLMQ_ENGINE__DECODE__ADMIT_ROWS": str(2 * batch),
        **faults.env(),
    }
    h.worker("--modality", "text", "--no-celery", "--name", name, **env)
    h.wait_registered(name)


def poison_in_batch(h: Harness, model: str, batch: int = 16) -> dict[str, Any]:
    """One request that makes generate raise, among ``batch`` in one batch."""
    _faulty_worker(h, "poisoned", model, batch, Faults(poison_marker="POISON"))
    job, ids = h.submit_text(batch, marker="POISON")
    status = h.wait_job(job)
    wait_until(
        lambda: h.worker_info("poisoned").get("engine", {}).get("rows", 0) >= batch - 1,
        timeout=30,
        what="engine stats",
    )
    engine = h.worker_info("poisoned")["engine"]
    errors = {s.get("error_code") for s in h.statuses(ids) if s.get("state") == "failed"}
    return {
        "batch": batch,
        "succeeded": status["counts"]["succeeded"],
        "failed": status["counts"]["failed"],
        "failed_codes": sorted(errors),
        "generate_calls": engine["micro_batches"] + engine["bisections"] + 1,
        "extra_generate_calls": engine["micro_batches"] + engine["bisections"],
        "bisections": engine["bisections"],
    }


def crash_request(h: Harness, tasks: int = 6) -> dict[str, Any]:
    """A request that kills its worker each time: dead-lettered, no loop."""
    job, _ids = h.submit_text(tasks, marker="CRASH")
    deaths = 0
    while not h.client.status(job)["finished"] and deaths <= 6:
        proc = h.noop_worker(f"crashy-{deaths}", 0.05, **Faults(crash_marker="CRASH").env())
        wait_until(
            lambda p=proc: p.poll() is not None or h.client.status(job)["finished"],
            timeout=60,
            what="a crash or the end",
        )
        deaths += proc.poll() is not None
    status = h.client.status(job)
    return {
        "tasks": tasks,
        "worker_deaths": deaths,
        "succeeded": status["counts"]["succeeded"],
        "dead_lettered": h.client.redis.llen(Keys().dead_letters()),
    }


def oom_halving(h: Harness, model: str, batch: int = 16, limit: int = 4) -> dict[str, Any]:
    """A fake out-of-memory error for any micro-batch above ``limit`` rows."""
    _faulty_worker(h, "small-gpu", model, batch, Faults(oom_above_batch=limit))
    job, ids = h.submit_text(batch)
    status = h.wait_job(job)
    sizes = [r.get("batch_size") for r in (h.client.result(i) for i in ids)]
    wait_until(
        lambda: h.worker_info("small-gpu").get("engine", {}).get("rows", 0) >= batch,
        timeout=30,
        what="engine stats",
    )
    engine = h.worker_info("small-gpu")["engine"]
    return {
        "batch": batch,
        "oom_above": limit,
        "succeeded": status["counts"]["succeeded"],
        "largest_micro_batch": max(s or 0 for s in sizes),
        "oom_splits": engine["oom_splits"],
    }


def sigterm_mid_batch(h: Harness, tasks: int = 64, delay_s: float = 1.0) -> dict[str, Any]:
    job, ids = h.submit_text(tasks)
    proc = h.noop_worker("terminated", delay_s)
    wait_until(lambda: h.running_on(ids, "terminated"), timeout=120, what="a batch in flight")
    in_flight = len(h.running_on(ids, "terminated"))
    h.kill(proc, signal.SIGTERM)
    code = proc.wait(60)
    counts = h.client.status(job)["counts"]
    returned = counts["queued"]
    finished = counts["succeeded"]
    running_left = counts["running"]
    h.noop_worker("after", 0.05)
    h.wait_job(job)
    figures = _delivery_figures(h, job, ids)
    return {
        **figures,
        "exit_code": code,
        "in_flight_at_sigterm": in_flight,
        "finished_before_exit": finished,
        "returned_to_queue": returned,
        "left_running": running_left,
        "dropped": tasks - figures["succeeded"],
    }


def double_publish(h: Harness) -> dict[str, Any]:
    """The same message published twice, and a third message with the same task id (a new
    envelope): the copy runs once; the other message names a task it is not, and fails alone
    under an id of its own."""
    task = h.client.submit([{"role": "user", "content": "once"}], lane="bulk")
    raw: str = h.client.redis.lindex("vlmq.text", 0)  # type: ignore[assignment]
    h.client.redis.lpush("vlmq.text", raw)
    request = {"id": task, "messages": [{"role": "user", "content": "once"}]}
    h.client.redis.lpush("vlmq.text", encode_message(request, task, "vlmq.text"))
    h.noop_worker("dedup", 0.05)
    wait_until(lambda: h.client.status(task)["state"] == "succeeded", what="the task")
    wait_until(
        lambda: (
            h.client.redis.llen("vlmq.text") == 0 and h.client.redis.hlen(Keys().inflight()) == 0
        ),
        what="all copies consumed",
    )
    status = h.client.status(task)
    objects = h.client.store.keys("_tasks")
    return {
        "published": 3,
        "result_objects": sum(1 for key in objects if f"/{task}." in key),
        "refused": sum(1 for key in objects if "/invalid-" in key),
        "state": status["state"],
        "executions": int(status.get("attempts") or 0),
    }


def _policy(size: int, wait_s: float) -> str:
    from tests.support.faults.harness import batch_policy

    return batch_policy(size, wait_s)
