"""A fleet under test: private Redis, S3 (moto) behind a breakable proxy, and
real ``vlmq worker`` processes that can be killed, stopped and restarted.

Used by the CI fault suite (small sizes) and by ``bench/faults.py`` (the full
figures in docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.workers.testing.proxy import Proxy
from vlmq.workers.testing.services import MotoServer, RedisServer, wait_until

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["Harness"]


def batch_policy(size: int, wait_s: float = 0.05) -> str:
    policy = {"max_batch_size": size, "max_wait_s": wait_s, "token_budget": 10**6}
    return json.dumps({m: policy for m in ("text", "image", "video")})


class Harness:
    def __init__(self, workdir: Path | None = None, appendonly: bool = True) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="vlmq-faults-"))
        self.redis = RedisServer(self.workdir / "redis", appendonly=appendonly)
        self.moto = MotoServer()
        self.proxy: Proxy | None = None
        self.bucket = "faults"
        self.workers: list[subprocess.Popen[bytes]] = []
        self._client: Client | None = None

    # lifecycle -------------------------------------------------------------
    def start(self) -> Harness:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
        self.redis.start()
        self.moto.start()
        self.moto.s3().create_bucket(Bucket=self.bucket)
        self.proxy = Proxy(self.moto.port).up()
        return self

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.proxy is not None:
            self.proxy.down()
        self.moto.stop()
        self.redis.kill()

    def __enter__(self) -> Harness:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # clients -----------------------------------------------------------------
    @property
    def settings(self) -> Settings:
        # The producer reads results straight from moto, never through the proxy.
        return Settings(
            redis_url=self.redis.url,
            results_url=f"s3://{self.bucket}/results",
            s3_endpoint_url=self.moto.endpoint,
        )

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.settings)
        return self._client

    def env(self, **extra: str) -> dict[str, str]:
        assert self.proxy is not None
        return {
            **os.environ,
            "VLMQ_REDIS_URL": self.redis.url,
            "VLMQ_RESULTS_URL": f"s3://{self.bucket}/results",
            "VLMQ_S3_ENDPOINT_URL": self.proxy.endpoint,
            "VLMQ_FLEET__LEASE_S": "3",
            "VLMQ_FLEET__REAP_INTERVAL_S": "0.5",
            "VLMQ_FLEET__STORE_RETRY_MAX_S": "1",
            "VLMQ_FLEET__REDIS_SOCKET_TIMEOUT_S": "2",
            "VLMQ_ENGINE__TORCH_THREADS": "1",
            "VLMQ_BATCH": batch_policy(16),
            **extra,
        }

    # workers -----------------------------------------------------------------
    def worker(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vlmq", "worker", *args],
            cwd=ROOT,
            env=self.env(**env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.workers.append(proc)
        return proc

    def noop_worker(self, name: str, delay_s: float = 0.2, **env: str) -> subprocess.Popen[bytes]:
        return self.worker(
            "--modality",
            "text",
            "--engine",
            "noop",
            "--no-celery",
            "--name",
            name,
            "--noop-delay",
            str(delay_s),
            **env,
        )

    def wait_registered(self, name: str, timeout: float = 120) -> None:
        wait_until(
            lambda: self.client.redis.hexists(Keys().workers(), name),
            timeout=timeout,
            what=f"worker {name}",
        )

    def worker_info(self, name: str) -> dict[str, Any]:
        raw = self.client.redis.hget(Keys().workers(), name)
        return json.loads(raw) if raw else {}

    # jobs ----------------------------------------------------------------------
    def submit_text(self, n: int, marker: str = "") -> tuple[str, list[str]]:
        def text(i: int) -> str:
            return f"task {i} {marker}" if marker and i == n // 2 else f"task {i}"

        items = [
            {"custom_id": f"c{i}", "messages": [{"role": "user", "content": text(i)}]}
            for i in range(n)
        ]
        job = self.client.submit_many(items)
        return job, list(self.client.job_task_ids(job))

    def wait_job(self, job: str, timeout: float = 300) -> dict[str, Any]:
        wait_until(lambda: self.client.status(job)["finished"], timeout=timeout, what="job end")
        return self.client.status(job)

    def statuses(self, ids: list[str]) -> list[dict[str, str]]:
        return self.client.status_db.tasks(ids)

    def objects(self, job: str) -> list[str]:
        return self.client.store.keys(job)

    def running_on(self, ids: list[str], worker: str) -> list[str]:
        fields = ("state", "worker", "attempts")
        return [
            i
            for i, s in zip(ids, self.client.status_db.tasks(ids, fields), strict=True)
            if s.get("state") == "running" and s.get("worker") == worker and s.get("attempts")
        ]

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> float:
        at = time.monotonic()
        proc.send_signal(sig)
        return at
