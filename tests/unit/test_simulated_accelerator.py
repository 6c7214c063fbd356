"""The simulated accelerator charges prompt tokens (visual ones included): video prefill is
never free."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from vlmq.config.schemas import Request
from vlmq.workers.engine import noop
from vlmq.workers.engine.interface import Collated
from vlmq.workers.engine.noop import SimulatedAccelerator, parse_simulate, simulated_seconds
from vlmq.workers.engine.prepare import Prepared

pytestmark = pytest.mark.unit


def _prepared(prompt_tokens: int, max_new_tokens: int = 16, n: int = 1) -> Prepared:
    request = Request.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "n": n, "temperature": 1.0}
    )
    return Prepared(request, max_new_tokens, prompt_tokens=prompt_tokens)


def test_a_video_batch_costs_more_than_a_text_batch_by_its_tokens() -> None:
    base, step, token = 0.005, 0.004, 0.00002
    text = [_prepared(30) for _ in range(8)]
    video = [_prepared(30 + 1024) for _ in range(8)]  # 16 frames: ~1,024 visual tokens each
    text_s = simulated_seconds(text, base, step, token)
    video_s = simulated_seconds(video, base, step, token)
    assert text_s == pytest.approx(base + token * 8 * 30 + step * 16)
    assert video_s - text_s == pytest.approx(token * 8 * 1024)  # 0.164 s more
    assert simulated_seconds([], base, step, token) == 0.0


def test_rows_and_the_longest_generation_count() -> None:
    items = [_prepared(100, max_new_tokens=8, n=4), _prepared(50, max_new_tokens=32)]
    assert simulated_seconds(items, 0.0, 0.001, 0.0001) == pytest.approx(
        0.0001 * (100 * 4 + 50) + 0.001 * 32
    )


def test_the_simulate_option_keeps_its_two_number_form() -> None:
    assert parse_simulate("0.015,0.004") == (0.015, 0.004, 0.0)  # no per-token charge
    assert parse_simulate("0.005,0.004,0.00002") == (0.005, 0.004, 0.00002)
    assert parse_simulate(noop.SIMULATE_DEFAULT) == (
        noop.PREFILL_BASE_S,
        noop.DECODE_STEP_S,
        noop.PREFILL_TOKEN_S,
    )
    for bad in ("0.1", "1,2,3,4", "0.1,-1", "a,b"):
        with pytest.raises(ValueError):
            parse_simulate(bad)


def test_the_cli_default_is_the_simulators() -> None:
    from vlmq.workers.cli import SIMULATE_DEFAULT

    assert parse_simulate(SIMULATE_DEFAULT) == parse_simulate(noop.SIMULATE_DEFAULT)


def test_poll_sleeps_and_reports_the_charged_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(noop.time, "sleep", slept.append)
    engine: Any = types.SimpleNamespace(model_name="m", stats=types.SimpleNamespace(generate_s=0))
    accelerator = SimulatedAccelerator(engine, 0.005, 0.004, 0.00002)
    items = [_prepared(1054), _prepared(30)]
    accelerator.submit(Collated(items, None, 0.0))
    results = accelerator.poll("w")
    expected = simulated_seconds(items, 0.005, 0.004, 0.00002)
    assert slept == [pytest.approx(expected)]
    assert [r.timings["generate_s"] for r in results] == [pytest.approx(expected)] * 2


def test_the_processor_runs_on_the_simulated_device(checkpoint: Any, tmp_path: Path) -> None:
    """``--simulate-processor device``: the collated tensors are made on ``meta`` (no host
    CPU spent on them); the token ids are the host's."""
    from tests.support.samples import save_image
    from vlmq.config.schemas import Request
    from vlmq.config.settings import EngineSettings, MediaSettings
    from vlmq.workers.engine import Engine

    save_image(tmp_path / "a.png", size=(64, 48), seed=1)
    media = MediaSettings(local_roots=[str(tmp_path)])
    request = Request.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(tmp_path / "a.png")},
                        "Describe it.",
                    ],
                }
            ]
        }
    )
    host = Engine(str(checkpoint("qwen2_5_vl")), EngineSettings(), media).setup()
    device = SimulatedAccelerator(
        Engine(str(checkpoint("qwen2_5_vl")), EngineSettings(), media), 0, 0, 0, True
    ).setup()
    on_host = host.collate([host.prepare(request)]).inputs
    on_device = device.collate([device.prepare(request)]).inputs
    assert on_device["pixel_values"].device.type == "meta"
    assert on_device["pixel_values"].shape == on_host["pixel_values"].shape
    assert on_device["input_ids"].tolist() == on_host["input_ids"].tolist()
