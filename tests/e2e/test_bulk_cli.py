"""Bulk jobs through the CLI with real worker processes on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.e2e.conftest import vlmq
from tests.e2e.test_fleet import BATCH16, NOOP, _client, _ready
from tests.support.samples import save_image, save_video
from tests.support.services import wait_until


def _run(*args: str, env: dict) -> str:
    proc = vlmq(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def _lines(tmp_path: Path) -> list[str]:
    save_image(tmp_path / "a.png", size=(64, 64), seed=1)
    save_video(tmp_path / "v.mp4", n_frames=8, size=(64, 64), fps=4, seed=2)
    parts = {
        "text": "describe a queue",
        "image": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "what?"}],
        "video": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "what?"}],
    }
    lines = []
    for i in range(12):
        content = parts[("text", "image", "video")[i % 3]]
        messages = [{"role": "user", "content": content}]
        if i % 2:
            lines.append(
                json.dumps(
                    {
                        "custom_id": f"c{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "m", "messages": messages, "max_tokens": 6},
                    }
                )
            )
        else:
            lines.append(
                json.dumps({"custom_id": f"c{i}", "messages": messages, "max_new_tokens": 6})
            )
    lines.insert(5, "{this is not json")
    lines.append(json.dumps({"custom_id": "no-messages", "messages": []}))
    return lines


def test_bulk_file_resumed_waited_and_collected(fleet, fleet_env, tiny_model, tmp_path):
    env = {**fleet_env, "VLMQ_MODEL": str(tiny_model)}
    for modality in ("text", "image", "video"):
        fleet.start("--modality", modality, env=env)
    client = _client(fleet_env)
    wait_until(lambda: _ready(client, 3), timeout=120, what="workers")
    lines = _lines(tmp_path)
    (tmp_path / "part.jsonl").write_text("\n".join(lines[:6]) + "\n")  # an interrupted submit
    (tmp_path / "all.jsonl").write_text("\n".join(lines) + "\n")
    assert _run("submit", str(tmp_path / "part.jsonl"), "--job", "j1", env=env).strip() == "j1"
    _run(
        "submit",
        str(tmp_path / "all.jsonl"),
        "--job",
        "j1",
        "--wait",
        "--output",
        str(tmp_path / "out.jsonl"),
        "--errors",
        str(tmp_path / "err.jsonl"),
        "--format",
        "openai",
        env=env,
    )
    status = json.loads(_run("status", "j1", "--json", env=env))
    assert status["state"] == "completed" and status["total"] == 12
    assert status["counts"]["succeeded"] == 12 and status["errors"] == 2
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(12))
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] is not None for x in out)
    errors = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert sorted(e["error"]["line"] for e in errors) == [6, 14]
    _run("results", "j1", "-o", str(tmp_path / "vlmq.jsonl"), "--format", "vlmq", env=env)
    records = [json.loads(x) for x in (tmp_path / "vlmq.jsonl").read_text().splitlines()]
    assert len(records) == 14
    modalities = {r.get("modality") for r in records if r.get("status") == "succeeded"}
    assert modalities == {"text", "image", "video"}
    # Submitting the finished file again changes nothing.
    _run("submit", str(tmp_path / "all.jsonl"), "--job", "j1", env=env)
    assert json.loads(_run("status", "j1", "--json", env=env))["total"] == 12


def test_cancel_mid_way(fleet, fleet_env, tmp_path):
    lines = [
        json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": "x"}]})
        for i in range(200)
    ]
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    _run("submit", str(tmp_path / "big.jsonl"), "--job", "big", env=fleet_env)
    client = _client(fleet_env)
    fleet.start(*NOOP, "--noop-delay", "0.3", env=BATCH16)
    wait_until(lambda: client.status("big")["done"] >= 16, timeout=60, what="some done")
    said = _run("cancel", "big", env=fleet_env)
    cancelled = int(said.split()[1].replace(",", ""))
    assert 0 < cancelled < 200
    wait_until(lambda: client.status("big")["finished"], timeout=60, what="job end")
    status = json.loads(_run("status", "big", "--json", env=fleet_env))
    assert status["state"] == "cancelled"
    assert status["counts"]["cancelled"] == cancelled
    assert status["counts"]["succeeded"] + cancelled == 200
