"""The Celery meta a worker writes for tasks that arrived through Celery: which messages ask
for it, the shapes of SUCCESS / FAILURE / REVOKED, what a client without vlmq rebuilds, and
the order of links, results and chord parts. No services: Celery's in-memory broker and
cache backend."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from celery import Celery
from kombu.simple import SimpleQueue

from vlmq.broker.state import State
from vlmq.broker.state.intake import Delivery, Pull
from vlmq.broker.state.tasks import Tasks
from vlmq.celery import TaskFailed, generate
from vlmq.config.errors import InvalidRequest
from vlmq.config.settings import FleetSettings
from vlmq.config.wire import Envelope, decode_envelope, encode_message, peek_envelope
from vlmq.workers.fleet.celery_results import (
    CeleryResults,
    celery_context,
    outcome,
    success_value,
)
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.settle import Settlement, Settler
from vlmq.workers.fleet.triage import Triage

REQUEST = {"messages": [{"role": "user", "content": "hi"}]}


def _envelope(task_id: str = "t1", ignore_result: bool = False, **embed: Any) -> Envelope:
    raw = json.loads(encode_message(REQUEST, task_id, "vlmq.text", ignore_result=ignore_result))
    if embed:
        import base64

        body = json.loads(base64.b64decode(raw["body"]))
        body[2].update(embed)
        raw["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    raw["headers"]["group"] = embed.get("chord") and "g1"
    return decode_envelope(json.dumps(raw))


def _succeeded(task_id: str = "t1", **extra: Any) -> dict[str, Any]:
    return {
        "id": task_id,
        "status": "succeeded",
        "output": "hello",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        "result_url": f"s3://b/results/_tasks/{task_id}.1.json",
        "timings": {"started_at": 1.0, "finished_at": 2.0},
        "worker": "w",
        "model": "m",
        "custom_id": "c",
        **extra,
    }


def _failed(code: str, message: str = "bad") -> dict[str, Any]:
    return {"id": "t1", "status": "failed", "error": {"code": code, "message": message}}


# which messages ask -------------------------------------------------------------------------
def test_vlmq_producers_messages_ask_for_nothing():
    assert celery_context(_envelope(ignore_result=True)) is None


def test_a_celery_message_is_a_context_without_its_request():
    context = celery_context(_envelope("t9"))
    assert context is not None
    assert (context.id, context.root_id, context.ignore_result) == ("t9", "t9", False)
    assert context.args is None and context.kwargs is None  # media never kept
    assert context.correlation_id == "t9"


def test_a_link_asks_even_when_the_result_is_ignored():
    link = {"task": "app.post", "args": [], "kwargs": {}, "options": {}, "immutable": False}
    context = celery_context(_envelope(ignore_result=True, callbacks=[link]))
    assert context is not None and context.ignore_result and context.callbacks == [link]


# shapes -----------------------------------------------------------------------------------
def test_success_is_a_small_dict():
    value = success_value(_succeeded(choices=None, parsed=None, pixel_values=[1, 2]))
    assert value == {
        "id": "t1",
        "output": "hello",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        "result_url": "s3://b/results/_tasks/t1.1.json",
    }
    asked = success_value(_succeeded(choices=[{"index": 0, "text": "x"}], parsed={"a": 1}))
    assert asked["choices"] == [{"index": 0, "text": "x"}] and asked["parsed"] == {"a": 1}


def test_outcomes():
    assert outcome(_succeeded())[0] == "SUCCESS"
    state, exc = outcome(_failed("media_fetch_failed", "404"))
    assert state == "FAILURE" and isinstance(exc, TaskFailed)
    assert exc.args == ("media_fetch_failed", "404") and str(exc) == "media_fetch_failed: 404"
    assert outcome(_failed("expired")) == ("REVOKED", "expired")
    assert outcome({"id": "t1", "status": "failed"})[1].code == "internal_error"


def test_a_client_without_vlmq_rebuilds_the_failure():
    backend = Celery(backend="cache+memory://", set_as_current=False).backend
    exc = TaskFailed("invalid_request", "messages: empty")
    stored = json.loads(backend.encode(backend.prepare_exception(exc)))  # as the backend has it
    assert stored == {
        "exc_type": "TaskFailed",
        "exc_message": ["invalid_request", "messages: empty"],
        "exc_module": "vlmq.celery",
    }
    script = (
        "import json, sys\n"
        "from celery import Celery\n"
        "exc = Celery(backend='cache+memory://').backend.exception_to_python(json.loads(sys.argv[1]))\n"
        "assert 'vlmq' not in sys.modules\n"
        "print(json.dumps([type(exc).__name__, list(exc.args), isinstance(exc, Exception)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(stored)],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert json.loads(out.stdout) == ["TaskFailed", ["invalid_request", "messages: empty"], True]


# the observer ---------------------------------------------------------------------------------
@pytest.fixture
def app():
    app = Celery("unit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    return app


def _flushed(results: CeleryResults) -> None:
    results._writer.submit(lambda: None).result(timeout=10)


def _meta(app: Celery, task_id: str) -> dict[str, Any]:
    return cast(dict[str, Any], app.backend.get_task_meta(task_id))


def test_started_then_success_then_the_link(app):
    results = CeleryResults(app, None, "w-1")
    link = app.signature("app.post", queue="post")
    results.received([_envelope("t1", callbacks=[dict(link)]), _envelope("mine", True)])
    results.started(["t1", "mine"])
    _flushed(results)
    assert _meta(app, "t1")["status"] == "STARTED"
    assert _meta(app, "t1")["result"]["hostname"] == "w-1"
    assert _meta(app, "mine")["status"] == "PENDING"  # vlmq's own: nothing recorded
    results.settled([_succeeded("t1"), _succeeded("mine")])
    _flushed(results)
    meta = _meta(app, "t1")
    assert meta["status"] == "SUCCESS" and meta["result"] == success_value(_succeeded("t1"))
    with app.connection_for_read() as conn:
        message = SimpleQueue(conn, "post").get(timeout=5)
        assert message.headers["task"] == "app.post"
        assert message.headers["parent_id"] == "t1"
        assert message.decode()[0] == [success_value(_succeeded("t1"))]
    results.close()


def test_a_task_ends_once_and_only_for_the_settle_that_won(app):
    results = CeleryResults(app, None, "w")
    results.received([_envelope("t1"), _envelope("t2")])
    results.superseded(["t2"])  # another delivery has it: its settle writes
    results.settled([_succeeded("t1"), _succeeded("t2")])
    results.settled([{**_succeeded("t1"), "output": "again"}])  # nothing left to end
    _flushed(results)
    assert _meta(app, "t1")["result"]["output"] == "hello"
    assert _meta(app, "t2")["status"] == "PENDING"
    results.close()


def test_failure_expiry_and_revoke(app):
    results = CeleryResults(app, None, "w", track_started=False)
    results.received([_envelope("bad"), _envelope("late"), _envelope("gone")])
    results.started(["bad"])
    results.settled(
        [{**_failed("invalid_request"), "id": "bad"}, {**_failed("expired"), "id": "late"}]
    )
    results.revoked(["gone"])
    _flushed(results)
    bad = app.AsyncResult("bad")
    assert bad.state == "FAILURE" and bad.result.args == ("invalid_request", "bad")
    assert app.AsyncResult("late").state == "REVOKED"
    assert app.AsyncResult("gone").state == "REVOKED"
    results.close()


@pytest.mark.parametrize("end", ["failed", "revoked"])
def test_a_late_started_never_replaces_an_end(app, end):
    """A delivery that started on a worker cut off past its lease writes STARTED after
    another delivery's end was recorded: the end stays (issue 37: a terminal Celery state
    never changes)."""
    task = f"late-{end}"
    late, winner = CeleryResults(app, None, "w-late"), CeleryResults(app, None, "w-won")
    for results in (late, winner):
        results.received([_envelope(task)])
    if end == "failed":
        winner.settled([{**_failed("media_fetch_failed"), "id": task}])
    else:
        winner.revoked([task])
    _flushed(winner)
    late.started([task])
    _flushed(late)
    assert _meta(app, task)["status"] == ("FAILURE" if end == "failed" else "REVOKED")
    late.close()
    winner.close()


def test_generate_picks_the_queue_from_the_request():
    image = {"type": "image", "image": "s3://b/cat.png"}
    sig = generate.s({"messages": [{"role": "user", "content": [image, "what?"]}], "id": "r1"})
    assert sig.task == "vlmq.generate" and sig.options["queue"] == "vlmq.image.interactive"
    assert sig.options["task_id"] == "r1" and sig.kwargs["request"]["id"] == "r1"
    assert generate.s(messages=[{"role": "user", "content": "x"}]).options["queue"] == (
        "vlmq.text.interactive"
    )
    with pytest.raises(InvalidRequest, match="messages"):
        generate.s({"messages": []})


# triage ----------------------------------------------------------------------------------------
class Recording(LoopObserver):
    def __init__(self, settler: RecordingSettler) -> None:
        self.settler = settler
        self.heard: list[tuple[str, int]] = []

    def received(self, envelopes: Sequence[Envelope]) -> None:
        self.heard += [(e.task_id, len(self.settler.submitted)) for e in envelopes]


class DeadLetters:
    """The dead-letter list of a state layer (``state.tasks.dead_letter``), in memory."""

    def __init__(self) -> None:
        self.tasks = self
        self.letters: list[str] = []

    def dead_letter(self, record: str, cap: int) -> None:
        self.letters.append(record)


class RecordingSettler(Settler):
    def __init__(self) -> None:
        super().__init__(None, cast(Tasks, None), Held(), LoopObserver(), 1, 1.0)  # type: ignore[arg-type]
        self.submitted: list[Settlement] = []

    def submit_many(self, settlements: Sequence[Settlement]) -> None:
        self.submitted += settlements


def test_observers_read_a_bad_request_before_it_is_failed():
    settler = RecordingSettler()
    observer = Recording(settler)
    triage = Triage(cast(State, None), Held(), settler, observer, "w", "m", FleetSettings())
    bad = encode_message({"messages": []}, "bad", "vlmq.text", ignore_result=False)
    good = encode_message(REQUEST, "good", "vlmq.text", ignore_result=False)
    deliveries = [Delivery("bad", bad, 1, {}), Delivery("good", good, 1, {})]
    admitted = triage.admit(Pull(deliveries, time.time()))
    assert [w.task_id for w in admitted] == ["good"]
    assert observer.heard == [("bad", 0), ("good", 0)]  # heard before any settle
    assert [s.task_id for s in settler.submitted] == ["bad"]
    assert settler.submitted[0].record["error"]["code"] == "invalid_request"
    settler.close()


def test_observers_hear_of_tasks_that_end_before_their_message_is_read():
    """An oversized message, one whose body cannot be read and a dead letter are failed
    without their request being read, and still heard of with their headers (a Celery caller
    gets their FAILURE); a message asking for no result says so; a message naming no task of
    its own is not heard of: the id it carries may be another task's (issue 37, 2)."""
    settler = RecordingSettler()
    observer = Recording(settler)
    fleet = FleetSettings(max_message_bytes=4096, max_unstarted_deliveries=2)
    letters = DeadLetters()
    triage = Triage(cast(State, letters), Held(), settler, observer, "w", "m", fleet)
    big = {"messages": [{"role": "user", "content": "x" * 8000}]}
    unreadable = json.loads(encode_message(REQUEST, "unreadable", "vlmq.text", ignore_result=False))
    unreadable["body"] = "not base64!"
    raws = {
        "big": encode_message(big, "big", "vlmq.text", ignore_result=False),
        "quiet": encode_message(big, "quiet", "vlmq.text", ignore_result=True),
        "unreadable": json.dumps(unreadable),
        "dead": encode_message(REQUEST, "dead", "vlmq.text", ignore_result=False),
        "invalid-1": encode_message(REQUEST, "someone-else", "vlmq.text", ignore_result=False),
    }
    tokens = {"dead": 3}  # two holders died before starting it
    deliveries = [Delivery(i, raw, tokens.get(i, 1), {}) for i, raw in raws.items()]
    assert triage.admit(Pull(deliveries, time.time())) == []
    heard = {task_id for task_id, _ in observer.heard}
    assert heard == {"big", "quiet", "unreadable", "dead"}
    codes = {s.task_id: s.record["error"]["code"] for s in settler.submitted}
    assert codes == {
        "big": "invalid_request",
        "quiet": "invalid_request",
        "unreadable": "invalid_request",
        "dead": "dead_lettered",
        "invalid-1": "invalid_request",
    }
    assert [json.loads(letter)["task_id"] for letter in letters.letters] == ["dead"]
    settler.close()


def test_a_peek_reads_the_headers_around_the_body_only():
    raw = encode_message(REQUEST, "t1", "vlmq.text", ignore_result=False)
    peeked = peek_envelope(raw, "t1", 1024)
    assert peeked.headers == json.loads(raw)["headers"] and peeked.body is None
    assert peeked.properties["delivery_tag"] == json.loads(raw)["properties"]["delivery_tag"]
    alone = {"id": "t1"}
    assert peek_envelope(raw, "t1", 64).headers == alone  # more than the limit around the body
    assert peek_envelope(raw, "other", 1024).headers == {"id": "other"}  # its header disagrees
    assert peek_envelope("not json", "t1", 1024).headers == alone
    escaped = raw.replace('"body":"', '"body":"\\u0041', 1)  # not kombu's base64 body
    assert peek_envelope(escaped, "t1", 1024).headers == alone


def test_vlmq_celery_imports_no_torch():
    code = (
        "import sys\n"
        "from vlmq.celery import generate, submit_many\n"
        "generate.s({'messages': [{'role': 'user', 'content': 'hi'}]})\n"
        "sys.exit('torch' in sys.modules or 'vlmq.workers' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0
