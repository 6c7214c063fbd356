"""vlmq: batched vision-language-model inference on a Celery worker fleet.

The installed distribution is this one package. Its subpackages are the repository's three
top-level folders, mapped under this name by ``pyproject.toml`` (see docs/design.md, "Layout"):

* ``vlmq.config``: the contract both sides import (settings, schemas, errors, keys, status);
* ``vlmq.producers``: the client, the CLI and the HTTP API (no torch);
* ``vlmq.workers``: the engine, media and the fleet worker.

The public surface for applications::

    from vlmq import Client, Settings, Request, Result, VlmqError

Names resolve on first use, so ``import vlmq`` stays cheap and never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Client", "Request", "Result", "Settings", "VlmqError", "__version__"]

_PUBLIC = {
    "Client": "vlmq.producers.client",
    "Request": "vlmq.config.schemas",
    "Result": "vlmq.config.schemas",
    "Settings": "vlmq.config.settings",
    "VlmqError": "vlmq.config.errors",
}

if TYPE_CHECKING:
    from vlmq.config.errors import VlmqError
    from vlmq.config.schemas import Request, Result
    from vlmq.config.settings import Settings
    from vlmq.producers.client import Client


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vlmq' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
