"""Constrained decoding per row: llguidance matchers masking the logits of the rows that asked.

``GrammarBook`` belongs to one loaded model: it builds the tokenizer's llguidance view once
(about 1.5 s for a 150k vocabulary, measured) and compiles each distinct grammar once
(``compile``; a bounded LRU of template matchers; a row gets a deep copy, ~2 us).
Compiling runs where requests are prepared (the preprocessing threads), so a constraint the
tokenizer cannot serve fails its own request before any batch forms.

``RowConstraints`` is the logits processor: each step it sets every logit a constrained row's
grammar disallows to -inf; the masks themselves (filled in parallel by llguidance's executor)
are computed for the next step while the model runs its forward pass.
Unconstrained rows are never touched. A row whose grammar is complete may only end (its
matcher allows EOS alone), so it finishes with ``stop``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from vlmq.config.constraints import Constraint
from vlmq.config.errors import InvalidRequest

__all__ = [
    "GrammarBook",
    "GrammarStats",
    "RowConstraints",
    "SlotConstraints",
    "apply_bitmask",
    "disallowed",
]


class GrammarStats:
    def __init__(self) -> None:
        self.compiled = 0
        self.hits = 0
        self.compile_s = 0.0


class GrammarBook:
    """One model's compiled constraints, bounded; safe to use from several threads."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], capacity: int = 512
    ) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        # The logits may be wider than the tokenizer (padded rows): those ids are no token.
        self.tokenizer_size = len(tokenizer)
        self.eos_ids = sorted(eos_ids)
        self.eos_set = set(self.eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=self.eos_ids
        )
        self.executor = llguidance.LLExecutor()
        # Fills the next step's masks while the model computes (RowConstraints).
        self.filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmq-masks")
        self.capacity = capacity
        self.stats = GrammarStats()
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Any:
        """A template matcher for this constraint (cached; a grammar other threads are
        compiling is waited for, not compiled twice); InvalidRequest names the field when
        the engine refuses it with this tokenizer."""
        key = constraint.grammar
        while True:
            with self._lock:
                template = self._templates.get(key)
                if template is not None:
                    self._templates.move_to_end(key)
                    self.stats.hits += 1
                    return template
                busy = self._compiling.get(key)
                if busy is None:
                    self._compiling[key] = threading.Event()
                    break
            busy.wait()  # then look again: compiled, or refused (and compiled again, refused)
        try:
            return self._compile(constraint)
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def _compile(self, constraint: Constraint) -> Any:
        started = time.perf_counter()
        template = self._llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if not template.is_error():
            # The first mask builds the lexer: pay it here, off the model's thread.
            template.compute_bitmask()
        if template.is_error():
            raise InvalidRequest(_reason(template.get_error()), field=constraint.field)
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_s += time.perf_counter() - started
            self._templates[constraint.grammar] = template
            while len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
        return template

    def matcher(self, template: Any) -> Any:
        """A fresh matcher for one row."""
        return template.deep_copy()

    def token_bytes(self, token_id: int) -> bytes:
        """A token's exact bytes (a byte-level token may be part of one UTF-8 character;
        a special token is its text); none for an id past the tokenizer (a padded logit)."""
        if not 0 <= token_id < self.tokenizer_size:
            return b""
        return bytes(self.tokenizer.decode_bytes([token_id]))


def _reason(error: str) -> str:
    text = " ".join(error.split())
    return text[:300] or "the grammar engine refused this constraint"


_SHIFTS = torch.arange(32, dtype=torch.int32)


def disallowed(
    bitmask: torch.Tensor, vocab: int, device: torch.device | None = None
) -> torch.Tensor:
    """Rows x vocab, True where the bitmask (bit k of word w: token 32w+k) refuses a token, on
    ``device`` (the bitmask's own by default). On the host numpy unpacks in one call; on a
    device, torch ops unpack it there (no sync: the decode loop's CUDA graphs hold them)."""
    device = bitmask.device if device is None else device
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab]) == 0
    words = bitmask.to(device)
    shifts = _SHIFTS.to(device)
    return ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab] == 0


