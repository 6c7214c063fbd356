"""What a request may weigh before it is built: a conversation's content parts, a JSON body's
objects and arrays, and a request's JSON against the message size a worker takes."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from vlmq.config import wire
from vlmq.config.schemas import MAX_PARTS, Request, count_parts
from vlmq.producers.api.bodies import parse_json_body
from vlmq.producers.api.errors import BodyTooLarge

TURN = {"role": "user", "content": "hi"}


def test_a_string_turn_and_an_empty_turn_count_one_part_each():
    turns = [TURN, {"role": "user", "content": []}, {"role": "user", "content": ["a", "b"]}]
    assert count_parts(turns) == 4
    assert count_parts(Request.model_validate({"messages": turns[::2]}).messages) == 3
    assert count_parts("not a list") == 0


@pytest.mark.parametrize(
    "messages",
    [
        [TURN] * (MAX_PARTS + 1),
        [{"role": "user", "content": ["x"] * (MAX_PARTS + 1)}],
        [{"role": "user", "content": []}] * (MAX_PARTS + 1),
    ],
    ids=["turns", "parts", "empty turns"],
)
def test_a_conversation_past_max_parts_is_refused_before_any_turn_is_built(messages):
    # A bad first part would fail validation if any turn were built: the bound speaks first.
    messages = [{"role": "user", "content": [{"type": "nonsense"}]}, *messages]
    with pytest.raises(ValidationError, match=f"at most {MAX_PARTS} content parts"):
        Request.model_validate({"messages": messages})


def test_a_conversation_of_max_parts_is_valid():
    request = Request.model_validate({"messages": [{"role": "user", "content": ["x"] * 4095}]})
    assert count_parts(request.messages) == MAX_PARTS - 1


BODIES = [
    b'{"a": [1, {"b": [2, 3]}, "x"], "c": {}}',
    b'{"text": "{[{[{[ braces in a string are not containers"}',
    '{"é": ["ü", {"n": null, "t": true, "f": -1.5e3}]}'.encode(),
    b"[]",
]


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_parses_as_json_loads_does_on_both_paths(raw):
    assert parse_json_body(raw, bound=1000) == json.loads(raw)
    # A bound under the body's braces takes the counting scanner, which still accepts it
    # while its real containers are within the bound.
    containers = _containers(json.loads(raw))
    assert parse_json_body(raw, bound=containers) == json.loads(raw)


def _containers(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_containers(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_containers(v) for v in value)
    return 0


@pytest.mark.parametrize("raw", [b"[" + b",".join([b"{}"] * 11) + b"]", b"[[[[[[[[[[[]]]]]]]]]]]"])
def test_a_body_past_the_bound_is_refused_while_parsing(raw):
    with pytest.raises(BodyTooLarge, match="more than 10 JSON objects and arrays"):
        parse_json_body(raw, bound=10)
    assert parse_json_body(raw, bound=12) == json.loads(raw)


def test_bad_json_fails_as_json_loads_fails_on_both_paths():
    for bound in (100, 2):  # 5 braces, 2 containers: the second takes the counting scanner
        with pytest.raises(json.JSONDecodeError):
            parse_json_body(b'{"s": "{{{", "a": [1, 2}', bound=bound)


@pytest.mark.parametrize("limit", [4096, 100_000, 64 * 1024 * 1024])
def test_the_largest_request_keeps_its_message_within_the_limit(limit, monkeypatch):
    # Everything that lengthens the envelope at its longest: ids, a job's prepared queue, a
    # host name of 253 characters, an expiry.
    monkeypatch.setattr(wire, "_ORIGIN", "4194304@" + "h" * 253)
    size = wire.largest_request(limit)
    request = '{"t":"' + "x" * (size - 8) + '"}'
    assert len(request) == size
    message = wire.encode_message(
        request,
        "i" * 128,
        "vlmq.video.job." + "j" * 128 + ".prepared",
        priority=9,
        expires=datetime.now(timezone.utc),
        ignore_result=False,
    )
    assert len(message) <= limit
    assert len(message) > limit - 1024  # the room kept is the envelope's, no more
