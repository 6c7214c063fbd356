"""``GET /v1/tasks/{id}/result?format=openai``: a task's result as an OpenAI chat completion,
against a real Redis, moto S3 and an in-process worker loop."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.test_api_support import (
    FAIL_MARKER,
    EchoEngine,
    api_settings,
    wait_for_state,
    worker_loop,
)
from vlmq.config.schemas import Choice, FinishReason, Result, Usage
from vlmq.producers.api.app import create_app


class ChoicesEngine(EchoEngine):
    """Answers ``n`` choices, with per-token logprobs when asked."""

    def _answer(self, request: Any, size: int, worker: str | None) -> Result:
        result = super()._answer(request, size, worker)
        generation = request.generation
        if result.status != "succeeded" or not generation.wants_choices:
            return result
        choices = [
            Choice(
                index=i,
                text=f"{result.output}#{i}",
                finish_reason=FinishReason.STOP,
                logprobs=_logprobs(i) if generation.logprobs else None,
            )
            for i in range(generation.completions)
        ]
        usage = Usage(prompt_tokens=3, completion_tokens=2 * len(choices))
        return result.model_copy(
            update={"choices": choices, "output": choices[0].text, "usage": usage}
        )


def _logprobs(index: int) -> dict[str, Any]:
    token = {"token": f"t{index}", "logprob": -0.25, "bytes": list(f"t{index}".encode())}
    return {"content": [{**token, "top_logprobs": [token]}]}


@pytest.fixture
def settings(redis_server, moto_server, request):
    return api_settings(redis_server, moto_server, request.node.name)


@pytest.fixture
def http(settings):
    with TestClient(
        create_app(settings), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        yield client


def _finished(settings: Any, http: Any, *bodies: dict[str, Any]) -> list[str]:
    """Submit each body, run them, and answer their task ids."""
    ids = []
    for body in bodies:
        reply = http.post("/v1/tasks", json=body)
        assert reply.status_code == 202, reply.text
        ids.append(reply.json()["id"])
    with worker_loop(settings, ChoicesEngine()):
        for task_id in ids:
            wait_for_state(
                lambda task_id=task_id: http.get(f"/v1/tasks/{task_id}").json(),
                {"succeeded", "failed"},
            )
    return ids


def test_an_openai_body_with_n_and_logprobs_reads_back_as_a_chat_completion(settings, http):
    body = {
        "model": "any",
        "custom_id": "oai",
        "messages": [{"role": "user", "content": "hello"}],
        "n": 3,
        "logprobs": True,
        "top_logprobs": 1,
    }
    (task_id,) = _finished(settings, http, body)
    record = http.get(f"/v1/tasks/{task_id}/result").json()
    assert record["output"] == "echo:oai#0" and len(record["choices"]) == 3
    completion = http.get(f"/v1/tasks/{task_id}/result", params={"format": "openai"}).json()
    assert completion["object"] == "chat.completion"
    assert completion["id"] == f"chatcmpl-{task_id}" and completion["model"] == "echo"
    assert [c["message"]["content"] for c in completion["choices"]] == [
        f"echo:oai#{i}" for i in range(3)
    ]
    assert completion["choices"][2]["logprobs"] == _logprobs(2)
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_one_choice_and_failures_in_the_openai_format(settings, http):
    plain, failing = _finished(
        settings,
        http,
        {"messages": [{"role": "user", "content": "hi"}], "custom_id": "one"},
        {"messages": [{"role": "user", "content": FAIL_MARKER}], "custom_id": "bad"},
    )
    completion = http.get(f"/v1/tasks/{plain}/result", params={"format": "openai"}).json()
    assert completion["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "echo:one"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    # No completion to show: the record, with its error, as with format=vlmq.
    failed = http.get(f"/v1/tasks/{failing}/result", params={"format": "openai"}).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"
    both = http.get(f"/v1/tasks/{plain}/result", params={"format": "openai", "presign": "true"})
    assert both.status_code == 422 and both.json()["error"]["message"].startswith("format:")
    unknown = http.get(f"/v1/tasks/{plain}/result", params={"format": "xml"})
    assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "invalid_request"


def test_a_bad_constraint_is_refused_naming_the_field(http):
    body = {"model": "any", "messages": [{"role": "user", "content": "x"}], "guided_regex": "("}
    reply = http.post("/v1/tasks", json=body)
    assert reply.status_code == 422
    assert reply.json()["error"]["message"].startswith("generation: regex:")
