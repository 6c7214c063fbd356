"""A web app's Celery module that uses a vlmq fleet without installing vlmq (docs/celery.md).

The app's broker is the fleet's Redis; its result backend is the one the fleet's workers
write to (``VLMQ_CELERY__RESULT_BACKEND``, the fleet's Redis when unset). Run the app's own
worker for its callbacks, then this file::

    export CELERY_BROKER_URL=redis://127.0.0.1:6379/0 CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/0
    celery -A celery_app worker -Q celery --pool solo      # from examples/: the app's tasks
    python examples/celery_app.py                          # sends work to the fleet and waits
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery, chord, group, signature

app = Celery(
    "webapp",
    broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/0"),
)
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])


def generate(request: dict[str, Any]) -> Any:
    """``vlmq.generate`` as a signature; the queue is the request's modality class: video if
    any video, else image if any image, else text (``.interactive``: served first)."""
    kinds = {
        part.get("type")
        for message in request["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict)
    }
    modality = "video" if "video" in kinds else "image" if "image" in kinds else "text"
    return signature(
        "vlmq.generate", kwargs={"request": request}, queue=f"vlmq.{modality}.interactive", app=app
    )


def ask(text: str, max_new_tokens: int = 16) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_new_tokens": max_new_tokens}


# The app's own tasks (explicit names: the same whether this file runs or is imported).
@app.task(name="webapp.word_count")
def word_count(result: dict[str, Any]) -> dict[str, Any]:
    return {"id": result["id"], "words": len(result["output"].split())}


@app.task(name="webapp.collect")
def collect(results: list[dict[str, Any]]) -> list[str]:
    return [r["output"] for r in results]


@app.task(name="webapp.report_failure")
def report_failure(task_id: str) -> str:
    # Errbacks get the failed task's id; its exception carries vlmq's code and message.
    code = app.AsyncResult(task_id).result.args[0]
    return f"{task_id} failed: {code}"


def main() -> None:
    timeout = float(os.environ.get("EXAMPLE_TIMEOUT_S", "120"))
    one = generate(ask("Describe a queue in five words.")).delay()
    print("result:", one.get(timeout=timeout))
    try:
        generate({"messages": []}).delay().get(timeout=timeout)
    except Exception as exc:  # TaskFailed('invalid_request', '...'), rebuilt without vlmq
        print("failure:", type(exc).__name__, exc.args[0])
    chained = (generate(ask("Count these words")) | word_count.s()).delay()
    print("chain:", chained.get(timeout=timeout))
    summaries = chord([generate(ask(f"Topic {i}")) for i in range(3)], collect.s()).delay()
    print("chord:", len(summaries.get(timeout=timeout)), "outputs")
    grouped = group(generate(ask(f"Q{i}")) for i in range(3)).delay()
    print("group:", len(grouped.get(timeout=timeout)))
    failing = generate({"messages": []}).apply_async(link_error=report_failure.s())
    failing.get(timeout=timeout, propagate=False)
    print("vlmq imported:", "vlmq" in sys.modules)


if __name__ == "__main__":
    main()
