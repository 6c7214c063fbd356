from __future__ import annotations

import json

from vlmq.config.jsonl import read_requests


def _lines(*objs):
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_both_formats_are_detected_per_line():
    parsed = list(
        read_requests(
            _lines(
                {
                    "custom_id": "a",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_new_tokens": 4,
                },
                {
                    "custom_id": "b",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "messages": [{"role": "user", "content": "yo"}],
                        "max_tokens": 9,
                        "temperature": 0,
                    },
                },
            )
        )
    )
    requests = [p.request for p in parsed if p.request is not None]
    assert [r.custom_id for r in requests] == ["a", "b"]
    assert requests[1].generation.max_new_tokens == 9


def test_bad_lines_become_error_records_and_the_rest_goes_on():
    parsed = list(
        read_requests(
            _lines(
                "{not json",
                {"custom_id": "x", "messages": []},
                {"custom_id": "y", "url": "/v1/embeddings", "body": {}},
                "[1, 2]",
                {"custom_id": "ok", "messages": [{"role": "user", "content": "fine"}]},
            )
        )
    )
    errors = [p.error for p in parsed if p.error]
    assert [e.line for e in errors] == [1, 2, 3, 4]
    assert "not valid JSON" in errors[0].message
    assert errors[1].custom_id == "x" and errors[1].message.startswith("messages")
    assert "only /v1/chat/completions" in errors[2].message
    last = parsed[-1].request
    assert last is not None and last.custom_id == "ok"


def test_duplicate_custom_ids_are_rejected():
    line = {"custom_id": "same", "messages": [{"role": "user", "content": "hi"}]}
    parsed = list(read_requests(_lines(line, line)))
    assert parsed[0].request is not None
    error = parsed[1].error
    assert error is not None and error.code == "duplicate_custom_id"


def test_blank_lines_are_skipped_and_line_numbers_kept():
    line = {"messages": [{"role": "user", "content": "hi"}]}
    parsed = list(read_requests(["", json.dumps(line), "  "]))
    assert [p.line for p in parsed] == [2]
