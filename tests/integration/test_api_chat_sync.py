"""``POST /v1/chat/completions`` and ``GET /v1/models`` with the official ``openai`` client,
unchanged, against a real uvicorn server, real Redis, moto S3 and an in-process worker loop:
create (text; an image as a data URI), parse with a pydantic model (the real engine on the
tiny checkpoint), stream, the timeout path, failures, tenancy, and 500 calls waiting at once
on one API process with bounded threads and memory."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.integration.test_api_chat_completion import ChoicesEngine
from tests.integration.test_api_support import (
    FAIL_MARKER,
    EchoEngine,
    api_settings,
    uvicorn_server,
    wait_for_state,
    worker_loop,
)
from tests.support.services import vlmq_serve, wait_until
from vlmq.config.settings import EngineSettings, Settings, TenantQuota
from vlmq.producers.api.app import create_app
from vlmq.producers.api.openai import chat_stream
from vlmq.producers.client import Client

KEY = "test-key-0123456789"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_chat.py"
TENANT_KEY = "tenant-b-key-0123456789"
# Typed loosely: the client types messages as TypedDicts.
TEXT: Any = [{"role": "user", "content": "hello"}]
FAILING: Any = [{"role": "user", "content": FAIL_MARKER}]


class RecordingEngine(EchoEngine):
    """EchoEngine that keeps each request's media sources (what the worker was handed)."""

    def __init__(self) -> None:
        super().__init__()
        self.media: dict[str, list[str]] = {}

    def run(
        self, requests: Any, worker: str | None = None, token_budget: int | None = None
    ) -> list[Any]:
        for request in requests:
            self.media[request.id] = [str(source) for source in request.media_sources()]
        return super().run(requests, worker, token_budget)


def _settings(redis_server: Any, moto_server: Any, name: str, **api: Any) -> Settings:
    api = {"api_keys": [KEY], "tenant_keys": {TENANT_KEY: "team-b"}, **api}
    return api_settings(redis_server, moto_server, name, **api)


@pytest.fixture
def settings(redis_server, moto_server, request, tmp_path):
    settings = _settings(redis_server, moto_server, request.node.name)
    if getattr(request, "param", None) == "file":
        settings = settings.model_copy(update={"results_url": f"file://{tmp_path / 'results'}"})
    return settings


@pytest.fixture
def app(settings):
    return create_app(settings)


@pytest.fixture
def server(app):
    with uvicorn_server(app) as url:
        yield url


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)


def _get(client: openai.OpenAI, path: str) -> httpx.Response:
    """GET one of vlmq's own routes with the client's server and key."""
    server = str(client.base_url).removesuffix("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {client.api_key}"}
    return httpx.get(f"{server}{path}", headers=headers, timeout=10)


def _png_data_uri() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_create_answers_the_completion_when_the_task_ends(settings, oai):
    engine = RecordingEngine()
    with worker_loop(settings, engine):
        raw = oai.chat.completions.with_raw_response.create(
            model="any", messages=TEXT, max_tokens=8, extra_body={"custom_id": "one"}
        )
        completion = raw.parse()
        image = [
            {"type": "image_url", "image_url": {"url": _png_data_uri()}},
            {"type": "text", "text": "what colour?"},
        ]
        pictured = oai.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": image}],
            extra_body={"custom_id": "img"},
        )
    task_id = raw.headers["x-vlmq-task-id"]
    assert completion.id == f"chatcmpl-{task_id}" and completion.object == "chat.completion"
    assert completion.model == "echo" and completion.choices[0].message.content == "echo:one"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 5
    # The task ran on the interactive lane, for the key's tenant, and is readable as any task.
    status = _get(oai, f"/v1/tasks/{task_id}").json()
    assert status["status"] == "succeeded" and status["custom_id"] == "one"
    assert pictured.choices[0].message.content == "echo:img"
    # The data URI was staged in the store: the worker got a URL, never the bytes.
    (source,) = engine.media[pictured.id.removeprefix("chatcmpl-")]
    assert source.startswith("s3://") and "base64" not in source


