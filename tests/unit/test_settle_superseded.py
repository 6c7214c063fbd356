"""A superseded holder's late objects: removed, and only then reported as discarded (the line
a fault drill waits on; no services: a folder store and a stub of the fenced settle)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

from vlmq.broker.state.tasks import Move, Moved, Tasks
from vlmq.config.status import TaskState
from vlmq.stores.files import FileStore
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settlement, Settler


class SupersededTasks:
    """Every move refused: a later delivery (token 2) has each task."""

    def __init__(self) -> None:
        self.outlived_calls: list[dict[str, int]] = []

    def settle(self, moves: Sequence[Move], usage: Any = None) -> list[Moved]:
        return [Moved(m.task_id, "running", False, False, "2", m.token or 0) for m in moves]

    def outlived(self, tokens: dict[str, int]) -> int:
        self.outlived_calls.append(dict(tokens))
        return len(tokens)


class KeysAtWarning(logging.Handler):
    """The store's keys at the moment each warning is logged."""

    def __init__(self, store: FileStore) -> None:
        super().__init__(logging.WARNING)
        self.store = store
        self.seen: list[tuple[str, list[str]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), self.store.keys("j")))


def test_a_superseded_holder_reports_its_discard_once_its_objects_are_gone(tmp_path):
    store = FileStore(f"file://{tmp_path}")
    settlements = [
        Settlement({"id": f"t{i}", "job_id": "j"}, TaskState.SUCCEEDED, {"worker": "w"}, 1)
        for i in range(3)
    ]
    for s in settlements:
        s.fields["result_url"] = store.put(s.key, s.record)
    assert len(store.keys("j")) == 3
    settler = Settler(store, cast(Tasks, SupersededTasks()), Held(), LoopObserver(), 2, 1.0)
    handler = KeysAtWarning(store)
    logger = logging.getLogger("vlmq.workers.fleet.settle")
    logger.addHandler(handler)
    try:
        settler.finish_many(settlements)
    finally:
        logger.removeHandler(handler)
        settler.close()
    assert handler.seen == [("3 results of superseded deliveries discarded", [])]
    assert store.keys("j") == []


def test_runs_a_superseded_holder_finished_are_said_to_be_outlived_not_died(tmp_path):
    """Issue 38: a live worker whose lease lapsed while the engine ran its task says so once
    its settle is refused, so the task's poison verdict does not count that run; a task it
    failed before any engine ran it (no attempt counted) is not said."""
    store = FileStore(f"file://{tmp_path}")
    ran = Settlement({"id": "ran", "job_id": "j"}, TaskState.SUCCEEDED, {}, 1, ran=True)
    unrun = Settlement({"id": "unrun", "job_id": "j"}, TaskState.FAILED, {}, 1)
    tasks = SupersededTasks()
    settler = Settler(store, cast(Tasks, tasks), Held(), LoopObserver(), 2, 1.0)
    try:
        settler.finish_many([ran, unrun])
    finally:
        settler.close()
    assert tasks.outlived_calls == [{"ran": 1}]
