"""The frame store under faults, with real processes: a results store that refuses every
write (docs/reliability.md, the frame store under faults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes
from tests.support.services import wait_until
from vlmq.producers.client import Client

pytestmark = pytest.mark.faults


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Any:
    procs = Processes(redis_server.url, moto_server, tmp_path)
    yield procs
    procs.stop()


def _wait_job(client: Client, job: str, worker: Any, timeout: float) -> dict[str, Any]:
    """The job's status once it finished; fails at once if ``worker`` exits meanwhile."""

    def finished() -> bool:
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited with {worker.returncode}")
        return bool(client.status(job)["finished"])

    wait_until(finished, timeout=timeout, what="the job to finish")
    return client.status(job)


def test_a_results_store_that_refuses_every_write_fails_tasks_instead_of_holding_them(
    fleet: Processes,
) -> None:
    """A store that never takes a result (here a job's folder that cannot be made, as a full
    volume refuses every file): the worker retries for the deadline, then fails each task
    alone with ``store_unavailable``. Before, it retried for ever with every lease held: the
    tasks stayed running and the job never finished."""
    results = fleet.workdir / "results"
    client = fleet.client()
    items = [
        {"custom_id": f"t{n}", "messages": [{"role": "user", "content": f"task {n}"}]}
        for n in range(40)
    ]
    job = client.submit_many(items)
    results.mkdir()
    (results / job).write_text("not a folder")  # every result key of the job is under it
    worker = fleet.worker(
        "w",
        env={
            "VLMQ_RESULTS_URL": f"file://{results}",
            "VLMQ_FLEET__STORE_RETRY_DEADLINE_S": "2",
        },
    )
    status = _wait_job(client, job, worker, timeout=40)
    assert status["counts"]["failed"] == len(items)
    assert not fleet.redis.hlen(fleet.keys.inflight())  # no lease left held
    codes = {client.status(t).get("error_code") for t in client.job_task_ids(job)}
    assert codes == {"store_unavailable"}
    assert worker.poll() is None
