"""Every per-row control of the decode loop as tensors on the device, one row per slot, and one
function that applies them to a step's logits and records the step. No host sync: the host
learns what happened (finished rows, rows whose text may hold a stop string) every few steps.

In the order the transformers path applies them (controls.py): logprobs of the raw logits,
repetition / presence / frequency penalties, EOS held back until ``min_tokens``, the
constraint's bitmask, then the token (greedy or a seeded draw, sampling.py). Then the step is
recorded: the token into the row's output, its logprobs, its penalty count, whether the row
ended (EOS or its own ``max_new_tokens``) and whether it may have completed a stop string.

A row without a control gets its identity (penalty 1 / 0, all tokens allowed), so one code
path serves every row; ``Features`` says which parts a batch needs at all, so a greedy batch
without logprobs, penalties or constraints does none of that work. Each feature set is its own
function (and its own CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmq.workers.engine.constraints import disallowed
from vlmq.workers.engine.sampling import choose_tokens, seed_words

__all__ = ["TOP_LOGPROBS", "Features", "RowSpec", "SlotControls"]

# Alternatives kept per step when logprobs are on (a row keeps its own first top_logprobs).
TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Features:
    """Which controls a batch's rows use."""

    sampling: bool = False
    logprobs: bool = False
    penalties: bool = False
    constraints: bool = False
    stops: bool = False

    def __or__(self, other: Features) -> Features:
        return Features(
            self.sampling or other.sampling,
            self.logprobs or other.logprobs,
            self.penalties or other.penalties,
            self.constraints or other.constraints,
            self.stops or other.stops,
        )


@dataclass(frozen=True)
class RowSpec:
    """One row's controls, as the host knows them at admission."""

    max_new: int
    min_tokens: int = 0
    sampled: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    logprobs: bool = False
    stops: tuple[str, ...] = ()
    constrained: bool = False

    @property
    def features(self) -> Features:
        penalised = (self.repetition, self.presence, self.frequency) != (1.0, 0.0, 0.0)
        return Features(self.sampled, self.logprobs, penalised, self.constrained, bool(self.stops))


