"""An engine that does no inference: for queue benchmarks and fault tests.

It has the Engine's interface (setup, run, close), answers every request with
an empty output, and can sleep per batch to stand in for generation time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from vlmq.config.schemas import FinishReason, Request, Result, Usage
from vlmq.config.settings import EXIT_INJECTED_CRASH

__all__ = ["NoopEngine"]


class NoopEngine:
    model_name = "noop"

    def __init__(self, batch_delay_s: float = 0.0, crash_marker: str | None = None) -> None:
        self.batch_delay_s = batch_delay_s
        self.crash_marker = crash_marker

    def setup(self) -> NoopEngine:
        return self

    def close(self) -> None:
        pass

    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]:
        if self.crash_marker and any(self.crash_marker in _text(r) for r in requests):
            os._exit(EXIT_INJECTED_CRASH)  # stands in for a segfault or an OOM kill
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
        return [
            Result(
                id=r.id,
                custom_id=r.custom_id,
                job_id=r.job_id,
                status="succeeded",
                model="noop",
                modality=r.modality,
                output="",
                finish_reason=FinishReason.STOP,
                usage=Usage(),
                batch_size=len(requests),
                worker=worker,
            )
            for r in requests
        ]


def _text(request: Request) -> str:
    return " ".join(getattr(p, "text", "") for m in request.messages for p in m.content)
