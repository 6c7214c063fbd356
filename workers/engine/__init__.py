"""The batch engines. Importing the package is cheap; ``Engine`` pulls in torch, ``VllmEngine``
vLLM (at ``setup``)."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineStats", "Outcome", "VllmEngine", "engine_for_backend"]


def engine_for_backend(backend: str, model: str, settings: Any, media: Any, **kwargs: Any) -> Any:
    """The engine a backend names (``hf`` or ``vllm``), not set up yet."""
    if backend == "vllm":
        from vlmq.workers.engine.vllm_engine import VllmEngine

        return VllmEngine(model, settings, media, **kwargs)
    from vlmq.workers.engine.engine import Engine

    return Engine(model, settings, media, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "VllmEngine":
        from vlmq.workers.engine import vllm_engine

        return vllm_engine.VllmEngine
    if name in __all__:
        from vlmq.workers.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
