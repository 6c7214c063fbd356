"""The object store interface: what a result, a staged medium, a job's input and output
file, and a prepared frame are kept in (one object per key), and where a task's result goes.

Chosen by URL (``vlmq.stores.urls.open_store``): ``s3://bucket/prefix`` (``s3.py``, boto3,
any S3-compatible endpoint) or ``file:///dir`` (``files.py``, the embedded default). Result
keys are per delivery (``result_key``), so objects are written once and never overwritten;
readers follow the task's status.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Allocate",
    "BlobWriter",
    "ObjectInfo",
    "ObjectStore",
    "encode_record",
    "result_key",
    "result_location",
    "split_lines",
]

# Bytes read per request when a stored file is read line by line: what a streamed file costs
# in memory.
READ_CHUNK = 1024 * 1024

# Writable memory of the given length that a read fills (the frame store's pooled buffers).
Allocate = Callable[[int], memoryview]


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes and last modification (epoch seconds; the
    frame store refreshes it on a read to keep its eviction order, ``touch``)."""

    key: str
    size: int
    modified: float


def result_key(task_id: str, job_id: str | None, delivery: int) -> str:
    """Where one delivery of a task writes its result. Each delivery has its own object, so a
    superseded holder never overwrites the winner's; the task's status hash points at the
    winner (``result_url``)."""
    return f"{job_id or '_tasks'}/{task_id}.{delivery}.json"


def result_location(status: Mapping[str, str]) -> str | None:
    """Where a finished task's result object is, from its status: the URL its settle stored,
    or (a task folded into its job) the key derived from its winning delivery."""
    return status.get("result_url") or status.get("result_key")


class ObjectStore(ABC):
    url: str
    # Remote stores gain from parallel uploads; a local disk does not.
    parallel_uploads: bool = True

    @abstractmethod
    def put(self, key: str, record: dict[str, Any]) -> str:
        """Write one result object; returns its URL."""

    @abstractmethod
    def get(self, url_or_key: str) -> dict[str, Any] | None:
        """Read one result object, or None when it does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        """Store raw bytes (uploaded files, exported result files)."""

    @abstractmethod
    def get_blob(self, key: str) -> bytes | None: ...

    def read_blob(self, key: str, allocate: Allocate) -> bytes | memoryview | None:
        """The object's bytes, or None when it does not exist: a file store reads the file
        into memory from ``allocate(size)`` (the frame store's reused buffers) and keeps
        nothing open; the others return :meth:`get_blob`'s bytes. Never a mapping: a mapped
        file holds a descriptor for as long as its bytes are used (a worker's media cache
        ran out of them), and a file truncated in place under a mapping kills its reader
        with SIGBUS. A file that changes while it is read gives bytes its checksum refuses."""
        return self.get_blob(key)

    @abstractmethod
    def info(self, key: str) -> ObjectInfo | None:
        """Size and modification time of one object, or None when it does not exist."""

    @abstractmethod
    def objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (any name, not only results), in no set order."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Make the object's modification time now (a missing one is not an error)."""

    def free_bytes(self) -> int | None:
        """Room left where the objects live (a local volume), or None: a remote store."""
        return None

    def ping(self) -> None:  # noqa: B027 - reachable by default (local stores)
        """Raise StoreUnavailable when the store cannot be reached."""

    def presign(self, key: str, expires_s: int = 3600) -> str | None:
        return None

    def key_of(self, url_or_key: str) -> str:
        return url_or_key.removeprefix(self.url.rstrip("/") + "/")

    def url_of(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    # streaming: files far larger than memory -------------------------------
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when it does not exist."""
        info = self.info(key)
        return None if info is None else info.size

    @abstractmethod
    def read_from(self, key: str, start: int = 0) -> Iterator[bytes]:
        """The object's bytes from offset ``start``, in chunks of at most READ_CHUNK."""

    @abstractmethod
    def writer(self, key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        """A writer whose bytes become the object when it closes without error (multipart
        on S3), and are discarded otherwise: nothing half-written is ever visible."""

    def lines(self, key: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Each line (without its newline) from byte ``start``, with the offset just past
        it: reading again from that offset resumes after the line."""
        return split_lines(self.read_from(key, start), start)


def split_lines(chunks: Iterator[bytes], start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Lines of a chunked byte stream, each with the offset just past its newline; a last
    line without a newline ends at the end of the stream."""
    offset = start
    # The pieces of a line that spans chunks, joined once its newline arrives: appending
    # to one bytes object would copy it again per chunk (quadratic in a long line, such
    # as one with inline base64 images).
    pending: list[bytes] = []
    for chunk in chunks:
        begin = 0
        while (end := chunk.find(b"\n", begin)) >= 0:
            line = b"".join([*pending, chunk[begin:end]]) if pending else chunk[begin:end]
            pending.clear()
            offset += len(line) + 1
            yield offset, line
            begin = end + 1
        if begin < len(chunk):
            pending.append(chunk[begin:])
    if pending:
        line = b"".join(pending)
        yield offset + len(line), line


class BlobWriter(ABC):
    """Bytes written in order to one object; see ``ObjectStore.writer``."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
