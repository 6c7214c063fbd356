"""A store from its URL: the one place the scheme picks the backend."""

from __future__ import annotations

from urllib.parse import urlparse

from vlmq.config.errors import ConfigError
from vlmq.stores.base import ObjectStore
from vlmq.stores.files import FileStore
from vlmq.stores.s3 import S3Store

__all__ = ["open_store"]


def open_store(url: str, endpoint_url: str | None = None, region: str = "us-east-1") -> ObjectStore:
    scheme = urlparse(url).scheme
    if scheme == "file":
        return FileStore(url)
    if scheme == "s3":
        return S3Store(url, endpoint_url=endpoint_url, region=region)
    raise ConfigError(f"results URL must be s3://bucket/prefix or file:///dir, got {scheme!r}")
