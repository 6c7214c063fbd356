"""The decode loop: rows of many micro-batches decoding together in fixed slots, each step one
forward pass and one control pass over device tensors, no host sync per step.

``admit`` prefills a collated micro-batch (the model's own ``generate`` for one token: vision
encoder, DeepStack, M-RoPE and padding exactly as transformers does them), copies its keys and
values into free slots of the slot cache, and chooses each row's first token. ``step`` then runs
decode steps for every slot at once: the forward step (``DecodeModel.logits`` into a logits
buffer) and the control step (``SlotControls.apply``: penalties, min_tokens, constraint masks,
greedy or seeded sampling, logprobs, and the record of what happened). Both are functions of
buffers only, so they run eagerly or as replayed CUDA graphs (``StepRunner``), bucketed by rows
(the highest slot in use) and by cache length (the longest row).

The host looks at the device every ``sync_every`` steps, or at the step where a row reaches its
``max_new_tokens``: which rows finished (EOS, their limit), and whether a row whose last tokens
could complete one of its stop strings did (checked in text, ``stops.first_stop``). Finished rows
leave their slot at once, so the next micro-batch of any class fills it while the others go on
(in-flight batching); a request returns when all its rows (its ``n`` completions) are done.
Constrained rows are the exception to "no sync per step": llguidance's matchers run on the host,
so each step copies the chosen tokens back while the next forward pass runs, and the next masks
go up before the control step.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlmq.workers.engine.constraints import SlotConstraints
from vlmq.workers.engine.decode_model import DecodeModel, Prefilled
from vlmq.workers.engine.gputime import DeviceTimer, RowShares
from vlmq.workers.engine.graphs import StepRunner
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.engine.slot_controls import Features, RowSpec, SlotControls
from vlmq.workers.engine.slots import KvLayers, SlotCache, bucket
from vlmq.workers.engine.stops import first_stop

__all__ = [
    "Admission",
    "DecodeStats",
    "Decoder",
    "DoesNotFit",
    "Finished",
    "RowOutput",
    "length_buckets",
    "row_buckets",
]

log = logging.getLogger(__name__)


def row_buckets(slots: int) -> list[int]:
    """Row counts a step is shaped to: 1, 2, 4, 8, then steps of a half (12, 16, 24, 32, ...)."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < slots:
        sizes.append(sizes[-1] + sizes[-1] // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3)
    return sorted({min(s, slots) for s in sizes})


def length_buckets(limit: int) -> list[int]:
    """Cache lengths a step is shaped to: 64, 96, 128, 192, 256, ... (powers of two and the
    halves between), up to ``limit``."""
    sizes, size = [], 64
    while size < limit:
        sizes += [size, size * 3 // 2]
        size *= 2
    return sorted({s for s in sizes if s < limit} | {limit})


class DoesNotFit(Exception):
    """A row needs more positions than the loop's cache may hold (``decode.max_length``)."""


@dataclass
class Admission:
    """What the engine hands the loop with a collated micro-batch."""

    items: list[Prepared]
    inputs: dict[str, Any]  # on the device
    rows: list[tuple[int, int]]  # per row: (item index, completion index)
    specs: list[RowSpec]
    matchers: list[Any | None]
    stop_ends: list[Any | None]
    collate_s: float = 0.0


@dataclass
class RowOutput:
    token_ids: list[int]
    stopped_at: int | None = None
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Finished:
    """A request whose rows all ended."""

    item: Prepared
    rows: list[RowOutput]
    prompt_tokens: int
    batch_id: str
    batch_size: int
    padding_ratio: float
    collate_s: float
    generate_s: float  # wall time from its admission to its end
    model_s: float  # its share of the device's work: prefill by prompt tokens, steps by rows
    gpu_s: float = 0.0  # the same share of the device's own time (DeviceTimer spans)


@dataclass
class _Entry:
    item: Prepared
    prompt_tokens: int
    batch_id: str
    batch_size: int
    padding_ratio: float
    collate_s: float
    admitted_at: float
    model_s: float
    rows_left: int
    outputs: dict[int, RowOutput] = field(default_factory=dict)
    share_from: float = 0.0
    gpu_s: float = 0.0  # its share of the device's own time (RowShares)
    gpu_from: int = 0  # RowShares.steps at its admission


@dataclass(eq=False)
class _Row:
    entry: _Entry
    copy: int
    spec: RowSpec
    start: int  # its prompt's padded length: where its first new token's key goes
    admitted_step: int
    serial: int  # which admission: a slot's rows over time are told apart by it
    checked: int = 0  # generated tokens already checked for stop strings

    @property
    def last_step(self) -> int:
        """The loop step after which its max_new_tokens-th token is chosen."""
        return self.admitted_step + self.spec.max_new - 1


@dataclass
class DecodeStats:
    steps: int = 0
    prefills: int = 0  # micro-batches admitted (each gives its rows their first tokens)
    graph_steps: int = 0  # steps replayed as CUDA graphs (the rest ran eagerly)
    syncs: int = 0
    admitted_rows: int = 0
    finished_rows: int = 0
    row_steps: int = 0  # rows x steps computed (a step's rows bucket; first tokens included)
    useful_steps: int = 0  # tokens that made it into an output
    grown: int = 0
    compactions: int = 0  # times rows moved down to fewer slots
    prefill_s: float = 0.0  # wall
    decode_s: float = 0.0  # wall of the steps
    constrained_steps: int = 0  # steps that waited for the host's constraint masks


class Decoder:
    def __init__(
        self,
        model: DecodeModel,
        slots: int,
        max_length: int,
        sync_every: int,
        max_steps: int,
        eos_ids: Sequence[int],
        constraints: SlotConstraints | None,
        decode: Callable[[list[int]], str],
        runner: StepRunner,
        timer: DeviceTimer,
        device: str,
    ) -> None:
        self.model = model
        self.slots = slots
        self.max_length = max_length
        self.sync_every = max(1, sync_every)
        self.device = device
        self.runner = runner
        self.timer = timer
        self.shares = RowShares(timer)
        self.constraints = constraints
        self._decode = decode
        self.controls = SlotControls(slots, model.vocab, max_steps, list(eos_ids), device)
        self.row_sizes = row_buckets(slots)
        self.stats = DecodeStats()
        self.cache: SlotCache | None = None
        self.lengths: list[int] = []

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(slots)
        self.write_pos = zeros(slots)
        self.positions = zeros(slots)
        self.active = zeros(slots, dtype=torch.bool)
        self.logits = torch.zeros(slots, model.vocab, device=device)
        self.valid = zeros(slots, 1, dtype=torch.bool)
        self._rows: list[_Row | None] = [None] * slots
        self._occupied = np.zeros(slots, dtype=bool)
        self._top = 0  # slots in use are all below this
        self._free = list(range(slots))  # a heap: lowest slots first keeps the rows bucket small
        # Heap of (the step a row reaches its max_new_tokens, its serial, its slot): the syncs
        # the loop knows it needs. Entries of rows gone or moved are skipped when they surface.
        self._ends: list[tuple[int, int, int]] = []
        self._lead = -(1 << 60)  # max over rows of (start - admitted_step): the longest row
        self._features = Features()
        self._step = 0
        self._requests = 0  # requests with rows in the loop
        self._serials = itertools.count()
        self._next_sync = 0
        self._share = 0.0  # cumulative model seconds per row of the steps run (apportioning)
        self._pending: set[int] = set()  # slots whose last chosen token the matchers lack
        self._host_tokens: torch.Tensor | None = None
        self._tokens_ready: Any = None

    # capacity ------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def busy_rows(self) -> int:
        return self.slots - len(self._free)

    @property
    def requests(self) -> int:
        """Requests with rows in the loop."""
        return self._requests

    def fits(self, prompt_length: int, max_new: int) -> bool:
        return prompt_length + max_new + self.sync_every + 1 <= self.max_length

    # admission -----------------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, admission: Admission) -> None:
        """Prefill a micro-batch and give each of its rows a slot and its first token. Raises
        before anything is admitted when rows do not fit (``DoesNotFit``) or the prefill fails
        (out of memory, a bad input: the engine isolates which)."""
        inputs = admission.inputs
        mask = inputs["attention_mask"]
        length = int(mask.shape[1])
        longest = max(spec.max_new for spec in admission.specs)
        if not self.fits(length, longest):
            raise DoesNotFit(f"{length} prompt + {longest} new tokens > {self.max_length}")
        if len(admission.rows) > len(self._free):
            raise RuntimeError(f"{len(admission.rows)} rows for {len(self._free)} free slots")
        started = time.perf_counter()
        mark = self.timer.start("prefill")
        prefilled: Prefilled = self.model.prefill(inputs)
        weights: list[tuple[_Entry, float]] = []  # its rows' shares, once _remember made them
        self.shares.stop_prefill(mark, weights)
        self._ensure_cache(prefilled.layers, length + longest + self.sync_every + 1)
        slots = [heapq.heappop(self._free) for _ in admission.rows]
        index = torch.tensor(slots, device=self.device)
        assert self.cache is not None
        self.cache.insert(index, prefilled.layers)
        self._place(index, mask, length, prefilled.positions)
        self.controls.admit(index, admission.specs, inputs["input_ids"], mask, admission.stop_ends)
        if self.constraints is not None and any(m is not None for m in admission.matchers):
            self.constraints.admit(slots, admission.matchers)
        for spec in admission.specs:
            self._features = self._features | spec.features
        prefill_s = time.perf_counter() - started
        self._first_tokens(index, prefilled.logits)
        self._remember(admission, slots, mask, length, prefill_s, weights)
        self.stats.prefill_s += prefill_s
        self.stats.admitted_rows += len(slots)
        self.stats.prefills += 1
        self.stats.row_steps += len(slots)  # each row's first token: its prefill's step

    def _ensure_cache(self, like: KvLayers, needed: int) -> None:
        if self.cache is not None and self.cache.capacity >= needed:
            return
        capacity = bucket(needed, length_buckets(self.max_length))
        if self.cache is None:
            self.cache = SlotCache.allocate(like, self.slots, capacity)
        else:
            self.cache = self.cache.grown(capacity)
            self.stats.grown += 1
        valid = torch.zeros(self.slots, capacity, dtype=torch.bool, device=self.device)
        valid[:, : self.valid.shape[1]] = self.valid
        self.valid = valid
        self.lengths = length_buckets(capacity)
        self.runner.reset()  # graphs hold the old storage
        log.info(
            "decode cache: %d slots x %d positions (%.1f MiB)",
            self.slots,
            capacity,
            self.cache.bytes() / 2**20,
        )

    def _place(
        self, index: torch.Tensor, mask: torch.Tensor, length: int, positions: torch.Tensor
    ) -> None:
        valid = torch.zeros(len(index), self.valid.shape[1], dtype=torch.bool, device=self.device)
        valid[:, :length] = mask.bool()
        self.valid.index_copy_(0, index, valid)
        self.write_pos.index_fill_(0, index, length)
        self.positions.index_copy_(0, index, positions.to(self.device))
        self.active.index_fill_(0, index, True)

    def _first_tokens(self, index: torch.Tensor, logits: torch.Tensor) -> None:
        rows = self._rows_bucket(int(index.max()) + 1)
        self.logits.index_copy_(0, index, logits.float())
        chosen = torch.zeros(rows, dtype=torch.bool, device=self.device)
        chosen[index] = True
        self._upload_masks(rows)
        tokens = self.controls.apply(self.logits[:rows], chosen, self._features)
        self.tokens[:rows] = torch.where(chosen, tokens, self.tokens[:rows])
        self._after_controls(rows, index.tolist())

    def _remember(
        self,
        admission: Admission,
        slots: list[int],
        mask: torch.Tensor,
        length: int,
        prefill_s: float,
        weights: list[tuple[_Entry, float]],
    ) -> None:
        real = mask.sum(dim=1).tolist()
        total = max(1, sum(real))
        batch_id = uuid.uuid4().hex[:12]
        padding = round(float(sum(real)) / float(mask.numel()), 4)
        now = time.perf_counter()
        entries: dict[int, _Entry] = {}
        for r, (item_index, copy) in enumerate(admission.rows):
            entry = entries.get(item_index)
            if entry is None:
                entry = entries[item_index] = _Entry(
                    item=admission.items[item_index],
                    prompt_tokens=int(real[r]),
                    batch_id=batch_id,
                    batch_size=len(admission.items),
                    padding_ratio=padding,
                    collate_s=admission.collate_s,
                    admitted_at=now,
                    model_s=0.0,
                    rows_left=0,
                    share_from=self._share,
                    gpu_from=self.shares.steps,
                )
            entry.rows_left += 1
            entry.model_s += prefill_s * real[r] / total
            weights.append((entry, real[r] / total))
            spec = admission.specs[r]
            slot = slots[r]
            self._rows[slot] = _Row(entry, copy, spec, length, self._step, next(self._serials))
            self._occupied[slot] = True
            self._top = max(self._top, slot + 1)
            self._lead = max(self._lead, length - self._step)
            row = self._rows[slot]
            assert row is not None
            heapq.heappush(self._ends, (row.last_step, row.serial, slot))
        self._requests += len(entries)
        self._next_sync = self._step  # the first tokens may have ended rows already

    # stepping ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, max_steps: int) -> list[Finished]:
        """Decode until some request finishes or ``max_steps`` steps ran; the requests that
        finished."""
        finished: list[Finished] = []
        for _ in range(max_steps):
            if self._step >= self._next_sync:
                finished += self._sync()
                if finished or not self.busy_rows:
                    return finished
            self._one_step()
        return finished + self._sync()

    @torch.inference_mode()
    def drain(self) -> list[Finished]:
        """Decode until every admitted request finished."""
        finished: list[Finished] = []
        while self.busy_rows:
            finished += self.step(1 << 20)
        return finished

    def _one_step(self) -> None:
        rows = self._rows_bucket(self._top)
        assert self.cache is not None
        front = min(self._step + self._lead, self.cache.capacity - 1)
        length = bucket(front + 1, self.lengths)
        started = time.perf_counter()
        mark = self.timer.start("decode" if self.runner.enabled else "decode_eager")
        self.runner.run(("forward", rows, length), lambda: self._forward(rows, length), True)
        if self._features.constraints:
            self._advance_matchers(rows)
        features = self._features
        self.runner.run(("controls", rows, features), lambda: self._controls(rows, features))
        self.shares.stop_step(mark, self.busy_rows)
        self._after_controls(rows, None)
        self._step += 1
        if self.runner.enabled:
            self.stats.graph_steps += 1
        elapsed = time.perf_counter() - started
        self.stats.steps += 1
        self.stats.row_steps += rows  # the rows the step computed, idle ones too
        self.stats.decode_s += elapsed
        self._share += elapsed / max(1, self.busy_rows)

    def _forward(self, rows: int, length: int) -> Callable[[], None]:
        assert self.cache is not None
        write_pos = self.write_pos[:rows]
        view = self.cache.view(rows, length, write_pos)
        index = torch.arange(rows, device=self.device)
        valid = self.valid[:rows, :length]

        def step() -> None:
            self.valid[index, write_pos] = True
            self.logits[:rows] = self.model.logits(
                self.tokens[:rows], self.positions[:rows], valid, view
            )

        return step

    def _controls(self, rows: int, features: Features) -> Callable[[], None]:
        assert self.cache is not None
        last = self.cache.capacity - 1

        def step() -> None:
            active = self.active[:rows]
            moved = (self.write_pos[:rows] + 1).clamp(max=last)
            self.write_pos[:rows] = torch.where(active, moved, 0)
            self.positions[:rows] += 1
            tokens = self.controls.apply(self.logits[:rows], active, features)
            self.tokens[:rows] = torch.where(active, tokens, self.tokens[:rows])

        return step

    # constraints: the one part of a step on the host ---------------------------------------
    def _after_controls(self, rows: int, applied: list[int] | None) -> None:
        """Constrained rows need the tokens just chosen: copy them back (without waiting)."""
        if self.constraints is None or not self.constraints:
            return
        if self._host_tokens is None:
            self._host_tokens = torch.zeros(self.slots, dtype=torch.long)
            if self.device.startswith("cuda"):
                self._host_tokens = self._host_tokens.pin_memory()
        self._host_tokens[:rows].copy_(self.tokens[:rows], non_blocking=True)
        if self.device.startswith("cuda"):
            self._tokens_ready = torch.cuda.Event()
            self._tokens_ready.record()
        chosen = applied if applied is not None else np.flatnonzero(self._occupied).tolist()
        self._pending.update(chosen)

    def _advance_matchers(self, rows: int) -> None:
        """While the forward pass runs: the matchers take the last tokens, and the next masks
        go up."""
        assert self.constraints is not None and self._host_tokens is not None
        if self._tokens_ready is not None:
            self._tokens_ready.synchronize()
        tokens = self._host_tokens.numpy()
        self.constraints.consume(sorted(self._pending), tokens)
        self._pending.clear()
        self._upload_masks(rows)
        self.stats.constrained_steps += 1

    def _upload_masks(self, rows: int) -> None:
        if self.constraints is not None and self.controls.bitmask is not None:
            self.constraints.upload(self.controls.bitmask, rows)

    # syncing and harvesting ----------------------------------------------------------------
    def _sync(self) -> list[Finished]:
        """Read which rows finished or may have hit a stop string; take finished rows out."""
        self.stats.syncs += 1
        self.timer.collect()
        rows = self._top
        self._next_sync = self._step + self.sync_every
        while self._ends and not self._current(self._ends[0]):
            heapq.heappop(self._ends)
        if self._ends:
            self._next_sync = max(self._step, min(self._next_sync, self._ends[0][0]))
        if rows <= 0:
            return []
        state = (
            torch.stack(
                [
                    self.controls.done[:rows].long(),
                    self.controls.check[:rows].long(),
                    self.controls.steps[:rows],
                ]
            )
            .cpu()
            .numpy()
        )
        done, check, steps = state[0].astype(bool), state[1].astype(bool), state[2]
        live = self._occupied[:rows]
        # Done rows too: a stop string reached before the row's EOS still cuts it there.
        stopped = self._check_stops(np.flatnonzero(check & live), steps)
        ended = sorted(set(np.flatnonzero(done & live).tolist()) | set(stopped))
        return self._harvest(ended, steps, stopped) if ended else []

    def _check_stops(self, slots: np.ndarray, steps: np.ndarray) -> dict[int, int]:
        """Rows whose text may have reached a stop string since they were last checked: where
        it did (slot -> generated tokens at the stop)."""
        if not len(slots):
            return {}
        index = torch.tensor(slots.tolist(), device=self.device)
        outputs = self.controls.out.index_select(0, index).cpu().tolist()
        self.controls.check.index_fill_(0, index, False)
        stopped: dict[int, int] = {}
        for slot, ids in zip(slots.tolist(), outputs, strict=True):
            row = self._rows[slot]
            assert row is not None
            count = int(steps[slot])
            at = first_stop(
                self._decode, ids, row.spec.stops, row.spec.min_tokens, row.checked, count
            )
            row.checked = count
            if at is not None:
                stopped[slot] = at
        return stopped

    def _harvest(
        self, slots: list[int], steps: np.ndarray, stopped: dict[int, int]
    ) -> list[Finished]:
        index = torch.tensor(slots, device=self.device)
        self.active.index_fill_(0, index, False)
        self.write_pos.index_fill_(0, index, 0)
        self.controls.release(index)
        if self.constraints is not None:
            self.constraints.release(slots)
        self._pending.difference_update(slots)
        outputs = self.controls.out.index_select(0, index).cpu().tolist()
        logprobs = self._logprobs(index)
        self.shares.catch_up()  # the device is synced: every span so far reads at once
        finished: list[Finished] = []
        now = time.perf_counter()
        for i, slot in enumerate(slots):
            row = self._rows[slot]
            assert row is not None
            self._rows[slot] = None
            self._occupied[slot] = False
            heapq.heappush(self._free, slot)
            count = min(int(steps[slot]), self.controls.max_steps)
            if slot in stopped:
                count = min(count, stopped[slot])
            kept = RowOutput(outputs[i][:count], stopped.get(slot), None)
            if logprobs is not None and row.spec.logprobs:
                kept.logprobs = logprobs(i, count)
            entry = row.entry
            entry.model_s += self._share - entry.share_from
            entry.gpu_s += self.shares.since(entry.gpu_from)
            entry.outputs[row.copy] = kept
            entry.rows_left -= 1
            self.stats.finished_rows += 1
            self.stats.useful_steps += count
            if entry.rows_left == 0:
                self._requests -= 1
                finished.append(self._finished(entry, now))
        self._after_release()
        self._compact()
        self.shares.prune(row.entry.gpu_from for row in self._rows if row is not None)
        return finished

    def _compact(self) -> None:
        """Rows left in high slots keep every step as wide as the highest of them: when the rows
        in use would fit a smaller rows bucket, move the high ones down (their keys and values
        up to the current length, and every per-slot state), so a step computes only them."""
        busy = self.busy_rows
        target = self._rows_bucket(busy)
        if not busy or target >= self._rows_bucket(self._top):
            return
        if self._pending and self.constraints:
            # The matchers take the tokens chosen last, by the slots they were chosen in.
            self._advance_matchers(self._top)
        high = [slot for slot in np.flatnonzero(self._occupied).tolist() if slot >= target]
        low = [slot for slot in range(target) if not self._occupied[slot]][: len(high)]
        sources = torch.tensor(high, device=self.device)
        targets = torch.tensor(low, device=self.device)
        assert self.cache is not None
        front = min(self._step + self._lead, self.cache.capacity - 1)
        self.cache.move(sources, targets, bucket(front + 1, self.lengths))
        for tensor in (self.tokens, self.write_pos, self.positions, self.active, self.valid):
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))
        self.controls.move(sources, targets)
        self.active.index_fill_(0, sources, False)
        self.write_pos.index_fill_(0, sources, 0)
        self.controls.release(sources)
        if self.constraints is not None:
            self.constraints.move(zip(high, low, strict=True))
        for source, target in zip(high, low, strict=True):
            row = self._rows[source]
            assert row is not None
            self._rows[target], self._rows[source] = row, None
            self._occupied[target], self._occupied[source] = True, False
            heapq.heappush(self._ends, (row.last_step, row.serial, target))
            if source in self._pending:
                self._pending.discard(source)
                self._pending.add(target)
        self._free = [slot for slot in range(self.slots) if not self._occupied[slot]]
        heapq.heapify(self._free)
        self._after_release()
        self.stats.compactions += 1

    def _logprobs(self, index: torch.Tensor) -> Callable[[int, int], list[dict[str, Any]]] | None:
        controls = self.controls
        if controls.logprob is None or controls.top_values is None or controls.top_ids is None:
            return None
        chosen = controls.logprob.index_select(0, index).cpu().tolist()
        values = controls.top_values.index_select(0, index).cpu().tolist()
        ids = controls.top_ids.index_select(0, index).cpu().tolist()

        def rows_of(i: int, count: int) -> list[dict[str, Any]]:
            return [
                {"logprob": chosen[i][t], "top": list(zip(ids[i][t], values[i][t], strict=True))}
                for t in range(count)
            ]

        return rows_of

    def _finished(self, entry: _Entry, now: float) -> Finished:
        return Finished(
            item=entry.item,
            rows=[entry.outputs[c] for c in sorted(entry.outputs)],
            prompt_tokens=entry.prompt_tokens,
            batch_id=entry.batch_id,
            batch_size=entry.batch_size,
            padding_ratio=entry.padding_ratio,
            collate_s=entry.collate_s,
            generate_s=now - entry.admitted_at,
            model_s=entry.model_s,
            gpu_s=entry.gpu_s,
        )

    def _after_release(self) -> None:
        """What the remaining rows need: the longest, and which controls."""
        taken = np.flatnonzero(self._occupied)
        self._top = int(taken[-1]) + 1 if len(taken) else 0
        rows = [row for row in self._rows if row is not None]
        self._lead = max((r.start - r.admitted_step for r in rows), default=-(1 << 60))
        features = Features()
        for row in rows:
            features = features | row.spec.features
        self._features = features

    @torch.inference_mode()
    def abort(self) -> list[Prepared]:
        """Take every row out (a step failed): the requests they belonged to, once each."""
        items: dict[int, Prepared] = {}
        for slot, row in enumerate(self._rows):
            if row is not None:
                items[id(row.entry)] = row.entry.item
                self._rows[slot] = None
        self._occupied[:] = False
        self._free = list(range(self.slots))
        self._requests = 0
        self._ends.clear()
        self._pending.clear()
        self.active.fill_(False)
        self.write_pos.fill_(0)
        self.controls.done.fill_(True)
        if self.constraints is not None:
            self.constraints.release(range(self.slots))
        self._after_release()
        return list(items.values())

    # helpers -------------------------------------------------------------------------------
    def _current(self, end: tuple[int, int, int]) -> bool:
        row = self._rows[end[2]]
        return row is not None and row.serial == end[1]

    def _rows_bucket(self, rows: int) -> int:
        return bucket(max(1, rows), self.row_sizes)
