"""The batch engine: requests in, exactly one result per request out.

decode (``prepare``: fetch + decode media, limits, length estimate; any thread) → batch
(``plan``: sort, cut under a token budget) → collate (``collate``: the processor, any thread,
each with its own processor) → predict (the model's thread: the decode loop, decoder.py, or
transformers' generate, ``engine.decode.mode``) → unbatch (one result per request). ``run``
does all of it in order, for ``vlmq run`` and the serial worker; the pipelined worker calls the
steps from its stages (workers/fleet/pipeline.py) through the generation interface
(``capacity`` / ``submit`` / ``poll``). With the decode loop in flight (the default) the engine
is continuous: ``submit`` prefills a micro-batch into free slots while earlier rows decode,
``poll`` decodes and returns each request as it finishes. Failures stay per request: bad media
or an over-long prompt fails alone; an exception in a micro-batch's prefill or ``generate``
bisects it until the culprit is alone; an out-of-memory error halves it and retries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vlmq.config.errors import GenerationFailed, OutOfMemory, PromptTooLong, VlmqError
from vlmq.config.schemas import Request, Result, Usage
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.engine.batching import plan_micro_batches
from vlmq.workers.engine.completions import result_choices
from vlmq.workers.engine.decoder import Decoder, DecodeStats, DoesNotFit
from vlmq.workers.engine.interface import CONTINUOUS, STATIC, Collated, OneSlot
from vlmq.workers.engine.loop_setup import build_decoder
from vlmq.workers.engine.model import LoadedModel, load_model, load_processor, processor_device
from vlmq.workers.engine.prepare import Prepared, Preparer, video_frame_counts
from vlmq.workers.engine.processors import ProcessorSet
from vlmq.workers.engine.runner import (
    BatchRunner,
    Completion,
    RowsTooLong,
    free_device_memory,
    is_oom,
)
from vlmq.workers.media import MediaLoader
from vlmq.workers.media.cache import CacheStats

__all__ = ["Engine", "EngineStats", "Outcome"]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What happened to one request: a completion or an error."""

    prepared: Prepared
    completion: Completion | None = None
    error: VlmqError | None = None


@dataclass
class EngineStats:
    micro_batches: int = 0
    oom_splits: int = 0
    bisections: int = 0
    rows: int = 0
    real_prompt_tokens: int = 0
    padded_prompt_tokens: int = 0
    generate_s: float = 0.0  # time inside generate: the model-busy numerator
    batch_sizes: list[int] = field(default_factory=list)
    cache: CacheStats = field(default_factory=CacheStats)  # the media cache's, shared
    decode: DecodeStats | None = None  # the decode loop's, when it runs
    device_s: dict[str, float] = field(default_factory=dict)  # the device's own time, by kind
    generate_fallbacks: int = 0  # micro-batches the loop could not hold, run by generate


Run = list[tuple[Prepared, Completion | None, VlmqError | None]]


def _rows(collated: Collated) -> int:
    return sum(item.rows for item in collated.items)


