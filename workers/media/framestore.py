"""The fleet-wide frame store: prepared media, content-addressed in the object store.

A clip decoded, sampled and resized to the model processor's target once is stored (the
results store's abstraction: ``file://`` on the embedded default, any S3-compatible store),
and every later request on the same media, on any worker, reads it back instead of fetching
and decoding the source again.

* **Key** (``key_for``): the source's content id (``content_id``), the sampling (fps, frame
  cap, exact or keyframes), the resize target (the processor's, ``visual_downscale``), the
  decoder (``cpu``: Pillow + FFmpeg, whose versions are in the key too, since a new resampler
  may change pixels) and the format version, hashed; under the tenant's folder, or a shared
  one when ``share_across_tenants`` is on.
* **Objects** (``framecodec``): lossless, checksummed; a corrupt or unreadable one reads as a
  miss (logged), so the caller decodes again and its ``put`` replaces the bad object. An
  object is read back without a copy where the store can (a ``file://`` store maps it), and
  its frames are decompressed into reused memory (``BufferPool``, ``read_buffer_bytes``).
* **Lifecycle**: objects are immutable and never needed (a missing one is a miss), so any
  expiry rule is safe: on S3 a lifecycle rule on the prefix (e.g. 7 days, as task status);
  on ``file://`` delete the folder's old files at will.

Torch-free: prepare workers run without a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import av
import PIL

from vlmq.config.errors import ConfigError, StoreUnavailable
from vlmq.config.results import ResultStore, open_store
from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.config.staging import DIGEST_FOLDER, file_url_folder
from vlmq.workers.media.buffers import BufferPool
from vlmq.workers.media.decode import Downscale, Sampling
from vlmq.workers.media.framecodec import (
    CorruptObject,
    PreparedMedia,
    decode_object,
    encode_object,
    missing_package,
    resolve_codec,
)

__all__ = [
    "FORMAT_VERSION",
    "FrameScope",
    "FrameStore",
    "content_id",
    "open_frame_store",
    "staged_digest",
]

log = logging.getLogger(__name__)

# Bumped whenever what a key names could change meaning (the object layout, the decode steps).
FORMAT_VERSION = 2
SHARED_SCOPE = "_shared"
_DIGEST_RE = re.compile(r"^([0-9a-f]{64})\.[A-Za-z0-9]{1,10}$")
# What decodes the pixels: a new Pillow or FFmpeg may resample differently.
DECODERS = f"pillow-{PIL.__version__}+av-{av.__version__}"


# --- content ids ----------------------------------------------------------------------------


def staged_digest(source: str, staging: str | None) -> str | None:
    """The SHA-256 a staged media URL carries in its key (``{staging}/sha256/<hex>.<ext>``),
    or None for any other source. A ``file://`` staging folder also matches its plain path."""
    if not staging:
        return None
    for prefix in _staged_prefixes(staging):
        if source.startswith(prefix):
            match = _DIGEST_RE.match(source[len(prefix) :])
            return match.group(1) if match else None
    return None


@lru_cache(maxsize=16)
def _staged_prefixes(staging: str) -> tuple[str, ...]:
    """What a staged URL under ``staging`` starts with. Kept: resolving a ``file://`` folder
    walks its path with a system call per part (~0.5 ms of a GPU worker's CPU per photo,
    measured), and a worker's staging URL and working directory do not change."""
    prefixes = [f"{staging.rstrip('/')}/{DIGEST_FOLDER}/"]
    if staging.startswith("file://"):
        prefixes.append(f"{file_url_folder(staging)}/{DIGEST_FOLDER}/")
    return tuple(prefixes)


def content_id(
    source: str,
    data: bytes | None = None,
    staging: str | None = None,
    s3_head: Callable[[str], tuple[str, int]] | None = None,
) -> str | None:
    """What identifies a source's bytes, the cheapest way known, or None when nothing does:

    * a staged URL: the digest in its key (no I/O; the producer hashed the bytes);
    * bytes in hand: their SHA-256 (so a staged copy and the same file elsewhere match);
    * ``s3://``: the object's location, ETag and size from a HEAD (``s3_head``), without a
      download. The location is part of it: an ETag is an MD5 (collisions can be made) or,
      for a multipart upload, depends on the part size, so alone it names no content.
    """
    digest = staged_digest(source, staging)
    if digest is not None:
        return f"sha256:{digest}"
    if data is not None:
        return f"sha256:{hashlib.sha256(data).hexdigest()}"
    if s3_head is not None and source.startswith("s3://"):
        etag, size = s3_head(source)
        return f"s3:{source}@{etag}:{size}"
    return None


# --- keys -------------------------------------------------------------------------------


def _resize_of(resize: Downscale | None) -> dict[str, Any] | None:
    if resize is None:
        return None
    return {"max_pixels": resize.max_pixels, "cover": list(resize.cover) if resize.cover else None}


def _sampling_of(sampling: Sampling | None) -> dict[str, Any] | None:
    if sampling is None:
        return None
    return {"fps": sampling.fps, "max_frames": sampling.max_frames, "mode": sampling.mode}


# --- the store ------------------------------------------------------------------------------


