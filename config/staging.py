"""Where staged media lives: one content-addressed location producers write and workers read.

An object's key is ``sha256/<hex>.<ext>`` under the staging URL: ``media.staging_url``, or
``{results_url}/media`` when that is empty. The URL is made absolute the way the result stores
make theirs (a ``file://`` folder resolved against the working directory), so a producer and a
worker started with the same settings name the same place without configuring it twice.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from vlmq.config.errors import ConfigError
from vlmq.config.settings import Settings

__all__ = ["DIGEST_FOLDER", "file_url_folder", "media_key", "split_s3_url", "staging_url"]

# The folder under the staging URL that names the digest, so another scheme could sit beside it.
DIGEST_FOLDER = "sha256"


def staging_url(settings: Settings) -> str:
    """The absolute staging URL (``s3://bucket/prefix`` or ``file:///dir``), no trailing '/'."""
    url = settings.media.staging_url or f"{settings.results_url.rstrip('/')}/media"
    scheme = urlparse(url).scheme
    if scheme == "file":
        return f"file://{file_url_folder(url)}"
    if scheme == "s3":
        split_s3_url(url)  # a bucket is required
        return url.rstrip("/")
    raise ConfigError(
        f"media staging URL must be s3://bucket/prefix or file:///dir, got {scheme!r}"
    )


def media_key(digest: str, ext: str) -> str:
    """The key, under the staging URL, of the media whose bytes have SHA-256 ``digest``."""
    return f"{DIGEST_FOLDER}/{digest}.{ext}"


def file_url_folder(url: str) -> Path:
    """The absolute folder of a ``file://`` URL (``file://./rel`` is relative to the working
    directory), as ``FileStore`` resolves its root."""
    parsed = urlparse(url)
    return Path((parsed.netloc or "") + parsed.path).resolve()


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix without surrounding '/')."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError("an S3 location must look like s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")
