"""Preemption drain with real worker processes (``workers/fleet/drain.py``): a worker holding
a batch inside a long engine call gets SIGTERM; it hands the batch back at once and another
worker runs it, every task exactly once. (The figures, ten drills of each kind against a
SIGKILL without drain: bench/drain.py, docs/reliability.md.)"""

from __future__ import annotations

from tests.support.faults.drain import Standby, drill
from tests.support.faults.harness import Harness


def test_sigterm_hands_a_running_batch_to_an_idle_worker_at_once(harness: Harness) -> None:
    standby = Standby(harness)
    # A 30 s lease: the batch coming back by lease and reap would take over 30 s, so B
    # starting all of it within the drill's deadline is the hand-back's doing.
    figures = drill(
        harness, standby, 1, mode="term", tasks=8, engine_s=60, lease_s=30, timeout_s=20
    )
    assert figures.to_last_start_s is not None, figures
    assert figures.to_last_start_s < 15, figures  # far under the 30 s lease
    assert figures.lost == 0 and figures.run_twice == 0, figures
    # Handed back, not died: the attempt A made is taken back, so B's is the only one.
    assert figures.attempts == {"1": 8}, figures
    assert figures.a_exit == 0, figures  # A drained and exited by itself, before the SIGKILL
