"""Faults reach a worker through its test hook (``VLMQ_TEST_HOOK``), never through settings."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults.inject import FAULTS_ENV, ROOT, Faults, injected, patches
from vlmq.workers.cli import TEST_HOOK_ENV, run_test_hook
from vlmq.workers.engine.noop import NoopEngine
from vlmq.workers.fleet.loop import BatchLoop
from vlmq.workers.fleet.settle import Settler

pytestmark = pytest.mark.unit


def test_the_worker_hands_its_engine_to_the_module_the_hook_names(tmp_path, monkeypatch):
    (tmp_path / "recording_hook.py").write_text(
        "seen = []\ndef install(engine):\n    seen.append(engine)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TEST_HOOK_ENV, "recording_hook")
    engine = NoopEngine()
    run_test_hook(engine)
    assert sys.modules.pop("recording_hook").seen == [engine]


def test_without_the_hook_nothing_is_imported(monkeypatch):
    monkeypatch.delenv(TEST_HOOK_ENV, raising=False)

    def refuse(name: str, *args: Any) -> None:
        raise AssertionError(f"imported {name}")

    monkeypatch.setattr(importlib, "import_module", refuse)
    run_test_hook(NoopEngine())


def test_faults_env_names_this_module_and_puts_the_checkout_on_the_path():
    env = Faults(settle_errors=2, crash_marker="X").env()
    assert env[TEST_HOOK_ENV] == "tests.support.faults.inject"
    assert json.loads(env[FAULTS_ENV])["settle_errors"] == 2
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert first == str(ROOT) and (Path(first) / "tests" / "support").is_dir()


def test_injected_faults_patch_the_worker_only_inside_the_block():
    store_all, heartbeat, run = Settler._store_all, BatchLoop.heartbeat, NoopEngine.run
    faults = Faults(settle_errors=1, heartbeat_error_at=2, crash_marker="X")
    with injected(faults, NoopEngine()):
        assert Settler._store_all is not store_all
        assert BatchLoop.heartbeat is not heartbeat
        assert NoopEngine.run is not run
        with pytest.raises(RuntimeError, match="injected settle error"):
            Settler._store_all(None, [])  # type: ignore[arg-type]
    assert (Settler._store_all, BatchLoop.heartbeat, NoopEngine.run) == (store_all, heartbeat, run)


def test_only_an_engine_other_than_the_noop_one_gets_the_runner_patch():
    from vlmq.workers.engine.runner import BatchRunner

    faults = Faults(oom_above_batch=1)
    assert patches(faults, NoopEngine()) == []
    # Where a micro-batch enters the model: transformers' generate, or the decode loop.
    assert [(owner, name) for owner, name, _ in patches(faults, None)] == [
        (BatchRunner, "generate"),
        (BatchRunner, "admission"),
    ]
