"""The e2e and fault tiers fork their ``python -m vlmq`` processes from a zygote that has
imported torch and transformers once (tests/support/zygote.py). Each is the process a fresh
interpreter would be: its own arguments, environment, directory, streams and session; the
test signals, kills and waits for it by pid, and sees its exit status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import zygote
from tests.support.services import wait_until
from tests.support.zygote import ZYGOTE, ZygotePopen, vlmq_process
from vlmq.config.keys import Keys

DEAD_REDIS = "redis://127.0.0.1:1/0"  # (nothing listens on port 1)


def _vlmq(*args: str, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    return vlmq_process(
        [sys.executable, "-m", "vlmq", *args], {**os.environ, **(env or {})}, **popen
    )


def test_a_forked_vlmq_has_its_own_arguments_environment_directory_and_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status = _vlmq(
        "status",
        "j1",
        "--json",
        env={"VLMQ_REDIS_URL": DEAD_REDIS},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = status.communicate(timeout=60)
    assert isinstance(status, ZygotePopen)
    # Its environment's Redis (the zygote's has none: it would name 6379), its exit status.
    assert status.returncode == 75, err
    assert "127.0.0.1:1" in err and out == ""

    # Torch sets it in the test process (after the zygote started) the first time it compiles
    # there: it must not stop every later fork.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    made = _vlmq("make-examples", cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    out, _ = made.communicate(timeout=60)
    assert isinstance(made, ZygotePopen) and made.returncode == 0
    assert Path(out.strip()) == tmp_path / ".vlmq" / "examples" / "requests.resolved.jsonl"
    assert Path(out.strip()).is_file()  # written under its own working directory


def test_a_forked_worker_is_signalled_killed_and_waited_for_by_pid(
    fleet_env: dict[str, str], redis_server: Any
) -> None:
    redis = redis_server.connect()
    noop = ("worker", "--engine", "noop", "--no-celery", "--modality", "text", "--name")
    stopped = _vlmq(
        *noop, "stopped", env=fleet_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    killed = _vlmq(
        *noop,
        "killed",
        env=fleet_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert isinstance(stopped, ZygotePopen) and isinstance(killed, ZygotePopen)
        for name in ("stopped", "killed"):
            wait_until(lambda n=name: redis.hexists(Keys().workers(), n), 60, what=name)
        assert os.getsid(killed.pid) == killed.pid  # a session of its own, as asked
        assert os.getsid(stopped.pid) == os.getsid(0)
        assert stopped.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            stopped.wait(0.2)
        stopped.send_signal(signal.SIGTERM)
        killed.kill()
        assert stopped.wait(60) == 0
        assert killed.wait(60) == -signal.SIGKILL
        assert killed.poll() == -signal.SIGKILL
    finally:
        for proc in (stopped, killed):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_what_a_fork_cannot_give_gets_a_fresh_process(tmp_path: Path) -> None:
    # An environment a library reads at import (a preloaded library, a skewed clock).
    preloaded = _vlmq("--help", env={"LD_PRELOAD": ""}, stdout=subprocess.DEVNULL)
    # A command that is not `python -m vlmq`.
    other = vlmq_process([sys.executable, "-c", "pass"], dict(os.environ))
    for proc in (preloaded, other):
        assert type(proc) is subprocess.Popen
        assert proc.wait(60) == 0


def test_a_zygote_with_a_thread_refuses_to_fork_and_closes_the_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(zygote, "_single_threaded", lambda: False)
    streams = [*os.pipe(), os.open(os.devnull, os.O_WRONLY)]  # (what recv_fds gives it)
    request = {"op": "fork", "args": [], "env": {}, "cwd": "/", "new_session": False}
    assert zygote._fork(theirs, request, streams) is None  # (no child: this process goes on)
    assert "refused" in json.loads(ours.recv(1000))
    for fd in streams:
        with pytest.raises(OSError):
            os.fstat(fd)
    ours.close()
    theirs.close()


def test_a_refusal_gives_this_and_every_later_command_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ZYGOTE, "refused", False)
    monkeypatch.setattr(ZYGOTE, "_ask", lambda *_: {"refused": "it has a thread"})
    first = _vlmq("--help", stdout=subprocess.DEVNULL)
    assert type(first) is subprocess.Popen and first.wait(60) == 0
    assert ZYGOTE.refused
    assert not ZYGOTE.forks([sys.executable, "-m", "vlmq", "--help"], dict(os.environ))
