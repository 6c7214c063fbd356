"""The repair of lost settles: a redelivered task whose earlier delivery stored its result is
settled with that result instead of running again (no services: a folder store, stubs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from vlmq.broker.state import State
from vlmq.broker.state.intake import Delivery
from vlmq.broker.state.tasks import Tasks
from vlmq.config.errors import StoreUnavailable
from vlmq.config.settings import FleetSettings
from vlmq.config.status import TaskState
from vlmq.stores.base import result_key
from vlmq.stores.files import FileStore
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settlement, Settler
from vlmq.workers.fleet.triage import Triage
from vlmq.workers.fleet.work import Work


class RecordingSettler(Settler):
    def __init__(self, store: Any) -> None:
        super().__init__(store, cast(Tasks, None), Held(), LoopObserver(), 4, 1.0)
        self.submitted: list[Settlement] = []

    def submit_many(self, settlements: Sequence[Settlement]) -> None:
        self.submitted += settlements


def _record(task_id: str, job: str | None, delivery: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": task_id,
        "job_id": job,
        "status": "succeeded",
        "worker": "w-old",
        "deliveries": delivery,
        "batch_id": "b1",
        **extra,
    }


def test_stored_finds_the_newest_earlier_delivery(tmp_path):
    store = FileStore(f"file://{tmp_path}")
    store.put(result_key("t1", "j", 1), _record("t1", "j", 1))
    store.put(result_key("t1", "j", 3), _record("t1", "j", 3))
    store.put(result_key("t2", None, 1), _record("someone-else", None, 1))
    store.put(result_key("t3", "j", 4), _record("t3", "j", 4))  # its own token: not looked at
    settler = RecordingSettler(store)
    found = settler.stored([("t1", "j", 4), ("t1", "j", 2), ("t2", None, 2), ("t3", "j", 4)])
    assert [(f.delivery if f else None) for f in found] == [3, 1, None, None]
    settler.close()


def test_a_store_that_cannot_be_read_means_run_again(tmp_path):
    class Broken(FileStore):
        def get(self, url_or_key: str) -> dict[str, Any] | None:
            raise StoreUnavailable("down")

    settler = RecordingSettler(Broken(f"file://{tmp_path}"))
    assert settler.stored([("t1", None, 2)]) == [None]
    settler.close()


def _work(task_id: str, token: int, job: str | None = "j") -> Work:
    status = {"state": "running", "job_id": job} if job else {"state": "running"}
    return Work(Delivery(task_id, "", token, dict(status)), status=dict(status))


def test_triage_settles_stored_results_of_redeliveries_only(tmp_path):
    store = FileStore(f"file://{tmp_path}")
    store.put(result_key("lost", "j", 1), _record("lost", "j", 1))
    failed = _record(
        "failed", "j", 2, status="failed", error={"code": "generation_failed", "message": "boom"}
    )
    store.put(result_key("failed", "j", 2), failed)
    expired = _record(
        "expired", "j", 1, status="failed", error={"code": "expired", "message": "late"}
    )
    store.put(result_key("expired", "j", 1), expired)
    store.put(result_key("first", "j", 1), _record("first", "j", 1))  # a first delivery: not read
    settler = RecordingSettler(store)
    triage = Triage(
        cast(State, None),
        Held(),
        settler,
        LoopObserver(),
        "w-new",
        "m",
        FleetSettings(),
    )
    work = [
        _work("lost", 2),
        _work("failed", 3),
        _work("expired", 2),
        _work("first", 1),
        _work("crashed", 2),
    ]
    left = triage._repair(work)
    assert [w.task_id for w in left] == ["first", "crashed"]
    by_id = {s.task_id: s for s in settler.submitted}
    assert set(by_id) == {"lost", "failed", "expired"}
    lost = by_id["lost"]
    # This delivery's token and key; the record and worker of the run that produced it.
    assert lost.token == 2 and lost.key == result_key("lost", "j", 2)
    assert lost.state is TaskState.SUCCEEDED and lost.record["deliveries"] == 1
    assert lost.fields == {
        "worker": "w-old",
        "error_code": None,
        "error_message": None,
        "batch_id": "b1",
    }
    assert by_id["failed"].state is TaskState.FAILED
    assert by_id["failed"].fields["error_code"] == "generation_failed"
    assert by_id["expired"].state is TaskState.EXPIRED
    settler.close()


def test_admit_skips_the_look_up_when_nothing_is_redelivered(tmp_path):
    class NoReads(FileStore):
        def get(self, url_or_key: str) -> dict[str, Any] | None:
            raise AssertionError("a first delivery must not read the store")

    settler = RecordingSettler(NoReads(f"file://{tmp_path}"))
    triage = Triage(
        cast(State, None),
        Held(),
        settler,
        LoopObserver(),
        "w",
        "m",
        FleetSettings(),
    )
    assert triage._repair([_work("a", 1), _work("b", 1)])
    settler.close()
