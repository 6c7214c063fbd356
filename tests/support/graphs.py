"""Stand-ins for CUDA graphs on machines without a GPU, for the decode loop's graph path.

``ReplayGraphs`` does what ``workers.engine.graphs.CudaGraphs`` does around a step, without
CUDA: the warm-up runs the step twice (a forward step must be safe to run twice, as it is before
a real capture), capture keeps it, replay runs it again. Tokens identical to the eager loop then
show the loop's steps are functions of their buffers alone and that the warm-up leaves nothing
behind. ``FailingGraphs`` refuses every capture, as a model whose step cannot be captured does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FailingGraphs", "ReplayGraphs"]

Step = Callable[[], None]


@dataclass
class _Replay:
    step: Step
    owner: ReplayGraphs

    def replay(self) -> None:
        self.owner.replays += 1
        self.step()


@dataclass
class ReplayGraphs:
    captured: list[Step] = field(default_factory=list)
    warm_ups: int = 0
    replays: int = 0

    def capture(self, step: Step, warm_up: bool) -> _Replay:
        if warm_up:
            for _ in range(2):
                step()
                self.warm_ups += 1
        self.captured.append(step)
        return _Replay(step, self)


class FailingGraphs:
    def __init__(self) -> None:
        self.attempts = 0

    def capture(self, step: Step, warm_up: bool) -> _Replay:
        self.attempts += 1
        raise RuntimeError("operation not permitted when stream is capturing")
