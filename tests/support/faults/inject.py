"""Deterministic faults in a worker, so the GPU and fleet failure paths run on CPU.

A test starts a worker with ``Faults(...).env()``: the worker's entry point imports this module
(it is named by ``VLMQ_TEST_HOOK``; ``run_test_hook`` in workers/cli.py) and calls
:func:`install` with the engine it built, before it builds anything else. The faults are
patches of the product's classes in that process only; in-process, :func:`injected` applies
them for the length of a ``with``. Production settings know nothing of them, and none of this
is installed with vlmq.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from vlmq.config.errors import OutOfMemory
from vlmq.config.schemas import Request, TextPart
from vlmq.workers.cli import TEST_HOOK_ENV
from vlmq.workers.engine.noop import NoopEngine

__all__ = ["EXIT_INJECTED_CRASH", "Faults", "InjectedFault", "injected", "install", "patches"]

# Exit status of a worker a crash marker killed.
EXIT_INJECTED_CRASH = 86
# The faults a worker installs, as JSON (Faults' fields).
FAULTS_ENV = "VLMQ_TEST_FAULTS"
# The checkout: on a worker's path so that it imports this module from any directory.
ROOT = Path(__file__).resolve().parents[3]

Patch = tuple[Any, str, Callable[..., Any]]  # (class, attribute, replacement)


class InjectedFault(RuntimeError):
    """A fault raised on purpose (the poison marker)."""


@dataclass(frozen=True)
class Faults:
    # Raise an out-of-memory error for any micro-batch larger than this (HF engine).
    oom_above_batch: int | None = None
    # Raise inside generate for any micro-batch holding a request whose text contains this
    # marker: a "poison" request for bisection (HF engine).
    poison_marker: str | None = None
    # Exit the worker abruptly (as a segfault or an OOM kill would) when a batch holds a
    # request whose text contains this marker (HF and noop engines).
    crash_marker: str | None = None
    # The same while the request is prepared, before it starts: a native decoder crash or an
    # OOM kill while decoding (noop engine, and a prepare worker's media loading).
    prepare_crash_marker: str | None = None
    # The first N settles of a worker raise an unexpected error (a bug in settling).
    settle_errors: int = 0
    # The worker's Nth heartbeat raises an unexpected error (a bug in the renewal thread).
    heartbeat_error_at: int | None = None

    def env(self) -> dict[str, str]:
        """The environment that makes a ``vlmq worker`` process install these faults."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        return {TEST_HOOK_ENV: __name__, FAULTS_ENV: json.dumps(asdict(self)), "PYTHONPATH": path}

    @classmethod
    def from_env(cls) -> Faults:
        return cls(**json.loads(os.environ.get(FAULTS_ENV) or "{}"))


def install(engine: Any) -> None:
    """The worker's test hook: patch in the faults its environment names, for good."""
    for owner, name, replacement in patches(Faults.from_env(), engine):
        setattr(owner, name, replacement)


@contextmanager
def injected(faults: Faults, engine: Any = None) -> Iterator[None]:
    """The faults for ``engine`` (an HF engine when None) in this process, inside the block."""
    with ExitStack() as stack:
        for owner, name, replacement in patches(faults, engine):
            stack.enter_context(mock.patch.object(owner, name, replacement))
        yield


def patches(faults: Faults, engine: Any) -> list[Patch]:
    """What to patch for ``faults`` in a worker serving with ``engine``."""
    found = _noop_patches(faults) if isinstance(engine, NoopEngine) else _runner_patches(faults)
    return found + _fleet_patches(faults)


def _text(request: Request) -> str:
    return " ".join(
        part.text for m in request.messages for part in m.content if isinstance(part, TextPart)
    )


def _crash_if_marked(marker: str | None, requests: Sequence[Request]) -> None:
    if marker and any(marker in _text(r) for r in requests):
        os._exit(EXIT_INJECTED_CRASH)  # no cleanup, as a segfault or an OOM kill


def _runner_patches(faults: Faults) -> list[Patch]:
    """The HF engine's padded generate (imported only when a fault needs it: torch)."""
    if faults.oom_above_batch is None and not faults.poison_marker and not faults.crash_marker:
        return []
    from vlmq.workers.engine.runner import BatchRunner

    def faulty(method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (a micro-batch entering the model: transformers' generate, or the decode
        loop's admission), failing as the faults say."""

        def entered(self: BatchRunner, collated: Any) -> Any:
            requests = [item.request for item in collated.items]
            limit = faults.oom_above_batch
            if limit is not None and len(requests) > limit:
                raise OutOfMemory(f"injected: batch of {len(requests)} above {limit}")
            marker = faults.poison_marker
            if marker and any(marker in _text(r) for r in requests):
                raise InjectedFault("injected poison request")
            _crash_if_marked(faults.crash_marker, requests)
            return method(self, collated)

        return entered

    return [
        (BatchRunner, "generate", faulty(BatchRunner.generate)),
        (BatchRunner, "admission", faulty(BatchRunner.admission)),
    ]


def _noop_patches(faults: Faults) -> list[Patch]:
    from vlmq.workers.engine.interface import RunOnlyEngine

    found: list[Patch] = []
    if faults.crash_marker:
        run = NoopEngine.run

        def crashing_run(self: Any, requests: Sequence[Request], *args: Any, **kw: Any) -> Any:
            _crash_if_marked(faults.crash_marker, requests)
            return run(self, requests, *args, **kw)

        found.append((NoopEngine, "run", crashing_run))
    if faults.prepare_crash_marker:
        prepare = RunOnlyEngine.prepare  # how the loop prepares for a run-only engine

        def crashing_prepare(self: RunOnlyEngine, request: Request, *args: Any) -> Any:
            _crash_if_marked(faults.prepare_crash_marker, [request])
            return prepare(self, request, *args)

        found.append((RunOnlyEngine, "prepare", crashing_prepare))
    return found


def _fleet_patches(faults: Faults) -> list[Patch]:
    found: list[Patch] = []
    if faults.prepare_crash_marker:
        from vlmq.workers.fleet.prepare_tier import PrepareLoop

        load = PrepareLoop._load  # how a prepare worker loads a request's media

        def crashing_load(self: PrepareLoop, request: Request, *args: Any) -> Any:
            _crash_if_marked(faults.prepare_crash_marker, [request])
            return load(self, request, *args)

        found.append((PrepareLoop, "_load", crashing_load))
    if faults.settle_errors:
        from vlmq.workers.fleet.settle import Settler

        failing = _failing_first(Settler._store_all, faults.settle_errors, "settle")
        found.append((Settler, "_store_all", failing))
    if faults.heartbeat_error_at:
        from vlmq.workers.fleet.loop import BatchLoop

        failing = _failing_nth(BatchLoop.heartbeat, faults.heartbeat_error_at, "heartbeat")
        found.append((BatchLoop, "heartbeat", failing))
    return found


def _failing_first(method: Callable[..., Any], times: int, what: str) -> Callable[..., Any]:
    """``method``, whose first ``times`` calls raise instead (the settle's thread pool calls
    it from two threads)."""
    left = itertools.count(times, -1)
    lock = threading.Lock()

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            fail = next(left) > 0
        if fail:
            raise RuntimeError(f"injected {what} error")
        return method(self, *args, **kwargs)

    return failing


def _failing_nth(method: Callable[..., Any], nth: int, what: str) -> Callable[..., Any]:
    """``method``, whose ``nth`` call raises instead."""
    calls = itertools.count(1)

    def failing(self: Any) -> Any:
        if next(calls) == nth:
            raise RuntimeError(f"injected {what} error")
        return method(self)

    return failing
