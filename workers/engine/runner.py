"""Predict step: one padded micro-batch through ``processor`` and the model.

collate (chat template, left padding; any thread, with that thread's processor) → generate
(per-row limits, stops, sampling, penalties, constraints, logprobs; the model's thread) →
trim each prompt → ``batch_decode(skip_special_tokens=True)``. On CUDA the collated tensors
are pinned where they were made, so the model thread's host-to-device copy is non-blocking.

Two ways to generate, one set of per-row controls (``row_specs``): the decode loop
(decoder.py: ``admission`` hands it a micro-batch, ``completion`` turns what it finished into a
completion) and transformers' ``generate`` with per-row logits processors (``generate``: the
reference, ``engine.decode.mode=generate``).

A request with ``n`` sampled completions is ``n`` rows of the batch (its conversation
repeated at collation; the media cache keeps its pixels processed once), each with its own
seed (``completion_seed``); its rows come back together as one completion with ``n``
choices. A greedy request's completions are identical: one row, copied.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from vlmq.config.errors import OutOfMemory
from vlmq.config.schemas import FinishReason
from vlmq.workers.engine.completions import Generated
from vlmq.workers.engine.constraints import GrammarBook, RowConstraints
from vlmq.workers.engine.controls import (
    RowMinTokens,
    RowPenalties,
    RowPenalty,
    RowSampler,
    RowSampling,
    RowStopper,
    completion_seed,
)
from vlmq.workers.engine.decoder import Admission, Finished
from vlmq.workers.engine.interface import Collated
from vlmq.workers.engine.logprobs import LogprobRecorder, openai_logprobs
from vlmq.workers.engine.model import LoadedModel, eos_token_ids
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.engine.slot_controls import RowSpec
from vlmq.workers.engine.stops import StopTable
from vlmq.workers.media.devpixels import DeviceFrames, DevicePhoto
from vlmq.workers.media.prepared.pixels import Pixels

__all__ = ["BatchRunner", "Completion", "RowsTooLong", "free_device_memory", "row_specs"]


@dataclass
class Completion:
    """One request of a generated micro-batch: its completions, first one first."""

    choices: list[Generated]
    prompt_tokens: int
    batch_id: str
    batch_size: int
    padding_ratio: float
    generate_s: float
    collate_s: float = 0.0
    model_s: float | None = None  # its share of the device's work (the decode loop apportions)
    gpu_s: float | None = None  # the same share of the device's own time (measured spans)

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)


class RowsTooLong(Exception):
    """Rows whose real prompt (after collation) leaves no room in the context."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"{len(rows)} rows exceed the context")
        self.rows = rows


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


@dataclass(frozen=True)
class _Row:
    """One row of the padded batch: which item, which of its completions."""

    item: int
    copy: int


def _rows_of(items: Sequence[Prepared]) -> list[_Row]:
    return [_Row(i, c) for i, item in enumerate(items) for c in range(item.rows)]


def _row_spec(item: Prepared, copy: int, fixed_output_length: bool) -> RowSpec:
    """One row's controls, from its request (``copy``: which of its completions)."""
    params = item.request.generation
    seed = params.seed if params.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
    return RowSpec(
        max_new=item.max_new_tokens,
        # Benchmarks: every row makes exactly its max_new_tokens (EOS held back until then).
        min_tokens=item.max_new_tokens if fixed_output_length else params.min_tokens or 0,
        sampled=params.sampling,
        temperature=1.0 if params.temperature is None else params.temperature,
        top_p=params.top_p or 1.0,
        seed=completion_seed(seed, copy),
        repetition=params.repetition_penalty or 1.0,
        presence=params.presence_penalty or 0.0,
        frequency=params.frequency_penalty or 0.0,
        logprobs=bool(params.logprobs),
        stops=tuple(params.stop),
        constrained=item.constraint is not None,
    )


def row_specs(items: Sequence[Prepared], fixed_output_length: bool = False) -> list[RowSpec]:
    """The controls of every row of a micro-batch, in row order."""
    return [_row_spec(items[row.item], row.copy, fixed_output_length) for row in _rows_of(items)]


def _row_sampling(spec: RowSpec) -> RowSampling | None:
    if not spec.sampled:
        return None
    return RowSampling(temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed)


def _row_penalty(spec: RowSpec) -> RowPenalty | None:
    penalty = RowPenalty(spec.repetition, spec.presence, spec.frequency)
    return None if penalty == RowPenalty() else penalty


def _top_logprobs(item: Prepared) -> int | None:
    params = item.request.generation
    return (params.top_logprobs or 0) if params.logprobs else None


