"""What ``vlmq submit`` stages, on real Redis and moto's S3: relative media paths stay in the
input file's folder (``..`` and symlinks out are refused; ``--allow-media-outside-input-dir``
allows them), ``/proc`` files and bytes that are not media are never uploaded, and an input
read from S3 has none of its local paths read (not even against the working directory). Each
refused line fails alone, named by its line number, and its batch-mates run.

Written against public behaviour only (the CLI), so the same file runs on code before the
rule."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.samples import data_uri, save_image
from vlmq.config.staging import split_s3_url
from vlmq.producers.cli import cli
from vlmq.producers.client import Client
from vlmq.producers.export import iter_line_errors, job_summary


@pytest.fixture
def env(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("VLMQ_RESULTS_URL", settings.results_url)
    monkeypatch.setenv("VLMQ_S3_ENDPOINT_URL", str(settings.s3_endpoint_url))
    return settings


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The input's folder with an image in it; ``outside.png`` beside the folder, a symlink
    to it inside, a text file named like an image."""
    inside = tmp_path / "input"
    inside.mkdir()
    save_image(inside / "a.png", size=(40, 30), seed=1)
    save_image(tmp_path / "outside.png", size=(48, 32), seed=2)
    (inside / "link.png").symlink_to(tmp_path / "outside.png")
    (inside / "notes.png").write_bytes(b"AWS_SECRET_ACCESS_KEY=hunter2\n")
    return inside


def _line(custom_id: str, *parts: Any) -> str:
    content = [*parts, "what is this?"] if parts else "hello"
    return json.dumps({"custom_id": custom_id, "messages": [{"role": "user", "content": content}]})


def _image(source: str) -> dict[str, str]:
    return {"type": "image", "image": source}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _staged_digests(settings: Any, moto_server: Any) -> set[str]:
    bucket, prefix = split_s3_url(settings.results_url)
    listing = moto_server.s3().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/media/")
    return {Path(o["Key"]).stem for o in listing.get("Contents", [])}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _errors(settings: Any, job: str) -> dict[int, str]:
    return {e["line"]: e["error"]["message"] for e in iter_line_errors(Client(settings), job)}


def _lines(folder: Path) -> list[str]:
    """Lines 1-6 run; 7-11 name what a local user's input may not make staging read."""
    return [
        _line("a-1", _image("a.png")),
        _line("a-2", _image("a.png")),
        _line("a-3", _image(str(folder / "a.png"))),  # absolute: taken as named
        _line("text-1"),
        _line("text-2"),
        _line("text-3"),
        _line("dotdot", _image("../outside.png")),
        _line("symlink", _image("link.png")),
        _line("environ", _image("/proc/self/environ")),
        _line("environ-url", {"type": "video", "video": "file:///proc/self/environ"}),
        _line("not-media", _image("notes.png")),
    ]


def test_submit_refuses_what_leaves_the_folder_or_is_not_media_line_by_line(
    env: Any, folder: Path, tmp_path: Path, moto_server: Any
) -> None:
    path = _write(folder / "job.jsonl", _lines(folder))
    result = CliRunner().invoke(cli, ["submit", str(path), "--job", "confined"])
    assert result.exit_code == 0, result.output
    summary = job_summary(Client(env), "confined")
    assert summary["total"] == 6 and summary["errors"] == 5, summary
    errors = _errors(env, "confined")
    assert sorted(errors) == [7, 8, 9, 10, 11], errors
    assert "outside the input's folder" in errors[7] and "outside the input's folder" in errors[8]
    assert "claims 0 bytes" in errors[9] and "claims 0 bytes" in errors[10]
    assert "not an image" in errors[11]
    assert _staged_digests(env, moto_server) == {_sha(folder / "a.png")}


def test_the_flag_lets_relative_paths_leave_the_input_folder(
    env: Any, folder: Path, tmp_path: Path, moto_server: Any
) -> None:
    path = _write(folder / "job.jsonl", _lines(folder))
    result = CliRunner().invoke(
        cli, ["submit", str(path), "--job", "allowed", "--allow-media-outside-input-dir"]
    )
    assert result.exit_code == 0, result.output
    summary = job_summary(Client(env), "allowed")
    assert summary["total"] == 8 and summary["errors"] == 3, summary
    assert sorted(_errors(env, "allowed")) == [9, 10, 11]  # /proc and non-media: still refused
    staged = _staged_digests(env, moto_server)
    assert staged == {_sha(folder / "a.png"), _sha(tmp_path / "outside.png")}


def test_an_s3_inputs_local_paths_are_never_read(
    env: Any, folder: Path, moto_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)  # a.png is in the working directory: it must not be read
    save_image(folder.parent / "inline.png", size=(24, 24), seed=5)
    inline = data_uri((folder.parent / "inline.png").read_bytes(), "image/png")
    lines = [
        _line("text-1"),
        _line("text-2"),
        _line("inline", {"type": "image_url", "image_url": {"url": inline}}),
        _line("relative", _image("a.png")),
        _line("absolute", _image(str(folder / "a.png"))),
        _line("file-url", _image(f"file://{folder / 'a.png'}")),
        _line("text-3"),
    ]
    bucket, _ = split_s3_url(env.results_url)
    body = "".join(line + "\n" for line in lines).encode()
    moto_server.s3().put_object(Bucket=bucket, Key="in/remote.jsonl", Body=body)
    result = CliRunner().invoke(cli, ["submit", f"s3://{bucket}/in/remote.jsonl", "--job", "s3in"])
    assert result.exit_code == 0, result.output
    summary = job_summary(Client(env), "s3in")
    assert summary["total"] == 4 and summary["errors"] == 3, summary
    errors = _errors(env, "s3in")
    assert sorted(errors) == [4, 5, 6], errors
    assert all("read from elsewhere" in message for message in errors.values()), errors
    # Only the data: URI's bytes were staged: nothing of this machine's disk.
    assert _staged_digests(env, moto_server) == {_sha(folder.parent / "inline.png")}


def test_validating_processes_apply_the_same_rules(
    env: Any, folder: Path, tmp_path: Path, moto_server: Any
) -> None:
    path = _write(folder / "job.jsonl", _lines(folder))
    result = CliRunner().invoke(cli, ["submit", str(path), "--job", "procs", "--processes", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(_errors(env, "procs")) == [7, 8, 9, 10, 11]
    allowed = ["submit", str(path), "--job", "procs-allowed", "--processes", "2"]
    result = CliRunner().invoke(cli, [*allowed, "--allow-media-outside-input-dir"])
    assert result.exit_code == 0, result.output
    assert sorted(_errors(env, "procs-allowed")) == [9, 10, 11]
    assert _staged_digests(env, moto_server) == {
        _sha(folder / "a.png"),
        _sha(tmp_path / "outside.png"),
    }
