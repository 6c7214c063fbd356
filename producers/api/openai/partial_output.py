"""A batch's finished lines while it runs: vlmq's extension to the OpenAI Batch API.

OpenAI's batches give their output only at completion, expiry or cancel. A vlmq batch also
names a file of the lines finished so far, ``vlmq_partial_output_file_id`` on the Batch
object (an extra field: the official client keeps it in ``model_extra`` and ignores it
otherwise). Its content is a snapshot read when asked: every line finished at that moment,
in the order they finished, succeeded ones as output lines and the others as error lines (one
file; each line has its ``custom_id``, and ``response`` or ``error``). Nothing is stored: the
lines come from the job's completion list and its result objects (producers/finished.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from vlmq.producers.api.openai.mapping import to_openai_error, to_openai_output
from vlmq.producers.api.openai.objects import FileObject
from vlmq.producers.client import Client
from vlmq.producers.finished import iter_finished

__all__ = ["batch_of_partial", "partial_file_id", "partial_file_object", "snapshot_lines"]

_PREFIX, _SUFFIX = "file-", "-partial"


def partial_file_id(batch_id: str) -> str:
    return f"{_PREFIX}{batch_id}{_SUFFIX}"


def batch_of_partial(file_id: str) -> str | None:
    """The batch whose partial file ``file_id`` names, or None for any other file."""
    if file_id.startswith(f"{_PREFIX}batch_") and file_id.endswith(_SUFFIX):
        return file_id.removeprefix(_PREFIX).removesuffix(_SUFFIX)
    return None


def partial_file_object(batch_id: str) -> FileObject:
    """The File object of a batch's partial file: its size is not known until it is read
    (``bytes`` 0), and it is made at each read (``created_at`` now)."""
    return FileObject(
        id=partial_file_id(batch_id),
        bytes=0,
        created_at=int(time.time()),
        filename=f"{batch_id}_partial_output.jsonl",
        purpose="batch_output",
    )


def snapshot_lines(client: Client, batch_id: str) -> Iterator[bytes]:
    """The batch's lines finished when this is called, as OpenAI output and error lines."""
    finished = client.state.jobs.get(batch_id).finished
    until = None if finished else int(client.redis.llen(client.keys.job_finished(batch_id)))
    for item in iter_finished(client, batch_id, 0, until):
        if item.record is not None:
            yield _line(item.record)


def _line(record: dict[str, Any]) -> bytes:
    succeeded = record.get("status") == "succeeded"
    line = to_openai_output(record) if succeeded else to_openai_error(record)
    return (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")