def _micro_batch_rows(settings: EngineSettings) -> int:
    """Rows a micro-batch may have: never more than the decode loop's slots, and in flight a
    fraction of them, so freed slots are refilled a few rows at a time."""
    decode = settings.decode
    rows = settings.max_batch_size
    if decode.mode != "loop":
        return rows
    slots = decode.slots or rows
    if decode.inflight:
        return max(1, min(rows, decode.admit_rows or slots // 8))
    return min(rows, slots)


class Engine(OneSlot):
    """Owns one loaded model; ``setup()`` loads it, ``run()`` serves batches."""

    stats: EngineStats  # always kept (capabilities: static, OneSlot's)

    def __init__(
        self,
        model: str,
        engine: EngineSettings | None = None,
        media: MediaSettings | None = None,
        loader: MediaLoader | None = None,
    ) -> None:
        self.model_name = model
        self.settings = engine or EngineSettings()
        self.media_settings = media or MediaSettings()
        self.loader = loader or MediaLoader(self.media_settings)
        self.loaded: LoadedModel | None = None
        self.stats = EngineStats(cache=self.loader.cache.stats)
        self._pool = ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2))
        decode = self.settings.decode
        self._max_rows = _micro_batch_rows(self.settings)
        if decode.mode == "loop" and decode.inflight:
            self.capabilities = CONTINUOUS
        self.decoder: Decoder | None = None
        self._waiting: list[Collated] = []  # submitted, waiting for free slots
        self._done: list[Outcome] = []  # ended outside the loop, returned by the next poll

    # lifecycle -------------------------------------------------------------
    def setup(self) -> Engine:
        if self.loaded is None:
            self.loaded = load_model(self.model_name, self.settings)
            self.processors = ProcessorSet(
                self.loaded.processor,
                lambda: load_processor(self.model_name, self.settings),
                self.loader.cache,
            )
            self._runner = BatchRunner(
                self.loaded,
                self.settings.fixed_output_length,
                processor_device(self.settings, self.loaded.device),
                self.settings.grammar_cache_size,
            )
            self._preparer = Preparer(
                self.loaded,
                self.settings,
                self.media_settings,
                self.loader,
                self._pool,
                self.processors,
                self._runner.grammars,
            )
            self._build_decoder()
        return self

    def set_processor_device(self, device: str | None) -> None:
        """Where the processor makes its tensors (its calls' ``device``): a simulated
        accelerator passes ``meta``, so the resizing and normalising a GPU would do are not
        charged to the host's CPU."""
        self._ready()
        self._runner.processor_device = device

    def set_max_batch_size(self, rows: int) -> None:
        """Change the row cap of later micro-batches (benchmarks sweep it); a decode loop whose
        slots follow it (``decode.slots`` unset) gets that many."""
        self.settings = self.settings.model_copy(update={"max_batch_size": rows})
        self._max_rows = _micro_batch_rows(self.settings)
        decoder = self.decoder
        if decoder is not None and self.settings.decode.slots is None and decoder.slots != rows:
            self._build_decoder()

    def set_decode(self, **fields: Any) -> None:
        """Change how later micro-batches decode (``engine.decode``'s fields: mode, inflight,
        slots, ...), with nothing in flight: benchmarks and tests compare the paths on one
        loaded model."""
        if self.pending:
            raise RuntimeError("set_decode with requests in flight")
        before = self.settings.decode
        decode = before.model_copy(update=fields)
        self.settings = self.settings.model_copy(update={"decode": decode})
        self.capabilities = CONTINUOUS if decode.mode == "loop" and decode.inflight else STATIC
        self._max_rows = _micro_batch_rows(self.settings)
        # The loop is kept (with its cache and captured graphs) unless what shapes it changed.
        kept = {"mode", "inflight", "poll_steps"}
        same = before.model_dump(exclude=kept) == decode.model_dump(exclude=kept)
        if self.loaded is not None and decode.mode == "loop" and not (same and self.decoder):
            self._build_decoder()

    def _build_decoder(self) -> None:
        self.decoder = None
        if self.settings.decode.mode == "loop":
            self.decoder = build_decoder(self._ready(), self.settings, self._runner)
            self.stats.decode = self.decoder.stats
            self.stats.device_s = self.decoder.timer.seconds

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ready(self) -> LoadedModel:
        if self.loaded is None:
            raise RuntimeError("Engine.setup() must run before the engine is used")
        return self.loaded

    # the steps -------------------------------------------------------------
    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        """Fetch, decode, check and estimate one request (any thread); never raises.
        ``tenant`` keys the frame store (``media.frame_store``); ``prepared_media``: the
        prepare tier stored this task's media there."""
        self._ready()
        return self._preparer.prepare(request, tenant, prepared_media)

    def plan(
        self, prepared: Sequence[Prepared], token_budget: int | None = None
    ) -> list[list[Prepared]]:
        """Micro-batches under the row cap and token budget; ``token_budget`` (a class's batch
        policy) can only lower the engine's, which is the device's limit.

        InternVL's processor stacks all videos of one call, so their frame counts must match:
        video requests are grouped by frame count, and requests without video join the
        largest group.
        """
        budget = min(token_budget or self.settings.token_budget, self.settings.token_budget)
        groups: dict[tuple[int, ...], list[Prepared]] = {(): []}
        for item in prepared:
            frames = video_frame_counts(item.conversation)
            key = tuple(sorted(set(frames))) if self._ready().family == "internvl" else ()
            groups.setdefault(key, []).append(item)
        if len(groups) > 1:
            plain = groups.pop(())
            max(groups.values(), key=len).extend(plain)
        return [
            batch
            for group in groups.values()
            for batch in plan_micro_batches(
                group, self._max_rows, budget, self.settings.length_bucketing
            )
        ]

    def collate(self, items: Sequence[Prepared]) -> Collated:
        """The micro-batch's padded tensors, made with this thread's own processor. A
        processor failure is left for ``generate`` to isolate (it bisects)."""
        try:
            return self._runner.collate(items, self.processors.for_thread())
        except Exception:
            log.warning("collating %d requests failed; generate will isolate", len(items))
            return Collated(list(items), None, 0.0)

    def generate(self, collated: Collated) -> list[Outcome]:
        """Run one collated micro-batch to its end on the model's thread; one outcome per
        item, never raises."""
        self._ready()
        return [
            Outcome(item, completion, error)
            for item, completion, error in self._run_safely(collated.items, collated)
        ]

    # the generation interface (a continuous engine takes requests as slots free) -----
    def slot_rows(self) -> int:
        """The HF engine runs static micro-batches of at most this many rows."""
        return self._max_rows

    def capacity(self) -> int:
        """Continuous: the decode loop's free rows (those a waiting micro-batch will take
        excepted); static: a whole micro-batch when idle."""
        if not self.capabilities.continuous:
            return super().capacity()
        decoder = self._decoder()
        return max(0, decoder.free_rows - sum(_rows(c) for c in self._waiting))

    def submit(self, collated: Collated) -> None:
        """Continuous: prefill the micro-batch into free slots now (or as soon as they free).
        Static: keep it for the next ``poll``."""
        if not self.capabilities.continuous:
            return super().submit(collated)
        self._ready()
        if _rows(collated) > self._decoder().slots:  # could never get its slots: alone, now
            self._end_now(self._run_safely(collated.items, collated, reference=True))
            return None
        self._waiting.append(collated)
        self._admit_waiting()
        return None

    @property
    def pending(self) -> int:
        if not self.capabilities.continuous:
            return OneSlot.pending.fget(self)  # type: ignore[attr-defined]
        waiting = sum(len(c.items) for c in self._waiting)
        inside = self.decoder.requests if self.decoder is not None else 0
        return len(self._done) + waiting + inside

    def poll(self, worker: str) -> list[Result]:
        """Static: run what was submitted. Continuous: decode until a request finishes (or
        ``decode.poll_steps``), then the results of every request that ended."""
        if not self.capabilities.continuous:
            collated = self._take()
            if collated is None:
                return []
            return [self.to_result(outcome, worker) for outcome in self.generate(collated)]
        return [self.to_result(outcome, worker) for outcome in self._poll_outcomes()]

    def reject(self, prepared: Prepared, worker: str) -> Result:
        return self.to_result(Outcome(prepared, error=prepared.error), worker)

    # the decode loop in flight ---------------------------------------------------------
    def _decoder(self) -> Decoder:
        if self.decoder is None:
            raise RuntimeError("Engine.setup() must run before the engine is used")
        return self.decoder

    def _poll_outcomes(self) -> list[Outcome]:
        decoder = self._decoder()
        outcomes, self._done = self._done, []
        if decoder.busy_rows:
            try:
                finished = decoder.step(self.settings.decode.poll_steps)
            except Exception:
                log.exception("a decode step failed with %d rows inside", decoder.busy_rows)
                items = decoder.abort()
                outcomes += [Outcome(*e) for e in self._run_safely(items, reference=True)]
                finished = []
            completions = [self._runner.completion(f) for f in finished]
            self._record_finished(completions)
            outcomes += [Outcome(f.item, c) for f, c in zip(finished, completions, strict=True)]
        self._admit_waiting()
        return outcomes

    def _admit_waiting(self) -> None:
        decoder = self._decoder()
        while self._waiting and _rows(self._waiting[0]) <= decoder.free_rows:
            collated = self._waiting.pop(0)
            self._end_now(self._run_safely(collated.items, collated, admit=True))

    def _end_now(self, run: Run) -> None:
        self._done += [Outcome(*entry) for entry in run]

    # all in order ----------------------------------------------------------
    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]:
        """One result per request, in order."""
        outcomes = self.run_outcomes(requests, token_budget)
        return [self.to_result(o, worker) for o in outcomes]

    def run_outcomes(
        self, requests: Sequence[Request], token_budget: int | None = None
    ) -> list[Outcome]:
        self._ready()
        prepared = self._preparer.prepare_all(list(requests))
        outcomes = {id(p): Outcome(p, error=p.error) for p in prepared}
        ready = [p for p in prepared if p.error is None]
        micro_batches = self.plan(ready, token_budget)
        if self.capabilities.continuous:
            ended = self._in_flight(micro_batches)
        else:
            ended = [Outcome(*e) for batch in micro_batches for e in self._run_safely(batch)]
        for outcome in ended:
            outcomes[id(outcome.prepared)] = outcome
        return [outcomes[id(p)] for p in prepared]

    def _in_flight(self, micro_batches: list[list[Prepared]]) -> list[Outcome]:
        """Every micro-batch through the loop, each going in as soon as it has room."""
        ended: list[Outcome] = []
        for batch in micro_batches:
            collated = self._runner.collate(batch, self.processors.primary)
            while self.pending and self.capacity() < _rows(collated):
                ended += self._poll_outcomes()
            self.submit(collated)
        while self.pending:
            ended += self._poll_outcomes()
        return ended

    # failure handling --------------------------------------------------------
    def _run_safely(
        self,
        items: list[Prepared],
        collated: Collated | None = None,
        admit: bool = False,
        reference: bool = False,
    ) -> Run:
        """Run a micro-batch to its end, or with ``admit`` put it into the decode loop (its
        results come from ``poll``), collating it here unless given; an entry per item that
        ended now. ``reference``: through transformers' generate, whatever the setting."""
        try:
            if collated is None or collated.inputs is None:
                collated = self._runner.collate(items, self.processors.primary)
            completions = self._through_model(collated, admit, reference)
        except OutOfMemory as exc:
            return self._after_oom(items, exc, admit, reference)
        except RowsTooLong as exc:
            return self._drop_rows(items, exc.rows, admit, reference)
        except Exception:
            return self._bisect(items, admit, reference)
        if completions is None:
            return []
        self._record(completions)
        return [(item, c, None) for item, c in zip(items, completions, strict=True)]

    def _through_model(
        self, collated: Collated, admit: bool, reference: bool
    ) -> list[Completion] | None:
        decoder = self.decoder
        if decoder is None or reference or self.settings.decode.mode != "loop":
            return self._runner.generate(collated)
        try:
            decoder.admit(self._runner.admission(collated))
        except DoesNotFit as exc:
            log.info("micro-batch through generate: %s", exc)
            self.stats.generate_fallbacks += 1
            return self._runner.generate(collated)
        except Exception as exc:
            if is_oom(exc):
                raise OutOfMemory("the batch did not fit in device memory") from exc
            raise
        self.stats.micro_batches += 1
        self.stats.batch_sizes.append(len(collated.items))
        if admit:
            return None
        finished = decoder.drain()
        by_item = {id(f.item): self._runner.completion(f) for f in finished}
        return [by_item[id(item)] for item in collated.items]

    def _after_oom(
        self, items: list[Prepared], exc: OutOfMemory, admit: bool, reference: bool
    ) -> Run:
        free_device_memory()
        if len(items) == 1:
            return [(items[0], None, exc)]
        self.stats.oom_splits += 1
        # Later micro-batches of this engine start at the size that fitted.
        self._max_rows = max(1, min(self._max_rows, len(items) // 2))
        log.warning("out of memory at %d rows; retrying at %d", len(items), len(items) // 2)
        return self._split(items, admit, reference)

    def _bisect(self, items: list[Prepared], admit: bool, reference: bool) -> Run:
        if len(items) == 1:
            log.exception("generate failed for request %s", items[0].request.id)
            return [(items[0], None, GenerationFailed("generation failed for this request"))]
        self.stats.bisections += 1
        return self._split(items, admit, reference)

    def _split(self, items: list[Prepared], admit: bool, reference: bool) -> Run:
        half = len(items) // 2
        return self._run_safely(items[:half], None, admit, reference) + self._run_safely(
            items[half:], None, admit, reference
        )

    def _drop_rows(
        self, items: list[Prepared], rows: list[int], admit: bool, reference: bool
    ) -> Run:
        limit = self._ready().context_length
        failed: Run = [
            (items[i], None, PromptTooLong(f"prompt plus max_new_tokens exceeds context {limit}"))
            for i in rows
        ]
        rest = [item for i, item in enumerate(items) if i not in set(rows)]
        return failed + (self._run_safely(rest, None, admit, reference) if rest else [])

    def _record(self, completions: list[Completion]) -> None:
        """A micro-batch that ran to its end here (the loop counts its own at admission)."""
        if not completions:
            return
        if completions[0].model_s is None:
            self.stats.micro_batches += 1
            self.stats.batch_sizes.append(completions[0].batch_size)
            self.stats.generate_s += completions[0].generate_s
        self._record_finished(completions)

    def _record_finished(self, completions: list[Completion]) -> None:
        """Requests the decode loop finished: its device seconds are apportioned per request."""
        self.stats.rows += len(completions)
        self.stats.generate_s += sum(c.model_s or 0.0 for c in completions)
        real = sum(c.prompt_tokens for c in completions)
        self.stats.real_prompt_tokens += real
        self.stats.padded_prompt_tokens += sum(
            round(c.prompt_tokens / c.padding_ratio) for c in completions if c.padding_ratio
        )

    # encode ----------------------------------------------------------------
    def to_result(self, outcome: Outcome, worker: str | None = None) -> Result:
        request = outcome.prepared.request
        record: dict[str, Any] = {
            "id": request.id,
            "custom_id": request.custom_id,
            "job_id": request.job_id,
            "model": self.model_name,
            "modality": request.modality,
            "worker": worker,
            "timings": dict(outcome.prepared.timings),
        }
        completion = outcome.completion
        if completion is None:
            error = outcome.error or GenerationFailed("no output was produced")
            return Result.model_validate({**record, "status": "failed", "error": error.to_dict()})
        record["timings"]["generate_s"] = round(completion.generate_s, 4)
        record["timings"]["collate_s"] = round(completion.collate_s, 4)
        if completion.model_s is not None:
            record["timings"]["model_s"] = round(completion.model_s, 6)
        if completion.gpu_s is not None:  # measured: what its cost is charged by
            record["timings"]["gpu_s"] = round(completion.gpu_s, 6)
        usage = Usage(
            prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens
        )
        return Result.model_validate(
            {
                **record,
                "status": "succeeded",
                "output": completion.text,
                "finish_reason": completion.finish_reason,
                "usage": usage,
                "batch_id": completion.batch_id,
                "batch_size": completion.batch_size,
                "padding_ratio": completion.padding_ratio,
                **result_choices(request, completion.choices),
            }
        )
