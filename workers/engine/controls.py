"""Per-row generation controls, so requests with different settings share a batch.

``model.generate`` takes one configuration per call. These two hooks make it
behave per row instead:

* :class:`RowSampler` runs greedy decoding for greedy rows and, for sampling
  rows, draws the token itself (its own temperature, top-p and seeded
  generator) and masks every other logit, so the batch-wide greedy step picks
  exactly that token. A seeded request therefore samples the same tokens
  whatever its batch-mates are.
* :class:`RowStopper` ends each row at its own ``max_new_tokens`` or at one of
  its stop strings (not before its ``min_tokens``); the batch generates to the longest
  row's limit.
* :class:`RowPenalties` applies each row's repetition (multiplicative, over prompt and
  output, as transformers and vLLM do), presence and frequency (additive, over the output,
  OpenAI's definition) penalties; :class:`RowMinTokens` holds back EOS until a row has its
  ``min_tokens``.

The list runs in this order every step: logprobs (raw logits), penalties, min tokens,
constraints, sampler; so a sampled token obeys the constraint and its logprob is the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

from vlmq.workers.engine.completions import completion_seed

__all__ = [
    "RowMinTokens",
    "RowPenalties",
    "RowPenalty",
    "RowSampler",
    "RowSampling",
    "RowStopper",
    "completion_seed",
]

# Below this a temperature is greedy in effect; it keeps the division finite.
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True)
class RowPenalty:
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0


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
        min_tokens: Sequence[int] | None = None,
    ) -> None:
        self.prompt_length = prompt_length
        self.max_new_tokens = torch.tensor(list(max_new_tokens))
        self.min_tokens = list(min_tokens or [0] * len(stop_strings))
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
            if generated <= self.min_tokens[row]:
                continue
            if stops and not done[row] and self._hit(input_ids[row], row, generated, stops):
                self.stopped_at[row] = generated
                done[row] = True
        return done  # type: ignore[return-value]

    def _hit(self, row_ids: torch.Tensor, row: int, generated: int, stops: list[str]) -> bool:
        window = min(self.windows[row], generated)
        tail = self.decode(row_ids[-window:].tolist()) if window else ""
        return any(stop in tail for stop in stops)


class RowMinTokens(LogitsProcessor):
    """EOS is not an option for a row until it has generated its ``min_tokens``."""

    def __init__(self, min_tokens: Sequence[int], eos_ids: Iterable[int]) -> None:
        self.min_tokens = torch.tensor(list(min_tokens))
        self.eos_ids = torch.tensor(sorted(eos_ids))
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        held = torch.nonzero(self.min_tokens > self.steps).flatten().to(scores.device)
        self.steps += 1
        if held.numel():
            eos = self.eos_ids.to(scores.device)
            scores[held.unsqueeze(1), eos.unsqueeze(0)] = float("-inf")
        return scores


class RowPenalties(LogitsProcessor):
    """Per-row repetition, presence and frequency penalties, vectorised over the rows that
    have any. Output counts are kept incrementally (one scatter per step)."""

    def __init__(
        self, penalties: Sequence[RowPenalty | None], prompt_ids: torch.Tensor, prompt_mask: Any
    ) -> None:
        self.rows = [row for row, p in enumerate(penalties) if p is not None]
        chosen = [p for p in penalties if p is not None]
        self.repetition = torch.tensor([p.repetition for p in chosen]).unsqueeze(1)
        self.presence = torch.tensor([p.presence for p in chosen]).unsqueeze(1)
        self.frequency = torch.tensor([p.frequency for p in chosen]).unsqueeze(1)
        index = torch.tensor(self.rows, dtype=torch.long)
        self._prompt = prompt_ids.index_select(0, index.to(prompt_ids.device))
        self._prompt_mask = prompt_mask.index_select(0, index.to(prompt_mask.device)).bool()
        self._counts: torch.Tensor | None = None
        self._in_prompt: torch.Tensor | None = None
        self.steps = 0

    def _start(self, scores: torch.Tensor) -> None:
        shape = (len(self.rows), scores.shape[1])
        self._counts = torch.zeros(shape, device=scores.device)
        # Padding positions are not prompt tokens: they add 0 (a sum, not a last write).
        mask = self._prompt_mask.to(scores.device)
        ids = self._prompt.to(scores.device).masked_fill(~mask, 0)
        hits = torch.zeros(shape, device=scores.device).scatter_add_(1, ids, mask.float())
        self._in_prompt = hits > 0
        self.repetition = self.repetition.to(scores.device)
        self.presence = self.presence.to(scores.device)
        self.frequency = self.frequency.to(scores.device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.rows:
            return scores
        index = torch.tensor(self.rows, device=scores.device)
        if self._counts is None:
            self._start(scores)
        assert self._counts is not None and self._in_prompt is not None
        if self.steps:
            last = input_ids[:, -1].index_select(0, index).unsqueeze(1)
            self._counts.scatter_add_(1, last, torch.ones_like(last, dtype=self._counts.dtype))
        self.steps += 1
        picked = scores.index_select(0, index).float()
        seen = self._in_prompt | (self._counts > 0)
        repeated = torch.where(picked > 0, picked / self.repetition, picked * self.repetition)
        picked = torch.where(seen, repeated, picked)
        picked = picked - self.frequency * self._counts - self.presence * (self._counts > 0)
        scores.index_copy_(0, index, picked.to(scores.dtype))
        return scores
