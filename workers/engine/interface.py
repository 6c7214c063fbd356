"""What a worker's stages ask of an engine, so a continuous engine can fill the same role.

The pipelined worker (workers/fleet/pipeline.py) prepares requests and collates micro-batches
on its preprocessing threads, then its model thread asks the engine how much it can take
(``capacity``), hands it collated work (``submit``) and collects results as they finish
(``poll``). The HF engine takes one static micro-batch at a time and returns all of it from
the next ``poll``; an engine with continuous batching can take requests as slots free and
return each as it finishes. Each engine says which it is in its ``capabilities``, so the
worker never probes it. The no-op engine implements it too. Importing this module does not
import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vlmq.config.schemas import Request, Result
from vlmq.workers.engine.prepare import Prepared

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = [
    "CONTINUOUS",
    "STATIC",
    "Capabilities",
    "Collated",
    "EngineDied",
    "GenerationEngine",
    "OneSlot",
    "RunOnlyEngine",
    "RunsBatches",
    "as_generation_engine",
]


class EngineDied(RuntimeError):
    """The engine is gone (vLLM's engine process died): nothing it held will finish. Raised
    out of the batch loop, so the worker exits and the fleet redelivers its leases; a request
    that kills the engine each time is isolated by the fleet's poison handling."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine declares about how it runs, read by the worker instead of probing.

    ``continuous``: it takes requests while others decode (``submit`` while ``capacity`` is
    above 0) and ``poll`` returns each request as it finishes, so the worker keeps it full
    (vLLM); otherwise it runs one submitted micro-batch at a time and returns all of it from
    the next ``poll`` (the HF engine).
    """

    continuous: bool = False


STATIC = Capabilities()
CONTINUOUS = Capabilities(continuous=True)


@dataclass
class Collated:
    """One micro-batch as the model takes it: padded input tensors (on the host), made on a
    preprocessing thread; ``inputs`` None when collation failed (generate isolates why)."""

    items: list[Prepared]
    inputs: Any
    collate_s: float
    pinned: bool = False
    token_budget: int | None = None

    @property
    def rows(self) -> int:
        return len(self.items)


@runtime_checkable
class GenerationEngine(Protocol):
    model_name: str
    capabilities: Capabilities
    # Cumulative counters the worker exports (micro-batches, OOM splits, the media cache);
    # None for an engine that keeps none the worker reads (vLLM keeps its own).
    stats: EngineStats | None

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        """Fetch, decode, check and estimate one request; any thread; never raises.
        ``tenant`` keys the frame store; ``prepared_media``: the prepare tier stored this
        task's media there."""

    def plan(
        self, prepared: Sequence[Prepared], token_budget: int | None = None
    ) -> list[list[Prepared]]:
        """Cut prepared requests into micro-batches."""

    def collate(self, items: Sequence[Prepared]) -> Collated:
        """A micro-batch's model inputs; any thread."""

    def capacity(self) -> int:
        """Rows the engine can take now (0: poll first)."""

    def submit(self, collated: Collated) -> None:
        """Hand over collated work (the model's thread)."""

    def poll(self, worker: str) -> list[Result]:
        """Results of submitted requests that finished (the model's thread)."""

    @property
    def pending(self) -> int:
        """Requests submitted whose results ``poll`` has not returned yet."""

    def reject(self, prepared: Prepared, worker: str) -> Result:
        """The result of a request that failed before generation (its ``error``)."""


class RunsBatches(Protocol):
    """An engine that only runs whole batches (test doubles, simple engines)."""

    model_name: str

    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]: ...


class OneSlot:
    """``capacity`` and ``submit`` of an engine that runs what was submitted when polled,
    one collated micro-batch at a time (the HF engine, the test and simulated engines)."""

    capabilities = STATIC
    stats: EngineStats | None = None
    _submitted: Collated | None = None

    def slot_rows(self) -> int:
        """Rows one micro-batch may have (unbounded unless the engine says otherwise)."""
        return 1 << 30

    def capacity(self) -> int:
        """A whole micro-batch when idle, none while one waits to run."""
        return 0 if self._submitted is not None else self.slot_rows()

    def submit(self, collated: Collated) -> None:
        if self._submitted is not None:
            raise RuntimeError(f"{type(self).__name__} runs one micro-batch at a time")
        self._submitted = collated

    @property
    def pending(self) -> int:
        """The submitted micro-batch's rows until ``poll`` ran it; then none."""
        return 0 if self._submitted is None else self._submitted.rows

    def _take(self) -> Collated | None:
        collated, self._submitted = self._submitted, None
        return collated


class RunOnlyEngine(OneSlot):
    """The generation interface over an engine that has only ``run``: every request is its
    own trivially prepared item, a pulled batch is one micro-batch, and ``poll`` runs it; it
    keeps no counters (``stats`` None)."""

    def __init__(self, engine: RunsBatches) -> None:
        self.engine = engine
        self.model_name = engine.model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)  # setup, close, a double's records: the engine's own

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        return Prepared(request, request.generation.max_new_tokens or 0)

    def plan(
        self, prepared: Sequence[Prepared], token_budget: int | None = None
    ) -> list[list[Prepared]]:
        return [list(prepared)] if prepared else []

    def collate(self, items: Sequence[Prepared]) -> Collated:
        return Collated(list(items), None, 0.0)

    def poll(self, worker: str) -> list[Result]:
        collated = self._take()
        if collated is None:
            return []
        requests = [item.request for item in collated.items]
        return self.engine.run(requests, worker=worker, token_budget=collated.token_budget)

    def reject(self, prepared: Prepared, worker: str) -> Result:
        raise RuntimeError("a run-only engine prepares nothing that can fail")


def as_generation_engine(engine: Any) -> GenerationEngine:
    """``engine`` itself when it has the generation interface, else adapted."""
    if isinstance(engine, GenerationEngine):
        return engine
    return RunOnlyEngine(engine)