def apply_bitmask(scores: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits a row's bitmask disallows to -inf, in place."""
    refused = disallowed(bitmask, scores.shape[1], scores.device)
    if rows.numel() == scores.shape[0]:  # every row constrained (rows are in order)
        scores.masked_fill_(refused, float("-inf"))
        return
    picked = scores.index_select(0, rows)
    scores.index_copy_(0, rows, picked.masked_fill(refused, float("-inf")))


class RowConstraints(LogitsProcessor):
    """Masks each constrained row to what its grammar allows next.

    In line (``overlap`` off): each call advances the matchers by the tokens the rows took
    last, fills their bitmask and applies it. Overlapped (on, for a model on a GPU): the
    masks of step t+1 are made while the device runs step t+1's forward pass. The last
    processor of the list (``committer``) sees step t's final logits and takes each
    constrained row's token (the argmax generate takes: a sampled row's logits are already
    reduced to its one token); a background thread advances the matchers and fills the
    bitmask (llguidance releases the GIL); the next call waits for it and applies it. On
    this project's 2-core CPU machines overlapping was slower (the host computes the forward
    pass itself, and the threads contend for the GIL), so it is off there.
    """

    def __init__(
        self,
        matchers: Sequence[Any | None],
        book: GrammarBook,
        guard_empty: bool = False,
        overlap: bool = False,
    ) -> None:
        self.book = book
        # Only min_tokens can leave a row with nothing allowed: check for it only then.
        self.guard_empty = guard_empty
        self.overlap = overlap
        self.rows = [row for row, m in enumerate(matchers) if m is not None]
        self.matchers = [m for m in matchers if m is not None]
        self.live = [True] * len(self.rows)
        self.eos = torch.tensor(book.eos_ids)
        self.eos_set = set(book.eos_ids)
        words = (book.vocab_size + 31) // 32
        self.bitmask = torch.full((len(self.rows), words), -1, dtype=torch.int32)
        self._next: Future[list[int]] | None = None
        self._steps = 0

    @property
    def committer(self) -> LogitsProcessor | None:
        """The processor to put last in the list when overlapping."""
        return _Commit(self) if self.overlap else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._next is not None:
            live = self._next.result()
            self._next = None
        elif self._steps and not self.overlap:
            live = self._live()
            last = input_ids[:, -1].tolist()
            live = self._step(live, [last[self.rows[j]] for j in live])
        else:  # the first step
            live = self._step([], [])
        self._steps += 1
        if not live:
            return scores
        rows = torch.tensor([self.rows[j] for j in live], device=scores.device)
        apply_bitmask(scores, rows, self.bitmask[live])
        if self.guard_empty:
            self._never_empty(scores, rows)
        return scores

    def commit(self, scores: torch.Tensor) -> None:
        """Overlapped: step t's tokens are known; start making step t+1's masks."""
        live = self._live()
        if not live:
            return
        index = torch.tensor([self.rows[j] for j in live], device=scores.device)
        tokens = scores.index_select(0, index).argmax(dim=-1).tolist()
        self._next = self.book.filler.submit(self._step, live, tokens)

    def _live(self) -> list[int]:
        return [j for j, alive in enumerate(self.live) if alive]

    def _step(self, live: list[int], tokens: list[int]) -> list[int]:
        """Advance the matchers by their rows' tokens, then fill the bitmask of the rows still
        generating (returned)."""
        self._advance(live, tokens)
        live = self._live()
        if live:
            self.book.executor.unsafe_compute_mask_ptr(
                [(self.matchers[j], j) for j in live],
                self.bitmask.data_ptr(),
                self.bitmask.shape[1] * 4,
                self.bitmask.shape[0],
            )
        return live

    def _advance(self, live: list[int], tokens: list[int]) -> None:
        steps = []
        for j, token in zip(live, tokens, strict=True):
            if token in self.eos_set:  # the row ends here
                self.live[j] = False
            else:
                steps.append((j, token))
        if not steps:
            return
        accepted = self.book.executor.consume_token_par(
            [(self.matchers[j], token) for j, token in steps]
        )
        for (j, _), ok in zip(steps, accepted, strict=True):
            self.live[j] = bool(ok)

    def _never_empty(self, scores: torch.Tensor, rows: torch.Tensor) -> None:
        """A row left with nothing (min_tokens held back the EOS its complete grammar needs)
        may end: the constraint wins."""
        empty = torch.isinf(scores.index_select(0, rows)).all(dim=1)
        if bool(empty.any()):
            for row in rows[empty].tolist():
                scores[row, self.eos.to(scores.device)] = 0.0


class _Commit(LogitsProcessor):
    def __init__(self, constraints: RowConstraints) -> None:
        self.constraints = constraints

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.constraints.commit(scores)
        return scores


class SlotConstraints:
    """The decode loop's constrained slots: a matcher per slot and a host bitmask (pinned on
    CUDA) whose rows are copied to the device bitmask the step applies. Unconstrained slots
    keep an all-allowed row. The loop hands over the tokens its last controls chose
    (``consume``); the matchers advance in parallel in llguidance and fill the next masks."""

    def __init__(self, book: GrammarBook, slots: int, pinned: bool) -> None:
        self.book = book
        words = (book.vocab_size + 31) // 32
        self.host = torch.full((slots, words), -1, dtype=torch.int32)
        if pinned:
            self.host = self.host.pin_memory()
        self.matchers: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def admit(self, slots: Sequence[int], matchers: Sequence[Any | None]) -> None:
        """New rows: the constrained ones get their first masks."""
        for slot, matcher in zip(slots, matchers, strict=True):
            self.host[slot] = -1
            if matcher is not None:
                self.matchers[slot] = matcher
        self._fill([s for s in slots if s in self.matchers])

    def consume(self, slots: Iterable[int], tokens: Sequence[int] | np.ndarray) -> None:
        """``tokens[slot]`` was chosen for each of ``slots``: advance their matchers and fill
        their next masks. A matcher that ends (EOS) or refuses leaves its row all-allowed: the
        row is finished and its later tokens are dropped."""
        steps = [(s, int(tokens[s])) for s in slots if s in self.matchers]
        ending = [s for s, token in steps if token in self.book.eos_set]
        going = [(s, token) for s, token in steps if token not in self.book.eos_set]
        accepted = (
            self.book.executor.consume_token_par([(self.matchers[s], t) for s, t in going])
            if going
            else []
        )
        refused = [s for (s, _), ok in zip(going, accepted, strict=True) if not ok]
        for slot in ending + refused:
            del self.matchers[slot]
            self.host[slot] = -1
        self._fill([s for s, _ in going if s in self.matchers])

    def release(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self.matchers.pop(slot, None) is not None:
                self.host[slot] = -1

    def move(self, moves: Iterable[tuple[int, int]]) -> None:
        """Rows moved slots (source, target): their matchers and next masks follow."""
        for source, target in moves:
            matcher = self.matchers.pop(source, None)
            if matcher is not None:
                self.matchers[target] = matcher
                self.host[target] = self.host[source]
                self.host[source] = -1

    def upload(self, bitmask: torch.Tensor, rows: int) -> None:
        bitmask[:rows].copy_(self.host[:rows], non_blocking=True)

    def _fill(self, slots: list[int]) -> None:
        if not slots:
            return
        self.book.executor.unsafe_compute_mask_ptr(
            [(self.matchers[s], s) for s in slots],
            self.host.data_ptr(),
            self.host.shape[1] * 4,
            self.host.shape[0],
        )
