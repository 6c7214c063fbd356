"""Uploaded and generated files: bytes in the results store, metadata in Redis.

Bytes go to ``files/{file_id}`` in the results store (S3 or a folder), so the
API process holds no state of its own; the OpenAI File object is a Redis hash
(``Keys.files``), and a sorted set by creation time lists them.

Content is streamed both ways, never held whole: written through the store's
writer (a multipart upload on S3) a chunk at a time, read back in chunks or
line by line. What a file costs the API in memory is a few chunks and one
multipart part, whatever its size.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from vlmq.config.tenants import DEFAULT_TENANT, Caller
from vlmq.producers.api.openai.objects import FileObject
from vlmq.producers.client import Client
from vlmq.stores.base import BlobWriter

__all__ = [
    "FileRegistry",
    "FileTooLarge",
    "content_key",
    "new_file_id",
    "newest_first",
    "valid_file_id",
]

T = TypeVar("T")

_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,160}$")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def valid_file_id(file_id: str) -> bool:
    """Ids name store keys: only our own shape may reach the store."""
    return bool(_FILE_ID.match(file_id))


def content_key(file_id: str) -> str:
    """The file's content in the results store."""
    return f"files/{file_id}"


class FileTooLarge(Exception):
    """A streamed file passed its cap; what was written of it was discarded."""


class FileRegistry:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.index = client.keys.files_index()

    def create_stream(
        self,
        chunks: Iterable[bytes],
        filename: str,
        purpose: str,
        file_id: str | None = None,
        max_bytes: int | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> FileObject:
        """Write the chunks to the store as they come, then register the file.

        Past ``max_bytes`` the write is aborted (nothing stored, nothing listed)
        and FileTooLarge raised.
        """
        file_id = file_id or new_file_id()
        size = 0
        with self.writer(file_id) as out:
            for chunk in chunks:
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise FileTooLarge(file_id)
                out.write(chunk)
        return self.register(file_id, size, filename, purpose, tenant)

    def writer(self, file_id: str) -> BlobWriter:
        """A writer for the file's content; ``register`` the file once it is closed."""
        if not valid_file_id(file_id):
            raise ValueError("not a file id")
        return self.client.store.writer(content_key(file_id), "application/jsonl")

    def register(
        self, file_id: str, size: int, filename: str, purpose: str, tenant: str = DEFAULT_TENANT
    ) -> FileObject:
        """List a file of ``tenant`` whose content is already in the store: content first,
        then the metadata, so a listed file always has content."""
        meta = {
            "id": file_id,
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "tenant": tenant,
        }
        key = self.client.keys.file(file_id)
        pipe = self.client.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={k: str(v) for k, v in meta.items()})
        ttl_s, now = self.client.settings.fleet.task_ttl_s, time.time()
        pipe.expire(key, ttl_s)
        for index in (self.index, self.client.keys.files_index(tenant)):
            pipe.zadd(index, {file_id: now})
            # Entries older than a record's ttl name records Redis already dropped.
            pipe.zremrangebyscore(index, "-inf", now - ttl_s)
        pipe.execute()
        return _file_object(meta)

    def get(self, file_id: str, caller: Caller | None = None) -> FileObject | None:
        """The file, or None: no such file, or (``caller``) one another tenant owns."""
        if not valid_file_id(file_id):
            return None
        raw: dict[str, str] = self.client.redis.hgetall(self.client.keys.file(file_id))  # type: ignore[assignment]
        if not raw or (caller is not None and not caller.may_see(raw)):
            return None
        return _file_object(raw)

    def size(self, file_id: str) -> int | None:
        """The stored content's size, or None when it is missing."""
        if not valid_file_id(file_id):
            return None
        return self.client.store.size(content_key(file_id))

    def read(self, file_id: str) -> Iterator[bytes]:
        """The content in chunks (nothing for a missing file: ask ``size`` first)."""
        if not valid_file_id(file_id):
            return iter(())
        return self.client.store.read_from(content_key(file_id))

    def lines(self, file_id: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """The content line by line from byte ``start``, each line with the offset just
        past it (see ``ObjectStore.lines``)."""
        if not valid_file_id(file_id):
            return iter(())
        return self.client.store.lines(content_key(file_id), start)

    def list(
        self, limit: int, after: str | None = None, caller: Caller | None = None
    ) -> tuple[list[FileObject], bool]:
        """Newest first, the caller's tenant's (an admin's: all); ``after`` is the last id of
        the previous page."""
        index = self.index
        if caller is not None and not caller.admin:
            index = self.client.keys.files_index(caller.tenant)
        return newest_first(
            self.client, index, lambda file_id: self.get(file_id, caller), limit, after
        )


def _file_object(meta: dict[str, Any]) -> FileObject:
    return FileObject(
        id=meta["id"],
        bytes=int(meta["bytes"]),
        created_at=int(meta["created_at"]),
        filename=meta["filename"],
        purpose=meta["purpose"],
    )


def newest_first(
    client: Client, index: str, load: Callable[[str], T | None], limit: int, after: str | None
) -> tuple[list[T], bool]:
    """One page of a newest-first sorted-set index, skipping entries that expired."""
    start = 0
    if after:
        rank: Any = client.redis.zrevrank(index, after)
        start = int(rank) + 1 if rank is not None else 0
    ids: list[str] = client.redis.zrevrange(index, start, start + limit)  # type: ignore[assignment]
    objects = [o for o in (load(i) for i in ids[:limit]) if o is not None]
    return objects, len(ids) > limit
