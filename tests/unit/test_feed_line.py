"""A staged input line is spliced into its message as stored: the request comes back whole."""

from __future__ import annotations

import json

import pytest

from vlmq.broker.feeding import FeedLine
from vlmq.config.schemas import Request
from vlmq.producers.bulk import _normalised


@pytest.mark.parametrize(
    "custom_id",
    ["plain", 'tricky ,"r": {"id":"x"}', "ünïcødé ✓", None],
)
def test_a_stored_line_becomes_the_same_request_with_its_ids(custom_id: str | None) -> None:
    image = {"type": "image", "image": 'https://media.example.com/a ,"r": b.jpg'}
    request = Request.model_validate(
        {
            "custom_id": custom_id,
            "messages": [{"role": "user", "content": [image, 'what is ,"r": here? ✓']}],
            "max_new_tokens": 7,
            "temperature": 0.5,
        }
    )
    _, raw = _normalised(12, request)
    line = FeedLine.parse(raw.rstrip(b"\n"))
    assert line.number == 12 and line.modality == "image"
    assert line.custom_id == (custom_id or line.custom_id) and line.custom_id
    wire = json.loads(line.request_json("1.abc.def", "job-1"))
    back = Request.model_validate(wire)
    assert (back.id, back.job_id, back.custom_id) == ("1.abc.def", "job-1", line.custom_id)
    expected = request.model_copy(update={"id": "1.abc.def", "job_id": "job-1"})
    expected = expected.model_copy(update={"custom_id": line.custom_id})
    assert back == expected


def test_a_line_without_the_spliceable_shape_is_parsed_whole() -> None:
    raw = json.dumps({"r": {"messages": []}, "n": 3, "c": "x", "m": "text"}).encode()
    line = FeedLine.parse(raw)
    assert (line.number, line.custom_id, line.body) == (3, "x", '{"messages":[]}')
    assert json.loads(line.request_json("t", "j")) == {
        "id": "t",
        "job_id": "j",
        "custom_id": "x",
        "messages": [],
    }
