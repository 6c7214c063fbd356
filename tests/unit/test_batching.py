from __future__ import annotations

from dataclasses import dataclass

from vlmq.workers.engine.batching import padded_cost, plan_micro_batches


@dataclass
class Item:
    prompt_tokens: int
    max_new_tokens: int = 8


def test_sorted_by_length_and_capped_by_rows():
    items = [Item(n) for n in (104, 100, 103, 101, 102)]
    batches = plan_micro_batches(items, max_batch_size=2, token_budget=10**9)
    assert [[i.prompt_tokens for i in b] for b in batches] == [[100, 101], [102, 103], [104]]


def test_a_half_full_batch_closes_before_padding_gets_wasteful():
    items = [Item(100)] * 4 + [Item(200)] * 4
    batches = plan_micro_batches(items, max_batch_size=8, token_budget=10**9)
    assert [[i.prompt_tokens for i in b] for b in batches] == [[100] * 4, [200] * 4]
    # Below half full a batch keeps filling even if padding grows.
    few_short = [Item(100)] * 2 + [Item(200)] * 6
    assert [len(b) for b in plan_micro_batches(few_short, 8, 10**9)] == [4, 4]
    assert [len(b) for b in plan_micro_batches(few_short, 8, 10**9, bucketing=False)] == [8]


def test_token_budget_splits_batches():
    items = [Item(100, 28) for _ in range(8)]  # 128 padded positions each
    batches = plan_micro_batches(items, max_batch_size=32, token_budget=512)
    assert [len(b) for b in batches] == [4, 4]
    assert all(padded_cost(b) <= 512 for b in batches)


def test_budget_counts_the_longest_row():
    items = [Item(10), Item(10), Item(500)]
    batches = plan_micro_batches(items, max_batch_size=32, token_budget=600)
    assert [len(b) for b in batches] == [2, 1]


def test_an_item_over_budget_runs_alone():
    batches = plan_micro_batches([Item(5000), Item(10)], max_batch_size=8, token_budget=100)
    assert [[i.prompt_tokens for i in b] for b in batches] == [[10], [5000]]


def test_every_item_is_planned_exactly_once():
    items = [Item(n % 97 + 1, n % 13 + 1) for n in range(300)]
    batches = plan_micro_batches(items, max_batch_size=16, token_budget=2000)
    flat = [id(i) for b in batches for i in b]
    assert sorted(flat) == sorted(id(i) for i in items)


def test_first_come_order_without_bucketing():
    items = [Item(n) for n in (50, 10, 40, 20)]
    batches = plan_micro_batches(items, max_batch_size=2, token_budget=10**9, bucketing=False)
    assert [[i.prompt_tokens for i in b] for b in batches] == [[50, 10], [40, 20]]
