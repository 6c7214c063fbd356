"""The S3 store: any S3-compatible endpoint through boto3 (``s3://bucket/prefix``). Large
objects are written as multipart uploads of ``PART_BYTES``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from vlmq.config.errors import StoreUnavailable
from vlmq.stores.base import (
    READ_CHUNK,
    BlobWriter,
    ObjectInfo,
    ObjectStore,
    encode_record,
)

__all__ = ["PART_BYTES", "S3Store"]

# The part size of a multipart write (S3's minimum part is 5 MiB): what a streamed object
# costs in memory.
PART_BYTES = 8 * 1024 * 1024


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


class S3Store(ObjectStore):
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
                Body=encode_record(record),
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
        data = self.get_blob(self.key_of(url_or_key))
        if data is None:
            return None
        result: dict[str, Any] = json.loads(data)
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