class Verdict(BaseModel):
    ok: bool
    colour: Literal["red", "green", "blue"]


@pytest.fixture
def tiny_engine(settings: Settings, checkpoint: Any) -> Iterator[Any]:
    """The real engine on the tiny checkpoint, as ``vlmq worker`` builds it."""
    from vlmq.workers.engine import Engine
    from vlmq.workers.media.fleet import fleet_loader

    loader = fleet_loader(settings)
    model = str(Path(checkpoint("qwen2_5_vl")))
    engine = Engine(model, EngineSettings(), loader.settings, loader=loader).setup()
    try:
        yield engine
    finally:
        engine.close()


def test_parse_with_a_pydantic_model_and_an_image_on_the_real_engine(
    settings, oai, server, tiny_engine, tmp_path
):
    image = [
        {"type": "image_url", "image_url": {"url": _png_data_uri()}},
        {"type": "text", "text": "Is it red?"},
    ]
    messages: Any = [{"role": "user", "content": image}]
    with worker_loop(settings, tiny_engine):
        parsed = oai.chat.completions.parse(
            model="tiny", messages=messages, response_format=Verdict, max_tokens=96
        )
        pictured = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        question: Any = [{"role": "user", "content": "Is it red?"}]
        plain = oai.chat.completions.create(model="tiny", messages=question, max_tokens=4)
        example = _run_example(server, tmp_path)
    verdict = parsed.choices[0].message.parsed
    assert isinstance(verdict, Verdict), parsed.choices[0].message.content
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.model == tiny_engine.model_name
    # The image went through the real engine: its visual tokens are in the prompt.
    assert pictured.usage is not None and plain.usage is not None
    assert pictured.usage.prompt_tokens > plain.usage.prompt_tokens
    assert 0 < pictured.usage.completion_tokens <= 4
    # examples/openai_chat.py runs as it is, against the same server (its last step, the
    # timeout, does not happen here: the call is answered).
    assert example.returncode == 0, example.stderr[-3000:]
    assert "parse: answer=" in example.stdout and "stream finished: " in example.stdout