class SlotControls:
    """The per-slot control state on one device (``slots`` rows, ``vocab`` logits wide, outputs
    up to ``max_steps`` tokens)."""

    def __init__(
        self, slots: int, vocab: int, max_steps: int, eos_ids: list[int], device: Any
    ) -> None:
        self.slots, self.vocab, self.max_steps = slots, vocab, max_steps
        self.device = torch.device(device)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.steps = zeros(slots)
        self.max_new = zeros(slots)
        self.min_tokens = zeros(slots)
        self.done = zeros(slots, dtype=torch.bool)
        self.check = zeros(slots, dtype=torch.bool)
        self.has_stop = zeros(slots, dtype=torch.bool)
        self.sampled = zeros(slots, dtype=torch.bool)
        self.temperature = torch.ones(slots, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.keys = zeros(slots)
        self.repetition = torch.ones(slots, device=device)
        self.presence = zeros(slots, dtype=torch.float32)
        self.frequency = zeros(slots, dtype=torch.float32)
        self.out = zeros(slots, max_steps)
        # Grown on first use: a vocabulary-wide row per slot costs memory only when asked for.
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.stop_ends: torch.Tensor | None = None
        self.logprob: torch.Tensor | None = None
        self.top_values: torch.Tensor | None = None
        self.top_ids: torch.Tensor | None = None
        self.bitmask: torch.Tensor | None = None

    # admission -----------------------------------------------------------------------------
    def admit(
        self,
        slots: torch.Tensor,
        specs: list[RowSpec],
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        stop_ends: list[Any],
    ) -> None:
        """Reset ``slots`` for new rows: their specs, their prompt's tokens (penalties) and
        their stop-string end tokens (``stop_ends[i]``: a vocab-wide numpy mask or None)."""
        device = self.device

        def put(target: torch.Tensor, values: list[Any]) -> None:
            target.index_copy_(0, slots, torch.tensor(values, dtype=target.dtype, device=device))

        put(self.max_new, [s.max_new for s in specs])
        put(self.min_tokens, [s.min_tokens for s in specs])
        put(self.sampled, [s.sampled for s in specs])
        put(self.temperature, [s.temperature for s in specs])
        put(self.top_p, [s.top_p for s in specs])
        put(self.repetition, [s.repetition for s in specs])
        put(self.presence, [s.presence for s in specs])
        put(self.frequency, [s.frequency for s in specs])
        put(self.has_stop, [bool(s.stops) for s in specs])
        seeds = torch.tensor([s.seed for s in specs], dtype=torch.long, device=device)
        self.keys.index_copy_(0, slots, seed_words(seeds))
        for target in (self.steps, self.done, self.check):
            target.index_fill_(0, slots, 0)
        features = Features()
        for spec in specs:
            features = features | spec.features
        if features.penalties or self.counts is not None:
            self._admit_prompts(slots, prompts, prompt_mask)
        if any(e is not None for e in stop_ends) or self.stop_ends is not None:
            self._admit_stops(slots, stop_ends)
        if features.logprobs and self.logprob is None:
            self.logprob = torch.zeros(self.slots, self.max_steps, device=device)
            self.top_values = torch.zeros(self.slots, self.max_steps, TOP_LOGPROBS, device=device)
            self.top_ids = torch.zeros(
                self.slots, self.max_steps, TOP_LOGPROBS, dtype=torch.long, device=device
            )
        if self.bitmask is None and features.constraints:
            words = (self.vocab + 31) // 32
            self.bitmask = torch.full((self.slots, words), -1, dtype=torch.int32, device=device)
        if self.bitmask is not None:
            self.bitmask.index_fill_(0, slots, -1)

    def _admit_prompts(
        self, slots: torch.Tensor, prompts: torch.Tensor, prompt_mask: torch.Tensor
    ) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.slots, self.vocab, device=self.device)
            self.in_prompt = torch.zeros(
                self.slots, self.vocab, dtype=torch.bool, device=self.device
            )
        assert self.in_prompt is not None
        mask = prompt_mask.to(self.device).bool()
        ids = prompts.to(self.device).masked_fill(~mask, 0)
        # Padding positions are not prompt tokens: they add 0 (a sum, not a last write).
        hits = torch.zeros(len(slots), self.vocab, device=self.device)
        hits.scatter_add_(1, ids, mask.float())
        self.in_prompt.index_copy_(0, slots, hits > 0)
        self.counts.index_fill_(0, slots, 0.0)

    def _admit_stops(self, slots: torch.Tensor, stop_ends: list[Any]) -> None:
        if self.stop_ends is None:
            self.stop_ends = torch.zeros(
                self.slots, self.vocab, dtype=torch.bool, device=self.device
            )
        rows = torch.zeros(len(stop_ends), self.vocab, dtype=torch.bool)
        for i, ends in enumerate(stop_ends):
            if ends is not None:
                rows[i, : len(ends)] = torch.from_numpy(ends[: self.vocab])
        self.stop_ends.index_copy_(0, slots, rows.to(self.device))

    # the step ------------------------------------------------------------------------------
    def apply(
        self, logits: torch.Tensor, rows_on: torch.Tensor, features: Features
    ) -> torch.Tensor:
        """Choose and record the next token of the first ``len(logits)`` slots; rows where
        ``rows_on`` is False (idle slots) or already done change nothing. Returns the tokens."""
        rows = logits.shape[0]
        index = torch.arange(rows, device=logits.device)
        steps = self.steps[:rows]
        live = rows_on & ~self.done[:rows]
        scores = logits.float()
        raw = torch.log_softmax(scores, dim=-1) if features.logprobs else None
        if features.penalties:
            scores = self._penalised(scores, rows)
        held = (steps < self.min_tokens[:rows]).unsqueeze(1)
        eos_scores = scores.index_select(1, self.eos)
        scores = scores.index_copy(1, self.eos, eos_scores.masked_fill(held, float("-inf")))
        if features.constraints:
            scores = self._masked(scores, rows)
        if features.sampling:
            tokens = choose_tokens(
                scores,
                self.sampled[:rows],
                self.temperature[:rows],
                self.top_p[:rows],
                self.keys[:rows],
                steps,
            )
        else:
            tokens = scores.argmax(dim=-1)
        self._record(index, tokens, live, raw, features)
        return tokens

    def _penalised(self, scores: torch.Tensor, rows: int) -> torch.Tensor:
        assert self.counts is not None and self.in_prompt is not None
        counts = self.counts[:rows]
        seen = self.in_prompt[:rows] | (counts > 0)
        repetition = self.repetition[:rows].unsqueeze(1)
        repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
        scores = torch.where(seen, repeated, scores)
        frequency = self.frequency[:rows].unsqueeze(1)
        presence = self.presence[:rows].unsqueeze(1)
        return scores - frequency * counts - presence * (counts > 0)

    def _masked(self, scores: torch.Tensor, rows: int) -> torch.Tensor:
        assert self.bitmask is not None
        scores = scores.masked_fill(disallowed(self.bitmask[:rows], scores.shape[1]), float("-inf"))
        # A row left with nothing (min_tokens held back the EOS its complete grammar needs) may
        # end: the constraint wins.
        empty = torch.isinf(scores).all(dim=1, keepdim=True)
        eos_scores = scores.index_select(1, self.eos)
        return scores.index_copy(1, self.eos, torch.where(empty, 0.0, eos_scores))

    def _record(
        self,
        index: torch.Tensor,
        tokens: torch.Tensor,
        live: torch.Tensor,
        raw: torch.Tensor | None,
        features: Features,
    ) -> None:
        rows = len(index)
        steps = self.steps[:rows]
        column = steps.clamp(max=self.max_steps - 1)
        self.out[index, column] = torch.where(live, tokens, self.out[index, column])
        if raw is not None:
            self._record_logprobs(index, column, tokens, live, raw)
        if features.penalties and self.counts is not None:
            self.counts[:rows].scatter_add_(1, tokens.unsqueeze(1), live.float().unsqueeze(1))
        after = steps + 1
        ended = (tokens.unsqueeze(1) == self.eos).any(dim=1) | (after >= self.max_new[:rows])
        if features.stops and self.stop_ends is not None:
            may_stop = self.stop_ends[index, tokens] | (after == self.min_tokens[:rows] + 1)
            self.check[:rows] |= live & self.has_stop[:rows] & may_stop
        self.done[:rows] |= live & ended
        self.steps[:rows] = steps + live.long()

    def _record_logprobs(
        self,
        index: torch.Tensor,
        column: torch.Tensor,
        tokens: torch.Tensor,
        live: torch.Tensor,
        raw: torch.Tensor,
    ) -> None:
        assert self.logprob is not None and self.top_values is not None
        assert self.top_ids is not None
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        self.logprob[index, column] = torch.where(live, chosen, self.logprob[index, column])
        values, ids = torch.topk(raw, min(TOP_LOGPROBS, raw.shape[1]), dim=-1)
        keep = live.unsqueeze(1)
        width = values.shape[1]
        old_values = self.top_values[index, column, :width]
        old_ids = self.top_ids[index, column, :width]
        self.top_values[index, column, :width] = torch.where(keep, values, old_values)
        self.top_ids[index, column, :width] = torch.where(keep, ids, old_ids)

    # moving and releasing ------------------------------------------------------------------
    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Rows move slots (the loop packs its rows into fewer): every per-slot state follows."""
        for tensor in self._per_slot():
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def _per_slot(self) -> list[torch.Tensor]:
        found = [
            self.steps, self.max_new, self.min_tokens, self.done, self.check, self.has_stop,
            self.sampled, self.temperature, self.top_p, self.keys, self.repetition,
            self.presence, self.frequency, self.out, self.counts, self.in_prompt,
            self.stop_ends, self.logprob, self.top_values, self.top_ids, self.bitmask,
        ]  # fmt: skip
        return [t for t in found if t is not None]

    def release(self, slots: torch.Tensor) -> None:
        """Slots whose rows were taken out: done, so a step leaves them alone until reused."""
        self.done.index_fill_(0, slots, True)
        self.check.index_fill_(0, slots, False)
