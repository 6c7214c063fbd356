"""The CLI's entry points as a user meets them: JSON logs from a real worker, and the demo
run from a directory that is not the checkout."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.conftest import vlmq
from tests.e2e.test_fleet import _client
from tests.support.services import wait_until


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line must be a JSON object (a log collector parses each one)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _worker_logs(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    """Run a no-op worker until one queued task succeeds; its log lines, parsed."""
    client = _client(env)
    task = client.submit([{"role": "user", "content": "hi"}])
    worker = vlmq(
        "--log-level",
        "info",
        *args,
        "worker",
        "--engine",
        "noop",
        "--no-celery",
        "--modality",
        "text",
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: client.status(task)["state"] == "succeeded", timeout=60, what="task")
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    lines = _json_lines(stderr)
    done = [line for line in lines if line.get("task_id") == task]
    assert done and done[0]["message"] == f"task {task} succeeded"
    return lines


def test_log_format_json_is_one_object_per_line_with_ids(fleet_env: dict[str, str]) -> None:
    lines = _worker_logs(fleet_env, "--log-format", "json")
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    batch = [line for line in lines if line["message"].startswith("batch ")]
    assert batch and batch[0]["worker"] and batch[0]["batch_id"]
    # The same through the environment.
    assert _worker_logs({**fleet_env, "VLMQ_LOG_FORMAT": "json"})


def test_demo_runs_from_another_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "somewhere-else"
    elsewhere.mkdir()
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "vlmq", "demo", "--workdir", str(workdir), "--timeout", "240"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Examples came from the package and were generated under the demo's own directory.
    assert (workdir / "examples" / "requests.resolved.jsonl").exists()
    assert (workdir / "examples" / "media" / "clip.mp4").exists()
    assert "ok   text-hello" in done.stdout
    assert "FAIL bad-missing-media" in done.stdout  # the one bad line fails alone
    assert len(list((workdir / "results").rglob("*.json"))) == 9
    assert not list(elsewhere.iterdir())  # nothing written where it was started
