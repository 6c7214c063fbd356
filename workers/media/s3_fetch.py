"""s3://bucket/key media from allowlisted buckets, size-checked with HEAD first."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vlmq.config.errors import (
    InvalidRequest,
    MediaFetchFailed,
    MediaFetchTransient,
    MediaForbidden,
    MediaTooLarge,
    VlmqError,
)
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.deadline import Deadline, call_with_deadline

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

__all__ = ["S3ClientFactory", "S3Fetcher", "is_allowed", "parse_s3_url"]

# Returns a boto3 S3 client; the factory owns endpoint, credentials, retries
# and per-request timeouts (botocore Config).
S3ClientFactory = Callable[[], Any]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MAX_KEY_BYTES = 1024
_CHUNK = 256 * 1024
_NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "NoSuchBucket", "404"})
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"})


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/key``. Keys are taken verbatim (not percent-decoded),
    as the AWS CLI does, since '?' and '#' are legal in keys."""
    bucket, sep, key = url[len("s3://") :].partition("/")
    if not sep or not key or not _BUCKET_RE.match(bucket):
        raise InvalidRequest("s3 media URL must look like s3://bucket/key")
    try:
        key_bytes = key.encode("utf-8")  # botocore would raise on a lone surrogate
    except UnicodeEncodeError:
        raise InvalidRequest("s3 media key is not valid Unicode") from None
    if len(key_bytes) > _MAX_KEY_BYTES:
        raise InvalidRequest("s3 media key is too long")
    return bucket, key


def is_allowed(bucket: str, key: str, settings: MediaSettings) -> bool:
    """A listed bucket, or a key under a listed ``s3://bucket/prefix``."""
    if bucket in settings.allowed_buckets:
        return True
    return any(_under_prefix(bucket, key, entry) for entry in settings.allowed_s3_prefixes)


def _under_prefix(bucket: str, key: str, entry: str) -> bool:
    """Under the prefix with plain segments only: no '.', '..' or empty segment that a
    server normalising paths could turn into a key outside the prefix."""
    allowed_bucket, _, prefix = entry.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if not entry.startswith("s3://") or bucket != allowed_bucket:
        return False
    if prefix and not key.startswith(prefix + "/"):
        return False
    rest = key[len(prefix) + 1 :] if prefix else key
    return all(segment not in ("", ".", "..") for segment in rest.split("/"))


@contextmanager
def _store_errors() -> Iterator[None]:
    """The object store's errors as media errors (a VlmqError passes as it is). botocore is
    imported with a client only: a worker that reads no s3:// media (the GPU check on a
    machine without boto3) needs none."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except VlmqError:
        raise
    except ClientError as exc:
        raise _client_error(exc) from None
    except BotoCoreError:
        raise MediaFetchTransient("object store is unreachable") from None


class S3Fetcher:
    """Fetches one object: bucket allowlist, HEAD size check, capped GET."""

    def __init__(self, settings: MediaSettings, client_factory: S3ClientFactory | None) -> None:
        self._settings = settings
        self._factory = client_factory
        self._client: Any = None
        self._lock = threading.Lock()

    def fetch_versioned(
        self, url: str, cap: int, deadline: Deadline, known: str | None = None
    ) -> tuple[bytes | None, str | None]:
        """The object and its version tag (``etag:…``); (None, known) without a download
        when HEAD shows the object is still the version ``known`` names."""
        bucket, key = parse_s3_url(url)
        if not is_allowed(bucket, key, self._settings):
            raise MediaForbidden("media bucket is not allowed")
        client = self._get_client()
        cancelled = threading.Event()
        try:
            with _store_errors():
                head = call_with_deadline(
                    lambda: client.head_object(Bucket=bucket, Key=key), deadline
                )
                _check_head_size(head, cap)
                etag = head.get("ETag")
                version = f"etag:{etag}" if etag else None
                if known is not None and version == known:
                    return None, known
                data = call_with_deadline(
                    lambda: _download(client, bucket, key, etag, cap, cancelled), deadline
                )
                return data, version
        finally:
            cancelled.set()  # a download thread past the deadline stops at its next chunk

    def identity(self, url: str, cap: int, deadline: Deadline) -> tuple[str, int]:
        """(ETag, size) of an allowed object from a HEAD, nothing downloaded: how the frame
        store names an S3 source before fetching it."""
        bucket, key = parse_s3_url(url)
        if not is_allowed(bucket, key, self._settings):
            raise MediaForbidden("media bucket is not allowed")
        client = self._get_client()
        with _store_errors():
            head = call_with_deadline(lambda: client.head_object(Bucket=bucket, Key=key), deadline)
        _check_head_size(head, cap)
        etag = head.get("ETag")
        if not isinstance(etag, str) or not etag:
            raise MediaFetchFailed("object store returned no ETag")
        return etag, int(head["ContentLength"])

    def _get_client(self) -> Any:
        if self._factory is None:
            raise MediaForbidden("s3 media sources are not enabled")
        with self._lock:  # boto3 clients are thread-safe; creating them is not cheap
            if self._client is None:
                self._client = self._factory()
            return self._client


def _check_head_size(head: dict[str, Any], cap: int) -> None:
    size = head.get("ContentLength")
    if not isinstance(size, int):
        raise MediaFetchFailed("object store returned no object size")
    if size > cap:
        raise MediaTooLarge("media is larger than the allowed size")


def _download(
    client: Any, bucket: str, key: str, etag: str | None, cap: int, cancelled: threading.Event
) -> bytes:
    # If-Match pins the GET to the object whose size HEAD approved.
    extra = {"IfMatch": etag} if etag else {}
    body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
    try:
        data = bytearray()
        while not cancelled.is_set():
            chunk = body.read(_CHUNK)
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > cap:
                raise MediaTooLarge("media is larger than the allowed size")
        raise MediaFetchTransient("media fetch timed out")
    finally:
        body.close()


def _client_error(exc: ClientError) -> VlmqError:
    """Classify by the S3 error code / HTTP status, never by the message."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    if code in _NOT_FOUND or status == 404:
        return MediaFetchFailed("media object not found")
    if code in ("PreconditionFailed", "412") or status == 412:
        return MediaFetchTransient("media object changed during fetch")
    if code in _THROTTLED or status in (408, 429) or status >= 500:
        return MediaFetchTransient("object store is temporarily unavailable")
    if status == 403 or code == "AccessDenied":
        return MediaFetchFailed("access to media object denied")
    return MediaFetchFailed("object store refused the media request")
