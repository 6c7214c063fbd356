"""What travels between the worker's stages: a pulled batch, its micro-batches, a started one.

A *pulled batch* is one modality class's pull, admitted, its requests on the prepare pool; it
is cut into *micro-batches* (``Planned``), each collated and then started and handed to the
engine (``Begun``). (A bulk *job* is something else: a producer's file of requests.)
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vlmq.workers.engine.interface import Collated
from vlmq.workers.engine.prepare import Prepared
from vlmq.workers.fleet.work import Work

__all__ = ["Begun", "Planned", "PulledBatch"]


@dataclass
class PulledBatch:
    """One pulled batch on its way through the stages."""

    modality: str
    works: list[Work]
    prepared: list[Future[Prepared]]
    alone: list[Work] = field(default_factory=list)  # prepared alone, later (Planned.unprepared)
    media_bytes: int = 0
    left: int = 0  # micro-batches not yet through generate
    pulled_at: float = 0.0  # Redis's time at its first pull: its leases run from then


@dataclass
class Planned:
    """One micro-batch: its work, its collated inputs (being made), whether it is a request
    that ran before (run alone, after its batch-mates are settled)."""

    pulled: PulledBatch
    works: list[Work]
    collated: Future[Collated]
    suspect: bool = False
    items: list[Prepared] = field(default_factory=list)  # what ``collated`` is made of
    ready_at: float = field(default_factory=time.monotonic)
    # Not prepared yet: a request whose holders died before it started, prepared on the
    # model's thread once its batch-mates are settled (``Stages.begin``).
    unprepared: bool = False


@dataclass
class Begun:
    """A micro-batch started (its works running) and handed to the engine."""

    planned: Planned
    works: list[Work]
    collated: Collated
    batch_id: str
    modality: str
    waited: float
