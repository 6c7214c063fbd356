"""Cost per result: integer micro-cents, apportioning by tokens, charging a micro-batch."""

from __future__ import annotations

import random
from typing import Any

import pytest

from vlmq.config.cost import Pricing, apportion, cents, per_thousand
from vlmq.config.settings import CostSettings
from vlmq.config.usage import TaskUsage
from vlmq.workers.fleet.charge import charge, tokens


def test_apportioning_sums_exactly_to_the_total_in_proportion():
    rng = random.Random(7)
    for _ in range(2000):
        total = rng.randrange(0, 10**9)
        weights = [rng.randrange(0, 5000) for _ in range(rng.randrange(1, 65))]
        shares = apportion(total, weights)
        assert sum(shares) == total
        whole = sum(weights)
        for share, weight in zip(shares, weights, strict=True):
            exact = total * weight / whole if whole else total / len(weights)
            assert abs(share - exact) < 1  # largest remainder: off by less than one unit


def test_apportioning_edges():
    assert apportion(10, []) == []
    assert apportion(10, [0, 0, 0]) == [4, 3, 3]  # nothing to weigh by: equal shares
    assert apportion(10, [1, 0, 1]) == [5, 0, 5]
    assert apportion(0, [3, 4]) == [0, 0]
    assert apportion(7, [1, 1]) == [4, 3]  # ties go to the earlier share


def test_ucents_are_priced_and_rounded_half_up():
    pricing = Pricing.of(CostSettings(gpu_hour_price=3.6, currency="EUR"), "cpu")
    assert pricing.ucents_per_hour == 360_000_000
    assert pricing.ucents(1_000_000) == 100_000  # one second at 3.60/h: 0.1 cent
    assert pricing.ucents(10) == 1  # 0.1 ucent per µs: 1.0 exactly
    assert pricing.ucents(5) == 1 and pricing.ucents(4) == 0  # half up
    assert pricing.ucents(-3) == 0
    assert Pricing.of(CostSettings(gpu_name="H200"), "cpu").gpu == "H200"
    assert Pricing.of(CostSettings(), "NVIDIA H100").gpu == "NVIDIA H100"
    assert Pricing.of(CostSettings(gpu_hour_price=2.5), "cpu").gpu_hour_price == 2.5


def test_cents_format_to_the_cent():
    assert cents(0) == "0.00"
    assert cents(499_999) == "0.00" and cents(500_000) == "0.01"
    assert cents(123_456_789_012) == "1234.57"
    assert per_thousand(69_444, 3) == 23_148_000
    assert per_thousand(5, 0) == 0


def _record(batch: str, prompt: int, completion: int, **timings: float) -> dict[str, Any]:
    return {
        "batch_id": batch,
        "batch_size": 3,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
        "timings": {"generate_s": 0.3, **timings},
    }


def test_a_batch_is_charged_its_model_seconds_split_by_tokens():
    pricing = Pricing(ucents_per_hour=250_000_000, currency="USD", gpu="cpu")
    records = [_record("b1", 10, 0), _record("b1", 20, 10), _record("b1", 50, 10)]
    charge(records, pricing)
    gpu = [r["cost"]["gpu_us"] for r in records]
    assert sum(gpu) == 300_000  # the batch's generate time, whole
    assert gpu == [30_000, 90_000, 180_000]  # by prompt + generated tokens
    assert {r["cost"]["basis"] for r in records} == {"model"}
    for record in records:
        cost = record["cost"]
        assert cost["ucents"] == pricing.ucents(cost["gpu_us"])
        assert (cost["currency"], cost["gpu"], cost["gpu_hour_price"]) == ("USD", "cpu", 2.5)
        assert TaskUsage.of(record).cost_ucents == cost["ucents"]
        assert TaskUsage.of(record).values()[-2:] == [cost["gpu_us"], cost["ucents"]]


def test_measured_gpu_time_wins_and_batches_are_apart():
    pricing = Pricing(ucents_per_hour=100_000_000)
    records = [
        _record("b1", 10, 10, gpu_s=0.05, model_s=0.2),
        _record("b1", 30, 10, gpu_s=0.07, model_s=0.1),
        _record("b2", 10, 0, model_s=0.4),
        {"status": "failed", "timings": {}},  # never ran: nothing to charge
    ]
    charge(records, pricing)
    assert records[0]["cost"]["gpu_us"] + records[1]["cost"]["gpu_us"] == 120_000
    assert records[0]["cost"]["gpu_us"] == 40_000  # 20 of 60 tokens
    assert records[0]["cost"]["basis"] == "device"
    assert records[2]["cost"] == {**records[2]["cost"], "gpu_us": 400_000, "basis": "model"}
    assert records[3]["cost"]["gpu_us"] == 0 and records[3]["cost"]["ucents"] == 0
    assert tokens(records[3]) == 0


@pytest.mark.parametrize("price", [0.0, 0.01, 2.5, 31.7])
def test_results_sum_to_the_batch_cost_within_a_ucent_each(price):
    pricing = Pricing.of(CostSettings(gpu_hour_price=price), "cpu")
    rng = random.Random(3)
    records = [_record("b", rng.randrange(1, 900), rng.randrange(0, 300)) for _ in range(64)]
    for record in records:
        record["batch_size"] = 64  # model seconds: generate_s over the batch's size
    charge(records, pricing)
    assert sum(r["cost"]["gpu_us"] for r in records) == 300_000
    spent = sum(r["cost"]["ucents"] for r in records)
    assert abs(spent - pricing.ucents(300_000)) <= len(records) // 2 + 1
