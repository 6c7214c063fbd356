"""The media a fleet worker may read: its configured allowlist plus the staging location.

Producers stage local files and ``data:`` URIs to one content-addressed location derived from
the settings (``config/staging.py``), so a worker started with the same settings reads it with
no setting of its own: a ``file://`` staging folder becomes one more local root; an S3 one is
allowed by bucket *and* prefix, never the whole bucket (the results beside it stay unreadable
as media). Every other guard is unchanged: a path outside the staging folder and outside
``local_roots`` is still refused, symlinks and '..' included.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from vlmq.config.settings import MediaSettings, Settings
from vlmq.config.staging import file_url_folder, staging_url
from vlmq.workers.media import MediaLoader
from vlmq.workers.media.prepared.framestore import open_frame_store

__all__ = ["fleet_loader", "fleet_media_settings", "fleet_s3_client"]


def fleet_media_settings(settings: Settings) -> MediaSettings:
    """``settings.media`` with the staging location added to its allowlist."""
    media = settings.media
    url = staging_url(settings)
    if url.startswith("file://"):
        roots = [*media.local_roots, str(file_url_folder(url))]
        return media.model_copy(update={"local_roots": roots})
    return media.model_copy(update={"allowed_s3_prefixes": [*media.allowed_s3_prefixes, url]})


def fleet_s3_client(endpoint_url: str | None, region: str) -> Any:
    """An S3 client for media on the fleet's own endpoint (where results and staged media
    live). Few attempts: the fetch has its own deadline and retries (``fetch_retries``)."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": 2},
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=32,
    )
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def fleet_loader(settings: Settings) -> MediaLoader:
    """The loader of a ``vlmq worker``: the fleet's allowlist, S3 on the fleet's endpoint
    (built on the first s3:// fetch), and the fleet's frame store (prepared media shared by
    every worker; ``media.frame_store``)."""
    factory = partial(fleet_s3_client, settings.s3_endpoint_url, settings.s3_region)
    media = fleet_media_settings(settings)
    frames = open_frame_store(
        media, settings.results_url, settings.s3_endpoint_url, settings.s3_region
    )
    return MediaLoader(
        media, s3_client_factory=factory, frames=frames, staging=staging_url(settings)
    )
