"""Shared pieces of the API tests (no tests here): settings against the real
Redis and moto S3 fixtures, an echo engine, a worker loop in a thread, and a
uvicorn server on a free loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.integration.test_fleet_loop import make_loop
from tests.support.services import free_port, wait_until
from vlmq.config.schemas import FinishReason, Result, Usage
from vlmq.config.settings import ApiSettings, BatchPolicy, Settings

__all__ = ["EchoEngine", "api_settings", "serving", "uvicorn_server", "worker_loop"]

FAIL_MARKER = "PLEASE-FAIL"


class EchoEngine:
    """Answers ``echo:<custom_id>``; a request whose text holds FAIL_MARKER fails alone."""

    model_name = "echo"

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(
        self, requests: Any, worker: str | None = None, token_budget: int | None = None
    ) -> list[Result]:
        self.ran += [r.id for r in requests]
        return [self._answer(r, len(requests), worker) for r in requests]

    def _answer(self, request: Any, size: int, worker: str | None) -> Result:
        text = " ".join(getattr(p, "text", "") for m in request.messages for p in m.content)
        common = {
            "id": request.id,
            "custom_id": request.custom_id,
            "job_id": request.job_id,
            "model": "echo",
            "modality": request.modality,
            "batch_size": size,
            "worker": worker,
        }
        if FAIL_MARKER in text:
            error = {"code": "generation_failed", "message": "generation failed"}
            return Result(status="failed", error=error, **common)
        return Result(
            status="succeeded",
            output=f"echo:{request.custom_id}",
            finish_reason=FinishReason.STOP,
            usage=Usage(prompt_tokens=3, completion_tokens=2),
            **common,
        )


def api_settings(redis_server: Any, moto_server: Any, name: str, **api: Any) -> Settings:
    """Settings on the test's Redis and a fresh moto bucket; ``api`` overrides ApiSettings."""
    bucket = f"api-{abs(hash(name)) % 10**8}"
    moto_server.s3().create_bucket(Bucket=bucket)
    policy = BatchPolicy(max_batch_size=16, max_wait_s=0.01, token_budget=10**6)
    return Settings(
        redis_url=redis_server.url,
        results_url=f"s3://{bucket}/runs",
        s3_endpoint_url=moto_server.endpoint,
        batch={m: policy for m in ("text", "image", "video")},
        api=ApiSettings(**api),
    )


@contextmanager
def worker_loop(settings: Settings, engine: Any | None = None) -> Iterator[Any]:
    """An in-process worker loop serving every class, on a thread."""
    engine = engine or EchoEngine()
    loop = make_loop(settings, engine)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        loop.stop()
        thread.join(10)
        loop.shutdown(10)


@contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """The app on a real uvicorn server, on a free loopback port; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=20, what="uvicorn")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def serving(settings: Settings, app: Any) -> Iterator[str]:
    """A real server plus a worker loop."""
    with worker_loop(settings), uvicorn_server(app) as url:
        yield url


def wait_for_state(get: Any, states: set[str], timeout: float = 30.0, key: str = "status") -> Any:
    """Poll ``get()`` until its ``key`` field (item or attribute) is one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        status = value[key] if isinstance(value, dict) else getattr(value, key)
        if status in states:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {status!r} after {timeout}s")
        time.sleep(0.05)
