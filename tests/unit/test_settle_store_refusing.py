"""A results store that refuses every write (a full volume, an outage that does not end):
each task fails alone once the batch's retries reach their deadline, instead of staying
running with its lease held (no services: a folder store and a stub of the fenced settle)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from vlmq.broker.state.intake import Delivery
from vlmq.broker.state.tasks import Move, Moved, Tasks
from vlmq.config.errors import StoreUnavailable
from vlmq.config.status import TaskState
from vlmq.stores.files import FileStore
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settlement, Settler

pytestmark = pytest.mark.unit


class Full(FileStore):
    """Every write refused, as by a full disk; the first ``accept`` are taken."""

    accept = 0

    def put(self, key: str, record: dict[str, Any]) -> str:
        if self.accept > 0:
            self.accept -= 1
            return super().put(key, record)
        raise StoreUnavailable("the results folder could not be written")


class RecordingTasks:
    def __init__(self) -> None:
        self.moves: list[Move] = []

    def settle(self, moves: Sequence[Move], usage: Any = None) -> list[Moved]:
        self.moves += moves
        return [Moved(m.task_id, "running", True, True, str(m.token), m.token or 0) for m in moves]


def test_a_store_that_refuses_every_write_fails_each_task_at_the_deadline(tmp_path: Path) -> None:
    store = Full(f"file://{tmp_path}")
    store.accept = 1
    tasks, held = RecordingTasks(), Held()
    held.add(Delivery(f"t{i}", "", 1, {}) for i in range(4))
    settler = Settler(store, cast(Tasks, tasks), held, LoopObserver(), 2, 0.05, 0.5)
    settlements = [
        Settlement(
            {"id": f"t{i}", "job_id": "j", "status": "succeeded", "output": "x"},
            TaskState.SUCCEEDED,
            {"worker": "w"},
            1,
        )
        for i in range(4)
    ]
    started = time.monotonic()
    settler.submit_many(settlements)
    try:
        # One deadline for the batch, not one per upload (they run one after another here).
        assert settler.drain(timeout_s=10)
    finally:
        settler.close()
    assert time.monotonic() - started < 2.5
    states = {m.task_id: (m.state, m.fields.get("error_code")) for m in tasks.moves}
    assert states == {
        "t0": (TaskState.SUCCEEDED, None),
        "t1": (TaskState.FAILED, "store_unavailable"),
        "t2": (TaskState.FAILED, "store_unavailable"),
        "t3": (TaskState.FAILED, "store_unavailable"),
    }
    failed = next(m for m in tasks.moves if m.task_id == "t1")
    assert "result_url" not in failed.fields
    assert failed.fields["error_message"].endswith("the results store refused it for 0.5 s")
    assert held.tokens() == {}  # nothing left held, so nothing is renewed for ever
