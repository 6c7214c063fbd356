"""Issue 38: a task that ran ``max_deliveries`` times without finishing is dead-lettered only
when its holders may have died; when its last run was this very live process's (its lease
lapsed while it ran on a starved host), it runs again."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from tests.unit.test_celery_results import DeadLetters, RecordingSettler
from vlmq.broker.state import State
from vlmq.broker.state.intake import Delivery, Pull
from vlmq.config.settings import FleetSettings
from vlmq.config.wire import encode_message
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.triage import Triage

REQUEST = {"messages": [{"role": "user", "content": "hi"}]}


class Tasks(DeadLetters):
    """Dead letters, and the fields of the task hashes (``state.tasks.many``)."""

    def __init__(self, worker: str) -> None:
        super().__init__()
        self.worker = worker

    def many(self, task_ids: Sequence[str], fields: Sequence[str] = ()) -> list[dict[str, str]]:
        return [{"worker": self.worker} for _ in task_ids]


def _delivery(task_id: str, outlived: int = 0) -> Delivery:
    raw = encode_message(REQUEST, task_id, "vlmq.text", ignore_result=False)
    status = {"attempts": "3", "returns": "0"}
    if outlived:
        status["outlived"] = str(outlived)
    return Delivery(task_id, raw, 4, status)


def _triage(last_worker: str) -> tuple[Triage, RecordingSettler, Tasks]:
    settler = RecordingSettler()
    tasks = Tasks(last_worker)
    fleet = FleetSettings(max_deliveries=3)
    triage = Triage(cast(State, tasks), Held(), settler, LoopObserver(), "w", "m", fleet)
    return triage, settler, tasks


def _started_here(triage: Triage, task_id: str) -> None:
    """As ``Triage.start`` remembers a run it started."""
    triage._started_here[task_id] = None


def test_a_task_whose_runs_this_live_worker_outlived_runs_again() -> None:
    triage, settler, tasks = _triage("w")
    _started_here(triage, "t")
    admitted = triage.admit(Pull([_delivery("t")], time.time()))
    assert [w.task_id for w in admitted] == ["t"]
    assert tasks.letters == [] and settler.submitted == []
    settler.close()


def test_a_task_whose_last_run_was_another_process_is_dead_lettered() -> None:
    for last_worker, remembered in (("other", True), ("w", False)):
        # Another worker's run, or this name's earlier process (a restart after a crash).
        triage, settler, tasks = _triage(last_worker)
        if remembered:
            _started_here(triage, "t")
        assert triage.admit(Pull([_delivery("t")], time.time())) == []
        assert [s.record["error"]["code"] for s in settler.submitted] == ["dead_lettered"]
        assert len(tasks.letters) == 1
        settler.close()


def test_a_run_another_live_worker_outlived_is_not_a_death() -> None:
    """Three runs, one of them outlived by its (live) worker elsewhere: two deaths, under the
    limit of 3, so it runs again; with none outlived it is dead-lettered (above)."""
    triage, settler, tasks = _triage("other")
    admitted = triage.admit(Pull([_delivery("t", outlived=1)], time.time()))
    assert [w.task_id for w in admitted] == ["t"]
    assert tasks.letters == [] and settler.submitted == []
    settler.close()


def test_outlived_runs_are_forgiven_up_to_twice_the_limit() -> None:
    """A request whose every run outlives its lease (one that starves its worker's heartbeat)
    is not run for ever: at 2x max_deliveries runs it is dead-lettered, outlived or not."""
    triage, settler, _ = _triage("w")
    _started_here(triage, "t")
    delivery = _delivery("t", outlived=5)
    delivery.status["attempts"] = "6"
    assert triage.admit(Pull([delivery], time.time())) == []
    assert [s.record["error"]["code"] for s in settler.submitted] == ["dead_lettered"]
    settler.close()
