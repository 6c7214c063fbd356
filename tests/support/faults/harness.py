"""A fleet under test: private Redis, S3 (moto) behind a breakable proxy, and
real ``vlmq worker`` processes that can be killed, stopped, restarted, cut off from
Redis (:meth:`Harness.redis_proxy`) or run with a skewed clock (:func:`faketime`).

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
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support.proxy import Proxy
from tests.support.services import MotoServer, RedisServer, wait_until
from tests.support.zygote import vlmq_process
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client

_FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
)


def faketime_library() -> str | None:
    """libfaketime (Debian: apt-get install faketime), or None when it is not installed."""
    return next((lib for lib in _FAKETIME_LIBS if Path(lib).exists()), None)


# libfaketime and CPython 3.11 disagree here in both of its modes (measured): with the
# monotonic clock faked, every timed wait of a lock or event (sem_clockwait on the real
# monotonic clock, given a faked deadline) hangs; with FAKETIME_DONT_FAKE_MONOTONIC=1,
# time.sleep (clock_nanosleep with an absolute monotonic deadline) fails with EINVAL. So the
# wall clock is faked, the monotonic clock is left alone, and time.sleep is replaced by an
# Event wait (which the monotonic clock serves correctly) in the skewed process only.
_SLEEP_SHIM = """import threading
import time


def _sleep(seconds):
    if seconds > 0:
        threading.Event().wait(seconds)


time.sleep = _sleep
"""


def faketime(offset_s: float, shim_dir: Path, monotonic: bool = False) -> dict[str, str]:
    """Environment that runs a process with its wall clock ``offset_s`` seconds off; with
    ``monotonic``, its monotonic clock too, and no shim: every timed wait of a lock or event
    in it then hangs (above), as a heartbeat thread does on a host whose clock jumped."""
    lib = faketime_library()
    if lib is None:
        raise RuntimeError("libfaketime is not installed (apt-get install faketime)")
    if monotonic:
        return {
            "LD_PRELOAD": lib,
            "FAKETIME": f"{offset_s:+.0f}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "0",
        }
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(_SLEEP_SHIM, encoding="utf-8")
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": f"{offset_s:+.0f}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": str(shim_dir),
    }


__all__ = ["Harness"]


def batch_policy(size: int, wait_s: float = 0.05) -> str:
    policy = {"max_batch_size": size, "max_wait_s": wait_s, "token_budget": 10**6}
    return json.dumps({m: policy for m in ("text", "image", "video")})


class Harness:
    """A drill's Redis (its own: drills kill and restart it), S3 behind a breakable proxy, and
    its worker processes. ``moto``: a running moto server to share (the tests' session one;
    the drill gets a bucket of its own on it), else the harness starts and stops its own."""

    def __init__(
        self, workdir: Path | None = None, appendonly: bool = True, moto: MotoServer | None = None
    ) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="vlmq-faults-"))
        self.redis = RedisServer(self.workdir / "redis", appendonly=appendonly)
        self.moto = moto or MotoServer()
        self._own_moto = moto is None
        self.proxy: Proxy | None = None
        self.bucket = "faults" if moto is None else f"faults-{uuid.uuid4().hex[:12]}"
        self.workers: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}  # worker pid -> its log file
        self.redis_proxies: list[Proxy] = []
        self._client: Client | None = None

    # lifecycle -------------------------------------------------------------
    def start(self) -> Harness:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
        self.redis.start()
        if self._own_moto:
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
        for proxy in self.redis_proxies:
            proxy.down()
        if self._own_moto:
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
    def skewed(self, offset_s: float, monotonic: bool = False) -> dict[str, str]:
        """Environment for a worker whose wall clock (and with ``monotonic``, its monotonic
        clock) is ``offset_s`` seconds off."""
        return faketime(offset_s, self.workdir / "faketime", monotonic)

    def redis_proxy(self) -> Proxy:
        """A breakable TCP path to Redis: a worker given ``VLMQ_REDIS_URL=proxy.redis_url``
        can be cut off from Redis while everything else still reaches it."""
        proxy = Proxy(self.redis.port).up()
        self.redis_proxies.append(proxy)
        return proxy

    def worker(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        """A ``vlmq worker`` process; its log goes to ``workdir/logs/worker-N.log``."""
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        path = logs / f"worker-{len(self.workers)}.log"
        with path.open("wb") as log:
            proc = vlmq_process(
                [sys.executable, "-m", "vlmq", "--log-level", "info", "worker", *args],
                self.env(**env),
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.workers.append(proc)
        self.logs[proc.pid] = path
        return proc

    def wait_logged(self, proc: subprocess.Popen[bytes], text: str, timeout: float = 60) -> None:
        """Until ``proc``'s log says ``text``."""
        path = self.logs[proc.pid]
        wait_until(
            lambda: text in path.read_text(errors="replace"), timeout=timeout, what=repr(text)
        )

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
        return self.client.state.tasks.many(ids)

    def objects(self, job: str) -> list[str]:
        return self.client.store.keys(job)

    def pointed_objects(
        self, statuses: list[dict[str, str]]
    ) -> list[tuple[str, dict[str, Any] | None]]:
        """Per status, the store key it points at ('' for none) and that object (None when
        missing); fetched in parallel."""
        store = self.client.store
        keys = [store.key_of(s["result_url"]) if s.get("result_url") else "" for s in statuses]
        with ThreadPoolExecutor(16) as pool:
            records = list(pool.map(lambda k: store.get(k) if k else None, keys))
        return list(zip(keys, records, strict=True))

    def running_on(self, ids: list[str], worker: str) -> list[str]:
        fields = ("state", "worker", "attempts")
        return [
            i
            for i, s in zip(ids, self.client.state.tasks.many(ids, fields), strict=True)
            if s.get("state") == "running" and s.get("worker") == worker and s.get("attempts")
        ]

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> float:
        at = time.monotonic()
        proc.send_signal(sig)
        return at
