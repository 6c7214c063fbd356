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
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vlmq.config.errors import ConfigError, StoreUnavailable

__all__ = ["FileStore", "ResultStore", "S3Store", "open_store", "result_key"]


def result_key(task_id: str, job_id: str | None, delivery: int) -> str:
    """Where one delivery of a task writes its result. Each delivery has its own object, so a
    superseded holder never overwrites the winner's; the task's status hash points at the
    winner (``result_url``)."""
    return f"{job_id or '_tasks'}/{task_id}.{delivery}.json"


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

    def ping(self) -> None:  # noqa: B027 - reachable by default (local stores)
        """Raise StoreUnavailable when the store cannot be reached."""

    def presign(self, key: str, expires_s: int = 3600) -> str | None:
        return None

    def key_of(self, url_or_key: str) -> str:
        return url_or_key.removeprefix(self.url.rstrip("/") + "/")


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
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise ConfigError("result key escapes the store root")
        return path

    def put(self, key: str, record: dict[str, Any]) -> str:
        return self.put_blob(key, _encode(record), "application/json")

    def put_blob(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename: a reader never sees half an object.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
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

    def get(self, url_or_key: str) -> dict[str, Any] | None:
        path = self._path(self.key_of(url_or_key))
        if not path.exists():
            return None
        result: dict[str, Any] = json.loads(path.read_bytes())
        return result

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

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
        paginator = self.client.get_paginator("list_objects_v2")
        full = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            out += [obj["Key"][strip:] for obj in page.get("Contents", [])]
        return sorted(out)

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
