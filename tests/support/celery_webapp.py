"""The scenarios tests/e2e/test_celery_app.py drives against a vlmq fleet from a web app that
only has Celery (it never imports vlmq): the app is examples/celery_app.py (its tasks run by
its own worker, ``celery -A celery_app worker``). Each scenario runs as
``python celery_webapp.py SCENARIO ARGS_JSON`` with examples/ on the path; its findings are
the last line of its output, as JSON.

Environment: ``CELERY_BROKER_URL`` (the fleet's Redis), ``CELERY_RESULT_BACKEND``.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from typing import Any

from celery import chord, group, signature
from celery_app import app, collect, report_failure, word_count

TIMEOUT_S = 90


def _request(text: str, media: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    content: Any = [media, text] if media else text
    return {"messages": [{"role": "user", "content": content}], "max_new_tokens": 4, **extra}


def _generate(request: dict[str, Any], queue: str = "vlmq.text") -> Any:
    return signature("vlmq.generate", kwargs={"request": request}, queue=queue)


def _error(result: Any) -> list[Any]:
    try:
        result.get(timeout=TIMEOUT_S)
    except Exception as exc:
        return [type(exc).__name__, list(exc.args)]
    return ["no exception", []]


# scenarios -----------------------------------------------------------------------------------
def get(image: str, video: str) -> dict[str, Any]:
    sent = {
        "text": app.send_task(
            "vlmq.generate", kwargs={"request": _request("hi")}, queue="vlmq.text"
        ),
        "image": app.send_task(
            "vlmq.generate",
            kwargs={"request": _request("what?", {"type": "image", "image": image})},
            queue="vlmq.image",
        ),
        "video": _generate(
            _request("what?", {"type": "video", "video": video}), "vlmq.video"
        ).apply_async(),
    }
    results = {kind: r.get(timeout=TIMEOUT_S) for kind, r in sent.items()}
    return {"ids": {k: r.id for k, r in sent.items()}, "results": results}


def one() -> dict[str, Any]:
    return app.send_task(
        "vlmq.generate", kwargs={"request": _request("once")}, queue="vlmq.text"
    ).get(timeout=TIMEOUT_S)


def failure(missing_image: str) -> dict[str, Any]:
    invalid = app.send_task(
        "vlmq.generate", kwargs={"request": {"messages": []}}, queue="vlmq.text"
    )
    unreadable = app.send_task(
        "vlmq.generate",
        kwargs={"request": _request("what?", {"type": "image", "image": missing_image})},
        queue="vlmq.image",
    )
    return {
        "invalid": _error(invalid),
        "unreadable": _error(unreadable),
        "state": invalid.state,
        "vlmq_imported": "vlmq" in sys.modules,
    }


def canvas() -> dict[str, Any]:
    link = word_count.s().freeze()
    linked = _generate(_request("one two")).apply_async(link=word_count.s().set(task_id=link.id))
    errback = report_failure.s().freeze()
    failing = _generate({"messages": []}).apply_async(
        link_error=report_failure.s().set(task_id=errback.id)
    )
    headers = [_generate(_request(f"member {i}")) for i in range(3)]
    chorded = chord(headers, collect.s()).apply_async()
    grouped = group(_generate(_request(f"g {i}")) for i in range(3)).apply_async()
    chained = (_generate(_request("a b c")) | word_count.s()).apply_async()
    return {
        "linked": linked.get(timeout=TIMEOUT_S)["id"],
        "link": app.AsyncResult(link.id).get(timeout=TIMEOUT_S),
        "failing": failing.id,
        "errback": app.AsyncResult(errback.id).get(timeout=TIMEOUT_S),
        "chord": chorded.get(timeout=TIMEOUT_S),
        "chord_headers": [h.get(timeout=TIMEOUT_S)["output"] for h in chorded.parent.results],
        "group": [r["id"] for r in grouped.get(timeout=TIMEOUT_S)],
        "group_ids": [r.id for r in grouped.results],
        "chain": chained.get(timeout=TIMEOUT_S),
        "chain_first": chained.parent.id,
    }


def _wait_state(result: Any, state: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while result.state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{result.id} never {state} (is {result.state})")
        time.sleep(0.05)


def revoke(queue: str) -> dict[str, Any]:
    """A task queued (or prefetched) behind a running one is revoked: it never runs."""
    running = app.send_task("vlmq.generate", kwargs={"request": _request("first")}, queue=queue)
    _wait_state(running, "STARTED")
    queued = app.send_task("vlmq.generate", kwargs={"request": _request("second")}, queue=queue)
    replies = app.control.revoke(queued.id, reply=True, timeout=3)
    running.get(timeout=TIMEOUT_S)
    _wait_state(queued, "REVOKED")
    unseen_id = str(uuid.uuid4())
    app.control.revoke(unseen_id)  # before it is even sent: the message is dropped
    unseen = app.send_task(
        "vlmq.generate", kwargs={"request": _request("third")}, queue=queue, task_id=unseen_id
    )
    after = app.send_task("vlmq.generate", kwargs={"request": _request("after")}, queue=queue)
    after.get(timeout=TIMEOUT_S)  # the same queue drained past the unseen one
    return {
        "queued": queued.id,
        "replies": replies,
        "state": queued.state,
        "unseen": unseen.id,
        "unseen_state": unseen.state,
    }


def killed(queue: str, count: int) -> None:
    """Send ``count`` tasks, say so, wait for every result while counting every SUCCESS the
    backend publishes for each (the test kills the worker in between)."""
    backend = app.backend
    pubsub = backend.client.pubsub()
    pubsub.psubscribe(backend.task_keyprefix.decode() + "*")
    sent = [
        app.send_task("vlmq.generate", kwargs={"request": _request(f"k {i}")}, queue=queue)
        for i in range(count)
    ]
    print(json.dumps({"sent": [r.id for r in sent]}), flush=True)
    results = [r.get(timeout=TIMEOUT_S)["id"] for r in sent]
    time.sleep(1.0)  # a second SUCCESS would be published by now
    successes: Counter[str] = Counter()
    while (message := pubsub.get_message(timeout=0.2)) is not None:
        if message["type"] == "pmessage":
            meta = json.loads(message["data"])
            if meta["status"] == "SUCCESS":
                successes[meta["task_id"]] += 1
    pubsub.close()
    print(json.dumps({"results": results, "successes": dict(successes)}), flush=True)


if __name__ == "__main__":
    scenario, args = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    found = globals()[scenario](**args)
    if found is not None:
        print(json.dumps(found), flush=True)
