"""Real vlmq processes for the fault regressions: ``vlmq worker --engine noop`` and CLI
commands, each with a log file, all killed at teardown. The environment is the e2e tier's
(``tests/e2e/conftest.py`` ``fleet_environment``: this Redis, a bucket on moto, 3 s leases and
0.5 s reaps) with the fault harness's batch policy; a process may be pointed at another Redis
address (a :class:`~tests.support.replydrop.ReplyDropProxy`) by ``VLMQ_REDIS_URL``."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from tests.e2e.conftest import fleet_environment, vlmq
from tests.support.faults.harness import batch_policy
from tests.support.services import wait_until
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.config.status import TERMINAL
from vlmq.producers.client import Client

__all__ = ["TERMINAL_STATES", "Processes", "celery_message", "write_jsonl"]

TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


class Processes:
    """The vlmq processes of one test (and what they share: Redis, a bucket on moto)."""

    def __init__(self, redis_url: str, moto: Any, workdir: Path, **extra: str) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        media = workdir / "media"
        media.mkdir(exist_ok=True)
        bucket = f"regress-{uuid.uuid4().hex[:12]}"
        self.env = fleet_environment(redis_url, moto, bucket, media)
        self.env["VLMQ_BATCH"] = batch_policy(16)
        self.env["VLMQ_FLEET__STORE_RETRY_MAX_S"] = "1"
        self.env.update(extra)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: dict[int, Path] = {}
        self.keys = Keys()

    # clients -------------------------------------------------------------------------------
    def settings(self, redis_url: str | None = None, **fields: Any) -> Settings:
        """Settings of a producer of this fleet (its results store; ``redis_url``: another
        address of its Redis, a proxy's)."""
        return Settings(
            redis_url=redis_url or self.redis_url,
            results_url=self.env["VLMQ_RESULTS_URL"],
            s3_endpoint_url=self.env["VLMQ_S3_ENDPOINT_URL"],
            **fields,
        )

    def client(self, redis_url: str | None = None, **fields: Any) -> Client:
        return Client(self.settings(redis_url, **fields))

    def celery_app(self) -> Celery:
        """A web app's Celery app on this fleet: its Redis as the broker and as the result
        backend (the workers' default, ``VLMQ_CELERY__RESULT_BACKEND`` unset); close it."""
        app = Celery("webapp", broker=self.redis_url, backend=self.redis_url, set_as_current=False)
        app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
        return app

    @cached_property
    def redis(self) -> redis.Redis:
        """The test's own connection to this fleet's Redis (never through a proxy)."""
        return Client(self.settings()).redis

    # processes -----------------------------------------------------------------------------
    def start(
        self,
        label: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        nofile: int | None = None,
    ) -> Any:
        """``python -m vlmq ARGS``; its output goes to ``logs/<label>.log``. ``nofile``: its
        descriptor limit (``ulimit -n``), set as it starts (``prlimit``: a ``preexec_fn``
        is not safe in a test process with threads)."""
        path = self.logs / f"{label}.log"
        with path.open("wb") as log:
            proc = vlmq(
                *args,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if nofile is not None:
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
        self.procs.append(proc)
        self._logs[proc.pid] = path
        return proc

    def worker(
        self,
        name: str,
        delay_s: float = 0.0,
        modality: str = "text",
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> Any:
        """A ``vlmq worker --engine noop`` process named ``name``; with ``wait``, returned once
        its heartbeat record is in Redis."""
        proc = self.start(
            name,
            "--log-level",
            "info",
            "worker",
            "--engine",
            "noop",
            "--no-celery",
            "--modality",
            modality,
            "--name",
            name,
            "--noop-delay",
            str(delay_s),
            env=env,
        )
        if wait:
            self.wait_registered(name, proc)
        return proc

    def model_worker(
        self,
        name: str,
        modality: str = "image,video",
        env: Mapping[str, str] | None = None,
        nofile: int | None = None,
    ) -> Any:
        """A ``vlmq worker`` with a model (``VLMQ_MODEL`` in this fleet's environment: a tiny
        checkpoint), returned once registered; ``nofile`` as for :meth:`start`."""
        proc = self.start(
            name,
            *("--log-level", "info", "worker", "--modality", modality),
            *("--no-celery", "--name", name),
            env=env,
            nofile=nofile,
        )
        self.wait_registered(name, proc, timeout=120)
        return proc

    def prepare_worker(self, name: str, env: Mapping[str, str] | None = None) -> Any:
        """A ``vlmq worker --role prepare`` (the model's config files from ``VLMQ_MODEL``),
        returned once registered."""
        proc = self.start(
            name,
            *("--log-level", "info", "worker", "--role", "prepare"),
            *("--no-celery", "--name", name),
            env=env,
        )
        self.wait_registered(name, proc, timeout=60)
        return proc

    def wait_registered(self, name: str, proc: Any, timeout: float = 30) -> None:
        def registered() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"worker {name} exited: {self.log(proc)[-2000:]}")
            return bool(self.redis.hexists(self.keys.workers(), name))

        wait_until(registered, timeout=timeout, what=f"worker {name} registered")

    def run(self, label: str, *args: str, env: Mapping[str, str] | None = None) -> Any:
        """``python -m vlmq ARGS`` to its end (60 s at most)."""
        proc = self.start(label, *args, env=env)
        proc.wait(60)
        return proc

    def terminate(self, proc: Any, timeout: float = 30) -> int:
        """SIGTERM: a worker drains (finishes what fits its drain window and its settles,
        hands back the rest) and exits; returns its exit code (whatever it did with what it
        held is done by then)."""
        proc.send_signal(signal.SIGTERM)
        code: int = proc.wait(timeout)
        return code

    def log(self, proc: Any) -> str:
        return self._logs[proc.pid].read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)

    # state -------------------------------------------------------------------------------
    def drained(self, *lists: str) -> bool:
        """Nothing left in ``lists`` and nothing held by any worker."""
        pipe = self.redis.pipeline(transaction=False)
        for name in lists:
            pipe.llen(name)
        pipe.hlen(self.keys.inflight())
        return not any(pipe.execute())

    def wait_drained(self, *lists: str, timeout: float = 30) -> None:
        wait_until(lambda: self.drained(*lists), timeout=timeout, what=f"{lists} drained")

    def states(self, client: Client, task_ids: Iterable[str]) -> dict[str, str]:
        return {t: str(client.status(t).get("state")) for t in task_ids}


def write_jsonl(path: Path, count: int, prefix: str = "line") -> Path:
    """A bulk input of ``count`` text lines with custom_ids ``{prefix}-{i}``."""
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "messages": [{"role": "user", "content": f"{prefix} {i}"}],
            "max_new_tokens": 4,
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def celery_message(
    task_id: str, request: Mapping[str, Any], queue: str, headers_first: Mapping[str, Any]
) -> str:
    """A Celery protocol-2 JSON message as any Celery producer may write it (``send_task``),
    with ``headers_first`` placed in its headers before the task id."""
    import base64

    body = json.dumps([[], {"request": dict(request)}, {"callbacks": None, "errbacks": None}])
    headers = {**headers_first, "lang": "py", "task": "vlmq.generate", "id": task_id}
    headers |= {"root_id": task_id, "parent_id": None, "retries": 0, "expires": None}
    message = {
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": task_id,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": uuid.uuid4().hex,
        },
    }
    return json.dumps(message, separators=(",", ":"))
