"""Predict step: one padded micro-batch through ``processor`` and ``model.generate``.

collate (chat template, left padding; any thread, with that thread's processor) → generate
(per-row limits, stops, sampling; the model's thread) → trim each prompt →
``batch_decode(skip_special_tokens=True)``. On CUDA the collated tensors are pinned where
they were made, so the model thread's host-to-device copy is non-blocking.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from vlmq.config.errors import OutOfMemory
from vlmq.config.schemas import FinishReason, TextPart
from vlmq.config.settings import EXIT_INJECTED_CRASH, FaultInjection
from vlmq.workers.engine.controls import RowSampler, RowSampling, RowStopper
from vlmq.workers.engine.interface import Collated
from vlmq.workers.engine.model import LoadedModel
from vlmq.workers.engine.prepare import Prepared

__all__ = ["BatchRunner", "Completion", "RowsTooLong", "free_device_memory"]


@dataclass
class Completion:
    """One row of a generated micro-batch."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    batch_id: str
    batch_size: int
    padding_ratio: float
    generate_s: float
    collate_s: float = 0.0


class RowsTooLong(Exception):
    """Rows whose real prompt (after collation) leaves no room in the context."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"{len(rows)} rows exceed the context")
        self.rows = rows


class InjectedFault(RuntimeError):
    """A fault raised on purpose by ``FaultInjection`` (tests only)."""


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _row_sampling(item: Prepared) -> RowSampling | None:
    params = item.request.generation
    if not params.sampling:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
    temperature = 1.0 if params.temperature is None else params.temperature
    return RowSampling(temperature=temperature, top_p=params.top_p or 1.0, seed=seed)


class BatchRunner:
    """Runs micro-batches on a loaded model; knows nothing about queues."""

    def __init__(
        self,
        loaded: LoadedModel,
        faults: FaultInjection | None = None,
        fixed_output_length: bool = False,
        processor_device: str | None = None,
    ) -> None:
        self.loaded = loaded
        # Where the image and video processors compute (the torchvision ones take a device):
        # the model's GPU, so resizing and normalising leave the CPU; None: where they are.
        self.processor_device = processor_device
        self.faults = faults or FaultInjection()
        self.fixed_output_length = fixed_output_length
        tokenizer = loaded.tokenizer
        eos = loaded.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(i) for i in eos_ids if i is not None} | {int(tokenizer.eos_token_id)}
        self.pad_id = int(tokenizer.pad_token_id)

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
        metadata = [
            part["metadata"]
            for item in items
            for message in item.conversation
            for part in message["content"]
            if part["type"] == "video"
        ]
        if metadata:
            # Frames are already sampled; the metadata places them in time.
            processor_kwargs |= {"do_sample_frames": False, "video_metadata": metadata}
        return processor.apply_chat_template(
            [item.conversation for item in items],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs=processor_kwargs,
        )

    def generate(self, collated: Collated) -> list[Completion]:
        items = collated.items
        self._inject_faults(items)
        self._check_context(items, collated.inputs["attention_mask"])
        inputs = self._to_device(collated.inputs, non_blocking=collated.pinned)
        started = time.perf_counter()
        try:
            output, stopper = self._generate(items, inputs)
        except Exception as exc:
            if _is_oom(exc):
                raise OutOfMemory("the batch did not fit in device memory") from exc
            raise
        elapsed = time.perf_counter() - started
        completions = self._unbatch(items, inputs, output, stopper, elapsed)
        for completion in completions:
            completion.collate_s = collated.collate_s
        return completions

    def _inject_faults(self, items: Sequence[Prepared]) -> None:
        limit = self.faults.oom_above_batch
        if limit is not None and len(items) > limit:
            raise OutOfMemory(f"injected: batch of {len(items)} above {limit}")
        marker = self.faults.poison_marker
        if marker and any(marker in _text_of(item) for item in items):
            raise InjectedFault("injected poison request")
        crash = self.faults.crash_marker
        if crash and any(crash in _text_of(item) for item in items):
            os._exit(EXIT_INJECTED_CRASH)

    def _check_context(self, items: Sequence[Prepared], attention_mask: torch.Tensor) -> None:
        lengths = attention_mask.sum(dim=1).tolist()
        limit = self.loaded.context_length
        over = [i for i, item in enumerate(items) if lengths[i] + item.max_new_tokens > limit]
        if over:
            raise RowsTooLong(over)

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
    ) -> tuple[Any, RowStopper]:
        tokenizer = self.loaded.tokenizer
        prompt_length = inputs["input_ids"].shape[1]
        stopper = RowStopper(
            prompt_length,
            [item.max_new_tokens for item in items],
            [item.request.generation.stop for item in items],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        processors = LogitsProcessorList()
        sampling = [_row_sampling(item) for item in items]
        if any(sampling):
            processors.append(RowSampler(sampling))
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
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([stopper]),
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
            )
        return output, stopper

    def _unbatch(
        self,
        items: Sequence[Prepared],
        inputs: dict[str, Any],
        output: torch.Tensor,
        stopper: RowStopper,
        elapsed: float,
    ) -> list[Completion]:
        mask = inputs["attention_mask"]
        prompt_length = mask.shape[1]
        padding_ratio = float(mask.sum()) / float(mask.numel())
        prompt_tokens = mask.sum(dim=1).tolist()
        rows = [
            self._trim(output[i, prompt_length:].tolist(), self._row_limit(i, items, stopper))
            for i in range(len(items))
        ]
        texts = self.loaded.tokenizer.batch_decode(
            [ids for ids, _ in rows], skip_special_tokens=True
        )
        batch_id = uuid.uuid4().hex[:12]
        completions = []
        for i, ((ids, hit_eos), text) in enumerate(zip(rows, texts, strict=True)):
            text, hit_stop = _cut_at_stop(text, items[i].request.generation.stop)
            stopped = hit_eos or hit_stop or i in stopper.stopped_at
            completions.append(
                Completion(
                    token_ids=ids,
                    text=text,
                    finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
                    prompt_tokens=int(prompt_tokens[i]),
                    batch_id=batch_id,
                    batch_size=len(items),
                    padding_ratio=round(padding_ratio, 4),
                    generate_s=elapsed,
                )
            )
        return completions

    @staticmethod
    def _row_limit(row: int, items: Sequence[Prepared], stopper: RowStopper) -> int:
        return stopper.stopped_at.get(row, items[row].max_new_tokens)

    def _trim(self, generated: list[int], limit: int) -> tuple[list[int], bool]:
        """This row's own tokens: up to its EOS (kept) or its own limit."""
        generated = generated[:limit]
        for position, token in enumerate(generated):
            if token in self.eos_ids:
                return generated[: position + 1], True
        return generated, False


def _text_of(item: Prepared) -> str:
    return " ".join(
        part.text for m in item.request.messages for part in m.content if isinstance(part, TextPart)
    )


def _cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    positions = [text.find(stop) for stop in stops if stop in text]
    if not positions:
        return text, False
    return text[: min(positions)], True


def _pinned(value: Any) -> Any:
    """A host tensor in pinned memory; anything else (a tensor already on the device) as is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value.pin_memory()
    return value