def _run_example(server: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    from PIL import Image

    image = tmp_path / "photo.png"
    Image.new("RGB", (48, 32), (20, 120, 200)).save(image)
    env = {
        **os.environ,
        "VLMQ_OPENAI_BASE_URL": f"{server}/v1",
        "VLMQ_OPENAI_API_KEY": KEY,
        "VLMQ_OPENAI_TIMEOUT_S": "60",
    }
    command = [sys.executable, str(EXAMPLE), str(image)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_stream_answers_openai_chunks_then_done(settings, oai, server):
    with worker_loop(settings, ChoicesEngine()):
        chunks = list(
            oai.chat.completions.create(
                model="any",
                messages=TEXT,
                stream=True,
                stream_options={"include_usage": True},
                n=2,
                logprobs=True,
                extra_body={"custom_id": "s"},
            )
        )
        raw = httpx.post(
            f"{server}/v1/chat/completions",
            json={"model": "any", "messages": TEXT, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
    texts: dict[int, str] = {}
    finish, tokens = {}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            if choice.logprobs and choice.logprobs.content:
                tokens[choice.index] = [t.token for t in choice.logprobs.content]
    assert texts == {0: "echo:s#0", 1: "echo:s#1"} and finish == {0: "stop", 1: "stop"}
    assert tokens == {0: ["t0"], 1: ["t1"]}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"


def test_a_call_that_waits_too_long_answers_504_with_the_status_url(
    redis_server, moto_server, request, monkeypatch
):
    settings = _settings(redis_server, moto_server, request.node.name, sync_timeout_s=0.3)
    with uvicorn_server(create_app(settings)) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=2, timeout=30)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as raised:
            oai.chat.completions.create(
                model="any", messages=TEXT, extra_body={"custom_id": "late"}
            )
        # Told not to retry (it would enqueue the task again): one call, one task.
        assert time.monotonic() - started < 5
        error = raised.value
        assert error.status_code == 504 and error.code == "timeout"
        assert error.type == "timeout_error"
        assert error.response.headers["x-should-retry"] == "false"
        body: Any = error.body
        task_id = body["task_id"]
        assert body["status_url"] == f"/v1/tasks/{task_id}" and body["status_url"] in error.message
        assert Client(settings).redis.llen("vlmq.text.interactive") == 1
        # It keeps its place: a worker runs it, and its status URL says so.
        with worker_loop(settings):
            status = wait_for_state(lambda: _get(oai, body["status_url"]).json(), {"succeeded"})
        assert status["id"] == task_id
        # A stream gives up the same way, with an error event and [DONE] (kept alive first).
        monkeypatch.setattr(chat_stream, "KEEPALIVE_S", 0.05)
        raw = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "any", "messages": TEXT, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.status_code == 200 and events[0] == ": keepalive"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "timeout"


def test_a_stream_whose_client_hangs_up_stops_watching(settings, app, server, monkeypatch):
    monkeypatch.setattr(chat_stream, "KEEPALIVE_S", 0.05)
    body = {"model": "any", "messages": TEXT, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=headers) as r:
        events = r.iter_bytes()  # held: dropping it would close the connection already
        assert next(events).startswith(b": keepalive") and next(events)
        assert app.state.waiter.waiting == 1
    # The next keep-alive finds the connection gone; the stream ends and its watch with it.
    wait_until(lambda: app.state.waiter.waiting == 0, timeout=10, what="the watch to close")


def test_failures_answer_openai_errors_with_their_status(settings, oai, server):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="any", messages=TEXT, n=1000)
    assert bad.value.code == "invalid_request" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as empty:
        oai.chat.completions.create(model="any", messages=[])
    assert empty.value.param == "messages"
    with worker_loop(settings):
        with pytest.raises(openai.InternalServerError) as failed:
            oai.chat.completions.create(model="any", messages=FAILING)
        stream = oai.chat.completions.create(model="any", messages=FAILING, stream=True)
        with pytest.raises(openai.APIError) as in_stream:
            list(stream)
    assert failed.value.status_code == 500 and failed.value.code == "generation_failed"
    assert failed.value.type == "server_error"
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert in_stream.value.code == "generation_failed"
    # A gate refusal on this path carries the same shape.
    anonymous = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        anonymous.chat.completions.create(model="any", messages=TEXT)
    assert refused.value.code == "unauthorized" and refused.value.type == "authentication_error"


def test_tenants_quotas_and_their_tasks(redis_server, moto_server, request):
    settings = _settings(redis_server, moto_server, request.node.name)
    quotas = {"team-b": TenantQuota(max_queued_tasks=0)}
    settings = settings.model_copy(
        update={"tenants": settings.tenants.model_copy(update={"quotas": quotas})}
    )
    with uvicorn_server(create_app(settings)) as url:
        team_b = openai.OpenAI(base_url=f"{url}/v1", api_key=TENANT_KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused:
            team_b.chat.completions.create(model="any", messages=TEXT)
        assert refused.value.code == "quota_exceeded"
        default = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        with worker_loop(settings):
            raw = default.chat.completions.with_raw_response.create(model="any", messages=TEXT)
        task_id = raw.headers["x-vlmq-task-id"]
        # Another tenant does not see it.
        assert _get(team_b, f"/v1/tasks/{task_id}").status_code == 404
        assert _get(default, f"/v1/tasks/{task_id}").status_code == 200
    assert Client(settings).state.tasks.get(task_id)["tenant"] == "default"


def test_models_are_the_fleets_from_worker_heartbeats(settings, oai):
    assert oai.models.list().data == []
    records = Client(settings).state.workers
    now = time.time()
    records.announce("w1", {"model": "org/vl-7b", "modalities": ["image"], "at": now - 5}, 60)
    records.announce("w2", {"model": "org/vl-7b", "modalities": ["text"], "at": now}, 60)
    records.announce("w3", {"model": "small", "modalities": ["video"], "at": now}, 60)
    records.announce("p1", {"role": "prepare", "modalities": ["image"], "at": now}, 60)
    models = oai.models.list().data
    assert [m.id for m in models] == ["org/vl-7b", "small"]
    assert all(m.object == "model" and m.owned_by == "vlmq" for m in models)
    seven = oai.models.retrieve("org/vl-7b")
    assert seven.created == int(now - 5)
    assert seven.model_extra == {"modalities": ["image", "text"], "workers": 2}
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("nope")
    assert missing.value.code == "model_not_found"


CONCURRENT = 500
FIRST = 100  # calls waiting before the marginal cost of the rest is measured


class ProcessFigures:
    """Threads and resident memory of a process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.status = Path(f"/proc/{pid}/status")

    def _field(self, name: str) -> int:
        for line in self.status.read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {name} in {self.status}")

    def threads(self) -> int:
        return self._field("Threads")

    def rss_kib(self) -> int:
        return self._field("VmRSS")


@pytest.fixture
def api_process(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, ProcessFigures]]:
    """A real ``vlmq serve`` process on these settings (results on local disk: what is
    measured is the API's waiting, not moto's speed)."""
    env = {
        **os.environ,
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_API__API_KEYS": json.dumps([KEY]),
        "VLMQ_API__RATE_LIMIT_PER_S": "1000000",
        "VLMQ_API__RATE_LIMIT_BURST": "1000000",
    }
    with vlmq_serve(tmp_path, env) as (url, process):
        yield url, ProcessFigures(process.pid)


@pytest.mark.parametrize("settings", ["file"], indirect=True)
def test_500_waiting_calls_cost_memory_not_threads(settings, api_process):
    """500 calls wait at once on one ``vlmq serve`` process: its threads stay at the thread
    pool's bound whatever the number of calls, and each waiting call costs tens of kB."""
    url, process = api_process
    figures = asyncio.run(_wait_at_once(settings, url, process))
    done = figures.pop("done")
    assert sorted(c.choices[0].message.content for c in done) == sorted(
        f"echo:c{i}" for i in range(CONCURRENT)
    )
    # AnyIO's thread pool (40 at most) and uvicorn's: none more for five times the calls.
    assert figures["threads_first"] <= 48, figures
    assert figures["threads_all"] <= figures["threads_first"] + 2, figures
    # Measured ~42 kB a call (uvicorn's connection, the request, its watch): generously bounded.
    assert figures["kib_per_call"] < 128, figures


async def _wait_at_once(settings: Settings, url: str, process: ProcessFigures) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    async with client:
        return await _calls(settings, client, process)


async def _waiting(queued: Any, wanted: int, process: ProcessFigures) -> int:
    """Once ``wanted`` tasks are queued (each call waits once its task is): the process's
    peak thread count meanwhile."""
    threads = process.threads()
    deadline = time.monotonic() + 120
    while queued() < wanted:
        assert time.monotonic() < deadline, f"{queued()} queued"
        threads = max(threads, process.threads())
        await asyncio.sleep(0.05)
    return max(threads, process.threads())


async def _calls(
    settings: Settings, client: openai.AsyncOpenAI, process: ProcessFigures
) -> dict[str, Any]:
    redis = Client(settings).redis

    def queued() -> int:
        return int(redis.llen("vlmq.text.interactive"))

    def call(i: int) -> asyncio.Future[Any]:
        messages: Any = TEXT
        create = client.chat.completions.create(
            model="any", messages=messages, extra_body={"custom_id": f"c{i}"}
        )
        return asyncio.ensure_future(create)

    figures: dict[str, Any] = {"threads_before": process.threads()}
    calls = [call(i) for i in range(FIRST)]
    figures["threads_first"] = await _waiting(queued, FIRST, process)
    rss_first = process.rss_kib()
    calls += [call(i) for i in range(FIRST, CONCURRENT)]
    figures["threads_all"] = await _waiting(queued, CONCURRENT, process)
    figures["kib_per_call"] = (process.rss_kib() - rss_first) / (CONCURRENT - FIRST)
    assert not any(c.done() for c in calls), [c.exception() for c in calls if c.done()]
    with worker_loop(settings):
        figures["done"] = await asyncio.gather(*calls)
    return figures
