"""Local media files, without services: nothing local is read on a remote caller's say (the
token estimate of ``Client(local_media=False)``, as the HTTP API uses it), and a local
caller's reads take only a regular file, never block, and stay in the input's folder
(``MediaStager``, ``Preflight``, ``vlmq submit --dry-run``).

Written against public behaviour only, so the same file runs on code before the rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.blocking import fifo, within
from tests.support.samples import save_image, save_video
from vlmq.config.errors import InvalidRequest
from vlmq.config.schemas import Request
from vlmq.config.settings import MediaSettings, Settings, TenantQuota, TenantSettings
from vlmq.producers.client import Client
from vlmq.producers.preflight import Preflight
from vlmq.producers.staging import MediaStager
from vlmq.stores.files import FileStore

PROMPT_S = 20.0  # what "at once" may take on a loaded machine; a blocked read never ends


def _settings(tmp_path: Path, **media: Any) -> Settings:
    return Settings(
        model="/nonexistent-model",  # the estimate's defaults: no model files read
        results_url=f"file://{tmp_path / 'results'}",
        media=MediaSettings(**media),
        tenants=TenantSettings(default_quota=TenantQuota(max_queued_tokens=10**9)),
    )


def _request(*parts: Any) -> Request:
    content = [*parts, "what is this?"]
    return Request.model_validate({"messages": [{"role": "user", "content": content}]})


def _image(source: str) -> dict[str, str]:
    return {"type": "image", "image": source}


def _sources(request: Request) -> list[str]:
    return [p.source for p in request.messages[0].content if p.type != "text"]


def _staged_bytes(tmp_path: Path) -> list[bytes]:
    folder = tmp_path / "results" / "media"
    return [p.read_bytes() for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The input's folder, with one image in it; ``outside.png`` lies beside it."""
    inside = tmp_path / "input"
    inside.mkdir()
    save_image(inside / "a.png", size=(40, 30), seed=1)
    save_image(tmp_path / "outside.png", size=(48, 32), seed=2)
    return inside


# --- a remote caller: the token estimate of Client(local_media=False) ------------------------


def test_a_remote_callers_fifo_is_never_opened(tmp_path: Path) -> None:
    client = Client(_settings(tmp_path), local_media=False)
    with fifo(tmp_path / "pipe") as pipe:
        done, value = within(PROMPT_S, lambda: client.estimates([_request(_image(str(pipe)))], "t"))
        assert done, "the estimate blocked opening a FIFO a remote caller named"
    assert isinstance(value, list) and value[0] > 0, value


def test_a_remote_callers_device_is_never_opened(tmp_path: Path) -> None:
    """/dev/ptmx opens fine and then blocks every read: run in a process of its own, so a
    blocked read is killed with it instead of pinning a thread here."""
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx here")
    code = (
        "import json, sys\n"
        "from vlmq.config.settings import Settings, TenantQuota, TenantSettings\n"
        "from vlmq.producers.client import Client, as_request\n"
        "quota = TenantSettings(default_quota=TenantQuota(max_queued_tokens=10**9))\n"
        "client = Client(Settings(model='/nonexistent-model', tenants=quota), local_media=False)\n"
        "parts = [{'type': 'image', 'image': '/dev/ptmx'}, {'type': 'video', "
        "'video': 'file:///dev/ptmx'}, 'what?']\n"
        "request = as_request([{'role': 'user', 'content': parts}])\n"
        "print(json.dumps(client.estimates([request], 't')))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the estimate blocked reading /dev/ptmx for a remote caller")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])[0] > 0


