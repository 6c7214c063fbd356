"""Result stores: one JSON object per task under a key derived from job and task id.

Chosen by URL: ``s3://bucket/prefix`` (boto3; any S3-compatible endpoint via
``endpoint_url``) or ``file:///dir`` / ``file://./dir`` for the embedded
default. Keys are per delivery (``result_key``), so objects are written once and
never overwritten; readers follow the task's status. Workers write; producers read.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from stat import S_ISREG
from typing import IO, Any
from urllib.parse import urlparse

from vlmq.config.errors import ConfigError, StoreUnavailable

__all__ = [
    "BlobWriter",
    "FileStore",
    "ObjectInfo",
    "ResultStore",
    "S3Store",
    "open_store",
    "result_key",
    "result_location",
    "split_lines",
]

# Bytes read per request when a stored file is read line by line, and the part size of a
# multipart write (S3's minimum part is 5 MiB): what a streamed file costs in memory.
READ_CHUNK = 1024 * 1024
PART_BYTES = 8 * 1024 * 1024
# Where a write in progress goes before its rename (the file store): never an object.
_TMP_PREFIX = ".tmp-"

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


class ResultStore(ABC):
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

    def put_stream(
        self, key: str, source: IO[bytes], content_type: str = "application/octet-stream"
    ) -> int:
        """Copy a readable stream into one object, a chunk at a time; returns its size."""
        total = 0
        with self.writer(key, content_type) as out:
            while chunk := source.read(READ_CHUNK):
                out.write(chunk)
                total += len(chunk)
        return total


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
    """Bytes written in order to one object; see ``ResultStore.writer``."""

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


class _FileWriter(BlobWriter):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
        except OSError as exc:
            raise StoreUnavailable("the results folder could not be written") from exc
        self.tmp = tmp
        self.handle = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        try:
            self.handle.write(data)
        except OSError as exc:
            raise StoreUnavailable("the results folder could not be written") from exc

    def commit(self) -> None:
        try:
            self.handle.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise StoreUnavailable("the results folder could not be written") from exc

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.handle.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class _S3Writer(BlobWriter):
    """A multipart upload: parts of PART_BYTES as they fill, completed on commit."""

    def __init__(self, client: Any, bucket: str, key: str, content_type: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.content_type = content_type
        self.buffer = bytearray()
        self.parts: list[dict[str, Any]] = []
        self.upload_id: str | None = None

    def write(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) >= PART_BYTES:
            self._flush()

    def _flush(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if self.upload_id is None:
                reply = self.client.create_multipart_upload(
                    Bucket=self.bucket, Key=self.key, ContentType=self.content_type
                )
                self.upload_id = reply["UploadId"]
            number = len(self.parts) + 1
            part = self.client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=bytes(self.buffer),
            )
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store did not accept the write") from exc
        self.parts.append({"ETag": part["ETag"], "PartNumber": number})
        self.buffer.clear()

    def commit(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if self.upload_id is None:  # small: one plain put
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=bytes(self.buffer),
                    ContentType=self.content_type,
                )
                return
            if self.buffer:
                self._flush()
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
            )
        except (BotoCoreError, ClientError) as exc:
            self.abort()
            raise StoreUnavailable("the results store did not accept the write") from exc
        except StoreUnavailable:
            # The last part failed (_flush raised): an upload left open is billed by S3
            # until a lifecycle rule removes it.
            self.abort()
            raise

    def abort(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        if self.upload_id is not None:
            with contextlib.suppress(BotoCoreError, ClientError):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
                )
        self.buffer.clear()


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()


class FileStore(ResultStore):
    parallel_uploads = False

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.root = Path((parsed.netloc or "") + parsed.path).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        # Checked on the key, not by resolving the path: resolve() stats every folder on
        # the way (~0.3 ms for a frame-store key, on each read and write). A key may not
        # be absolute or climb out with '..'; links inside the root are the operator's.
        parts = PurePosixPath(key).parts
        if not parts or parts[0] == "/" or ".." in parts or "\0" in key:
            raise ConfigError("result key escapes the store root")
        return self.root / key

    def put(self, key: str, record: dict[str, Any]) -> str:
        return self.put_blob(key, _encode(record), "application/json")

    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename: a reader never sees half an object.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # a full or read-only disk: retried like an unreachable S3
            raise StoreUnavailable("the results folder could not be written") from exc
        return f"{self.url}/{key}"

    def get_blob(self, key: str) -> bytes | None:
        path = self._path(key)
        return path.read_bytes() if path.exists() else None

    def read_blob(self, key: str, allocate: Allocate) -> bytes | memoryview | None:
        # Read, not mapped (see ResultStore.read_blob), into reused memory already faulted
        # in: the copy out of the page cache costs ~0.1 ms more than mapping for a 1080p
        # photo's 3 MB, ~5 ms for a clip's 29 MB (docs/reliability.md, the frame store
        # under faults).
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return b""
            view = allocate(size)[:size]
            done = 0
            while done < size:
                count = os.readv(fd, [view[done:]])
                if not count:  # truncated while read: the short bytes fail their checksum
                    break
                done += count
        finally:
            os.close(fd)
        return view[:done].toreadonly()

    def get(self, url_or_key: str) -> dict[str, Any] | None:
        path = self._path(self.key_of(url_or_key))
        if not path.exists():
            return None
        result: dict[str, Any] = json.loads(path.read_bytes())
        return result

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def info(self, key: str) -> ObjectInfo | None:
        try:
            stat = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not S_ISREG(stat.st_mode):
            return None
        return ObjectInfo(key, stat.st_size, stat.st_mtime)

    def objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._path(prefix) if prefix else self.root
        folders = [base]
        while folders:
            try:
                entries = list(os.scandir(folders.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        if entry.name.startswith(_TMP_PREFIX):
                            continue
                        stat = entry.stat(follow_symlinks=False)
                        key = str(Path(entry.path).relative_to(self.root))
                        yield ObjectInfo(key, stat.st_size, stat.st_mtime)
                except FileNotFoundError:  # deleted while listed
                    continue

    def touch(self, key: str) -> None:
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable("the results folder could not be written") from exc

    def free_bytes(self) -> int | None:
        try:
            stat = os.statvfs(self.root)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def read_from(self, key: str, start: int = 0) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            return
        with path.open("rb") as handle:
            handle.seek(start)
            while chunk := handle.read(READ_CHUNK):
                yield chunk

    def writer(self, key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        return _FileWriter(self._path(key))

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreUnavailable("the results folder could not be written") from exc

    def keys(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*.json") if p.is_file())


class S3Store(ResultStore):
    def __init__(self, url: str, endpoint_url: str | None = None, region: str = "us-east-1"):
        import boto3
        from botocore.config import Config

        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.url = url.rstrip("/")
        config = Config(
            retries={"mode": "standard", "max_attempts": 5},
            connect_timeout=5,
            read_timeout=30,
            max_pool_connections=32,
        )
        self.client = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, record: dict[str, Any]) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._full(key),
                Body=_encode(record),
                ContentType="application/json",
            )
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store did not accept the write") from exc
        return f"{self.url}/{key}"

    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._full(key), Body=data, ContentType=content_type
            )
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store did not accept the write") from exc
        return f"{self.url}/{key}"

    def get_blob(self, key: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StoreUnavailable("the results store could not be read") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable("the results store could not be read") from exc
        data: bytes = reply["Body"].read()
        return data

    def get(self, url_or_key: str) -> dict[str, Any] | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            reply = self.client.get_object(
                Bucket=self.bucket, Key=self._full(self.key_of(url_or_key))
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StoreUnavailable("the results store could not be read") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable("the results store could not be read") from exc
        result: dict[str, Any] = json.loads(reply["Body"].read())
        return result

    def info(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise StoreUnavailable("the results store could not be read") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable("the results store could not be read") from exc
        return ObjectInfo(key, int(reply["ContentLength"]), reply["LastModified"].timestamp())

    def objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    key = obj["Key"][strip:]
                    yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store could not be listed") from exc

    def touch(self, key: str) -> None:
        # S3 has no access time and an object's Last-Modified changes only when it is
        # written: a copy onto itself (server-side, no bytes through here) writes it.
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._full(key)
        try:
            self.client.copy_object(
                Bucket=self.bucket,
                Key=full,
                CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE",
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return
            raise StoreUnavailable("the results store did not accept the write") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable("the results store did not accept the write") from exc

    def read_from(self, key: str, start: int = 0) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        size = self.size(key)
        if size is None or start >= size:
            return
        try:
            reply = self.client.get_object(
                Bucket=self.bucket, Key=self._full(key), Range=f"bytes={start}-"
            )
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store could not be read") from exc
        body = reply["Body"]
        try:
            yield from body.iter_chunks(READ_CHUNK)
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store could not be read") from exc
        finally:
            # A reader that stops early (a client hung up mid-download) must not leave the
            # connection holding the rest of the object.
            body.close()

    def writer(self, key: str, content_type: str = "application/octet-stream") -> BlobWriter:
        return _S3Writer(self.client, self.bucket, self._full(key), content_type)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError:
            return False
        return True

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store did not accept the delete") from exc

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(info.key for info in self.objects(prefix))

    def ping(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable("the results store is not reachable") from exc

    def presign(self, key: str, expires_s: int = 3600) -> str | None:
        url: str = self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._full(key)},
            ExpiresIn=expires_s,
        )
        return url


def open_store(url: str, endpoint_url: str | None = None, region: str = "us-east-1") -> ResultStore:
    scheme = urlparse(url).scheme
    if scheme == "file":
        return FileStore(url)
    if scheme == "s3":
        return S3Store(url, endpoint_url=endpoint_url, region=region)
    raise ConfigError(f"results URL must be s3://bucket/prefix or file:///dir, got {scheme!r}")
