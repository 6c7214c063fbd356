"""Worker metrics and structured logs, from a real loop on real Redis."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from tests.integration.test_fleet_loop import RecordingEngine, Running, _conversation, make_loop
from tests.support.services import wait_until
from vlmq.config.logs import JsonFormatter, configure_logging, log_context
from vlmq.config.settings import BatchPolicy
from vlmq.producers.client import Client
from vlmq.workers.fleet.metrics import WorkerMetrics


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_worker_metrics_follow_a_job(settings):
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(12)])
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    policies = {
        m: BatchPolicy(max_batch_size=8, max_wait_s=0.01, token_budget=10**6)
        for m in ("text", "image", "video")
    }
    loop = make_loop(
        settings.model_copy(update={"batch": policies}), RecordingEngine(), ("text",), [metrics]
    )
    with Running(loop):
        wait_until(lambda: client.status(job)["finished"], what="job")
        loop.heartbeat()
    text = generate_latest(registry).decode()
    assert _value(text, "vlmq_tasks_total", modality="text", status="succeeded") == 12
    assert _value(text, "vlmq_batch_size_count", modality="text") >= 2
    assert _value(text, "vlmq_batch_fill_sum", modality="text") > 0
    assert _value(text, "vlmq_stage_seconds_count", stage="queue_wait", modality="text") == 12
    assert _value(text, "vlmq_stage_seconds_count", stage="upload", modality="text") == 12
    assert _value(text, "vlmq_queue_depth", modality="text") == 0
    assert _value(text, "vlmq_queue_lane_depth", modality="text", lane="interactive") == 0
    assert _value(text, "vlmq_queue_lane_depth", modality="text", lane="bulk") == 0
    # The pipeline's view: stages busy, the model's share of the wall, hand-off depths.
    assert _value(text, "vlmq_stage_busy_seconds_total", stage="generate") > 0
    assert _value(text, "vlmq_stage_busy_seconds_total", stage="prepare") >= 0
    assert 0 <= _value(text, "vlmq_model_busy_ratio") <= 1
    assert _value(text, "vlmq_pipeline_depth", handoff="ready") >= 0


def test_media_cache_counters_are_exported_as_increases():
    from vlmq.workers.engine.engine import EngineStats
    from vlmq.workers.media.cache import CacheStats

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    stats = EngineStats(cache=CacheStats(hits=3, misses=2, evictions=1, bytes=4096))
    metrics.heartbeat({}, stats)
    stats.cache.hits, stats.cache.bytes = 7, 1024
    metrics.heartbeat({}, stats)
    text = generate_latest(registry).decode()
    assert _value(text, "vlmq_media_cache_lookups_total", outcome="hit") == 7
    assert _value(text, "vlmq_media_cache_lookups_total", outcome="miss") == 2
    assert _value(text, "vlmq_media_cache_evictions_total") == 1
    assert _value(text, "vlmq_media_cache_bytes") == 1024


def test_json_logs_carry_task_job_batch_and_worker(capsys):
    configure_logging("info", "json")
    log = logging.getLogger("vlmq.test")
    with log_context(worker="w1", batch_id="b1"), log_context(task_id="t1", job_id="j1"):
        log.info("task done")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["message"] == "task done" and line["level"] == "info"
    assert (line["task_id"], line["job_id"], line["batch_id"], line["worker"]) == (
        "t1",
        "j1",
        "b1",
        "w1",
    )
    assert isinstance(JsonFormatter(), logging.Formatter)
    logging.getLogger().handlers.clear()


def test_task_events_reach_a_celery_event_receiver(settings):
    import threading

    from celery import Celery

    from vlmq.workers.fleet.events import TaskEvents

    app = Celery(broker=settings.redis_url, set_as_current=False)
    app.conf.update(accept_content=["json"])
    captured: list[dict] = []
    stop = threading.Event()

    def listen() -> None:
        with app.connection() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": captured.append})
            for _ in receiver.itercapture(limit=None, timeout=1, wakeup=False):
                if stop.is_set():
                    return

    thread = threading.Thread(target=lambda: _quietly(listen), daemon=True)
    thread.start()
    events = TaskEvents(settings.redis_url, "events-test")
    # Pub/sub drops what is sent before the receiver subscribes: probe until heard.
    wait_until(
        lambda: _probe(events) or any(e.get("uuid") == "probe" for e in captured),
        timeout=20,
        interval=0.2,
        what="the receiver to subscribe",
    )
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(3)])
    policies = {
        m: BatchPolicy(max_batch_size=8, max_wait_s=0.01, token_budget=10**6)
        for m in ("text", "image", "video")
    }
    loop = make_loop(
        settings.model_copy(update={"batch": policies}), RecordingEngine(), ("text",), [events]
    )
    with Running(loop):
        wait_until(lambda: client.status(job)["finished"], what="job")
    ids = set(client.job_task_ids(job))
    wait_until(
        lambda: {e["uuid"] for e in captured if e["type"] == "task-succeeded"} >= ids,
        what="succeeded events",
    )
    stop.set()
    kinds = {(e["type"], e["uuid"]) for e in captured if e.get("uuid") in ids}
    for task_id in ids:
        assert {
            ("task-received", task_id),
            ("task-started", task_id),
            ("task-succeeded", task_id),
        } <= kinds
    received = next(e for e in captured if e["type"] == "task-received" and e["uuid"] in ids)
    assert received["name"] == "vlmq.generate" and received["hostname"] == "events-test"


def _probe(events: Any) -> bool:
    events.started(["probe"])
    return False


def _quietly(target: Any) -> None:
    # The receiver's socket closes with the test's Redis.
    with contextlib.suppress(Exception):
        target()
