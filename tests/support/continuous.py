"""``StepEngine``: a continuous engine double for the fleet's continuous driver (issue 14).

Like vLLM behind ``VllmEngine``, it takes requests while others run: ``capacity`` is its free
slots, ``submit`` puts a micro-batch's requests inside, and each ``poll`` is one decode step:
every request inside gains a token and those at their ``max_new_tokens`` come out. It records
what was inside at each step, so tests can see that new work went in while a long request
was still decoding, and that a suspect ran alone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vlmq.config.schemas import FinishReason, Request, Result, Usage
from vlmq.workers.engine.interface import CONTINUOUS, Collated
from vlmq.workers.engine.prepare import Prepared

__all__ = ["StepEngine"]


class StepEngine:
    model_name = "step-engine"
    capabilities = CONTINUOUS
    stats = None

    def __init__(self, slots: int = 8, step_s: float = 0.0) -> None:
        self.slots = slots
        self.step_s = step_s
        self._inside: dict[str, tuple[Request, int]] = {}  # id -> (request, tokens so far)
        self.steps: list[set[str]] = []  # ids inside at each poll
        self.submitted: list[list[str]] = []  # ids per submit, in order
        self._wait = threading.Event()

    def setup(self) -> StepEngine:
        return self

    def close(self) -> None:
        pass

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        return Prepared(request, request.generation.max_new_tokens or 4, prompt_tokens=8)

    def plan(self, prepared: Sequence[Prepared], token_budget: int | None = None) -> Any:
        items = list(prepared)
        return [items[i : i + self.slots] for i in range(0, len(items), self.slots)]

    def collate(self, items: Sequence[Prepared]) -> Collated:
        return Collated(list(items), None, 0.0)

    def capacity(self) -> int:
        return self.slots - len(self._inside)

    @property
    def pending(self) -> int:
        return len(self._inside)

    def submit(self, collated: Collated) -> None:
        self.submitted.append([item.request.id for item in collated.items])
        for item in collated.items:
            self._inside[item.request.id] = (item.request, 0)

    def poll(self, worker: str) -> list[Result]:
        if self.step_s:
            self._wait.wait(self.step_s)
        self.steps.append(set(self._inside))
        done = []
        for task_id, (request, tokens) in list(self._inside.items()):
            tokens += 1
            if tokens >= (request.generation.max_new_tokens or 4):
                del self._inside[task_id]
                done.append(_result(request, tokens, worker))
            else:
                self._inside[task_id] = (request, tokens)
        return done

    def reject(self, prepared: Prepared, worker: str) -> Result:
        raise RuntimeError("StepEngine prepares nothing that fails")


def _result(request: Request, tokens: int, worker: str) -> Result:
    return Result(
        id=request.id,
        custom_id=request.custom_id,
        job_id=request.job_id,
        status="succeeded",
        model=StepEngine.model_name,
        modality=request.modality,
        output="x" * tokens,
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=8, completion_tokens=tokens),
        worker=worker,
    )
