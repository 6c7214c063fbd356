"""Issue 13's mixed batch (``tests/support/structured.py``: a JSON schema, json_object,
regex, choice, n=3, logprobs and two plain rows) through ``vlmq run`` on every family and
through the fleet (real worker process, real Redis, moto S3); every result must honour its
line (``check_record``), in vlmq's record shape and as an OpenAI chat completion."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import vlmq
from tests.e2e.test_fleet import _client, _job_finished, _policy
from tests.support.samples import save_image
from tests.support.services import wait_until
from tests.support.structured import check_record, mixed_lines, openai_line
from vlmq.producers.api.openai.mapping import to_chat_completion
from vlmq.producers.commands import write_results

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
CUSTOM_IDS = [line["custom_id"] for line in mixed_lines("x.png")]
# Lark with a special token the worker's tokenizer does not have: the producer-side check
# (no tokenizer) passes it, the worker refuses it when compiling.
BAD_GRAMMAR = {
    "custom_id": "bad_grammar",
    "messages": [{"role": "user", "content": "Say x."}],
    "grammar": 'start: "x" <|no_such_token|>',
}


@pytest.fixture(scope="module")
def models(checkpoint: Any) -> dict[str, Path]:
    return {family: checkpoint(family) for family in FAMILIES}


def _check_completion(custom_id: str, body: dict[str, Any]) -> None:
    """An OpenAI chat completion body: the official type accepts it, and it honours its line."""
    completion = openai.types.chat.ChatCompletion.model_validate(body)
    assert completion.object == "chat.completion" and completion.choices, body
    check_record(custom_id, body)


def _write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# --- vlmq run ---------------------------------------------------------------------------
# ``vlmq run`` has no ``--format`` option (its output is always vlmq records), so the OpenAI
# side is covered twice over instead: the same batch as OpenAI Batch *input* lines, and every
# record through ``to_chat_completion`` (the body ``vlmq results --format openai`` writes).


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("line_format", ["vlmq", "openai"])
def test_vlmq_run_honours_every_row(
    models: dict[str, Path], tmp_path: Path, family: str, line_format: str
) -> None:
    save_image(tmp_path / "a.png", size=(64, 64), seed=1)
    lines = mixed_lines("a.png")  # relative to the input file's folder
    if line_format == "openai":
        lines = [openai_line(line) for line in lines]
    source = _write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    proc = vlmq(
        "run",
        str(source),
        "-o",
        str(out),
        "--model",
        str(models[family]),
        "--max-batch-size",
        "8",
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    records = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["custom_id"] for r in records] == CUSTOM_IDS
    assert [r["line"] for r in records] == list(range(1, len(CUSTOM_IDS) + 1))
    for record in records:
        custom_id = record["custom_id"]
        assert record["status"] == "succeeded", record
        assert record["model"] == str(models[family])
        check_record(custom_id, record)
        _check_completion(custom_id, to_chat_completion(record))
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["schema"]["modality"] == "image" and by_id["regex"]["modality"] == "text"
    assert "8 succeeded, 0 failed" in stderr


# --- the fleet --------------------------------------------------------------------------
# All three families: a worker process loads a tiny checkpoint and runs this batch in ~6 s
# here (measured), well under the minute that would make one family enough. What the fleet
# adds to ``vlmq run``'s engine is the path: submit, staging to S3, queues, one worker's
# padded batches, the results store and the export.

ONE_BATCH = {
    "VLMQ_BATCH": json.dumps({m: _policy(16, 0.5) for m in ("text", "image", "video")}),
    # A pulled class is one micro-batch (in flight they are an eighth of the slots by default).
    "VLMQ_ENGINE__DECODE__ADMIT_ROWS": "32",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fleet_honours_every_row_and_fails_a_bad_grammar_alone(
    fleet: Any, fleet_env: dict[str, str], models: dict[str, Path], tmp_path: Path, family: str
) -> None:
    save_image(tmp_path / "a.png", size=(64, 64), seed=1)
    client = _client(fleet_env)
    items = [*mixed_lines(str(tmp_path / "a.png")), BAD_GRAMMAR]
    job = client.submit_many(items, name="structured")  # the image is staged to S3
    # Everything is queued before the worker starts: its first pull takes each class whole.
    env = {**ONE_BATCH, "VLMQ_MODEL": str(models[family])}
    fleet.start("--name", "structured-worker", env=env)
    wait_until(lambda: _job_finished(client, job), timeout=240, what="the structured job")
    counts = client.status(job)["counts"]
    assert (counts["succeeded"], counts["failed"]) == (len(CUSTOM_IDS), 1), counts

    records = {r["custom_id"]: r for r in (client.result(t) for t in client.job_task_ids(job))}
    assert sorted(records) == sorted([*CUSTOM_IDS, "bad_grammar"])
    refused = records.pop("bad_grammar")
    assert refused["status"] == "failed" and refused["error"]["code"] == "invalid_request"
    assert refused["error"]["message"].startswith("grammar:"), refused["error"]
    assert "no_such_token" in refused["error"]["message"]
    for custom_id, record in records.items():
        assert record["status"] == "succeeded", record
        assert record["worker"].startswith("structured-worker")
        assert record["model"] == str(models[family])
        check_record(custom_id, record)
    # The text rows the refused one was queued with ran together, in one padded batch.
    text_rows = [r for r in records.values() if r["modality"] == "text"]
    assert len({r["batch_id"] for r in text_rows}) == 1, [
        (r["custom_id"], r["batch_id"]) for r in text_rows
    ]

    # The same results as an OpenAI Batch output and error file (``vlmq results --format
    # openai``).
    out, errors = io.StringIO(), io.StringIO()
    assert write_results(client, job, out, errors, "openai") == (len(CUSTOM_IDS), 1)
    output = [json.loads(x) for x in out.getvalue().splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(CUSTOM_IDS)
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        _check_completion(line["custom_id"], line["response"]["body"])
    (error,) = [json.loads(x) for x in errors.getvalue().splitlines()]
    assert error["custom_id"] == "bad_grammar" and error["response"] is None
    assert error["error"]["code"] == "invalid_request"
    assert error["error"]["message"].startswith("grammar:")
