"""Issue 38: starved workers are not dead workers. Two real ``vlmq worker`` processes take one
valid request in turns, each frozen (SIGSTOP: a starved host) while its engine runs, so each
run's lease lapses and the task goes to the other. ``max_deliveries`` is 2, so on the old code
the third delivery dead-lettered the request as "its worker died each time", though no worker
died. Now a worker whose late settle is refused says its run was outlived, and the verdict
counts deaths only."""

from __future__ import annotations

import signal
import subprocess

from tests.support.faults.harness import Harness
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.config.status import TERMINAL

TERMINAL_STATES = {s.value for s in TERMINAL}

# Engine time per batch (the noop engine's delay) against the lease: a frozen run outlives it.
LEASE_S = 3
ENGINE_S = 5


def _running_on(h: Harness, task: str, worker: str) -> bool:
    return h.running_on([task], worker) == [task]


def _ended(h: Harness, task: str) -> bool:
    return h.statuses([task])[0].get("state") in TERMINAL_STATES


def _freeze_once_running(h: Harness, proc: subprocess.Popen[bytes], task: str, name: str) -> None:
    wait_until(lambda: _running_on(h, task, name), timeout=60, what=f"{task} running on {name}")
    proc.send_signal(signal.SIGSTOP)


def test_runs_outlived_by_starved_workers_do_not_dead_letter_a_valid_request(
    harness: Harness,
) -> None:
    h = harness
    env = {"VLMQ_FLEET__LEASE_S": str(LEASE_S), "VLMQ_FLEET__MAX_DELIVERIES": "2"}
    a = h.noop_worker("a", ENGINE_S, **env)
    b = h.noop_worker("b", ENGINE_S, **env)
    h.wait_registered("a")
    h.wait_registered("b")
    b.send_signal(signal.SIGSTOP)  # A takes the task first
    # A task of its own (not in a job, whose tasks fold their hashes away when they end).
    task = h.client.submit([{"role": "user", "content": "starved"}])
    try:
        _freeze_once_running(h, a, task, "a")  # run 1: A starved inside its engine call
        b.send_signal(signal.SIGCONT)
        _freeze_once_running(h, b, task, "b")  # run 2: A's lease lapsed; B starved too
        a.send_signal(signal.SIGCONT)
        # A's engine call ends and its settle is refused (B's delivery has the task): A says
        # the run was outlived. Run 3 follows once B's lease lapses; it finishes.
        wait_until(lambda: _ended(h, task), timeout=90, what=f"{task} ended")
    finally:
        b.send_signal(signal.SIGCONT)
    (final,) = h.statuses([task])
    assert final["state"] == "succeeded", final
    assert int(final.get("attempts") or 0) >= 3 and final.get("outlived") == "1", final
    assert h.client.redis.llen(Keys().dead_letters()) == 0
    assert a.poll() is None and b.poll() is None  # nobody died
