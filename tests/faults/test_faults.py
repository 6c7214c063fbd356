"""The fault suite at CI size (the full figures come from bench/faults.py)."""

from __future__ import annotations

import pytest

from tests.support.faults import scenarios


@pytest.fixture(scope="module")
def tiny_model(checkpoint):
    return str(checkpoint("qwen2_5_vl"))


def _no_loss(figures, tasks):
    assert figures["terminal"] == tasks
    assert figures["succeeded"] == tasks
    assert figures["result_objects"] == tasks
    assert figures["lost"] == 0 and figures["disagreeing"] == 0
    assert figures["orphan_objects"] == 0


def test_kill_storm(harness):
    figures = scenarios.kill_storm(harness, tasks=240, kills=2)
    _no_loss(figures, 240)
    assert figures["job_counts"]["succeeded"] == 240
    assert figures["longest_recovery_s"] < 30  # lease 3 s + reap 0.5 s + restart


def test_redis_restart_with_aof(harness):
    figures = scenarios.redis_restart(harness, tasks=200)
    _no_loss(figures, 200)
    assert figures["consuming_again_after_s"] < 10


def test_s3_outage(harness):
    figures = scenarios.s3_outage(harness, tasks=150, outage_s=6)
    _no_loss(figures, 150)
    assert figures["succeeded_without_object"] == 0


def test_poison_request_in_a_batch_of_16(harness, tiny_model):
    figures = scenarios.poison_in_batch(harness, tiny_model, batch=16)
    assert (figures["succeeded"], figures["failed"]) == (15, 1)
    assert figures["failed_codes"] == ["generation_failed"]
    assert figures["bisections"] >= 4  # 16 → 8 → 4 → 2 → 1


def test_request_that_kills_its_worker(harness):
    figures = scenarios.crash_request(harness, tasks=6)
    assert figures["worker_deaths"] == 3
    assert figures["succeeded"] == 5 and figures["dead_lettered"] == 1


def test_oom_halving(harness, tiny_model):
    figures = scenarios.oom_halving(harness, tiny_model, batch=16, limit=4)
    assert figures["succeeded"] == 16
    assert figures["largest_micro_batch"] <= 4 and figures["oom_splits"] >= 2


def test_sigterm_mid_batch(harness):
    figures = scenarios.sigterm_mid_batch(harness, tasks=64)
    assert figures["exit_code"] == 0
    assert figures["left_running"] == 0 and figures["dropped"] == 0
    _no_loss(figures, 64)


def test_double_publish(harness):
    figures = scenarios.double_publish(harness)
    assert figures == {
        "published": 3,
        "result_objects": 1,
        "refused": 1,
        "state": "succeeded",
        "executions": 1,
    }
