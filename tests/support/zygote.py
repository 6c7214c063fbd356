"""``python -m vlmq`` processes forked from one that has already imported what they import.

A worker's start is most of the e2e and fault tiers' time (docs/testing.md, "Where the time
goes"): each ``python -m vlmq worker`` imports torch, transformers and vlmq again. The zygote
is a process that imports them once, then forks a child per request; the child takes the
request's argv, environment, working directory and standard streams and runs ``vlmq``'s
``__main__`` as a fresh interpreter would. Forked, not spawned: the child shares the
zygote's imported modules copy-on-write.

What stays as a fresh process would have it:

* the child is a real process the test signals, kills and waits for by pid
  (``ZygotePopen`` is a ``subprocess.Popen``); it is the zygote's child, so the zygote reaps it
  and answers its exit status when the test asks (the test sees its exit through a pidfd);
* only an environment that differs from the zygote's in what is read at run time
  (``OWN_PREFIXES``: vlmq's settings, S3 credentials) is forked: anything else
  (``LD_PRELOAD`` and ``FAKETIME`` for a skewed clock, ``PYTHONPATH``, thread counts a
  library reads at import) gets a fresh process, as does any command that is not ``python -m
  vlmq``;
* the zygote forks only while it has one thread (a library that started a thread at import
  would leave the child a lock held by no one): once it refuses, every request gets a fresh
  process.

The zygote serves one test process over a socket pair and exits when that process closes its
end (or exits).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# What the tiers' vlmq processes import (a model worker's, read off one: torch, its media
# libraries, the three families' model and processor modules; a noop worker's, the CLI's and
# a Celery host's are subsets).
PRELOAD = (
    "torch",
    "torchvision",
    "transformers",
    "av",
    "PIL.Image",
    "llguidance",
    "boto3",
    "redis",
    "celery.apps.worker",
    "kombu.transport.redis",
    *(
        f"transformers.models.{family}.{module}_{family}"
        for family in ("qwen2_5_vl", "qwen3_vl", "internvl")
        for module in ("modeling", "processing", "video_processing")
        if (family, module) != ("qwen2_5_vl", "video_processing")
    ),
    "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "transformers.models.qwen2_vl.video_processing_qwen2_vl",
    "transformers.models.got_ocr2.image_processing_got_ocr2",
    "transformers.models.qwen2.tokenization_qwen2",
    "vlmq.producers.cli",
    "vlmq.workers.cli",
    "vlmq.workers.engine.runner",
    "vlmq.workers.media.loader",
    "vlmq.workers.fleet.service",
    "vlmq.stores.s3",
)
# Environment a forked child may have of its own: read at run time, never at import (vlmq's
# settings, S3's credentials, the name pytest gives the test running, and the cache folder
# torch's compiler writes into the test process's environment the first time it runs there).
OWN_PREFIXES = ("VLMQ_", "AWS_", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
# The zygote's own: numpy's OpenBLAS starts a pool thread at import, and a process forked
# with a thread it did not start is not safe (a lock the thread held stays held). Its
# children run BLAS on one thread (their torch runs on one too: VLMQ_ENGINE__TORCH_THREADS).
ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1"}
# The Popen options a forked child honours (any other, a preexec_fn, descriptors to pass, a
# process group, a user: a fresh process).
FORKED_OPTIONS = frozenset(
    {
        "stdin",
        "stdout",
        "stderr",
        "cwd",
        "text",
        "universal_newlines",
        "encoding",
        "errors",
        "bufsize",
        "start_new_session",
    }
)
MESSAGE_MAX = 1 << 20
STREAMS = 3  # stdin, stdout, stderr


# -- the zygote (its own process) ------------------------------------------------------------


def _single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answers requests until the client goes; returns a request only in a forked child."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, STREAMS)
        except ConnectionError:
            return None
        if not message:
            return None
        request = json.loads(message)
        if request["op"] == "fork":
            child = _fork(sock, request, fds)
            if child is not None:
                return child
        else:  # "status": the exit status of a child that has exited (its pidfd said so)
            _answer(sock, _status(request["pid"]))


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
    if not _single_threaded():
        for fd in fds:
            os.close(fd)
        _answer(sock, {"refused": "the zygote has threads: it cannot fork safely"})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sock.close()
        _become(request, fds)
        return request
    for fd in fds:
        os.close(fd)
    _answer(sock, {"pid": pid})
    return None


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """The child takes the request's streams, environment, directory and session."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # As `python -m` has it: the working directory first on the path.
    sys.path[0] = os.getcwd()


