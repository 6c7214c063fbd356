"""The preemption drill, with real ``vlmq worker`` processes (``workers/fleet/drain.py``).

Worker A holds a batch whose engine time is long (the noop engine's per-batch delay); worker
B, beside it, is idle (stopped with SIGSTOP while A pulls, so A takes the whole batch, and
woken before the signal). A gets SIGTERM and, as a spot node does, SIGKILL some seconds later
if it still lives; or SIGKILL alone (no drain: its work comes back by lease and reap). The
figure is the time from the signal to the last of A's tasks starting on B, on Redis's clock
(the start's ``started_at`` stamp against ``TIME`` read just before the signal). Used by the
faults tier (one drill) and ``bench/drain.py`` (ten of each kind, docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import re
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.support.faults.harness import Harness, batch_policy
from tests.support.services import wait_until

__all__ = ["Drill", "Standby", "drill"]

_SUCCEEDED = re.compile(r"task (\S+) succeeded")


@dataclass
class Drill:
    """One drill's figures."""

    mode: str  # "term" (SIGTERM, SIGKILL later) or "kill" (SIGKILL only)
    tasks: int
    to_last_start_s: float | None  # signal -> the last task started on B (None: not all did)
    lost: int  # tasks that did not succeed
    run_twice: int  # tasks whose success two workers settled
    attempts: dict[str, int] = field(default_factory=dict)  # final attempts -> tasks
    a_exit: int | None = None  # A's exit code (-9: the SIGKILL)
    a_exited_s: float | None = None  # signal -> A gone


class Standby:
    """Worker B: idle, kept across drills; paused while A pulls."""

    def __init__(self, harness: Harness, name: str = "standby", **env: str) -> None:
        self.harness = harness
        self.name = name
        self.proc = harness.noop_worker(name, delay_s=0.05, **env)
        harness.wait_registered(name)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Wake it, and wait until it is idle again as a standby is (its heartbeat ran after
        the wake twice: a process just woken from SIGSTOP takes about a second to poll
        again, which is the drill's doing, not the drain's)."""
        woken = _redis_now(self.harness)
        self.proc.send_signal(signal.SIGCONT)
        records = self.harness.client.state.workers

        def beat_since() -> bool:
            record = records.all().get(self.name) or {}
            return float(record.get("at") or 0) > woken + 1.0

        wait_until(beat_since, timeout=30, what=f"{self.name} awake")


def _redis_now(harness: Harness) -> float:
    seconds, micros = harness.client.redis.time()
    return float(seconds) + micros / 1e6


def _succeeded_by_log(harness: Harness, procs: list[subprocess.Popen[bytes]]) -> Counter[str]:
    """Task id -> how many workers' logs report its success."""
    seen: Counter[str] = Counter()
    for proc in procs:
        text = harness.logs[proc.pid].read_text(errors="replace")
        seen.update(set(_SUCCEEDED.findall(text)))
    return seen


def drill(
    harness: Harness,
    standby: Standby,
    number: int,
    mode: str = "term",
    tasks: int = 8,
    engine_s: float = 60.0,
    kill_after_s: float = 10.0,
    lease_s: float = 3.0,
    window_s: float = 25.0,
    timeout_s: float = 60.0,
) -> Drill:
    """One drill: A (named ``holder-<number>``) holds ``tasks`` tasks inside a ``engine_s``
    engine call; the signal; B takes them."""
    client = harness.client
    name = f"holder-{number}"
    a = harness.noop_worker(
        name,
        delay_s=engine_s,
        VLMQ_FLEET__LEASE_S=str(lease_s),
        VLMQ_DRAIN__WINDOW_S=str(window_s),
        # A gathers for up to 2 s after its first task: the drill's tasks, submitted one by
        # one, make one batch.
        VLMQ_BATCH=batch_policy(16, wait_s=2.0),
    )
    harness.wait_registered(name)
    standby.pause()
    try:
        ids = [
            client.submit([{"role": "user", "content": f"drill {number} task {i}"}])
            for i in range(tasks)
        ]
        wait_until(
            lambda: len(harness.running_on(ids, name)) == tasks,
            timeout=timeout_s,
            what=f"{name} running all {tasks}",
        )
    finally:
        standby.resume()
    signalled = _redis_now(harness)
    began = time.monotonic()
    a.send_signal(signal.SIGTERM if mode == "term" else signal.SIGKILL)
    killer = threading.Timer(kill_after_s, _kill_if_alive, (a,))
    killer.start()
    gone: list[float] = []
    threading.Thread(target=_note_exit, args=(a, gone), daemon=True).start()
    try:
        outcome = _outcome(harness, standby, a, ids, mode, signalled, timeout_s)
        outcome.a_exited_s = gone[0] - began if gone else None
        return outcome
    finally:
        killer.cancel()
        if a.poll() is None:
            a.kill()
        a.wait(10)


def _kill_if_alive(proc: subprocess.Popen[bytes]) -> None:
    """The spot node's SIGKILL, for a worker still there."""
    if proc.poll() is None:
        proc.kill()


def _note_exit(proc: subprocess.Popen[bytes], gone: list[float]) -> None:
    proc.wait()
    gone.append(time.monotonic())


def _outcome(
    harness: Harness,
    standby: Standby,
    a: subprocess.Popen[bytes],
    ids: list[str],
    mode: str,
    signalled: float,
    timeout_s: float,
) -> Drill:
    tasks = harness.client.state.tasks
    fields = ("state", "worker", "started_at", "attempts")

    def started_on_b() -> bool:
        rows = tasks.many(ids, fields)
        return all(r.get("worker") == standby.name and r.get("started_at") for r in rows)

    def all_ended() -> bool:
        return all(r.get("state") in ("succeeded", "failed") for r in tasks.many(ids, fields))

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not started_on_b():
        time.sleep(0.02)
    rows = tasks.many(ids, fields)
    last_start = None
    if all(r.get("worker") == standby.name and r.get("started_at") for r in rows):
        last_start = max(float(r["started_at"]) for r in rows) - signalled
    while time.monotonic() < deadline and not all_ended():
        time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        a.wait(max(0.1, deadline - time.monotonic()))
    rows = tasks.many(ids, fields)
    seen = _succeeded_by_log(harness, [a, standby.proc])
    return Drill(
        mode=mode,
        tasks=len(ids),
        to_last_start_s=last_start,
        lost=sum(1 for r in rows if r.get("state") != "succeeded"),
        run_twice=sum(1 for task in ids if seen[task] > 1),
        attempts=dict(Counter(str(r.get("attempts")) for r in rows)),
        a_exit=a.poll(),
    )


def figures(drills: list[Drill]) -> dict[str, Any]:
    """Median and range of the drills' times, and their totals."""
    times = sorted(d.to_last_start_s for d in drills if d.to_last_start_s is not None)
    return {
        "drills": len(drills),
        "median_s": statistics.median(times) if times else None,
        "min_s": times[0] if times else None,
        "max_s": times[-1] if times else None,
        "lost": sum(d.lost for d in drills),
        "run_twice": sum(d.run_twice for d in drills),
        "incomplete": sum(1 for d in drills if d.to_last_start_s is None),
    }
