"""Issue 23, hostile producers: what a message or a job id a producer chooses can do to
other tenants' work, against real ``vlmq worker`` processes.

Any Celery producer may push any protocol-2 JSON message into a class's plain queue
(``send_task(..., queue="vlmq.text")``); it may fail alone, never touch another task or job.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import TERMINAL_STATES, Processes, celery_message
from tests.support.services import wait_until
from vlmq.config.errors import InvalidRequest
from vlmq.config.keys import Keys

PLAIN_QUEUE = "vlmq.text"  # where a plain send_task(queue="vlmq.text") lands


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(redis_server.url, moto_server, tmp_path)
    yield processes
    processes.stop()


def _conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _request(task_id: str, text: str, **fields: Any) -> dict[str, Any]:
    return {"id": task_id, "messages": _conversation(text), "max_new_tokens": 4, **fields}


def _wait_ended(fleet: Processes, client: Any, task_ids: list[str], timeout: float = 20) -> None:
    try:
        wait_until(
            lambda: set(fleet.states(client, task_ids).values()) <= TERMINAL_STATES,
            timeout=timeout,
            what="tasks ended",
        )
    except TimeoutError:
        seen = {t: _summary(client.status(t)) for t in task_ids}
        pytest.fail(f"not all ended in {timeout:.0f} s: {seen}")


def _summary(status: dict[str, Any]) -> str:
    return f"{status.get('state')} (deliveries {status.get('deliveries')})"


def test_a_nested_id_names_no_other_tenants_task(fleet: Processes) -> None:
    """Defect 5. A message whose headers hold a nested "id" before their own
    (``{"headers": {"trace": {"id": <victim>}, "id": "mine"}}``) is pulled as the victim's:
    the pull takes the first ``"id":"`` of the raw text, the worker reads ``headers.id``,
    finds they disagree and fails the victim, another tenant's queued task, as
    invalid_request. Expected: the victim runs and succeeds; the hostile message ends alone
    under an id of its own (never the victim's)."""
    alice = fleet.client(tenant="alice")
    job = alice.submit_many([_conversation("the victim")], job_id="alice-job")
    (victim,) = alice.job_task_ids(job)
    hostile = celery_message(
        "mine", _request("mine", "hostile"), PLAIN_QUEUE, {"trace": {"id": victim}}
    )
    fleet.redis.lpush(PLAIN_QUEUE, hostile)
    fleet.worker("w-nested")
    _wait_ended(fleet, alice, [victim])
    fleet.wait_drained(PLAIN_QUEUE, Keys().job_queue("text", job))
    status = alice.status(victim)
    assert (status["state"], status.get("error_code") or None) == ("succeeded", None)
    assert (alice.result(victim) or {}).get("status") == "succeeded"


def test_a_plain_message_cannot_join_another_job(fleet: Processes) -> None:
    """Defect 6. A plain ``send_task`` message whose request names another tenant's job
    (``request.job_id``) is counted in that job when it runs: the job counts a success it
    never had (succeeded above total), can report completed while its own tasks wait, fires
    job.finished and bills its tenant. Expected: the job counts only its own 2 tasks."""
    alice = fleet.client(tenant="alice")
    job = alice.submit_many([_conversation(f"alice {i}") for i in range(2)], job_id="alice-job")
    own = list(alice.job_task_ids(job))
    intruder = _request("intruder-1", "not alice's", job_id=job)
    fleet.redis.lpush(PLAIN_QUEUE, celery_message("intruder-1", intruder, PLAIN_QUEUE, {}))
    fleet.worker("w-intruder")
    _wait_ended(fleet, alice, [*own, "intruder-1"])
    fleet.wait_drained(PLAIN_QUEUE, Keys().job_queue("text", job))
    status = alice.status(job)
    assert status["total"] == 2
    assert status["counts"]["succeeded"] == 2, status["counts"]
    assert status["done"] == status["total"]


def test_a_dot_dot_job_id_is_refused_or_fails_alone(
    redis_server: Any, moto_server: Any, tmp_path: Path
) -> None:
    """Defect 7. Job id ``..`` passes every id check; the file store then refuses its result
    key (ConfigError), which releases the whole settle batch: the task is redelivered for
    ever and its batch-mates of other jobs run again. Expected: ``..`` is refused as a job
    id, or its task ends (failed) alone while its batch-mate is delivered once."""
    results = f"file://{tmp_path / 'results'}"
    fleet = Processes(redis_server.url, moto_server, tmp_path, VLMQ_RESULTS_URL=results)
    try:
        client = fleet.client()
        mate_job = client.submit_many([_conversation("batch-mate")], job_id="mate")
        (mate,) = client.job_task_ids(mate_job)
        try:
            client.submit_many([_conversation("dot dot")], job_id="..")
        except InvalidRequest:
            return  # refused: nothing of it reaches a worker
        (dotdot,) = client.job_task_ids("..")
        fleet.worker("w-dotdot")
        _wait_ended(fleet, client, [mate, dotdot], timeout=15)
        assert client.status(mate)["state"] == "succeeded"
        assert client.status(mate).get("deliveries") == "1"
    finally:
        fleet.stop()
