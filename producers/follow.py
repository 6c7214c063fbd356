"""Writing a job's finished lines into JSONL files, each line once, from a position a rerun
can pass back (``vlmq results --after N``) or find in a small cursor file next to the output
(``vlmq results --follow``).

The cursor file says how far the output files hold the job's finished lines: the position,
and each file's size in bytes at that position. It is written (atomically: a new file renamed
over the old) only after the lines before it are flushed to disk, so a follow stopped anywhere
resumes by cutting each file back to its recorded size and reading on from the position: a
line written after the last cursor is written again once, and none is lost or doubled.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from vlmq.config.status import JobState
from vlmq.producers.api.openai.mapping import to_openai_error, to_openai_output
from vlmq.producers.client import Client
from vlmq.producers.finished import PAGE, iter_finished

__all__ = ["Cursor", "LineWriter", "Sinks", "cursor_path", "follow", "read_once"]


class LineWriter:
    """Result records as JSONL lines: succeeded ones to ``out``, the others to ``errors``
    (or to ``out`` too when there is no error sink); ``fmt`` "openai" writes OpenAI Batch
    output and error lines. Counts what it wrote."""

    def __init__(
        self, out: Callable[[str], object], errors: Callable[[str], object] | None, fmt: str
    ) -> None:
        self.out, self.errors, self.fmt = out, errors, fmt
        self.ok = self.failed = 0

    def write(self, record: dict[str, Any]) -> None:
        if record.get("status") == "succeeded":
            line = to_openai_output(record) if self.fmt == "openai" else record
            self.out(json.dumps(line, ensure_ascii=False) + "\n")
            self.ok += 1
        else:
            line = to_openai_error(record) if self.fmt == "openai" else record
            (self.errors or self.out)(json.dumps(line, ensure_ascii=False) + "\n")
            self.failed += 1


def cursor_path(output: Path) -> Path:
    return output.with_name(output.name + ".cursor")


@dataclass
class Cursor:
    """How far the output files hold a job's finished lines."""

    job_id: str
    position: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # file -> bytes up to `position`
    complete: bool = False

    @classmethod
    def load(cls, path: Path) -> Cursor | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        sizes = {str(k): int(v) for k, v in data["sizes"].items()}
        return cls(str(data["job_id"]), int(data["position"]), sizes, bool(data["complete"]))

    def save(self, path: Path) -> None:
        fresh = path.with_name(path.name + ".new")
        fresh.write_text(json.dumps(asdict(self)), encoding="utf-8")
        os.replace(fresh, path)


class Sinks:
    """The output files of one read, opened in binary (sizes in bytes for the cursor)."""

    def __init__(self, stack: ExitStack, paths: list[Path], resume: Cursor | None) -> None:
        self.paths = paths
        self.files: list[IO[bytes]] = []
        for path in paths:
            size = resume.sizes.get(str(path)) if resume else None
            handle: IO[bytes] = path.open("wb" if size is None else "r+b")
            stack.callback(handle.close)
            if size is not None:
                handle.truncate(size)  # what was written after the cursor goes
                handle.seek(size)
            self.files.append(handle)

    def writer(self, fmt: str) -> LineWriter:
        out = self.files[0]
        errors = self.files[1] if len(self.files) > 1 else None
        return LineWriter(_encoder(out), _encoder(errors) if errors else None, fmt)

    def flushed_sizes(self) -> dict[str, int]:
        sizes = {}
        for path, handle in zip(self.paths, self.files, strict=True):
            handle.flush()
            os.fsync(handle.fileno())
            sizes[str(path)] = handle.tell()
        return sizes


def _encoder(handle: IO[bytes]) -> Callable[[str], object]:
    return lambda text: handle.write(text.encode("utf-8"))


def read_once(client: Client, job_id: str, writer: LineWriter, after: int = 0) -> tuple[int, bool]:
    """One read: every line finished after position ``after`` so far. Returns the position
    reached and whether that was every line of a finished job."""
    finished = client.state.jobs.get(job_id).finished
    position = after
    for item in iter_finished(client, job_id, after):
        if item.record is not None:
            writer.write(item.record)
        position = item.position
    return position, finished


def follow(
    client: Client,
    job_id: str,
    paths: list[Path],
    fmt: str,
    after: int | None = None,
    poll_s: float = 1.0,
    progress: Callable[[LineWriter, int], None] | None = None,
) -> tuple[LineWriter, Cursor]:
    """Write the job's lines into ``paths`` (output, then errors if given) as they finish,
    until the job has finished; resumes from the cursor file of ``paths[0]`` when it is this
    job's and no ``after`` is given. Returns the writer (its counts are this run's) and the
    final cursor."""
    where = cursor_path(paths[0])
    found = Cursor.load(where) if after is None else None
    names = sorted(str(p) for p in paths)
    same = found is not None and found.job_id == job_id and sorted(found.sizes) == names
    resume = found if same and all(p.exists() for p in paths) else None
    cursor = resume or Cursor(job_id, after or 0)
    with ExitStack() as stack:
        sinks = Sinks(stack, paths, resume)
        writer = sinks.writer(fmt)
        cursor.sizes = sinks.flushed_sizes()
        cursor.save(where)
        while not cursor.complete:
            finished = _job_finished(client, job_id)
            for position in _written(client, job_id, writer, cursor.position):
                cursor.position = position
                cursor.sizes = sinks.flushed_sizes()
                cursor.save(where)
            cursor.complete = finished
            cursor.sizes = sinks.flushed_sizes()
            cursor.save(where)
            if progress is not None:
                progress(writer, cursor.position)
            if not cursor.complete:
                time.sleep(poll_s)
    return writer, cursor


def _written(client: Client, job_id: str, writer: LineWriter, after: int) -> Iterator[int]:
    """Writes the lines finished after ``after``; yields the position reached after each
    page and at the end (the points a cursor may be saved at)."""
    position = after
    for item in iter_finished(client, job_id, after):
        if item.record is not None:
            writer.write(item.record)
        position = item.position
        if position % PAGE == 0:
            yield position
    yield position


def _job_finished(client: Client, job_id: str) -> bool:
    job = client.state.jobs.get(job_id)
    if job.state is JobState.UNKNOWN:
        raise LookupError(f"job {job_id} is gone (expired or never existed)")
    return job.finished
