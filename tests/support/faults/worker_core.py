"""Fault scenarios of the worker core: clock skew, fencing, duplicates, malformed messages,
a full or read-only Redis, settle failures, per-call time limits, webhooks, the heartbeat.

Each runs real ``vlmq worker`` processes against the harness's Redis and S3 and returns its
figures (the CI fault suite asserts on them; ``bench/faults.py`` writes them to
docs/reliability.md). Sizes are arguments, so CI runs them small.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import time
from collections import Counter
from typing import Any

from celery import Celery

from tests.support.faults.harness import Harness, batch_policy
from tests.support.faults.inject import Faults
from tests.support.faults.scenarios import _delivery_figures
from tests.support.services import wait_until
from tests.support.webhook_receiver import HookReceiver
from vlmq.config.keys import Keys
from vlmq.config.wire import encode_message

__all__ = [
    "clock_skew",
    "cut_off_holder",
    "duplicates_in_two_queues",
    "heartbeat_error",
    "malformed_messages",
    "redis_full",
    "redis_read_only",
    "renewal_stall",
    "settle_errors",
    "time_limit_per_engine_call",
    "webhook_sender_dies",
]

_LEASED = {"VLMQ_FLEET__LEASE_S": "3", "VLMQ_FLEET__REAP_INTERVAL_S": "0.5"}


def _done_by(h: Harness, ids: list[str], worker: str) -> int:
    rows = h.client.state.tasks.many(ids, ("state", "worker"))
    return sum(r.get("state") == "succeeded" and r.get("worker") == worker for r in rows)


def _deliveries(h: Harness, ids: list[str]) -> list[int]:
    return [int(s.get("deliveries") or 0) for s in h.client.state.tasks.many(ids, ("deliveries",))]


def clock_skew(
    h: Harness, tasks: int = 200, skew_s: float = 20.0, lease_s: float = 6.0, delay_s: float = 0.3
) -> dict[str, Any]:
    """Workers whose clocks run ``skew_s`` ahead and behind serve beside an on-time one whose
    batches are slow (its leases live long, in the skewed reapers' sight); then the on-time
    one dies holding work, and only the skewed ones are left to recover it."""
    env = {
        "VLMQ_FLEET__LEASE_S": str(lease_s),
        "VLMQ_FLEET__REAP_INTERVAL_S": "0.5",
        "VLMQ_BATCH": batch_policy(4),
    }
    h.noop_worker("ahead", delay_s, **env, **h.skewed(skew_s))
    h.noop_worker("behind", delay_s, **env, **h.skewed(-skew_s))
    # The one that dies runs serially, so what it holds is exactly what runs on it (a
    # pipelined one also holds prefetched work: the pipeline scenarios kill those).
    on_time = h.noop_worker("on-time", 5 * delay_s, **env, VLMQ_WORKER__PIPELINE="false")
    for name in ("ahead", "behind", "on-time"):
        h.wait_registered(name)
    # The work comes once all three serve. Submitted before the on-time one started, it was
    # all taken by the skewed two on a loaded machine before the on-time one's slow start
    # ended, and the wait below ran out (the faults tier, 2 of 2 cores busy).
    job, ids = h.submit_text(tasks)
    wait_until(
        lambda: _done_by(h, ids, "on-time") >= 8 and h.running_on(ids, "on-time"),
        timeout=120,
        what="on-time through two batches, into a third",
    )
    held = h.running_on(ids, "on-time")
    killed_at = time.time()
    h.kill(on_time)
    on_time.wait(10)
    h.wait_job(job, timeout=240)
    finished = h.client.state.tasks.many(held, ("finished_at",))
    recovery = max(float(f["finished_at"]) for f in finished) - killed_at
    statuses = h.client.state.tasks.many(ids, ("worker",))
    return {
        **_delivery_figures(h, job, ids),
        "skew_s": skew_s,
        "lease_s": lease_s,
        # Deliveries beyond the first: only what the killed worker held may be redelivered.
        "redelivered": sum(d > 1 for d in _deliveries(h, ids)),
        "held_by_the_killed_worker": len(held),
        "recovery_s": round(recovery, 2),
        "by_worker": dict(Counter(s.get("worker") for s in statuses)),
    }


def renewal_stall(
    h: Harness, tasks: int = 60, lease_s: float = 6.0, delay_s: float = 2.0, skew_s: float = 20.0
) -> dict[str, Any]:
    """Two noop workers with short leases; one runs ``skew_s`` ahead with its monotonic clock
    shifted too, so its heartbeat thread's timed wait never returns and it renews nothing
    (issue 38: 9 of 60 tasks ran twice, the stalled worker pulling on). Expected: the stalled
    worker sees its stall on Redis's clock and stops pulling, so every task is delivered once."""
    env = {
        "VLMQ_FLEET__LEASE_S": str(lease_s),
        "VLMQ_FLEET__REAP_INTERVAL_S": "0.5",
        "VLMQ_BATCH": batch_policy(4),
    }
    # The work waits before the workers start: the stalled one pulls at once (an idle poll's
    # timed wait would hang it before it pulled anything).
    job, ids = h.submit_text(tasks)
    stalled = h.noop_worker("stalled", delay_s, **env, **h.skewed(skew_s, monotonic=True))
    h.noop_worker("on-time", delay_s, **env)
    h.wait_job(job, timeout=max(60.0, tasks * delay_s))
    statuses = h.client.state.tasks.many(ids, ("worker",))
    stall_logged = "lease renewals stalled" in h.logs[stalled.pid].read_text(errors="replace")
    return {
        **_delivery_figures(h, job, ids),
        "lease_s": lease_s,
        "skew_s": skew_s,
        "delivered_twice": sum(d > 1 for d in _deliveries(h, ids)),
        "by_worker": dict(Counter(s.get("worker") for s in statuses)),
        "stall_logged": stall_logged,
    }


def cut_off_holder(h: Harness, tasks: int = 16, delay_s: float = 15.0) -> dict[str, Any]:
    """A worker cut off from Redis past its lease while it runs a batch: the batch is taken
    over and finished elsewhere; when the first holder comes back, its results are refused
    (fenced) and never become the tasks' results.

    The batch's engine call outlasts the takeover (the rescuer's start, up to ~5 s on a loaded
    host, then the 3 s lease and the reap): one that ended first would have stored its results
    before the rescuer took the tasks, and a redelivered task with a stored result is settled
    with it, not run again (workers/fleet/triage.py), which is right, and not this drill."""
    proxy = h.redis_proxy()
    job, ids = h.submit_text(tasks)
    cut_off = h.noop_worker("cut-off", delay_s, VLMQ_REDIS_URL=proxy.redis_url, **_LEASED)
    wait_until(lambda: len(h.running_on(ids, "cut-off")) == tasks, timeout=120, what="the batch")
    proxy.down()
    h.noop_worker("rescuer", 0.1, **_LEASED)
    wait_until(
        lambda: all(s.get("state") == "succeeded" for s in h.statuses(ids)),
        timeout=60,
        what="the rescue",
    )
    proxy.up()
    # The first holder's engine call ends after delay_s; then it uploads and tries to settle.
    wait_until(
        lambda: h.worker_info("cut-off").get("batches", 0) >= 1,
        timeout=60,
        what="the cut-off worker's batch to end",
    )
    # Its uploads and its (refused) settle follow the batch's end.
    h.wait_logged(cut_off, "results of superseded deliveries discarded")
    statuses = h.client.state.tasks.many(ids, ("worker",))
    return {
        **_delivery_figures(h, job, ids),
        "taken_over": sum(s.get("worker") == "rescuer" for s in statuses),
        "cut_off_worker_alive": cut_off.poll() is None,
    }


def duplicates_in_two_queues(h: Harness, delay_s: float = 1.0) -> dict[str, Any]:
    """The same message in two classes' queues, a worker on each: one execution. Both copies
    are queued before the workers start (a running worker could take the first before it is
    copied)."""
    task = h.client.submit([{"role": "user", "content": "once"}], lane="bulk")
    raw: str = h.client.redis.lindex("vlmq.text", 0)  # type: ignore[assignment]
    h.client.redis.lpush("vlmq.image", raw)
    text = h.noop_worker("text-worker", delay_s)
    image = h.worker(
        "--modality",
        "image",
        "--engine",
        "noop",
        "--no-celery",
        "--name",
        "image-worker",
        "--noop-delay",
        str(delay_s),
    )
    h.wait_registered("text-worker")
    h.wait_registered("image-worker")
    wait_until(lambda: h.client.status(task)["state"] == "succeeded", what="the task")
    wait_until(
        lambda: h.client.redis.llen("vlmq.text") + h.client.redis.llen("vlmq.image") == 0,
        what="both copies consumed",
    )
    status = h.client.status(task)
    return {
        "copies": 2,
        "executions": int(status.get("attempts") or 0),
        "deliveries": int(status.get("deliveries") or 0),
        "result_objects": len(h.client.store.keys("_tasks")),
        "state": status["state"],
        "workers_alive": (text.poll(), image.poll()) == (None, None),
    }


def _raw_entries() -> dict[str, str]:
    """Raw list entries no Celery producer would write, by what is wrong with them."""
    good = encode_message({"messages": [{"role": "user", "content": "x"}]}, "raw-ok", "vlmq.text")
    message = json.loads(good)
    pickled = dict(message, **{"content-type": "application/x-python-serialize"})
    pickled["headers"] = {**message["headers"], "id": "raw-pickle"}
    garbage_body = dict(message, body=base64.b64encode(b"\x00not json").decode())
    garbage_body["headers"] = {**message["headers"], "id": "raw-garbage-body"}
    priority = dict(message, properties={**message["properties"], "priority": "high"})
    priority["headers"] = {**message["headers"], "id": "raw-priority"}
    return {
        "not JSON at all": "this is not a message",
        "pickle content type": json.dumps(pickled),
        "body not JSON": json.dumps(garbage_body),
        "non-numeric priority": json.dumps(priority),
        "task id not a plain id": good.replace('"id":"raw-ok"', '"id":"a b\\"c"', 1),
    }


def _expected_id(name: str, raw: str) -> str:
    if name in ("not JSON at all", "task id not a plain id"):
        return "invalid-" + hashlib.sha1(raw.encode()).hexdigest()
    return str(json.loads(raw)["headers"]["id"])


def malformed_messages(h: Harness, valid: int = 6) -> dict[str, Any]:
    """Every malformed shape a Celery producer (or anything pushing to the lists) can send,
    among valid tasks: each fails alone, the worker never exits."""
    proc = h.noop_worker("steady", 0.05)
    h.wait_registered("steady")
    pid = proc.pid
    app = Celery(broker=h.redis.url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"])
    request = {"messages": [{"role": "user", "content": "fine"}]}
    shapes: dict[str, dict[str, Any]] = {
        "generation not an object": {"kwargs": {"request": {**request, "generation": 5}}},
        "messages not a list": {"kwargs": {"request": {"messages": "hello"}}},
        "request not an object": {"kwargs": {"request": 5}},
        "kwargs not an object": {"args": ["positional", "only"]},
        "unknown field": {"kwargs": {"request": {**request, "colour": "blue"}}},
        "huge field": {"kwargs": {"request": {**request, "custom_id": "x" * 200_000}}},
        "content not text or parts": {
            "kwargs": {"request": {"messages": [{"role": "user", "content": 7}]}}
        },
    }
    ids: dict[str, str] = {}
    for name, call in shapes.items():
        ids[name] = app.send_task("vlmq.generate", queue="vlmq.text", **call).id
    for name, raw in _raw_entries().items():
        h.client.redis.lpush("vlmq.text", raw)
        ids[name] = _expected_id(name, raw)
    good = [
        app.send_task("vlmq.generate", kwargs={"request": request}, queue="vlmq.text").id
        for _ in range(valid)
    ]
    everything = [*ids.values(), *good]
    wait_until(
        lambda: all(s.get("state") in ("failed", "succeeded") for s in h.statuses(everything)),
        timeout=60,
        what="every message settled",
    )
    failed = {name: h.client.status(task) for name, task in ids.items()}
    return {
        "malformed": len(ids),
        "valid_succeeded": sum(h.client.status(t)["state"] == "succeeded" for t in good),
        "codes": {name: s.get("error_code") for name, s in failed.items()},
        "with_result_object": sum(bool(s.get("result_url")) for s in failed.values()),
        "worker_pid_unchanged": proc.poll() is None and proc.pid == pid,
    }


def redis_full(h: Harness, tasks: int = 300, full_s: float = 5.0) -> dict[str, Any]:
    """Redis reaches maxmemory (noeviction) mid-job, then gets room again."""
    job, ids = h.submit_text(tasks)
    proc = h.noop_worker("filled", 0.05, VLMQ_BATCH=batch_policy(8))
    wait_until(lambda: h.client.status(job)["done"] >= tasks // 5, timeout=120, what="progress")
    redis = h.client.redis
    used = int(redis.info("memory")["used_memory"])
    # Just above what it uses: the next writes that need memory fill it (a
    # settle writes less than it did, so the drain alone may never fill a roomier limit).
    redis.config_set("maxmemory", used + 16 * 1024)
    wait_until(lambda: _refused(h), timeout=60, what="Redis full")
    done_when_full = h.client.status(job)["done"]
    time.sleep(full_s)  # the worker waits out a full Redis; it must neither exit nor lose work
    alive_when_full = proc.poll() is None
    done_during = h.client.status(job)["done"] - done_when_full
    redis.config_set("maxmemory", 0)
    h.wait_job(job)
    return {
        **_delivery_figures(h, job, ids),
        "full_for_s": full_s,
        "settled_while_full": done_during,
        "worker_alive_while_full": alive_when_full,
        "worker_alive_after": proc.poll() is None,
    }


def _refused(h: Harness) -> bool:
    """A write that needs memory is refused (Redis is over maxmemory)."""
    from redis.exceptions import OutOfMemoryError

    try:
        h.client.redis.set("vlmq:probe", "x" * 65536)
    except OutOfMemoryError:
        return True
    h.client.redis.delete("vlmq:probe")
    return False


def redis_read_only(h: Harness, tasks: int = 120, read_only_s: float = 3.0) -> dict[str, Any]:
    """Redis turns read-only mid-job (a replica not yet promoted), then writable again."""
    from tests.support.services import free_port

    job, ids = h.submit_text(tasks)
    proc = h.noop_worker("steady", 0.05, VLMQ_BATCH=batch_policy(8))
    wait_until(lambda: h.client.status(job)["done"] >= tasks // 5, timeout=120, what="progress")
    h.client.redis.replicaof("127.0.0.1", free_port())  # a master that is not there
    time.sleep(read_only_s)
    alive = proc.poll() is None
    h.client.redis.replicaof("NO", "ONE")
    h.wait_job(job)
    return {
        **_delivery_figures(h, job, ids),
        "read_only_s": read_only_s,
        "worker_alive_while_read_only": alive,
        "worker_alive_after": proc.poll() is None,
    }


def settle_errors(h: Harness, tasks: int = 16) -> dict[str, Any]:
    """The worker's first settle raises an unexpected error (a bug): its batch is released,
    redelivered within lease + reap, and finished; nothing stays running."""
    job, ids = h.submit_text(tasks)
    started = time.monotonic()
    proc = h.noop_worker("buggy", 0.05, **Faults(settle_errors=1).env(), **_LEASED)
    h.wait_job(job, timeout=120)
    return {
        **_delivery_figures(h, job, ids),
        "finished_after_s": round(time.monotonic() - started, 2),
        "redelivered": sum(d > 1 for d in _deliveries(h, ids)),
        "worker_alive": proc.poll() is None,
    }


def time_limit_per_engine_call(
    h: Harness, suspects: int = 4, delay_s: float = 1.0, limit_s: float = 2.5
) -> dict[str, Any]:
    """Requests that ran before run alone, one engine call each: together they take longer
    than the time limit, each well under it. The worker must not count them as one batch."""
    job, ids = h.submit_text(suspects)
    for task in ids:  # each ran once before, on a worker that died
        h.client.redis.hincrby(Keys().task(task), "attempts", 1)
    proc = h.noop_worker("careful", delay_s, VLMQ_FLEET__BATCH_TIME_LIMIT_S=str(limit_s))
    h.wait_job(job, timeout=120)
    attempts = [int(s["attempts"]) for s in h.client.state.tasks.many(ids, ("attempts",))]
    return {
        **_delivery_figures(h, job, ids),
        "suspects": suspects,
        "engine_call_s": delay_s,
        "limit_s": limit_s,
        "attempts": attempts,
        "worker_alive": proc.poll() is None,
    }


def webhook_sender_dies(h: Harness) -> dict[str, Any]:
    """A worker takes a job's webhook and dies mid-delivery; another worker delivers it once
    the lease lapses. Then a stopping worker gives back an event between attempts."""
    receiver = HookReceiver(stall=1, stall_s=30)
    hooks = {
        "VLMQ_WEBHOOKS__SECRET": "s3cret",
        "VLMQ_WEBHOOKS__ALLOW_PRIVATE_ADDRESSES": "true",
        "VLMQ_WEBHOOKS__LEASE_S": "3",
        "VLMQ_WEBHOOKS__TIMEOUT_S": "20",
    }
    try:
        conversation = [{"role": "user", "content": "x"}]
        h.client.submit_many([conversation], job_id="hooked", webhook_url=receiver.url)
        dying = h.noop_worker("dying", 0.05, **hooks)
        wait_until(lambda: receiver.requests_seen >= 1, timeout=60, what="the first attempt")
        h.kill(dying)
        dying.wait(10)
        killed_at = time.monotonic()
        h.noop_worker("next", 0.05, **hooks)
        wait_until(lambda: receiver.received, timeout=60, what="delivery by the next worker")
        redelivered_after = time.monotonic() - killed_at

        def events_left() -> int:
            return h.client.redis.llen(Keys().events()) + h.client.redis.zcard(
                Keys().events_leased()
            )

        # The receiver has the request before the sender has its answer: the sender records
        # the outcome, then lets the event go. Read both once it has (or the deadline passed).
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: events_left() == 0, timeout=30, what="the event let go")
        return {
            "attempts_seen": receiver.requests_seen,
            "delivered": len(receiver.received),
            "webhook_status": h.client.redis.hget(Keys().job("hooked"), "webhook_status"),
            "redelivered_after_s": round(redelivered_after, 2),
            "events_left": events_left(),
        }
    finally:
        receiver.close()


def heartbeat_error(h: Harness, tasks: int = 8) -> dict[str, Any]:
    """The renewal thread hits an unexpected error: the worker exits (it does not go on
    without renewing), and its batch is redelivered to another worker."""
    job, ids = h.submit_text(tasks)
    broken = h.noop_worker("broken-heart", 8.0, **Faults(heartbeat_error_at=2).env(), **_LEASED)
    code = broken.wait(60)
    h.noop_worker("healthy", 0.05, **_LEASED)
    h.wait_job(job, timeout=120)
    return {**_delivery_figures(h, job, ids), "exit_code": code}