def _status(pid: int) -> dict[str, Any]:
    """The exit status of a child whose pidfd said it exited (it is waitable then, or within
    moments: the wait never blocks the zygote for longer)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError as exc:
            return {"error": f"no such child: {exc}"}
        if reaped:
            return {"status": status}
        if time.monotonic() > deadline:
            return {"error": f"{pid} is still running"}
        time.sleep(0.001)


def _answer(sock: socket.socket, reply: dict[str, Any]) -> None:
    sock.send(json.dumps(reply).encode())


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    # The children's collector never walks what the zygote imported: a walk writes to every
    # object it visits, and each write copies a page the child shared.
    gc.collect()
    gc.freeze()
    request = _serve(sock)
    if request is not None:
        _run_vlmq(request["args"])


def _run_vlmq(args: list[str]) -> None:
    """``python -m vlmq ARGS`` in this process, ended as the interpreter ends one (its
    threads joined, ``atexit`` run, its streams flushed) but without tearing down the modules
    it shares with the zygote (seconds of page copies, for nothing a process leaves behind)."""
    sys.argv = ["vlmq", *args]
    try:
        runpy.run_module("vlmq", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        # As the interpreter ends on an uncaught KeyboardInterrupt: by the signal itself.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    threading._shutdown()  # type: ignore[attr-defined]  # (what the interpreter calls at exit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # (a stream the program closed)
            stream.flush()


# -- the client (the test process) -------------------------------------------------------------


class ZygoteRefused(RuntimeError):
    """The zygote cannot fork safely (it has a thread): the caller starts a fresh process."""


class Zygote:
    """A test process's zygote, started at its first request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}
        self._log: IO[bytes] | None = None
        self.refused = False

    def forks(self, args: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a command with ``env`` can be forked (else: a fresh process)."""
        if self.refused or list(args[:3]) != [sys.executable, "-m", "vlmq"]:
            return False
        base = self._env if self._process else dict(os.environ)
        keys = set(base) | set(env)
        return all(base.get(k) == env.get(k) or k.startswith(OWN_PREFIXES) for k in keys)

    def fork(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        streams: Sequence[int],
        new_session: bool,
    ) -> int:
        request = {
            "op": "fork",
            "args": list(args[3:]),
            "env": dict(env),
            "cwd": cwd,
            "new_session": new_session,
        }
        reply = self._ask(request, streams)
        if "refused" in reply:
            self.refused = True
            raise ZygoteRefused(reply["refused"])
        return int(reply["pid"])

    def status(self, pid: int) -> int:
        if self._sock is None:  # (closed: its children's statuses went with it)
            raise ChildProcessError(f"the zygote that forked {pid} is gone")
        reply = self._ask({"op": "status", "pid": pid})
        if "error" in reply:
            raise ChildProcessError(reply["error"])
        return int(reply["status"])

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._process is not None:
                self._process.wait(30)
                self._process = None
            if self._log is not None:
                self._log.close()
                self._log = None

    def _ask(self, request: dict[str, Any], streams: Sequence[int] = ()) -> dict[str, Any]:
        with self._lock:
            sock = self._started()
            try:
                socket.send_fds(sock, [json.dumps(request).encode()], list(streams))
                reply = sock.recv(MESSAGE_MAX)
            except OSError:
                reply = b""
            if not reply:
                raise RuntimeError(f"the zygote exited: {self._log_tail()}")
            return json.loads(reply)

    def _started(self) -> socket.socket:
        if self._sock is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._env = dict(os.environ)
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the zygote)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.zygote", str(theirs.fileno())],
                cwd=Path(__file__).resolve().parents[2],
                pass_fds=[theirs.fileno()],
                env={**self._env, **ZYGOTE_ENV},
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            theirs.close()
            self._sock = ours
        return self._sock

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-3000:].decode(errors="replace")


ZYGOTE = Zygote()


class ZygotePopen(subprocess.Popen):
    """A ``subprocess.Popen`` whose child is forked by ``ZYGOTE``; everything else (pipes,
    text mode, ``communicate``, ``send_signal``, ``kill``) is Popen's own."""

    def _execute_child(
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: Any,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: Any,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: Any,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: Any,
        start_new_session: bool,
        process_group: Any,
    ) -> None:
        streams = [p2cread, c2pwrite, errwrite]
        streams = [fd if fd != -1 else i for i, fd in enumerate(streams)]  # (-1: inherit ours)
        self.pid = ZYGOTE.fork(
            args,
            os.environ if env is None else env,
            os.fspath(cwd) if cwd else os.getcwd(),
            streams,
            start_new_session,
        )
        self._child_created = True
        self._exited = os.pidfd_open(self.pid)
        self._close_pipe_fds(  # type: ignore[attr-defined]
            p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite
        )

    def _reap(self) -> None:
        """Its exit status, once (the caller saw its pidfd readable)."""
        with self._waitpid_lock:  # type: ignore[attr-defined]
            if self.returncode is None:
                self._handle_exitstatus(ZYGOTE.status(self.pid))  # type: ignore[attr-defined]
                os.close(self._exited)

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self.returncode is None and select.select([self._exited], [], [], 0)[0]:
            try:
                self._reap()
            except ChildProcessError:
                if _deadstate is None:  # (Popen's own clean-up passes one: it gives up)
                    raise
                self.returncode = _deadstate
                os.close(self._exited)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            if not select.select([self._exited], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            self._reap()
        return self.returncode


def vlmq_process(args: Sequence[str], env: Mapping[str, str], **popen: Any) -> subprocess.Popen:
    """``args`` (``sys.executable -m vlmq ...``) as a process: forked by the zygote where it
    can be (``forks``), else a fresh one; either way a ``subprocess.Popen``."""
    if ZYGOTE.forks(args, env) and set(popen) <= FORKED_OPTIONS:
        with contextlib.suppress(ZygoteRefused):
            return ZygotePopen(list(args), env=dict(env), **popen)
    return subprocess.Popen(list(args), env=dict(env), **popen)


if __name__ == "__main__":
    main()
