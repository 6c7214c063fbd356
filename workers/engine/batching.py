"""Cut a batch into micro-batches: sorted by length, under a padded-token budget.

Sorting by estimated prompt length keeps rows of similar length together, so
left padding wastes few tokens; the budget counts every padded position the
device holds (rows x (longest prompt + longest generation)). A request with ``n`` sampled
completions is ``n`` rows (its ``rows``; 1 for items that do not say).
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


def _rows(item: Sized) -> int:
    return int(getattr(item, "rows", 1))


# With bucketing, a micro-batch that is at least half full is closed early
# rather than let one longer row push its real/padded prompt tokens below this.
MIN_PADDING_EFFICIENCY = 0.9


@dataclass(frozen=True)
class _Extent:
    rows: int
    prompt: int
    new: int
    real: int = 0

    def cost(self) -> int:
        return self.rows * (self.prompt + self.new)

    def efficiency(self) -> float:
        return self.real / max(1, self.rows * self.prompt)


def padded_cost(items: Sequence[Sized]) -> int:
    """Token positions a padded micro-batch of these items occupies."""
    if not items:
        return 0
    longest_prompt = max(i.prompt_tokens for i in items)
    longest_new = max(i.max_new_tokens for i in items)
    return sum(_rows(i) for i in items) * (longest_prompt + longest_new)


def _full(grown: _Extent, current: _Extent, max_rows: int, budget: int, bucketing: bool) -> bool:
    if grown.rows > max_rows or grown.cost() > budget:
        return True
    half_full = current.rows >= max(1, max_rows // 2)
    return bucketing and half_full and grown.efficiency() < MIN_PADDING_EFFICIENCY


def plan_micro_batches(
    items: Sequence[T], max_batch_size: int, token_budget: int, bucketing: bool = True
) -> list[list[T]]:
    """Greedy fill in length order (or arrival order without bucketing); an item
    over budget on its own runs alone."""
    ordered = (
        sorted(items, key=lambda i: (i.prompt_tokens, i.max_new_tokens))
        if bucketing
        else list(items)
    )
    batches: list[list[T]] = []
    current: list[T] = []
    extent = _Extent(0, 0, 0)
    for item in ordered:
        rows = _rows(item)
        grown = _Extent(
            extent.rows + rows,
            max(extent.prompt, item.prompt_tokens),
            max(extent.new, item.max_new_tokens),
            extent.real + item.prompt_tokens * rows,
        )
        if current and _full(grown, extent, max_batch_size, token_budget, bucketing):
            batches.append(current)
            current = []
            grown = _Extent(
                rows, item.prompt_tokens, item.max_new_tokens, item.prompt_tokens * rows
            )
        current.append(item)
        extent = grown
    if current:
        batches.append(current)
    return batches
