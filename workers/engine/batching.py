"""Cut a batch into micro-batches: sorted by length, under a padded-token budget.

Sorting by estimated prompt length keeps rows of similar length together, so
left padding wastes few tokens; the budget counts every padded position the
device holds (rows x (longest prompt + longest generation)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Sized", "padded_cost", "plan_micro_batches"]


class Sized(Protocol):
    @property
    def prompt_tokens(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...


T = TypeVar("T", bound=Sized)


@dataclass(frozen=True)
class _Extent:
    rows: int
    prompt: int
    new: int

    def cost(self) -> int:
        return self.rows * (self.prompt + self.new)


def padded_cost(items: Sequence[Sized]) -> int:
    """Token positions a padded micro-batch of these items occupies."""
    if not items:
        return 0
    longest_prompt = max(i.prompt_tokens for i in items)
    longest_new = max(i.max_new_tokens for i in items)
    return len(items) * (longest_prompt + longest_new)


def plan_micro_batches(items: Sequence[T], max_batch_size: int, token_budget: int) -> list[list[T]]:
    """Greedy fill in length order; an item over budget on its own runs alone."""
    ordered = sorted(items, key=lambda i: (i.prompt_tokens, i.max_new_tokens))
    batches: list[list[T]] = []
    current: list[T] = []
    extent = _Extent(0, 0, 0)
    for item in ordered:
        grown = _Extent(
            extent.rows + 1,
            max(extent.prompt, item.prompt_tokens),
            max(extent.new, item.max_new_tokens),
        )
        if current and (grown.rows > max_batch_size or grown.cost() > token_budget):
            batches.append(current)
            current = []
            grown = _Extent(1, item.prompt_tokens, item.max_new_tokens)
        current.append(item)
        extent = grown
    if current:
        batches.append(current)
    return batches