class BatchRunner:
    """Runs micro-batches on a loaded model; knows nothing about queues."""

    def __init__(
        self,
        loaded: LoadedModel,
        fixed_output_length: bool = False,
        processor_device: str | None = None,
        grammar_cache_size: int = 512,
    ) -> None:
        self.loaded = loaded
        # Where the image and video processors compute (the torchvision ones take a device):
        # the model's GPU, so resizing and normalising leave the CPU; None: where they are.
        self.processor_device = processor_device
        self.fixed_output_length = fixed_output_length
        tokenizer = loaded.tokenizer
        self.eos_ids = eos_token_ids(loaded.model.generation_config.eos_token_id, tokenizer)
        self.pad_id = int(tokenizer.pad_token_id)
        # Constraint masks made during the forward pass: a GPU computes it while the host
        # waits; on the CPU the host computes it, and overlapping measured slower.
        self.overlap_masks = loaded.device.startswith("cuda")
        # The tokenizer's view for constraints and logprob bytes: built once per model.
        self.grammars = GrammarBook(
            tokenizer, _vocab_size(loaded.model), self.eos_ids, grammar_cache_size
        )
        self.stops = StopTable(self.grammars.token_bytes, _vocab_size(loaded.model))

    def collate(self, items: Sequence[Prepared], processor: Any) -> Collated:
        """One processor call for the whole micro-batch, left padded; pinned on CUDA."""
        started = time.perf_counter()
        inputs = self._apply_template(items, processor)
        pinned = self.loaded.device.startswith("cuda")
        if pinned:  # pinned host memory: the copy to the device can overlap (non_blocking)
            inputs = {k: _pinned(v) for k, v in inputs.items()}
        return Collated(list(items), inputs, time.perf_counter() - started, pinned)

    def _apply_template(self, items: Sequence[Prepared], processor: Any) -> Any:
        processor_kwargs: dict[str, Any] = {"padding": True}
        if self.processor_device:
            processor_kwargs["device"] = self.processor_device
        conversations = [processor_media(items[row.item].conversation) for row in _rows_of(items)]
        metadata = [
            part["metadata"]
            for conversation in conversations
            for message in conversation
            for part in message["content"]
            if part["type"] == "video"
        ]
        if metadata:
            # Frames are already sampled; the metadata places them in time.
            processor_kwargs |= {"do_sample_frames": False, "video_metadata": metadata}
        return processor.apply_chat_template(
            conversations,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs=processor_kwargs,
        )

    def generate(self, collated: Collated) -> list[Completion]:
        items = collated.items
        self._check_context(items, collated.inputs["attention_mask"])
        inputs = self._to_device(collated.inputs, non_blocking=collated.pinned)
        started = time.perf_counter()
        try:
            output, stopper, recorder = self._generate(items, inputs)
        except Exception as exc:
            if is_oom(exc):
                raise OutOfMemory("the batch did not fit in device memory") from exc
            raise
        elapsed = time.perf_counter() - started
        completions = self._unbatch(items, inputs, output, (stopper, recorder), elapsed)
        for completion in completions:
            completion.collate_s = collated.collate_s
        return completions

    def admission(self, collated: Collated) -> Admission:
        """A collated micro-batch as the decode loop takes it: on the device, with every row's
        controls, matcher and stop-string end tokens. Raises ``RowsTooLong`` first."""
        items = collated.items
        self._check_context(items, collated.inputs["attention_mask"])
        inputs = self._to_device(collated.inputs, non_blocking=collated.pinned)
        rows = _rows_of(items)
        specs = row_specs(items, self.fixed_output_length)
        matchers = [
            self.grammars.matcher(items[row.item].constraint)
            if items[row.item].constraint is not None
            else None
            for row in rows
        ]
        stop_ends = [self.stops.ends(spec.stops) if spec.stops else None for spec in specs]
        return Admission(
            list(items),
            inputs,
            [(row.item, row.copy) for row in rows],
            specs,
            matchers,
            stop_ends,
            collated.collate_s,
        )

    def completion(self, finished: Finished) -> Completion:
        """What the decode loop finished for one request, as the reference path returns it."""
        item = finished.item
        trimmed = [
            self._trim(row.token_ids, row.stopped_at or item.max_new_tokens)
            for row in finished.rows
        ]
        texts = self.loaded.tokenizer.batch_decode(
            [ids for ids, _ in trimmed], skip_special_tokens=True
        )
        top = item.request.generation.top_logprobs or 0
        choices = [
            self._choice(
                item, ids, text, hit_eos or row.stopped_at is not None, _top(row.logprobs, top)
            )
            for (ids, hit_eos), text, row in zip(trimmed, texts, finished.rows, strict=True)
        ]
        return Completion(
            choices=_all_choices(item, choices),
            prompt_tokens=finished.prompt_tokens,
            batch_id=finished.batch_id,
            batch_size=finished.batch_size,
            padding_ratio=finished.padding_ratio,
            generate_s=finished.generate_s,
            collate_s=finished.collate_s,
            model_s=finished.model_s,
            gpu_s=finished.gpu_s,
        )

    def _check_context(self, items: Sequence[Prepared], attention_mask: torch.Tensor) -> None:
        lengths = attention_mask.sum(dim=1).tolist()
        limit = self.loaded.context_length
        rows = _rows_of(items)
        over = {
            row.item
            for row, length in zip(rows, lengths, strict=True)
            if length + items[row.item].max_new_tokens > limit
        }
        if over:
            raise RowsTooLong(sorted(over))

    def _to_device(self, inputs: Any, non_blocking: bool = False) -> Any:
        model = self.loaded.model
        moved = {}
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor):
                value = value.to(model.device, non_blocking=non_blocking)
                if value.is_floating_point():
                    value = value.to(model.dtype)
            moved[key] = value
        return moved

    def _generate(
        self, items: Sequence[Prepared], inputs: dict[str, Any]
    ) -> tuple[Any, RowStopper, LogprobRecorder]:
        prompt_length = inputs["input_ids"].shape[1]
        rows = _rows_of(items)
        row_items = [items[row.item] for row in rows]
        specs = row_specs(items)
        stopper = RowStopper(
            prompt_length,
            [spec.max_new for spec in specs],
            [spec.stops for spec in specs],
            self._decode,
            [spec.min_tokens for spec in specs],
        )
        recorder = LogprobRecorder([_top_logprobs(item) for item in row_items])
        processors = self._processors(specs, row_items, inputs, recorder)
        longest = max(item.max_new_tokens for item in items)
        with torch.inference_mode():
            output = self.loaded.model.generate(
                **inputs,
                max_new_tokens=longest,
                min_new_tokens=longest if self.fixed_output_length else None,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                # Penalties are per row (RowPenalties): none from the checkpoint's defaults.
                repetition_penalty=None,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([stopper]),
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
            )
        return output, stopper, recorder

    def _processors(
        self,
        specs: list[RowSpec],
        row_items: list[Prepared],
        inputs: dict[str, Any],
        recorder: LogprobRecorder,
    ) -> LogitsProcessorList:
        """The per-row controls the batch needs, in the order the module docstring of
        controls.py gives (logprobs see raw logits; the sampler picks last)."""
        processors = LogitsProcessorList()
        if recorder.rows:
            processors.append(recorder)
        penalties = [_row_penalty(spec) for spec in specs]
        if any(penalties):
            mask = inputs["attention_mask"]
            processors.append(RowPenalties(penalties, inputs["input_ids"], mask))
        min_tokens = [spec.min_tokens for spec in specs]
        if any(min_tokens) and not self.fixed_output_length:
            processors.append(RowMinTokens(min_tokens, self.eos_ids))
        constraints = None
        if any(item.constraint is not None for item in row_items):
            matchers = [
                self.grammars.matcher(item.constraint) if item.constraint is not None else None
                for item in row_items
            ]
            constraints = RowConstraints(
                matchers,
                self.grammars,
                guard_empty=any(min_tokens),
                overlap=self.overlap_masks,
            )
            processors.append(constraints)
        sampling = [_row_sampling(spec) for spec in specs]
        if any(sampling):
            processors.append(RowSampler(sampling))
        if constraints is not None and constraints.committer is not None:
            processors.append(constraints.committer)  # last: it sees the step's final logits
        return processors

    def _unbatch(
        self,
        items: Sequence[Prepared],
        inputs: dict[str, Any],
        output: torch.Tensor,
        controls: tuple[RowStopper, LogprobRecorder],
        elapsed: float,
    ) -> list[Completion]:
        stopper, recorder = controls
        mask = inputs["attention_mask"]
        prompt_length = mask.shape[1]
        padding_ratio = float(mask.sum()) / float(mask.numel())
        prompt_tokens = mask.sum(dim=1).tolist()
        rows = _rows_of(items)
        generated = output[:, prompt_length:]
        trimmed = [
            self._trim(generated[r].tolist(), self._row_limit(r, items[row.item], stopper))
            for r, row in enumerate(rows)
        ]
        texts = self.loaded.tokenizer.batch_decode(
            [ids for ids, _ in trimmed], skip_special_tokens=True
        )
        logprobs = recorder.finish(generated)
        choices: list[list[Generated]] = [[] for _ in items]
        for r, row in enumerate(rows):
            ids, hit_eos = trimmed[r]
            choices[row.item].append(
                self._choice(
                    items[row.item],
                    ids,
                    texts[r],
                    hit_eos or r in stopper.stopped_at,
                    logprobs.get(r),
                )
            )
        batch_id = uuid.uuid4().hex[:12]
        first_row: dict[int, int] = {}  # item -> its first row (the prompt is the same)
        for r, row in enumerate(rows):
            first_row.setdefault(row.item, r)
        return [
            Completion(
                choices=_all_choices(item, choices[i]),
                prompt_tokens=int(prompt_tokens[first_row[i]]),
                batch_id=batch_id,
                batch_size=len(items),
                padding_ratio=round(padding_ratio, 4),
                generate_s=elapsed,
            )
            for i, item in enumerate(items)
        ]

    def _choice(
        self,
        item: Prepared,
        ids: list[int],
        text: str,
        stopped: bool,
        steps: list[dict[str, Any]] | None,
    ) -> Generated:
        params = item.request.generation
        # A stop string inside the first min_tokens tokens does not count (as in vLLM).
        floor = len(self._decode(ids[: params.min_tokens])) if params.min_tokens else 0
        text, hit_stop = _cut_at_stop(text, params.stop, floor)
        logprobs = openai_logprobs(self._token_bytes, ids, steps) if steps is not None else None
        return Generated(
            token_ids=ids,
            text=text,
            finish_reason=FinishReason.STOP if stopped or hit_stop else FinishReason.LENGTH,
            logprobs=logprobs,
        )

    def _decode(self, ids: list[int]) -> str:
        return str(self.loaded.tokenizer.decode(ids, skip_special_tokens=True))

    def decode_text(self, ids: list[int]) -> str:
        """A row's tokens as text (stop strings are looked for in it)."""
        return self._decode(ids)

    def _token_bytes(self, token_id: int) -> bytes:
        return self.grammars.token_bytes(token_id)

    @staticmethod
    def _row_limit(row: int, item: Prepared, stopper: RowStopper) -> int:
        return stopper.stopped_at.get(row, item.max_new_tokens)

    def _trim(self, generated: list[int], limit: int) -> tuple[list[int], bool]:
        """This row's own tokens: up to its EOS (kept) or its own limit."""
        generated = generated[:limit]
        for position, token in enumerate(generated):
            if token in self.eos_ids:
                return generated[: position + 1], True
        return generated, False


