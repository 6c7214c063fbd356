"""Fault scenarios of the pipelined worker: it is stopped (SIGTERM) or killed (SIGKILL) while
it generates one batch and holds more, pulled and prepared ahead.

Prefetched work is leased but never started, so a graceful stop gives it straight back (no
lease to wait out) and neither a stop nor a kill counts it as an attempt: only the batch
that was running can run twice. Each scenario runs real ``vlmq worker`` processes; sizes are
arguments, so CI runs them small (``bench/faults.py`` writes the full figures).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from tests.support.faults.harness import Harness, batch_policy
from tests.support.faults.scenarios import _delivery_figures
from tests.support.services import wait_until
from vlmq.config.keys import Keys

__all__ = ["stopped_with_prefetched_work"]


def _held(h: Harness) -> int:
    return int(h.client.redis.zcard(Keys().leases()))


def _attempts(h: Harness, ids: list[str]) -> list[int]:
    rows = h.client.state.tasks.many(ids, ("attempts",))
    return [int(r.get("attempts") or 0) for r in rows]


def stopped_with_prefetched_work(
    h: Harness,
    sig: int,
    tasks: int = 24,
    batch: int = 4,
    prefetch_batches: int = 3,
    delay_s: float = 3.0,
    lease_s: float = 4.0,
) -> dict[str, Any]:
    """One slow pipelined worker holds a running batch and prefetched ones; ``sig`` reaches
    it; a second worker then finishes the job."""
    env = {
        "VLMQ_BATCH": batch_policy(batch),
        "VLMQ_WORKER__PREFETCH_BATCHES": str(prefetch_batches),
        "VLMQ_FLEET__LEASE_S": str(lease_s),
        "VLMQ_FLEET__REAP_INTERVAL_S": "0.5",
    }
    job, ids = h.submit_text(tasks)
    victim = h.noop_worker("victim", delay_s, **env)
    # Until its prefetch is full the victim's puller pulls again at once, so a count taken
    # earlier could be one batch short by the time the signal lands; full, it pulls nothing
    # more until the running batch ends (``delay_s``).
    full = batch * prefetch_batches
    wait_until(
        lambda: len(h.running_on(ids, "victim")) == batch and _held(h) == full,
        timeout=120,
        what="a batch running and the prefetch full",
    )
    running = h.running_on(ids, "victim")
    held = _held(h)
    signalled = time.monotonic()
    h.kill(victim, sig)
    code = victim.wait(60)
    exited_s = time.monotonic() - signalled
    # Before anyone else runs: what the victim left behind.
    counts = h.client.status(job)["counts"]
    leases_left = _held(h)
    attempts = dict(zip(ids, _attempts(h, ids), strict=True))
    prefetched_attempts = sum(attempts[i] for i in ids if i not in running)
    h.noop_worker("rescuer", 0.05, **env)
    h.wait_job(job)
    return {
        **_delivery_figures(h, job, ids),
        "signal": signal.Signals(sig).name,
        "exit_code": code,
        "exited_s": round(exited_s, 2),
        "running_at_signal": len(running),
        "prefetched_at_signal": held - len(running),
        "finished_before_exit": counts["succeeded"],
        "leases_left_at_exit": leases_left,
        # Attempts counted on tasks that were only prefetched when the signal came: 0.
        "prefetched_attempts": prefetched_attempts,
        "running_finished_by_victim": sum(
            s.get("worker") == "victim" for s in h.client.state.tasks.many(running, ("worker",))
        ),
    }