def test_a_remote_caller_learns_nothing_of_what_a_path_holds(tmp_path: Path, folder: Path) -> None:
    save_image(tmp_path / "big.png", size=(1200, 900), seed=3)
    (tmp_path / "text.png").write_bytes(b"SECRET=1\n" * 10)
    client = Client(_settings(tmp_path), local_media=False)
    named = [
        str(folder / "a.png"),  # exists, small
        str(tmp_path / "big.png"),  # exists, large
        str(tmp_path / "no-such.png"),  # does not exist
        f"file://{tmp_path / 'text.png'}",  # exists, not an image
        str(folder),  # a directory
        "/proc/self/environ",
    ]
    estimates = client.estimates([_request(_image(path)) for path in named], "t")
    assert estimates is not None
    assert len(set(estimates)) == 1, dict(zip(named, estimates, strict=True))
    # ... and it is the estimate of a size that is not known (an https image, not fetched).
    remote = client.estimates([_request(_image("https://example.com/a.png"))], "t")
    assert remote == estimates[:1]


# --- a local caller: the pre-flight (vlmq submit --dry-run, Client(local_media=True)) ---------


def test_a_local_preflight_refuses_a_fifo_at_once(tmp_path: Path, folder: Path) -> None:
    preflight = Preflight(_settings(tmp_path))
    with fifo(folder / "pipe.png") as pipe:
        done, estimate = within(PROMPT_S, lambda: preflight.estimate(_request(_image(str(pipe)))))
        assert done, "the pre-flight blocked opening a FIFO"
    assert estimate.problem is not None and estimate.problem[0] == "media_fetch_failed"