class FrameStore:
    """``key_for`` / ``get`` / ``put`` / ``has`` over a :class:`ResultStore`. Safe to share
    between threads (the stores are)."""

    def __init__(
        self, store: ResultStore, settings: FrameStoreSettings, media: MediaSettings
    ) -> None:
        self.codec = resolve_codec(settings.codec)
        missing = missing_package(self.codec)
        if missing is not None:
            raise ConfigError(f"frame store codec {self.codec} needs the {missing} package")
        self.store = store
        self.settings = settings
        self.media = media
        self.buffers = BufferPool(settings.read_buffer_bytes)

    def key_for(
        self,
        content: str,
        sampling: Sampling | None,
        resize: Downscale | None,
        tenant: str | None,
        decoder: str = "cpu",
    ) -> str:
        """Where the prepared media of ``content`` with this sampling (None: an image) and
        resize target live. Everything that changes the pixels is in the key."""
        named = {
            "v": FORMAT_VERSION,
            "content": content,
            "sampling": _sampling_of(sampling),
            "resize": _resize_of(resize),
            "decoder": f"{decoder}:{DECODERS}",
        }
        digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()
        scope = self.scope_of(tenant)
        kind = "image" if sampling is None else "video"
        return f"{scope}/{kind}/{digest[:2]}/{digest}.vfr"

    def scope_of(self, tenant: str | None) -> str:
        if self.settings.share_across_tenants:
            return SHARED_SCOPE
        if not tenant or tenant == SHARED_SCOPE:
            raise ValueError("a per-tenant frame store key needs a tenant")
        return tenant

    def has(self, key: str) -> bool:
        """Whether an object is there (a HEAD; not verified)."""
        try:
            return self.store.size(key) is not None
        except StoreUnavailable:
            return False

    def get(self, key: str) -> PreparedMedia | None:
        """The verified prepared media under ``key``, or None: missing, unreadable, too large
        or corrupt (logged; the caller prepares it again and its ``put`` replaces it)."""
        try:
            size = self.store.size(key)
            if size is None:
                return None
            if size > self.settings.max_object_bytes:
                log.warning("frame store object %s is too large (%d bytes): ignored", key, size)
                return None
            data = self.store.get_blob_view(key)
        except (StoreUnavailable, ConfigError, OSError):
            log.warning("frame store object %s could not be read: preparing again", key)
            return None
        if data is None:
            return None
        if len(data) > self.settings.max_object_bytes:  # replaced by a larger one meanwhile
            log.warning("frame store object %s grew past max_object_bytes: ignored", key)
            return None
        return self._decoded(key, data)

    def _decoded(self, key: str, data: bytes | memoryview) -> PreparedMedia | None:
        max_pixels = max(self.media.max_image_pixels, self.media.video_max_pixels_per_frame)
        frames = self.buffers.array
        try:
            return decode_object(data, max_pixels, self.media.video_max_frames, key, frames)
        except CorruptObject as exc:
            log.warning("frame store object %s is corrupt (%s): preparing again", key, exc)
            return None

    def put(self, key: str, media: PreparedMedia) -> bool:
        """Store prepared media; False (logged) when the store refused it or it is too large:
        the store only ever saves work, so a failed write fails nothing."""
        try:
            params = {"level": self.settings.zstd_level} if self.codec == "zstd" else {}
            data = encode_object(media, self.codec, **params)
        except ValueError as exc:  # not RGB, or frames of several sizes (a resolution change)
            log.info("frame store object %s not written: %s", key, exc)
            return False
        if len(data) > self.settings.max_object_bytes:
            return False
        try:
            self.store.put_blob(key, data)
        except (StoreUnavailable, ConfigError, OSError):
            log.warning("frame store object %s could not be written", key)
            return False
        return True


def open_frame_store(
    settings: MediaSettings,
    results_url: str,
    endpoint_url: str | None = None,
    region: str = "us-east-1",
) -> FrameStore | None:
    """The frame store ``settings.frame_store`` names (default ``{results_url}/frames``), or
    None when it is off."""
    frames = settings.frame_store
    if not frames.enabled or not frames.kinds:
        return None
    url = frames.url or f"{results_url.rstrip('/')}/frames"
    return FrameStore(open_store(url, endpoint_url, region), frames, settings)


# --- one lookup ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FrameScope:
    """The frame store as one load sees it: the store, the tenant, what identifies sources
    without fetching them (the staging URL, an S3 HEAD)."""

    store: FrameStore
    tenant: str | None
    staging: str | None = None
    s3_head: Callable[[str], tuple[str, int]] | None = None

    def id_before_fetch(self, source: str) -> str | None:
        """The content id of a staged URL (free) or an S3 object (a HEAD), else None."""
        return content_id(source, staging=self.staging, s3_head=self.s3_head)

    def key(
        self, content: str, sampling: Sampling | None, resize: Downscale | None, decoder: str
    ) -> str:
        return self.store.key_for(content, sampling, resize, self.tenant, decoder)

    def storable(self, source: str, data: bytes) -> bool:
        """Bytes that may be stored under their source's id: a staged object must hash to
        the digest its key names (one that does not was altered after staging)."""
        digest = staged_digest(source, self.staging)
        if digest is None or hashlib.sha256(data).hexdigest() == digest:
            return True
        log.warning("staged media %s does not match its digest: not stored", source)
        return False
