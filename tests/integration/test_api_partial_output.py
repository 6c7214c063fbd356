"""A running batch's finished lines through the official ``openai`` client: the Batch object
names a snapshot file (``vlmq_partial_output_file_id``, an extra field the client keeps aside),
and its content is every line finished at that moment, once each."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.integration.test_api_support import api_settings, uvicorn_server, wait_for_state
from tests.integration.test_fleet_loop import Running, make_loop
from tests.support.gated_engine import GatedEngine
from tests.support.services import wait_until
from vlmq.producers.api.app import create_app
from vlmq.producers.client import Client

KEY = "test-key-0123456789"
LINES = 120
FAILING = frozenset({"r-7", "r-70"})


def _input() -> bytes:
    lines = [
        json.dumps(
            {
                "custom_id": f"r-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"q {n}"}]},
            }
        )
        for n in range(LINES)
    ]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def settings(redis_server: Any, moto_server: Any, request: Any) -> Any:
    return api_settings(redis_server, moto_server, request.node.name, api_keys=[KEY])


@pytest.fixture
def oai(settings: Any) -> Any:
    with uvicorn_server(create_app(settings)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=20)


def _snapshot(oai: Any, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def test_a_running_batch_offers_its_finished_lines_to_the_official_client(
    settings: Any, oai: Any
) -> None:
    client = Client(settings)
    uploaded = oai.files.create(file=("r.jsonl", _input()), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    engine = GatedEngine(FAILING)
    with Running(make_loop(settings, engine)):
        running = wait_for_state(lambda: oai.batches.retrieve(batch.id), {"in_progress"})
        assert isinstance(running, openai.types.Batch) and running.output_file_id is None
        partial = (running.model_extra or {})["vlmq_partial_output_file_id"]
        assert partial and "vlmq_partial_output_file_id" not in openai.types.Batch.model_fields
        assert _snapshot(oai, partial) == []  # nothing finished yet
        engine.release(3)
        wait_until(lambda: client.state.jobs.get(batch.id).done >= 1, what="some finished")
        before = client.state.jobs.get(batch.id).done
        lines = _snapshot(oai, partial)
        after = client.state.jobs.get(batch.id).done
        assert before <= len(lines) <= after < LINES
        ids = [line["custom_id"] for line in lines]
        assert len(ids) == len(set(ids))
        assert oai.files.retrieve(partial).purpose == "batch_output"
        engine.open()
        done = wait_for_state(lambda: oai.batches.retrieve(batch.id), {"completed"})
    final = _snapshot(oai, partial)
    assert [line["custom_id"] for line in final[: len(lines)]] == ids  # it only grows
    outputs = _snapshot(oai, done.output_file_id)
    errors = _snapshot(oai, done.error_file_id)
    by_id = {line["custom_id"]: line for line in final}
    assert len(final) == len(by_id) == LINES
    assert {line["custom_id"] for line in errors} == FAILING
    assert all(by_id[line["custom_id"]] == line for line in outputs + errors)


def test_another_tenants_or_an_unknown_partial_file_is_not_found(oai: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.files.content("file-batch_nosuchbatch-partial")
