"""``vlmq run``: a JSONL file through the engine in-process, bad lines included."""

from __future__ import annotations

import json
import subprocess

from tests.e2e.conftest import vlmq
from tests.support.samples import save_image, save_video


def test_run_writes_one_line_per_input_line(tmp_path, tiny_model):
    save_image(tmp_path / "cat.png", size=(64, 64), seed=1)
    save_video(tmp_path / "clip.mp4", n_frames=8, size=(64, 64), fps=4, seed=2)
    lines = [
        {"custom_id": "t", "messages": [{"role": "user", "content": "hello"}], "max_new_tokens": 4},
        "{broken json",
        {
            "custom_id": "i",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "cat.png"},
                        {"type": "text", "text": "what?"},
                    ],
                }
            ],
        },
        {
            "custom_id": "o",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "max_tokens": 3,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": f"file://{tmp_path / 'cat.png'}"},
                            },
                            {"type": "text", "text": "describe"},
                        ],
                    }
                ],
            },
        },
        {
            "custom_id": "v",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": "clip.mp4"},
                        {"type": "text", "text": "what happens?"},
                    ],
                }
            ],
        },
        {
            "custom_id": "missing",
            "messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}],
        },
        {"custom_id": "t", "messages": [{"role": "user", "content": "duplicate id"}]},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = vlmq(
        "run",
        str(source),
        "-o",
        str(out),
        "--model",
        str(tiny_model),
        "--max-batch-size",
        "8",
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines)
    by_line = {r["line"]: r for r in records}
    assert by_line[1]["status"] == "succeeded" and by_line[1]["usage"]["completion_tokens"] <= 4
    assert by_line[2]["error"]["code"] == "invalid_request"
    assert by_line[3]["status"] == "succeeded" and by_line[3]["modality"] == "image"
    assert by_line[4]["status"] == "succeeded" and by_line[4]["usage"]["completion_tokens"] <= 3
    assert by_line[5]["status"] == "succeeded" and by_line[5]["modality"] == "video"
    assert by_line[6]["error"]["code"] == "media_fetch_failed"
    assert by_line[7]["error"]["code"] == "duplicate_custom_id"
    assert "succeeded" in stderr and "3 failed" in stderr
