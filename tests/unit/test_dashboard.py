"""The Grafana dashboard asks only for metrics the stack exports.

Every panel's PromQL is parsed for metric names, and each must be a series the worker or the
API serves: read from their registries (the worker's WorkerMetrics and its process-wide
registry, the API's Metrics), with the suffixes Prometheus gives counters (_total) and
histograms (_bucket, _sum, _count); or one of the few redis_exporter series the Redis row
reads (REDIS_EXPORTER).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "vlmq.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"

# Series Prometheus itself writes for every target.
PROMETHEUS_OWN = {"up"}
# What the compose stack's redis_exporter (docker-compose.yml, redis-exporter) serves and the
# Redis row reads: not vlmq's to register, so named here, as the exporter maps INFO's fields
# (used_cpu_user_main_thread, used_cpu_sys_main_thread, used_memory, maxmemory).
REDIS_EXPORTER = {
    "redis_cpu_user_main_thread_seconds_total",
    "redis_cpu_sys_main_thread_seconds_total",
    "redis_memory_used_bytes",
    "redis_memory_max_bytes",
}
# What the issue asks the dashboard to show, by the series that show it.
REQUIRED = {
    "vlmq_queue_lane_depth",  # queue depth per class and lane
    "vlmq_stage_seconds_bucket",  # queue age (queue_wait) and stage latency
    "vlmq_model_busy_ratio",
    "vlmq_stage_busy_seconds_total",
    "vlmq_tasks_total",  # requests/s per modality and tenant
    "vlmq_prompt_tokens_total",
    "vlmq_generated_tokens_total",
    "vlmq_padding_ratio_sum",
    "vlmq_failures_total",  # errors by code
    "vlmq_dead_letters_total",
    "vlmq_model_seconds_total",  # per-tenant usage
    "vlmq_prepare_backlog",
    "vlmq_media_loads_total",
    "vlmq_gpu_seconds_total",  # cost per result (issue 39)
    "vlmq_cost_total",
    "redis_cpu_user_main_thread_seconds_total",  # the fleet's ceiling: one Redis core
    "redis_memory_used_bytes",
}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def series_names(registry: CollectorRegistry) -> set[str]:
    """The series a registry serves, whether or not a labelled metric has children yet."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names


@cache
def exported() -> frozenset[str]:
    # What a worker process registers (importing its service, as `vlmq worker` does) plus its
    # WorkerMetrics; what the API's app serves.
    import vlmq.workers.fleet.service  # noqa: F401
    from vlmq.producers.api.metrics import Metrics
    from vlmq.workers.fleet.metrics import WorkerMetrics

    worker = CollectorRegistry()
    WorkerMetrics(worker)
    return frozenset(
        series_names(worker) | series_names(REGISTRY) | series_names(Metrics().registry)
    )


_NOT_NAMES = [
    r'"(?:[^"\\]|\\.)*"',  # strings
    r"\{[^}]*\}",  # label matchers
    r"\[[^\]]*\]",  # ranges
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",  # label lists
    r"\$\w+",  # Grafana's variables
]
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and"}
_KEYWORDS |= {"or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers that are not functions,
    keywords, labels or durations)."""
    for pattern in _NOT_NAMES:
        expr = re.sub(pattern, " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if match.group(2) is None and match.group(1).lower() not in _KEYWORDS:
            names.add(match.group(1))
    return names


@cache
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(items: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard()["panels"] if items is None else items:
        yield panel
        yield from panels(panel.get("panels") or [])


def queries() -> Iterator[tuple[str, str]]:
    for panel in panels():
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_metric_names_are_read_from_promql():
    expr = (
        "histogram_quantile(0.95, sum by (le, modality) (rate(vlmq_stage_seconds_bucket{stage="
        '"queue_wait", x=~"a(b)"}[$__rate_interval]))) / on (modality) group_left '
        "sum without (instance) (up offset 5m) + 1e3 * vlmq_queue_depth > bool 2"
    )
    assert metric_names(expr) == {"vlmq_stage_seconds_bucket", "up", "vlmq_queue_depth"}


def test_every_query_names_a_metric_the_worker_or_the_api_exports():
    used = {(title, name) for title, expr in queries() for name in metric_names(expr)}
    assert used, "no queries found"
    known = exported() | PROMETHEUS_OWN | REDIS_EXPORTER
    unknown = sorted(f"{name} ({title})" for title, name in used if name not in known)
    assert not unknown, f"not exported by vlmq or the stack's redis_exporter: {unknown}"


def test_the_dashboard_shows_what_operators_need():
    used = {name for _, expr in queries() for name in metric_names(expr)}
    assert not REQUIRED - used, f"no panel shows {sorted(REQUIRED - used)}"
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert {"Prepare tier", "Per-tenant usage", "Redis"} <= set(rows)


def test_every_panel_reads_the_provisioned_datasource_and_fits_the_grid():
    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    uids = {s["uid"] for s in sources if s["type"] == "prometheus"}
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    for panel in panels():
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert {t["datasource"]["uid"] for t in panel["targets"]} <= uids, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


@pytest.mark.parametrize(
    "name", ["vlmq_queue_depth", "vlmq_tasks_total", "vlmq_api_requests_total"]
)
def test_the_registries_are_read(name):
    assert name in exported()
