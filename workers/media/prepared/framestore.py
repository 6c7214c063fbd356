"""The fleet-wide frame store: prepared media, content-addressed in the object store.

A clip decoded, sampled and resized to the model processor's target once is stored (the
results store's abstraction, in a location of its own: ``file://`` on the embedded default,
any S3-compatible store), and every later request on the same media, on any worker, reads it
back instead of fetching and decoding the source again.

* **Key** (``key_for``): the source's content id (``content_id``), the sampling (fps, frame
  cap, exact or keyframes), the resize target (the processor's, ``visual_downscale``), the
  decoder (``cpu``: Pillow + FFmpeg, whose versions are in the key too, since a new resampler
  may change pixels) and the format version, hashed; under the tenant's folder, or a shared
  one when ``share_across_tenants`` is on.
* **Objects** (``framecodec``): lossless, checksummed; a corrupt or unreadable one reads as a
  miss (logged), so the caller decodes again and its ``put`` replaces the bad object. An
  object is read into reused memory (``BufferPool``, ``read_buffer_bytes``), never mapped:
  nothing stays open once it is read, and a file rewritten or truncated later changes
  nothing a worker holds. A raw object's frames are then used where they were read.
* **Lifecycle**: objects are immutable and never needed (a missing one is a miss). The store
  keeps under its budget by deleting the least recently used (``framebudget``), and a store
  that fails is left alone for a pause (``_Pause``): the caller prepares the media itself
  meanwhile, so a full or failing store costs time, never a task.

Torch-free: prepare workers run without a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

import av
import PIL

from vlmq.config.errors import ConfigError, StoreUnavailable
from vlmq.config.settings import FrameStoreSettings, MediaSettings
from vlmq.config.staging import DIGEST_FOLDER, file_url_folder
from vlmq.stores.base import ObjectInfo, ObjectStore
from vlmq.stores.urls import open_store
from vlmq.workers.media.image import Downscale
from vlmq.workers.media.prepared.buffers import BufferPool
from vlmq.workers.media.prepared.framebudget import FrameBudget
from vlmq.workers.media.prepared.framecodec import (
    CorruptObject,
    PreparedMedia,
    decode_object,
    encode_object,
    missing_package,
    resolve_codec,
)
from vlmq.workers.media.video import Sampling

__all__ = [
    "FORMAT_VERSION",
    "FrameScope",
    "FrameStore",
    "content_id",
    "frame_store_url",
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


class _TooLarge(Exception):
    """An object past ``max_object_bytes`` (its size, or what its read found)."""


class _Pause:
    """After a store error, the store is left alone for a pause that doubles while it keeps
    failing (``FIRST_S`` to ``LONGEST_S``): a store that is down or full must not add its
    timeouts and retries to every load; the media is prepared in place meanwhile."""

    FIRST_S = 1.0
    LONGEST_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._pause = 0.0
        self._until = float("-inf")

    def open(self) -> bool:
        return self._clock() >= self._until

    def failed(self) -> None:
        with self._lock:
            self._pause = min(max(self._pause * 2, self.FIRST_S), self.LONGEST_S)
            self._until = self._clock() + self._pause

    def worked(self) -> None:
        if self._pause:
            with self._lock:
                self._pause = 0.0


class FrameStore:
    """``key_for`` / ``get`` / ``put`` / ``has`` over a :class:`ObjectStore`. Safe to share
    between threads (the stores are)."""

    def __init__(
        self,
        store: ObjectStore,
        settings: FrameStoreSettings,
        media: MediaSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.codec = resolve_codec(settings.codec)
        missing = missing_package(self.codec)
        if missing is not None:
            raise ConfigError(f"frame store codec {self.codec} needs the {missing} package")
        self.store = store
        self.settings = settings
        self.media = media
        self.buffers = BufferPool(settings.read_buffer_bytes)
        self.budget = FrameBudget(store, settings.max_bytes, settings.min_free_bytes)
        self._reads, self._writes = _Pause(clock), _Pause(clock)

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
        if not self._reads.open():
            return False
        try:
            return self.store.size(key) is not None
        except StoreUnavailable:
            self._reads.failed()
            return False

    def get(self, key: str) -> PreparedMedia | None:
        """The verified prepared media under ``key``, or None: missing, unreadable, too large
        or corrupt (logged; the caller prepares it again and its ``put`` replaces it), or the
        store paused after a failure."""
        if not self._reads.open():
            return None
        read = self._read(key)
        if read is None:
            return None
        info, data = read
        media = self._decoded(key, data)
        if media is not None:
            self.budget.used(info)
        return media

    def _read(self, key: str) -> tuple[ObjectInfo, bytes | memoryview] | None:
        """The object's size and age and its bytes, or None: missing, too large (logged),
        or unreadable (logged; reads pause)."""
        try:
            info = self.store.info(key)
            data = None if info is None else self._read_bytes(key, info)
        except _TooLarge as exc:
            log.warning("frame store object %s is too large (%s bytes): ignored", key, exc)
            return None
        except (StoreUnavailable, ConfigError, OSError):
            self._reads.failed()
            log.warning("frame store object %s could not be read: preparing again", key)
            return None
        self._reads.worked()
        return None if info is None or data is None else (info, data)

    def _read_bytes(self, key: str, info: ObjectInfo) -> bytes | memoryview | None:
        self._check_size(info.size)
        data = self.store.read_blob(key, self._allocate)
        if data is not None:  # it may have been replaced by a larger one since
            self._check_size(len(data))
        return data

    def _check_size(self, size: int) -> None:
        if size > self.settings.max_object_bytes:
            raise _TooLarge(size)

    def _allocate(self, size: int) -> memoryview:
        """Reused memory for an object's bytes (a raw object's frames stay in it)."""
        self._check_size(size)
        return self.buffers.array((size,)).data

    def _decoded(self, key: str, data: bytes | memoryview) -> PreparedMedia | None:
        max_pixels = max(self.media.max_image_pixels, self.media.video_max_pixels_per_frame)
        frames = self.buffers.array
        try:
            return decode_object(data, max_pixels, self.media.video_max_frames, key, frames)
        except CorruptObject as exc:
            log.warning("frame store object %s is corrupt (%s): preparing again", key, exc)
            return None

    def put(self, key: str, media: PreparedMedia) -> bool:
        """Store prepared media; False (logged) when the store refused it, is paused after a
        failure, has no room in its budget, or it is too large: the store only ever saves
        work, so a failed write fails nothing."""
        if not self._writes.open():
            return False
        try:
            params = {"level": self.settings.zstd_level} if self.codec == "zstd" else {}
            data = encode_object(media, self.codec, **params)
        except ValueError as exc:  # not RGB, or frames of several sizes (a resolution change)
            log.info("frame store object %s not written: %s", key, exc)
            return False
        if len(data) > self.settings.max_object_bytes:
            return False
        if not self.budget.admit(len(data)):
            log.info("frame store object %s not written: no room in the budget", key)
            return False
        try:
            self.store.put_blob(key, data)
        except (StoreUnavailable, ConfigError, OSError):
            self._writes.failed()
            log.warning("frame store object %s could not be written", key)
            return False
        self._writes.worked()
        self.budget.added(len(data))
        return True


def frame_store_url(settings: FrameStoreSettings, results_url: str) -> str:
    """Where the frame store lives: ``settings.url``, or by default beside the results store
    (never inside it), a folder named ``frames``: ``file://./.vlmq/frames`` beside
    ``file://./.vlmq/results``, ``s3://bucket/frames`` beside ``s3://bucket/results``. A
    results store that is a whole bucket or a root folder has nothing beside it: the URL
    must then be set."""
    if settings.url:
        return settings.url
    parsed = urlparse(results_url.rstrip("/"))
    path = PurePosixPath(parsed.path or "/")
    if path.name in ("", ".", ".."):
        raise ConfigError(
            "the results store is a whole bucket or folder root: set "
            "VLMQ_MEDIA__FRAME_STORE__URL (the frame store never shares the results' location)"
        )
    name = "frames" if path.name != "frames" else "frames-prepared"
    return parsed._replace(path=str(path.parent / name)).geturl()


def open_frame_store(
    settings: MediaSettings,
    results_url: str,
    endpoint_url: str | None = None,
    region: str = "us-east-1",
) -> FrameStore | None:
    """The frame store ``settings.frame_store`` names (default: ``frame_store_url``), or
    None when it is off."""
    frames = settings.frame_store
    if not frames.enabled or not frames.kinds:
        return None
    url = frame_store_url(frames, results_url)
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
