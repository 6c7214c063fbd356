"""An engine whose batches run only when a test lets them through: a job's tasks then finish
over time, in steps the test chooses, so reads can be made while it runs."""

from __future__ import annotations

import threading
from typing import Any

from vlmq.config.schemas import Result

__all__ = ["GatedEngine"]


class GatedEngine:
    """Answers each batch once a permit is released (``release(n)``: n more batches may
    run); a request whose custom_id is in ``failing`` fails alone (the rest succeed)."""

    model_name = "gated"

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.failing = failing
        self.permits = threading.Semaphore(0)
        self.closed = threading.Event()
        self.ran: list[str] = []

    def release(self, batches: int = 1) -> None:
        self.permits.release(batches)

    def open(self) -> None:
        """Every batch from now on runs at once."""
        self.closed.set()
        self.permits.release(10**6)

    def run(
        self, requests: list[Any], worker: str | None = None, token_budget: int | None = None
    ) -> list[Result]:
        while not self.permits.acquire(timeout=0.05):
            if self.closed.is_set():
                break
        self.ran += [r.id for r in requests]
        return [self._answer(r, len(requests), worker) for r in requests]

    def _answer(self, request: Any, batch_size: int, worker: str | None) -> Result:
        failed = request.custom_id in self.failing
        return Result(
            id=request.id,
            custom_id=request.custom_id,
            job_id=request.job_id,
            status="failed" if failed else "succeeded",
            model=self.model_name,
            modality=request.modality,
            output=None if failed else f"echo:{request.custom_id}",
            error={"code": "engine_error", "message": "told to fail"} if failed else None,
            batch_size=batch_size,
            worker=worker,
        )
