"""A web app that only has Celery, against real workers (issue 25): results through its result
backend (on another Redis database than the broker), failures it can rebuild without vlmq,
revoke, link / link_error / chord / group / chain, result expiry, and exactly one SUCCESS per
task when a worker is killed mid-batch.

One fleet for the module: a tiny-model worker for every class (``vlmq.*`` queues), a slow
noop worker under another key prefix (``slow.text``: a task that stays queued behind a running
one, a batch to kill), and the web app's own Celery worker. The app's side runs in
subprocesses that never import vlmq (tests/support/celery_webapp.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.e2e.conftest import Fleet, fleet_environment
from tests.support.faults.harness import batch_policy
from tests.support.samples import save_image, save_video
from tests.support.services import wait_until
from vlmq.config.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
WEBAPP = ROOT / "tests" / "support" / "celery_webapp.py"
EXAMPLE = ROOT / "examples" / "celery_app.py"
SLOW = Keys("slow")
RESULT_EXPIRES_S = 600


class CeleryFleet:
    def __init__(self, fleet: Fleet, broker: Any, backend: Any, media: Path) -> None:
        self.fleet = fleet
        self.broker = broker.connect()
        self.backend = backend.connect()
        self.media = media
        self.app_env = {
            **os.environ,
            "CELERY_BROKER_URL": broker.url,
            "CELERY_RESULT_BACKEND": backend.url,
            "PYTHONPATH": f"{EXAMPLE.parent}:{WEBAPP.parent}",
        }
        self.slow_env = {"VLMQ_FLEET__KEY_PREFIX": "slow", "VLMQ_BATCH": batch_policy(4, 0.2)}

    def run(self, scenario: str, **args: Any) -> Any:
        """A scenario of the web app, to its end; its findings."""
        out = subprocess.run(
            [sys.executable, str(WEBAPP), scenario, json.dumps(args)],
            env=self.app_env,
            cwd=WEBAPP.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def start_slow(self, name: str) -> subprocess.Popen[bytes]:
        args = ("--engine", "noop", "--noop-delay", "1.5", "--modality", "text", "--name", name)
        return self.fleet.start(*args, env=self.slow_env)

    def meta(self, task_id: str) -> dict[str, Any]:
        raw = self.backend.get(f"celery-task-meta-{task_id}")
        return json.loads(raw) if raw else {}


@pytest.fixture(scope="module")
def celery_fleet(
    shared_redis: Any, moto_server: Any, tmp_path_factory: Any, checkpoint: Any
) -> Iterator[CeleryFleet]:
    broker, backend = shared_redis.database(), shared_redis.database()
    media = tmp_path_factory.mktemp("celery-media")
    env = fleet_environment(broker.url, moto_server, "celery-app", media)
    env.update(
        VLMQ_CELERY__RESULT_BACKEND=backend.url,
        VLMQ_CELERY__RESULT_EXPIRES_S=str(RESULT_EXPIRES_S),
    )
    fleet = Fleet(env)
    celery = CeleryFleet(fleet, broker, backend, media)
    fleet.start("--name", "vlm", env={"VLMQ_MODEL": str(checkpoint("qwen2_5_vl"))})
    celery.start_slow("slow-1")
    worker_args = ["worker", "--pool", "solo", "-Q", "celery", "-n", "webapp@%h"]
    app_worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_app", *worker_args, "--without-mingle"],
        env=celery.app_env,
        cwd=WEBAPP.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fleet.procs.append(app_worker)
    probe = Celery(broker=broker.url, set_as_current=False)
    try:
        wait_until(
            lambda: (
                celery.broker.hexists(Keys().workers(), "vlm")
                and celery.broker.hexists(SLOW.workers(), "slow-1")
            ),
            timeout=180,
            what="the vlmq workers",
        )
        wait_until(
            lambda: any("webapp@" in name for r in probe.control.ping(timeout=0.5) for name in r),
            timeout=60,
            what="the web app's worker",
        )
        yield celery
    finally:
        probe.close()
        fleet.stop()
        for connection in (celery.broker, celery.backend):
            connection.flushdb()


def test_get_for_text_image_and_video(celery_fleet):
    image = save_image(celery_fleet.media / "cat.png", size=(64, 64), seed=1)
    video = save_video(celery_fleet.media / "clip.mp4", n_frames=8, size=(64, 64), fps=4, seed=2)
    found = celery_fleet.run("get", image=str(image), video=str(video))
    for kind, task_id in found["ids"].items():
        result = found["results"][kind]
        assert set(result) == {"id", "output", "finish_reason", "usage", "result_url"}
        assert result["id"] == task_id and isinstance(result["output"], str)
        assert result["finish_reason"] in ("stop", "length")
        assert result["usage"]["completion_tokens"] >= 1
        assert result["result_url"].startswith("s3://celery-app/results/")
    # The meta is Celery's own, in the backend's database and never in the broker's.
    meta = celery_fleet.meta(found["ids"]["image"])
    assert meta["status"] == "SUCCESS" and meta["task_id"] == found["ids"]["image"]
    assert not celery_fleet.broker.exists(f"celery-task-meta-{found['ids']['image']}")


def test_a_failing_request_raises_its_code_on_get(celery_fleet):
    found = celery_fleet.run("failure", missing_image=str(celery_fleet.media / "missing.png"))
    assert found["vlmq_imported"] is False
    name, (code, message) = found["invalid"]
    assert name == "TaskFailed" and code == "invalid_request" and "messages" in message
    name, (code, _) = found["unreadable"]
    assert name == "TaskFailed" and code.startswith("media_")
    assert found["state"] == "FAILURE"


def test_link_link_error_chord_group_and_chain(celery_fleet):
    found = celery_fleet.run("canvas")
    assert found["link"] == {"id": found["linked"], "words": found["link"]["words"]}
    assert found["errback"] == f"{found['failing']} failed: invalid_request"
    assert found["chord"] == found["chord_headers"]  # the callback got every header's result
    assert found["group"] == found["group_ids"]  # in order
    assert found["chain"]["id"] == found["chain_first"]


def test_the_example_app_runs(celery_fleet):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        env={**celery_fleet.app_env, "EXAMPLE_TIMEOUT_S": "90"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert "'finish_reason'" in lines["result"]
    assert lines["failure"] == "TaskFailed invalid_request"
    assert lines["chord"] == "3 outputs" and lines["group"] == "3"
    assert lines["vlmq imported"] == "False"


def test_revoke_of_a_queued_task(celery_fleet):
    found = celery_fleet.run("revoke", queue=SLOW.queue("text"))
    queued = found["queued"]
    replies = {name: reply for r in found["replies"] for name, reply in r.items()}
    assert replies["celery@slow-1"] == {"ok": {queued: "cancelled"}}
    assert found["state"] == "REVOKED"
    status = celery_fleet.broker.hgetall(SLOW.task(queued))
    assert status["state"] == "cancelled" and "started_at" not in status  # it never ran
    assert found["unseen_state"] == "REVOKED"
    assert celery_fleet.broker.hget(SLOW.task(found["unseen"]), "state") == "cancelled"


def test_results_expire_as_configured(celery_fleet):
    task_id = celery_fleet.run("one")["id"]
    assert celery_fleet.meta(task_id)["status"] == "SUCCESS"
    assert 0 < celery_fleet.backend.ttl(f"celery-task-meta-{task_id}") <= RESULT_EXPIRES_S


def test_a_worker_killed_mid_batch_ends_each_task_with_one_success(celery_fleet):
    driver = subprocess.Popen(
        [
            sys.executable,
            str(WEBAPP),
            "killed",
            json.dumps({"queue": SLOW.queue("text"), "count": 4}),
        ],
        env=celery_fleet.app_env,
        cwd=WEBAPP.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None
        sent = json.loads(driver.stdout.readline())["sent"]
        (victim,) = [p for p in celery_fleet.fleet.procs if "slow-1" in " ".join(map(str, p.args))]

        def running_on_victim() -> bool:
            metas = [celery_fleet.meta(task_id) for task_id in sent]
            return any(
                m.get("status") == "STARTED" and m["result"]["pid"] == victim.pid for m in metas
            )

        wait_until(running_on_victim, timeout=60, what="a batch running on slow-1")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        celery_fleet.start_slow("slow-2")
        found = json.loads(driver.communicate(timeout=120)[0].strip().splitlines()[-1])
    finally:
        if driver.poll() is None:
            driver.kill()
    assert found["results"] == sent
    assert found["successes"] == {task_id: 1 for task_id in sent}
    # What the victim held ran again on slow-2: its batch was killed, not finished.
    rerun = [celery_fleet.broker.hmget(SLOW.task(t), "worker", "deliveries") for t in sent]
    assert any(worker == "slow-2" and int(deliveries) >= 2 for worker, deliveries in rerun)
    assert all(celery_fleet.meta(t)["result"]["id"] == t for t in sent)
