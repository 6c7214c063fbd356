"""`vlmq submit --dry-run` against a real redis-server: an estimate, and nothing written."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.samples import save_image, save_video
from vlmq.config.keys import Keys
from vlmq.producers.cli import cli

# Commands a read of the heartbeat hash may send (connection setup included).
_READS = {"hgetall", "client", "hello", "ping", "info", "select"}


@pytest.fixture(scope="module")
def tiny_model(checkpoint: Any) -> Path:
    return Path(checkpoint("qwen2_5_vl"))


def _job_file(folder: Path) -> Path:
    save_image(folder / "a.png", size=(64, 64), seed=1)
    save_video(folder / "v.mp4", n_frames=16, size=(64, 64), fps=8, seed=2)
    lines = [
        {"custom_id": "t", "messages": [{"role": "user", "content": "hello"}]},
        {
            "custom_id": "i",
            "messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, "?"]}],
            "max_new_tokens": 16,
        },
        {
            "custom_id": "v",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}],
                "max_tokens": 8,
            },
        },
    ]
    path = folder / "job.jsonl"
    path.write_text("\n".join([*map(json.dumps, lines), "{broken"]) + "\n")
    return path


def _command_counts(redis: Any) -> dict[str, int]:
    stats = redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _beat(modalities: list[str], rows: int, generate_s: float) -> str:
    engine = {"rows": rows, "generate_s": generate_s, "real_prompt_tokens": rows * 50}
    return json.dumps({"modalities": modalities, "at": time.time(), "engine": engine})


@pytest.mark.private_redis
def test_dry_run_estimates_and_enqueues_nothing(redis_server, tiny_model, tmp_path):
    redis = redis_server.connect()
    workers = Keys().workers()
    redis.hset(workers, "text@box:1", _beat(["text"], rows=100, generate_s=10.0))
    redis.hset(workers, "image,video@box:2", _beat(["image", "video"], rows=30, generate_s=30.0))
    keys_before = sorted(redis.keys("*"))
    writes_before = redis.info("persistence")["rdb_changes_since_last_save"]
    calls_before = _command_counts(redis)
    env = {
        "VLMQ_REDIS_URL": redis_server.url,
        "VLMQ_MODEL": str(tiny_model),
        "VLMQ_RESULTS_URL": f"file://{tmp_path / 'results'}",
    }
    path = _job_file(tmp_path)

    result = CliRunner().invoke(cli, ["submit", str(path), "--dry-run", "--json"], env=env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["lines"] == 4 and report["invalid_lines"]["count"] == 1
    assert report["modality"] == {"text": 1, "image": 1, "video": 1}
    assert report["prompt_tokens"]["visual"] > 0 and report["prompt_tokens"][
        "text_method"
    ].startswith("exact")
    assert report["output_tokens"]["total"] == 128 + 16 + 8
    assert report["media"]["images"]["read"] == 1 and report["media"]["videos"]["read"] == 1
    assert report["fleet"]["workers"] == 2 and report["fleet"]["measured"] == 2
    # text: 1 task at 10/s; image then video on the 1/s worker: 2 s.
    assert report["eta"]["seconds"] == 2.0

    human = CliRunner().invoke(cli, ["submit", str(path), "--dry-run"], env=env)
    assert human.exit_code == 0, human.output
    assert human.output.startswith("dry run: nothing was enqueued")
    assert "ETA             ~2.0s" in human.output and "line 4: invalid_request" in human.output

    # Nothing was written: only reads of the heartbeats, no write command, the same keys.
    calls = _command_counts(redis)
    used = {name for name, n in calls.items() if n > calls_before.get(name, 0)}
    assert used <= _READS and "hgetall" in used, used
    assert redis.info("persistence")["rdb_changes_since_last_save"] == writes_before
    assert sorted(redis.keys("*")) == keys_before
    assert not (tmp_path / "results").exists()


def test_dry_run_without_redis_still_estimates(tiny_model, tmp_path):
    env = {"VLMQ_REDIS_URL": "redis://127.0.0.1:1/0", "VLMQ_MODEL": str(tiny_model)}
    result = CliRunner().invoke(
        cli, ["submit", str(_job_file(tmp_path)), "--dry-run", "--json"], env=env
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["lines"] == 4
    assert report["eta"]["seconds"] is None and "Redis unreachable" in report["eta"]["reason"]