def _cut_at_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[str, bool]:
    positions = [p for p in (text.find(stop, start) for stop in stops) if p >= 0]
    if not positions:
        return text, False
    return text[: min(positions)], True


def _all_choices(item: Prepared, choices: list[Generated]) -> list[Generated]:
    """A greedy request ran one row for its ``n`` identical completions: copy it."""
    wanted = item.request.generation.completions
    if len(choices) < wanted:
        choices = choices + [replace(choices[0]) for _ in range(wanted - len(choices))]
    return choices


def _top(steps: list[dict[str, Any]] | None, k: int) -> list[dict[str, Any]] | None:
    """A row's logprob steps with its own number of alternatives (the loop keeps more)."""
    if steps is None:
        return None
    return [{**step, "top": step["top"][:k]} for step in steps]


def _vocab_size(model: Any) -> int:
    """The logits' width (the output embedding's rows): what a bitmask must cover."""
    return int(model.get_output_embeddings().weight.shape[0])


def _pinned(value: Any) -> Any:
    """A host tensor in pinned memory; anything else (a tensor already on the device) as is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value.pin_memory()
    return value


def processor_media(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the processor takes it: frames read back from the frame store
    (``Pixels``) become uint8 tensors over the same memory, channel-first as the
    processors want them (no host copy); photos and frames decoded on the device
    (``DevicePhoto``, ``DeviceFrames``) are their tensors there; Pillow media stay as they
    are."""
    if not any(
        isinstance(part.get(part["type"]), Pixels | DevicePhoto | DeviceFrames)
        for message in conversation
        for part in message["content"]
    ):
        return conversation
    return [
        {**message, "content": [_tensor_part(part) for part in message["content"]]}
        for message in conversation
    ]


def _tensor_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part["type"]
    media = part.get(kind)
    if isinstance(media, DevicePhoto | DeviceFrames):
        return {**part, kind: media.tensor}  # on the processor's device already
    if not isinstance(media, Pixels):
        return part
    return {**part, kind: media.as_tensor(single=kind == "image")}
