"""The worker core under the faults a fleet meets every week, with real worker processes
(CI sizes; the full figures come from bench/faults.py into docs/reliability.md)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.faults import worker_core
from tests.support.faults.harness import Harness, faketime_library


def _all_done_once(figures: dict[str, Any], tasks: int) -> None:
    assert figures["succeeded"] == figures["terminal"] == tasks
    assert figures["lost"] == 0 and figures["disagreeing"] == 0


@pytest.mark.skipif(faketime_library() is None, reason="libfaketime: apt-get install faketime")
def test_leases_follow_redis_clock_under_skew(harness: Harness) -> None:
    figures = worker_core.clock_skew(harness, tasks=200, skew_s=20, lease_s=6)
    _all_done_once(figures, 200)
    assert figures["orphan_objects"] == 0
    # Nothing was taken from a live worker: only what the killed one held came back, and a
    # worker 20 s behind still recovered it within lease + reap (+ a batch).
    assert figures["redelivered"] <= figures["held_by_the_killed_worker"]
    assert figures["recovery_s"] < 6 + 0.5 + 5
    assert {"ahead", "behind"} <= set(figures["by_worker"])


@pytest.mark.skipif(faketime_library() is None, reason="libfaketime: apt-get install faketime")
def test_a_worker_whose_renewals_stall_stops_pulling(harness: Harness) -> None:
    """Issue 38: a worker 20 s ahead with its monotonic clock shifted renews nothing (its
    heartbeat's timed wait never returns); it sees the stall on Redis's clock and stops
    pulling, so nothing it pulled lapses and runs again. The full drill (60 tasks):
    ``python -m bench.faults --suite core``."""
    # Batches of 2 s against 3 s leases: on b0b2365 the stalled worker's prefetched batch
    # lapsed and ran twice (4 of 16).
    figures = worker_core.renewal_stall(harness, tasks=16, lease_s=3, delay_s=2.0)
    _all_done_once(figures, 16)
    assert figures["duplicate_executions"] == 0, figures
    assert figures["delivered_twice"] == 0, figures


def test_a_holder_cut_off_past_its_lease_is_fenced_out(harness: Harness) -> None:
    figures = worker_core.cut_off_holder(harness, tasks=16)
    _all_done_once(figures, 16)
    assert figures["taken_over"] == 16  # every status and object name the rescuer
    assert figures["orphan_objects"] == 0  # the cut-off worker removed its own late objects
    assert figures["cut_off_worker_alive"]


def test_two_copies_in_two_queues_run_once(harness: Harness) -> None:
    figures = worker_core.duplicates_in_two_queues(harness)
    assert figures["executions"] == 1 and figures["deliveries"] == 1
    assert figures["result_objects"] == 1 and figures["state"] == "succeeded"
    assert figures["workers_alive"]


def test_malformed_messages_fail_alone_and_the_worker_stays(harness: Harness) -> None:
    figures = worker_core.malformed_messages(harness, valid=6)
    assert figures["worker_pid_unchanged"]
    assert figures["valid_succeeded"] == 6
    assert set(figures["codes"].values()) == {"invalid_request"}, figures["codes"]
    assert figures["with_result_object"] == figures["malformed"]


def test_a_full_redis_is_waited_out_and_drained(harness: Harness) -> None:
    figures = worker_core.redis_full(harness, tasks=300, full_s=4)
    _all_done_once(figures, 300)
    assert figures["worker_alive_while_full"] and figures["worker_alive_after"]


def test_a_read_only_redis_is_retried_not_fatal(harness: Harness) -> None:
    figures = worker_core.redis_read_only(harness, tasks=120, read_only_s=3)
    _all_done_once(figures, 120)
    assert figures["worker_alive_while_read_only"] and figures["worker_alive_after"]


def test_a_settle_failure_releases_its_batch_for_redelivery(harness: Harness) -> None:
    figures = worker_core.settle_errors(harness, tasks=16)
    _all_done_once(figures, 16)
    assert figures["redelivered"] >= 1 and figures["worker_alive"]
    assert figures["finished_after_s"] < 60


def test_the_time_limit_is_per_engine_call(harness: Harness) -> None:
    figures = worker_core.time_limit_per_engine_call(harness, suspects=4, delay_s=1, limit_s=2.5)
    _all_done_once(figures, 4)
    assert figures["worker_alive"]
    assert figures["attempts"] == [2, 2, 2, 2]  # each ran once more, alone


def test_a_webhook_taken_by_a_dying_sender_is_delivered_by_another(harness: Harness) -> None:
    figures = worker_core.webhook_sender_dies(harness)
    assert figures["delivered"] == 1 and figures["webhook_status"] == "204"
    assert figures["attempts_seen"] == 2 and figures["events_left"] == 0


def test_a_heartbeat_error_exits_and_the_batch_is_redelivered(harness: Harness) -> None:
    figures = worker_core.heartbeat_error(harness, tasks=8)
    assert figures["exit_code"] == 70
    _all_done_once(figures, 8)


def test_sigterm_hands_back_the_running_batch_and_prefetched_work_straight_away(
    harness: Harness,
) -> None:
    """The victim's first batch is running (its engine time not known yet, so not expected to
    fit the drain window: workers/fleet/drain.py) and more is prefetched: all of it goes back
    at once, the running batch's attempts taken back; the rescuer runs everything once."""
    import signal

    from tests.support.faults import pipeline

    figures = pipeline.stopped_with_prefetched_work(harness, signal.SIGTERM)
    _all_done_once(figures, 24)
    assert figures["exit_code"] == 0 and figures["prefetched_at_signal"] > 0
    assert figures["finished_before_exit"] == 0  # nothing waited for
    assert figures["running_finished_by_victim"] == 0
    assert figures["leases_left_at_exit"] == 0  # handed back, not left to lapse
    assert figures["prefetched_attempts"] == 0
    assert figures["duplicate_executions"] == 0


def test_sigkill_with_prefetched_work_reruns_only_the_running_batch(harness: Harness) -> None:
    import signal

    from tests.support.faults import pipeline

    figures = pipeline.stopped_with_prefetched_work(harness, signal.SIGKILL)
    _all_done_once(figures, 24)
    assert figures["prefetched_at_signal"] > 0
    assert (
        figures["leases_left_at_exit"]
        == figures["running_at_signal"] + figures["prefetched_at_signal"]
    )
    assert figures["prefetched_attempts"] == 0  # prefetched work was never counted as run
    assert figures["duplicate_executions"] == figures["running_at_signal"]
