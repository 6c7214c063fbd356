"""The vLLM engine without vLLM: a request's mapping onto ``SamplingParams`` fields, and what a
refusal from vLLM means."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vlmq.config.schemas import Request
from vlmq.workers.engine.interface import Collated, EngineDied
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.engine.vllm_engine import VllmEngine, sampling_fields


def _fields(**generation: Any) -> dict[str, Any]:
    request = Request.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **generation}
    )
    return sampling_fields(request, request.generation.max_new_tokens or 16)


def test_greedy_is_temperature_zero_and_one_sequence():
    fields = _fields(n=4, max_new_tokens=9, seed=3)
    assert fields["temperature"] == 0.0 and fields["n"] == 1  # greedy n: one row, copied
    assert fields["max_tokens"] == 9 and "seed" not in fields
    assert "structured_outputs" not in fields and "logprobs" not in fields


def test_sampling_fields_map_one_to_one():
    fields = _fields(
        temperature=0.7,
        top_p=0.9,
        seed=11,
        n=3,
        stop=["END"],
        min_tokens=2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=4,
    )
    assert fields["temperature"] == 0.7 and fields["top_p"] == 0.9 and fields["seed"] == 11
    assert fields["n"] == 3 and fields["stop"] == ["END"] and fields["min_tokens"] == 2
    assert fields["repetition_penalty"] == 1.2
    assert (fields["presence_penalty"], fields["frequency_penalty"]) == (0.5, -0.5)
    assert fields["logprobs"] == 4


def test_each_constraint_kind_becomes_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_schema = _fields(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )["structured_outputs"]
    assert json.loads(as_schema["json"]) == schema and as_schema["disable_any_whitespace"]
    assert _fields(response_format={"type": "json_object"})["structured_outputs"] == {
        "json_object": True
    }
    assert _fields(regex="[0-9]+")["structured_outputs"] == {"regex": "[0-9]+"}
    assert _fields(choice=["a", "b"])["structured_outputs"] == {"choice": ["a", "b"]}
    assert _fields(grammar='start: "x"')["structured_outputs"] == {"grammar": 'start: "x"'}
    assert "structured_outputs" not in _fields(response_format={"type": "text"})


def test_fixed_length_holds_eos_back_to_the_limit():
    request = Request.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert sampling_fields(request, 12, fixed_length=True)["min_tokens"] == 12


class EngineDeadError(RuntimeError):
    """What vLLM's client raises once its engine process is gone (its name is what counts)."""


def _submit_refused_by(exc: Exception) -> VllmEngine:
    """A vLLM engine whose ``add_request`` raises ``exc``, handed one request (``_add`` is
    where vLLM is called: nothing here needs the vllm package)."""
    engine = VllmEngine("unused")
    engine._llm = object()  # started, as far as submit can tell

    def add(*args: Any) -> int:
        raise exc

    engine._add = add  # type: ignore[method-assign,assignment]
    request = Request.model_validate({"id": "r1", "messages": [{"role": "user", "content": "?"}]})
    try:
        engine.submit(Collated([Prepared(request, 4)], [{"prompt": "?"}], 0.0))
    finally:
        engine.close()
    return engine


def test_a_request_vllm_refuses_fails_alone():
    engine = _submit_refused_by(ValueError("temperature must be in [0, 2]"))
    (result,) = engine.poll("w1")
    assert result.status == "failed" and result.error is not None
    assert result.error["code"] == "invalid_request"


def test_a_dead_engine_is_no_request_refused():
    """Once vLLM's engine process died, ``add_request`` raises for every request: the engine
    is gone (the worker exits and its work is redelivered), no request failed."""
    with pytest.raises(EngineDied):
        _submit_refused_by(EngineDeadError("EngineCore encountered an issue"))
