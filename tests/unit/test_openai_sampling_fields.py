"""The OpenAI sampling surface on the producer side: OpenAI Batch lines and chat bodies (with
vLLM's extensions) map onto Request fields, bad constraints fail naming the field, results
read back in the OpenAI chat completion shape, and pre-flight counts every completion."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vlmq.config.errors import InvalidRequest
from vlmq.config.jsonl import parse_line
from vlmq.config.schemas import GenerationParams, Request
from vlmq.config.settings import Settings
from vlmq.producers.api.convert import request_from_body
from vlmq.producers.api.openai.mapping import to_chat_completion, to_openai_output
from vlmq.producers.api.openai.objects import ChatCompletion
from vlmq.producers.bulk import content_id
from vlmq.producers.preflight import Preflight

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
AS_RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "response", "schema": SCHEMA},
}


def _line(**body: Any) -> str:
    return json.dumps(
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": MESSAGES, **body},
        }
    )


def _from_line(**body: Any) -> GenerationParams:
    parsed = parse_line(_line(**body), 1)
    assert parsed.request is not None, parsed.error
    return parsed.request.generation


def _from_body(**body: Any) -> GenerationParams:
    return request_from_body({"model": "m", "messages": MESSAGES, **body}).generation


def _line_error(**body: Any) -> str:
    parsed = parse_line(_line(**body), 1)
    assert parsed.error is not None and parsed.error.code == "invalid_request"
    return parsed.error.message


def _body_error(**body: Any) -> str:
    with pytest.raises(InvalidRequest) as caught:
        _from_body(**body)
    assert caught.value.code == "invalid_request"
    return caught.value.message


READERS = pytest.mark.parametrize("read", [_from_line, _from_body], ids=["line", "body"])
ERRORS = pytest.mark.parametrize("error", [_line_error, _body_error], ids=["line", "body"])

# (body fields, the generation fields they set)
MAPPED = [
    ({"n": 3}, {"n": 3}),
    ({"logprobs": True, "top_logprobs": 5}, {"logprobs": True, "top_logprobs": 5}),
    ({"logprobs": False}, {"logprobs": False, "top_logprobs": None}),
    ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
    ({"frequency_penalty": -1.0}, {"frequency_penalty": -1.0}),
    ({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
    ({"min_tokens": 4, "max_completion_tokens": 9}, {"min_tokens": 4, "max_new_tokens": 9}),
    ({"seed": 11}, {"seed": 11}),
    ({"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_object"}}),
    ({"response_format": AS_RESPONSE_FORMAT}, {"response_format": AS_RESPONSE_FORMAT}),
    ({"response_format": {"type": "text"}}, {"response_format": {"type": "text"}}),
    ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"grammar": 'start: "a" | "b"'}, {"grammar": 'start: "a" | "b"'}),
    # vLLM's structured_outputs object and its older guided_* names
    ({"structured_outputs": {"json": SCHEMA}}, {"response_format": AS_RESPONSE_FORMAT}),
    (
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"response_format": AS_RESPONSE_FORMAT},
    ),
    (
        {"structured_outputs": {"json_object": True}},
        {"response_format": {"type": "json_object"}},
    ),
    ({"structured_outputs": {"regex": r"\d+"}}, {"regex": r"\d+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, {"grammar": 'start: "x"'}),
    (
        {"structured_outputs": {"regex": "a+", "whitespace_pattern": " ?"}},
        {"regex": "a+"},
    ),
    ({"guided_json": SCHEMA}, {"response_format": AS_RESPONSE_FORMAT}),
    ({"guided_regex": "b+"}, {"regex": "b+"}),
    ({"guided_choice": ["on", "off"]}, {"choice": ["on", "off"]}),
    ({"guided_grammar": 'start: "y"'}, {"grammar": 'start: "y"'}),
    # OpenAI's default format next to a vLLM constraint: the constraint holds.
    (
        {"response_format": {"type": "text"}, "guided_regex": "c+"},
        {"response_format": {"type": "text"}, "regex": "c+"},
    ),
    (
        {"response_format": {"type": "text"}, "structured_outputs": {"json": SCHEMA}},
        {"response_format": AS_RESPONSE_FORMAT},
    ),
]


@READERS
@pytest.mark.parametrize(("body", "expected"), MAPPED)
def test_body_fields_map_onto_generation_fields(read, body, expected):
    generation = read(**body)
    for name, value in expected.items():
        assert getattr(generation, name) == value, name


@READERS
def test_fields_an_openai_server_does_not_implement_are_ignored(read):
    generation = read(user="u-1", top_k=5, logit_bias={"1": 2}, guided_decoding_backend="x")
    assert generation == GenerationParams()


def test_a_vlmq_body_takes_the_fields_directly():
    body = {"messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 1, "choice": ["a"]}
    generation = request_from_body(body).generation
    assert (generation.n, generation.top_logprobs, generation.choice) == (2, 1, ["a"])
    assert generation.wants_choices


# (body fields, how the error message starts)
BAD = [
    ({"regex": "("}, "generation: regex:"),
    ({"guided_regex": "(a"}, "generation: regex:"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "generation: regex:"),
    ({"choice": []}, "generation.choice:"),
    ({"guided_choice": []}, "generation.choice:"),
    ({"grammar": "start: ("}, "generation: grammar:"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
        "generation: response_format.json_schema.schema:",
    ),
    (
        {"structured_outputs": {"json": {"type": "foo"}}},
        "generation: response_format.json_schema.schema:",
    ),
    ({"response_format": {"type": "xml"}}, "generation.response_format:"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json: not valid JSON"),
    ({"guided_json": [1]}, "guided_json: must be a JSON Schema object"),
    ({"structured_outputs": "json"}, "structured_outputs: must be an object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag:"),
    ({"regex": "a", "choice": ["a"]}, "generation: Value error, at most one constraint"),
    (
        {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
        "guided_json: at most one constraint per request",
    ),
    (
        {"structured_outputs": {"regex": "a"}, "guided_regex": "b"},
        "guided_regex: at most one constraint per request",
    ),
    ({"top_logprobs": 2}, "generation: Value error, top_logprobs needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "generation.top_logprobs:"),
    ({"n": 0}, "generation.n:"),
    ({"n": 17}, "generation.n:"),
    ({"presence_penalty": 3}, "generation.presence_penalty:"),
    ({"repetition_penalty": 0}, "generation.repetition_penalty:"),
    ({"min_tokens": 9, "max_tokens": 4}, "generation: Value error, min_tokens is larger"),
]


@ERRORS
@pytest.mark.parametrize(("body", "starts"), BAD)
def test_bad_fields_are_invalid_requests_naming_the_field(error, body, starts):
    assert error(**body).startswith(starts)


def test_a_bad_constraint_on_a_vlmq_line_names_its_field():
    line = json.dumps({"messages": MESSAGES, "choice": [], "n": 2})
    parsed = parse_line(line, 7)
    assert parsed.error is not None and parsed.error.line == 7
    assert parsed.error.message.startswith("generation.choice:")


# --- results in the OpenAI shape -------------------------------------------------------------


def _token(text: str, logprob: float) -> dict[str, Any]:
    top = [{"token": text, "logprob": logprob, "bytes": list(text.encode())}]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": top}


def _record_with_choices() -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": f"answer {i}",
            "finish_reason": "length" if i == 2 else "stop",
            "logprobs": {"content": [_token("answer", -0.1 * i), _token(f" {i}", -0.5)]},
            "parsed": None,
        }
        for i in range(3)
    ]
    return {
        "id": "t1",
        "custom_id": "c1",
        "status": "succeeded",
        "model": "tiny",
        "output": "answer 0",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": 12},
        "timings": {"finished_at": 1700000000.5},
        "choices": choices,
    }


def test_three_choices_with_logprobs_read_back_as_openai_choices():
    record = _record_with_choices()
    line = to_openai_output(record)
    assert line["id"] == "batch_req_t1" and line["custom_id"] == "c1"
    body = line["response"]["body"]
    assert body == to_chat_completion(record)
    assert body["object"] == "chat.completion" and body["created"] == 1700000000
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": f"answer {i}"} for i in range(3)
    ]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop", "length"]
    assert body["choices"][1]["logprobs"] == record["choices"][1]["logprobs"]
    first = body["choices"][0]["logprobs"]["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    # Summed over the choices by the worker; read as is.
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    # The documented model (and so the openai client's) parses it.
    assert ChatCompletion.model_validate(body).choices[2].logprobs is not None


def test_a_record_without_choices_reads_back_as_one_choice():
    record = {**_record_with_choices(), "choices": None}
    choices = to_openai_output(record)["response"]["body"]["choices"]
    assert choices == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "answer 0"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]


# --- the rest of the producer side -----------------------------------------------------------


def _request(**fields: Any) -> Request:
    return Request.model_validate({"messages": MESSAGES, **fields})


def test_content_ids_of_existing_lines_survive_the_new_fields():
    # The digest of this request before the sampling fields existed (a resubmitted job
    # finds its tasks by it).
    assert (
        content_id(_request(max_new_tokens=8, seed=3)) == "sha256-aef0d2b5025efd1faff4ad59ac4ae37e"
    )
    assert content_id(_request(max_new_tokens=8, seed=3, n=2)) != content_id(
        _request(max_new_tokens=8, seed=3)
    )
    assert content_id(_request(regex="a+")) != content_id(_request(regex="b+"))


def test_preflight_counts_the_output_tokens_of_every_completion():
    preflight = Preflight(Settings(model="/nonexistent-model"))
    one = preflight.estimate(_request(max_new_tokens=10))
    three = preflight.estimate(_request(max_new_tokens=10, n=3))
    default = preflight.estimate(_request(n=2))
    assert (one.output_tokens, three.output_tokens) == (10, 30)
    assert default.output_tokens == 2 * Settings().engine.max_new_tokens_default
    assert three.prompt_tokens == one.prompt_tokens  # one prompt, n completions
