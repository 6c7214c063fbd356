"""Per-row generation controls, so requests with different settings share a batch.

``model.generate`` takes one configuration per call. These two hooks make it
behave per row instead:

* :class:`RowSampler` runs greedy decoding for greedy rows and, for sampling
  rows, draws the token itself (its own temperature, top-p and seed: sampling.py,
  the same draw the decode loop makes) and masks every other logit, so the
  batch-wide greedy step picks exactly that token. A seeded request therefore
  samples the same tokens whatever its batch-mates are, on either path.
* :class:`RowStopper` ends each row at its own ``max_new_tokens`` or at one of
  its stop strings (not before its ``min_tokens``; stops.py's rule); the batch generates
  to the longest row's limit.
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
from vlmq.workers.engine.sampling import choose_tokens, seed_words
from vlmq.workers.engine.stops import first_stop, stop_window

__all__ = [
    "RowMinTokens",
    "RowPenalties",
    "RowPenalty",
    "RowSampler",
    "RowSampling",
    "RowStopper",
    "completion_seed",
]


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


class RowSampler(LogitsProcessor):
    """Samples the rows that asked for it (sampling.choose_tokens, the decode loop's own draw);
    leaves greedy rows untouched: a sampled row's logits become its drawn token alone."""

    def __init__(self, rows: Sequence[RowSampling | None]) -> None:
        self.rows = list(rows)
        self.sampled = torch.tensor([r is not None for r in self.rows])
        self.temperature = torch.tensor([r.temperature if r else 1.0 for r in self.rows])
        self.top_p = torch.tensor([r.top_p if r else 1.0 for r in self.rows])
        seeds = torch.tensor([r.seed if r else 0 for r in self.rows], dtype=torch.long)
        self.keys = seed_words(seeds)
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        device = scores.device
        sampled = self.sampled.to(device)
        tokens = choose_tokens(
            scores,
            sampled,
            self.temperature.to(device),
            self.top_p.to(device),
            self.keys.to(device),
            torch.full_like(self.keys, self.steps, device=device),
        )
        self.steps += 1
        only = torch.full_like(scores, torch.finfo(scores.dtype).min)
        only.scatter_(1, tokens.unsqueeze(1), 0.0)
        return torch.where(sampled.unsqueeze(1), only, scores)  # type: ignore[return-value]


class RowStopper(StoppingCriteria):
    """Per-row stop: each row's own token limit, and its own stop strings (stops.first_stop:
    the rule the decode loop applies too)."""

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
        # row -> number of generated tokens when its stop string appeared
        self.stopped_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_length
        done = (generated >= self.max_new_tokens).to(input_ids.device)
        for row, stops in enumerate(self.stop_strings):
            # A row stops once: generate pads it afterwards, and its window still holds the
            # stop string for a few steps.
            if not stops or done[row] or row in self.stopped_at:
                continue
            # The last window of tokens, counted from where it starts: the check at `generated`.
            tail = input_ids[row, self.prompt_length :][-stop_window(stops) :].tolist()
            skipped = generated - len(tail)
            floor = self.min_tokens[row] - skipped
            if first_stop(self.decode, tail, stops, floor, len(tail) - 1, len(tail)) is not None:
                self.stopped_at[row] = generated
                done[row] = True
        return done  # type: ignore[return-value]


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
