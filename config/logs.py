"""Logging, configured only at entry points (CLI commands, ``vlmq serve``).

``json`` format writes one JSON object per line with the task id, job id,
batch id and worker of the work being done (from context variables the batch
loop sets), so a log pipeline can follow one request through the fleet.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LOG_FORMATS", "configure_logging", "log_context"]

LOG_FORMATS = ("text", "json")

_FIELDS = ("task_id", "job_id", "batch_id", "worker")
_context: dict[str, contextvars.ContextVar[str | None]] = {
    name: contextvars.ContextVar(f"vlmq_{name}", default=None) for name in _FIELDS
}


@contextmanager
def log_context(**values: str | None) -> Iterator[None]:
    """Attach task/job/batch/worker ids to every log line inside the block."""
    tokens = [(_context[k], _context[k].set(v)) for k, v in values.items() if k in _context]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _context.items():
            if not hasattr(record, name):
                setattr(record, name, var.get())
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # transformers is chatty about generation flags vlmq sets on purpose.
    logging.getLogger("transformers").setLevel(logging.ERROR)
