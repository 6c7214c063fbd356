"""The shapes ``POST /v1/chat/completions`` and ``GET /v1/models`` answer, checked against the
official ``openai`` package's own types: completions, stream chunks and their SSE framing,
errors (OpenAI's error object, the status a task's error deserves) and the model list."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from vlmq.producers.api.errors import ApiError, error_body
from vlmq.producers.api.openai import chat_stream
from vlmq.producers.api.openai.chat_outcome import Outcome, task_error
from vlmq.producers.api.openai.chat_stream import DONE, KEEPALIVE, completion_chunks, sse_answer
from vlmq.producers.api.openai.fleet_models import fleet_models
from vlmq.producers.api.openai.mapping import to_chat_completion

RECORD = {
    "id": "t1",
    "status": "succeeded",
    "model": "org/vl",
    "output": "first",
    "choices": [
        {"index": 0, "text": "first", "finish_reason": "stop", "logprobs": None},
        {"index": 1, "text": "second", "finish_reason": "length", "logprobs": None},
    ],
    "usage": {"prompt_tokens": 7, "completion_tokens": 5},
    "timings": {"finished_at": 1_700_000_000.5},
}


def test_a_completion_is_an_openai_chat_completion() -> None:
    completion = openai.types.chat.ChatCompletion.model_validate(to_chat_completion(RECORD))
    assert completion.id == "chatcmpl-t1" and completion.created == 1_700_000_000
    assert [c.finish_reason for c in completion.choices] == ["stop", "length"]
    assert completion.usage is not None and completion.usage.total_tokens == 12


def test_chunks_carry_each_choice_then_its_end_then_the_usage() -> None:
    chunks = completion_chunks(to_chat_completion(RECORD), include_usage=True)
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all(c.id == "chatcmpl-t1" and c.model == "org/vl" for c in parsed)
    content = [(c.choices[0].index, c.choices[0].delta.content) for c in parsed[:2]]
    assert content == [(0, "first"), (1, "second")]
    assert all(c.choices[0].delta.role == "assistant" for c in parsed[:2])
    ends = [(c.choices[0].index, c.choices[0].finish_reason) for c in parsed[2:4]]
    assert ends == [(0, "stop"), (1, "length")]
    assert all(c.usage is None for c in parsed[:4])
    assert parsed[4].choices == [] and parsed[4].usage is not None
    assert parsed[4].usage.total_tokens == 12
    without = completion_chunks(to_chat_completion(RECORD), include_usage=False)
    assert len(without) == 4 and all("usage" not in c for c in without)


def _collect(events: Any) -> list[bytes]:
    async def run() -> list[bytes]:
        return [event async for event in events]

    return asyncio.run(run())


def test_the_stream_keeps_alive_until_the_outcome_then_ends_with_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chat_stream, "KEEPALIVE_S", 0.01)
    outcomes = [None, None, Outcome(completion=to_chat_completion(RECORD))]
    slices: list[float] = []

    async def next_outcome(slice_s: float) -> Outcome | None:
        slices.append(slice_s)
        return outcomes.pop(0)

    timeout = ApiError(504, "timeout", "late")
    events = _collect(sse_answer(next_outcome, timeout, 60, include_usage=False))
    assert events[:2] == [KEEPALIVE, KEEPALIVE] and events[-1] == DONE
    assert all(s <= 0.01 for s in slices)
    data = [json.loads(e.decode().removeprefix("data: ")) for e in events[2:-1]]
    assert [d["object"] for d in data] == ["chat.completion.chunk"] * 4
    assert all(e.endswith(b"\n\n") and e.startswith(b"data: ") for e in events[2:])


def test_a_stream_that_times_out_or_fails_ends_with_an_error_event() -> None:
    async def never(slice_s: float) -> Outcome | None:
        await asyncio.sleep(slice_s)
        return None

    timeout = ApiError(504, "timeout", "late", extra={"status_url": "/v1/tasks/t"})
    events = _collect(sse_answer(never, timeout, 0.05, include_usage=False))
    assert events[-1] == DONE
    error = json.loads(events[-2].decode().removeprefix("data: "))["error"]
    assert error == {
        "code": "timeout",
        "message": "late",
        "type": "timeout_error",
        "param": None,
        "status_url": "/v1/tasks/t",
    }

    failed = task_error("t", "failed", {"error_code": "generation_failed"})

    async def fails(slice_s: float) -> Outcome | None:
        return Outcome(error=failed)

    events = _collect(sse_answer(fails, timeout, 60, include_usage=True))
    assert len(events) == 2 and events[-1] == DONE
    assert json.loads(events[0].decode().removeprefix("data: "))["error"]["code"] == (
        "generation_failed"
    )


@pytest.mark.parametrize(
    ("state", "code", "status"),
    [
        ("failed", "media_fetch_failed", 400),
        ("failed", "prompt_too_long", 400),
        ("failed", "generation_failed", 500),
        ("failed", "dead_lettered", 500),
        ("failed", "store_unavailable", 503),
        ("cancelled", "cancelled", 409),
        ("cancelled", None, 409),
        ("expired", "expired", 504),
    ],
)
def test_a_task_error_answers_the_status_it_deserves(
    state: str, code: str | None, status: int
) -> None:
    fields = {"error_code": code, "error_message": "why"} if code else {}
    error = task_error("t9", state, fields)
    assert error.status == status and error.code == (code or state)
    assert error.headers == {"x-should-retry": "false"}
    body = error_body(error.status, error.code, error.message, error.param, error.extra)
    assert body["error"]["status_url"] == "/v1/tasks/t9"
    raised = openai.APIStatusError("x", response=_response(status), body=body["error"])
    assert raised.code == error.code and raised.type == body["error"]["type"]


def _response(status: int) -> Any:
    import httpx2  # the HTTP library the openai package is built on

    return httpx2.Response(status, request=httpx2.Request("POST", "http://x/v1/chat/completions"))


def test_error_bodies_are_openai_error_objects() -> None:
    body = error_body(400, "invalid_request", "messages: too short", "messages")
    assert body == {
        "error": {
            "code": "invalid_request",
            "message": "messages: too short",
            "type": "invalid_request_error",
            "param": "messages",
        }
    }
    types = {status: error_body(status, "c", "m")["error"]["type"] for status in (401, 429, 503)}
    assert types == {401: "authentication_error", 429: "rate_limit_error", 503: "server_error"}


def test_models_come_from_worker_records_and_prepare_records_are_skipped() -> None:
    records = {
        "w1": {"model": "b", "modalities": ["image", "text"], "at": 120.9},
        "w2": {"model": "b", "modalities": ["video"], "at": 100.2},
        "w3": {"model": "a", "modalities": ["text"], "at": 130.0},
        "p1": {"role": "prepare", "modalities": ["image"], "at": 140.0},
        "p2": {"role": "prepare", "model": "b", "at": 90.0},
        "old": {"modalities": ["text"], "at": 10.0},  # a record from before models were named
    }
    models = fleet_models(records)
    listed = openai.types.Model  # the client's own type accepts each
    assert [listed.model_validate(m.model_dump()).id for m in models] == ["a", "b"]
    b = models[1]
    assert (b.created, b.workers, b.modalities) == (100, 2, ["image", "text", "video"])
