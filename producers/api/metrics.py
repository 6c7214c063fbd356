"""Per-route request counts and latencies, served at /metrics in Prometheus
text format (``vlmq_api_requests_total``, ``vlmq_api_request_seconds``), and as
a JSON snapshot for humans (``/metrics?format=json``).

Routes are recorded by their template (``/v1/tasks/{task_id}``), never by the
raw path, so the table stays small whatever ids clients send.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Metrics", "MetricsMiddleware"]


@dataclass
class _RouteStats:
    count: int = 0
    errors: int = 0  # 5xx answers
    rejected: int = 0  # 4xx answers
    total_s: float = 0.0
    max_s: float = 0.0


class Metrics:
    def __init__(self) -> None:
        self._routes: dict[str, _RouteStats] = {}
        self._lock = threading.Lock()
        # One registry per app: tests create many apps in one process.
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "vlmq_api_requests",
            "HTTP requests answered",
            ["route", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "vlmq_api_request_seconds", "HTTP request latency", ["route"], registry=self.registry
        )

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, route: str, status: int, elapsed_s: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._latency.labels(route).observe(elapsed_s)
        with self._lock:
            stats = self._routes.setdefault(route, _RouteStats())
            stats.count += 1
            stats.errors += status >= 500
            stats.rejected += 400 <= status < 500
            stats.total_s += elapsed_s
            stats.max_s = max(stats.max_s, elapsed_s)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {
                route: {
                    "count": s.count,
                    "errors": s.errors,
                    "rejected": s.rejected,
                    "mean_s": round(s.total_s / s.count, 6) if s.count else 0.0,
                    "max_s": round(s.max_s, 6),
                }
                for route, s in sorted(self._routes.items())
            }


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.record(_route_of(scope), status, time.perf_counter() - started)


def _route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return f"{scope['method']} {path}" if path else f"{scope['method']} (unmatched)"