def test_the_dry_run_refuses_a_device_at_once(tmp_path: Path, folder: Path) -> None:
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx here")
    lines = [
        {"custom_id": "device", "messages": [{"role": "user", "content": [_image("/dev/ptmx")]}]},
        {"custom_id": "fine", "messages": [{"role": "user", "content": [_image("a.png")]}]},
    ]
    job = folder / "job.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {
        **os.environ,
        "VLMQ_MODEL": "/nonexistent-model",
        "VLMQ_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens: no fleet rate, at once
    }
    command = [sys.executable, "-m", "vlmq", "submit", str(job), "--dry-run", "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("vlmq submit --dry-run blocked reading /dev/ptmx")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["media"]["images"]["read"] == 1
    failures = {e["custom_id"]: e["code"] for e in report["predicted_failures"]["first"]}
    assert failures == {"device": "media_fetch_failed"}


def test_a_local_preflight_keeps_relative_paths_in_the_input_folder(
    tmp_path: Path, folder: Path
) -> None:
    (folder / "link.png").symlink_to(tmp_path / "outside.png")
    settings = _settings(tmp_path)
    for name in ("../outside.png", "link.png"):
        estimate = Preflight(settings).estimate(_request(_image(name)), folder)
        assert estimate.problem is not None, name
        assert estimate.problem[0] == "invalid_request" and "folder" in estimate.problem[1]
    assert Preflight(settings).estimate(_request(_image("a.png")), folder).problem is None
    allowed = Preflight(settings, allow_outside_base=True)
    for name in ("../outside.png", "link.png"):
        assert allowed.estimate(_request(_image(name)), folder).problem is None, name


# --- a local caller: staging ------------------------------------------------------------------


def test_staging_keeps_relative_paths_in_the_input_folder(tmp_path: Path, folder: Path) -> None:
    (folder / "link.png").symlink_to(tmp_path / "outside.png")
    (folder / "sub").mkdir()
    (folder / "sub" / "up.png").symlink_to("../a.png")  # a link that stays inside is fine
    stager = MediaStager(_settings(tmp_path), FileStore(f"file://{tmp_path / 'results'}"))
    outcomes = stager.stage_all(
        [
            _request(_image("../outside.png")),
            _request(_image("link.png")),
            _request(_image("sub/../../outside.png")),
            _request(_image("a.png")),
            _request(_image("sub/up.png")),
        ],
        folder,
    )
    *refused, fine, linked = outcomes
    for outcome in refused:
        assert isinstance(outcome, InvalidRequest), outcome
        assert "outside the input's folder" in outcome.message
        assert outcome.field == "messages.0.content.0"
    assert isinstance(fine, Request) and isinstance(linked, Request)
    assert _sources(fine) == _sources(linked)  # one object: a.png's bytes
    assert (tmp_path / "outside.png").read_bytes() not in _staged_bytes(tmp_path)


def test_the_flag_lets_relative_paths_leave_the_input_folder(tmp_path: Path, folder: Path) -> None:
    (folder / "link.png").symlink_to(tmp_path / "outside.png")
    stager = MediaStager(
        _settings(tmp_path),
        FileStore(f"file://{tmp_path / 'results'}"),
        allow_outside_base=True,
    )
    outcomes = stager.stage_all(
        [_request(_image("../outside.png")), _request(_image("link.png"))], folder
    )
    assert all(isinstance(o, Request) for o in outcomes), outcomes
    assert _staged_bytes(tmp_path) == [(tmp_path / "outside.png").read_bytes()]


def test_proc_files_and_non_media_are_never_staged(tmp_path: Path, folder: Path) -> None:
    (folder / "notes.png").write_bytes(b"AWS_SECRET_ACCESS_KEY=hunter2\n")  # named as an image
    save_video(folder / "clip.mp4", n_frames=2, size=(16, 16), fps=2, seed=4)
    stager = MediaStager(_settings(tmp_path), FileStore(f"file://{tmp_path / 'results'}"))
    named = [
        _image("/proc/self/environ"),  # st_size 0, yet it holds the environment
        _image("file:///proc/self/environ"),
        {"type": "video", "video": "/proc/self/environ"},
        _image("notes.png"),
        _image("clip.mp4"),  # a video's bytes are not an image
    ]
    *refused, fine = stager.stage_all(
        [*(_request(part) for part in named), _request(_image("a.png"))], folder
    )
    for part, outcome in zip(named, refused, strict=True):
        assert isinstance(outcome, InvalidRequest), part
        assert "/proc" not in str(part) or "claims 0 bytes" in outcome.message, outcome
    for outcome in refused[3:]:
        assert isinstance(outcome, InvalidRequest) and "not an image" in outcome.message
    assert isinstance(fine, Request)  # the batch-mate is staged
    assert _staged_bytes(tmp_path) == [(folder / "a.png").read_bytes()]


def test_fifos_and_devices_are_refused_without_blocking(tmp_path: Path, folder: Path) -> None:
    stager = MediaStager(_settings(tmp_path), FileStore(f"file://{tmp_path / 'results'}"))
    names = ["pipe.png", "/dev/null", "/dev/zero"]
    if os.path.exists("/dev/ptmx"):
        names.append("/dev/ptmx")
    with fifo(folder / "pipe.png"):
        requests = [_request(_image(name)) for name in names]
        done, outcomes = within(PROMPT_S, lambda: stager.stage_all(requests, folder))
        assert done, "staging blocked on a FIFO or a device"
    assert all(isinstance(o, InvalidRequest) for o in outcomes), outcomes
    assert all("not a regular file" in o.message for o in outcomes)


def test_a_remote_inputs_local_paths_are_not_resolved_against_the_working_directory(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)  # a.png is right here: it must still not be read
    roots = tmp_path / "shared"
    roots.mkdir()
    stager = MediaStager(
        _settings(tmp_path, local_roots=[str(roots)]),
        FileStore(f"file://{tmp_path / 'results'}"),
    )
    requests = [
        _request(_image("a.png")),
        _request(_image(str(folder / "a.png"))),
        _request(_image(f"file://{folder / 'a.png'}")),
        _request(_image(str(roots / "x.png"))),  # read in place by the workers: goes as it is
        _request(_image("https://example.com/x.png")),
    ]
    *refused, in_place, remote = stager.stage_all(requests, None, remote_input=True)
    for outcome in refused:
        assert isinstance(outcome, InvalidRequest), outcome
        assert "input read from elsewhere" in outcome.message
    assert isinstance(in_place, Request) and _sources(in_place) == [str(roots / "x.png")]
    assert isinstance(remote, Request)
    assert _staged_bytes(tmp_path) == []
