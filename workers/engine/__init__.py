"""The batch engine. Importing the package is cheap; ``Engine`` pulls in torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineStats", "Outcome"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vlmq.workers.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
