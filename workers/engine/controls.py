"""Per-row generation controls, so requests with different settings share a batch.

``model.generate`` takes one configuration per call. These two hooks make it
behave per row instead:

* :class:`RowSampler` runs greedy decoding for greedy rows and, for sampling
  rows, draws the token itself (its own temperature, top-p and seeded
  generator) and masks every other logit, so the batch-wide greedy step picks
  exactly that token. A seeded request therefore samples the same tokens
  whatever its batch-mates are.
* :class:`RowStopper` ends each row at its own ``max_new_tokens`` or at one of
  its stop strings; the batch generates to the longest row's limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

__all__ = ["RowSampler", "RowSampling", "RowStopper"]

# Below this a temperature is greedy in effect; it keeps the division finite.
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    seed: int


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the top token).
    drop = cumulative - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum()


class RowSampler(LogitsProcessor):
    """Samples the rows that asked for it; leaves greedy rows untouched."""

    def __init__(self, rows: Sequence[RowSampling | None]) -> None:
        self.rows = list(rows)
        self.generators: list[torch.Generator | None] = [
            torch.Generator().manual_seed(r.seed) if r else None for r in self.rows
        ]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row, (spec, generator) in enumerate(zip(self.rows, self.generators, strict=True)):
            if spec is None or generator is None:
                continue
            logits = scores[row].float().cpu()
            if spec.temperature > 0:
                # Shift, and floor the temperature: logits / 1e-300 overflows
                # float32 (1e-300 itself rounds to 0) and softmax gives NaN.
                temperature = max(spec.temperature, _MIN_TEMPERATURE)
                probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
                probs = _top_p_filter(probs, spec.top_p)
                token = int(torch.multinomial(probs, 1, generator=generator))
            else:
                token = int(torch.argmax(logits))
            scores[row] = torch.finfo(scores.dtype).min
            scores[row, token] = 0.0
        return scores


class RowStopper(StoppingCriteria):
    """Per-row stop: each row's own token limit, and its own stop strings."""

    def __init__(
        self,
        prompt_length: int,
        max_new_tokens: Sequence[int],
        stop_strings: Sequence[Sequence[str]],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.prompt_length = prompt_length
        self.max_new_tokens = torch.tensor(list(max_new_tokens))
        self.stop_strings = [list(s) for s in stop_strings]
        self.decode = decode
        # A stop string spans at most len(s) tokens; look a little further back.
        self.windows = [max((len(s) for s in stops), default=0) + 4 for stops in self.stop_strings]
        # row -> number of generated tokens when its stop string appeared
        self.stopped_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_length
        done = (generated >= self.max_new_tokens).to(input_ids.device)
        for row, stops in enumerate(self.stop_strings):
            if stops and not done[row] and self._hit(input_ids[row], row, generated, stops):
                self.stopped_at[row] = generated
                done[row] = True
        return done  # type: ignore[return-value]

    def _hit(self, row_ids: torch.Tensor, row: int, generated: int, stops: list[str]) -> bool:
        window = min(self.windows[row], generated)
        tail = self.decode(row_ids[-window:].tolist()) if window else ""
        return any(stop in tail for stop in stops)
