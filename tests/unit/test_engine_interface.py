"""The generation interface as the worker reads it: each engine declares how it runs
(``capabilities``), what it counts (``stats``) and what it still holds (``pending``)."""

from __future__ import annotations

from tests.support.continuous import StepEngine
from vlmq.config.schemas import Request
from vlmq.config.settings import DecodeSettings, EngineSettings
from vlmq.workers.engine.engine import Engine, EngineStats
from vlmq.workers.engine.interface import (
    Collated,
    GenerationEngine,
    RunOnlyEngine,
    as_generation_engine,
)
from vlmq.workers.engine.noop import NoopEngine
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.engine.vllm_engine import VllmEngine


def _prepared(prefix: str, n: int, max_new_tokens: int) -> list[Prepared]:
    lines = [
        {
            "id": f"{prefix}{i}",
            "messages": [{"role": "user", "content": "?"}],
            "generation": {"max_new_tokens": max_new_tokens},
        }
        for i in range(n)
    ]
    return [Prepared(Request.model_validate(line), max_new_tokens) for line in lines]


def test_each_engine_declares_how_it_runs_and_what_it_counts() -> None:
    hf, vllm = Engine("unused"), VllmEngine("unused")  # neither set up: nothing loaded
    try:
        declared = [
            (hf, True, EngineStats),  # the decode loop in flight (the default)
            (
                Engine("unused", EngineSettings(decode=DecodeSettings(inflight=False))),
                False,
                EngineStats,
            ),
            (
                Engine("unused", EngineSettings(decode=DecodeSettings(mode="generate"))),
                False,
                EngineStats,
            ),
            (vllm, True, type(None)),
            (StepEngine(), True, type(None)),
            (as_generation_engine(NoopEngine()), False, type(None)),
        ]
        for engine, continuous, stats in declared:
            assert isinstance(engine, GenerationEngine), type(engine).__name__
            assert engine.capabilities.continuous is continuous, type(engine).__name__
            assert isinstance(engine.stats, stats), type(engine).__name__
    finally:
        hf.close()
        vllm.close()


def test_a_one_slot_engine_holds_its_micro_batch_until_polled() -> None:
    engine = as_generation_engine(NoopEngine())
    assert isinstance(engine, RunOnlyEngine)
    assert engine.pending == 0
    engine.submit(Collated(_prepared("r", 3, 2), None, 0.0))
    assert engine.pending == 3 and engine.capacity() == 0
    assert len(engine.poll("w")) == 3
    assert engine.pending == 0 and engine.capacity() > 0


def test_a_continuous_engine_holds_what_has_not_finished() -> None:
    engine = StepEngine(slots=4)
    engine.submit(Collated(_prepared("short", 2, 1), None, 0.0))
    engine.submit(Collated(_prepared("long", 1, 3), None, 0.0))
    assert engine.pending == 3
    assert {r.id for r in engine.poll("w")} == {"short0", "short1"}
    assert engine.pending == 1
