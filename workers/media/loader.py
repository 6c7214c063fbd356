"""The media loader: fetch (with SSRF, size and time limits) and decode, through the cache
and the frame store.

Usage::

    loader = MediaLoader(settings.media, s3_client_factory=make_s3_client)
    image = loader.load_image("data:image/png;base64,...")
    video = loader.load_video("s3://bucket/clip.mp4", fps=2.0, max_frames=16)

Decoded media is kept in the loader's :class:`MediaCache` (content-addressed, a byte budget
from ``settings.cache_bytes``), so the same bytes are decoded once per worker.

Every failure is a ``config.errors`` media error with a fixed, client-safe
message; nothing here configures logging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, TypeVar, cast

from PIL import Image

from vlmq.config.errors import InvalidRequest
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.cache import MediaCache, Versions, content_key, version_key
from vlmq.workers.media.devpixels import DeviceFrames, DevicePhoto
from vlmq.workers.media.fetch import MediaFetcher, MediaKind
from vlmq.workers.media.image import Downscale, check_image_pixels, decode_image, to_rgb
from vlmq.workers.media.netpolicy import Resolver
from vlmq.workers.media.prepared.framecodec import PreparedMedia
from vlmq.workers.media.prepared.framestore import FrameScope, FrameStore, content_id
from vlmq.workers.media.prepared.pixels import Pixels
from vlmq.workers.media.s3_fetch import S3ClientFactory
from vlmq.workers.media.video import DecodedVideo, Sampling, decode_video, resolve_sampling

T = TypeVar("T")

__all__ = [
    "ImageDecoder",
    "LoadCounts",
    "MediaLoader",
    "VideoDecoder",
    "frames_bytes",
    "image_bytes",
    "video_bytes",
]


class LoadCounts(NamedTuple):
    cache_hits: int
    store_hits: int
    decodes: int


class ImageDecoder(Protocol):
    """A replacement image decoder (a device one): same call and result as ``decode_image``."""

    name: str

    def decode(
        self, data: bytes, settings: MediaSettings, downscale: Downscale | None
    ) -> Image.Image | DevicePhoto: ...


class VideoDecoder(Protocol):
    """A replacement video decoder (a device one): the sampled frames ``decode_video`` would
    give for ``plan``, as a ``DecodedVideo``."""

    name: str

    def decode(
        self, data: bytes, settings: MediaSettings, plan: Sampling, downscale: Downscale | None
    ) -> DecodedVideo: ...


def image_bytes(image: Image.Image | Pixels | DevicePhoto) -> int:
    if isinstance(image, Pixels | DevicePhoto):
        return image.nbytes
    return image.width * image.height * len(image.getbands())


def frames_bytes(frames: list[Image.Image] | Pixels | DeviceFrames) -> int:
    """What a video's frames hold, in bytes."""
    if isinstance(frames, Pixels | DeviceFrames):
        return frames.nbytes
    return sum(image_bytes(frame) for frame in frames)


def video_bytes(video: DecodedVideo) -> int:
    return frames_bytes(video.frames)


@dataclass(frozen=True)
class _Prepared:
    """What a load makes of its source beyond the bytes: the frame store's key parts."""

    sampling: Sampling | None  # None: an image
    resize: Downscale | None
    tenant: str | None
    decoder: str = "cpu"
    # A task a prepare worker prepares, or prepared: the store serves every kind of media
    # (``frame_store.kinds`` says which kinds a worker preparing for itself stores).
    every_kind: bool = False
    # False: what it decodes stays in device memory, so the store is neither read nor written.
    stored: bool = True


class MediaLoader:
    """Fetch + decode with one set of limits; safe to share between threads. With a
    :class:`FrameStore` (``frames``), prepared media is looked up fleet-wide before it is
    fetched or decoded, and stored once decoded (docs/design.md, frame store)."""

    def __init__(
        self,
        settings: MediaSettings,
        s3_client_factory: S3ClientFactory | None = None,
        resolver: Resolver | None = None,
        cache: MediaCache | None = None,
        frames: FrameStore | None = None,
        staging: str | None = None,
    ) -> None:
        self.settings = settings
        self.fetcher = MediaFetcher(settings, s3_client_factory, resolver)
        self.cache = cache if cache is not None else MediaCache(settings.cache_bytes)
        self.versions = Versions()
        self.frames = frames
        self.staging = staging  # the staging URL: staged sources are named by their digest
        self._local = threading.local()

    def thread_hits(self) -> int:
        """Cache hits of loads made on this thread so far (a request's share of them is
        the difference around its loads: its ``timings.media_cache_hits``)."""
        return int(getattr(self._local, "hits", 0))

    def thread_counts(self) -> LoadCounts:
        """This thread's loads so far: cache hits, frame store hits, decodes."""
        return LoadCounts(
            self.thread_hits(),
            int(getattr(self._local, "store_hits", 0)),
            int(getattr(self._local, "decodes", 0)),
        )

    def _cached(self, key: str, compute: Callable[[], T], size_of: Callable[[T], int]) -> T:
        value, hit = self.cache.get_or_compute(key, compute, size_of)
        self._count_hits(hit)
        return value

    def _count_hits(self, hits: int) -> None:
        self._local.hits = self.thread_hits() + hits

    def _count(self, name: str) -> None:
        setattr(self._local, name, int(getattr(self._local, name, 0)) + 1)

    def load_image(
        self,
        source: str | Image.Image,
        downscale: Downscale | None = None,
        tenant: str | None = None,
        decoder: ImageDecoder | None = None,
        prepared: bool = False,
    ) -> Image.Image | Pixels | DevicePhoto:
        """An RGB image from a source string, or an in-process PIL image; read back from the
        frame store, one frame of ``Pixels``. ``decoder`` (a device decoder) replaces the CPU
        one; its pixels are keyed apart. ``prepared``: the task goes through the prepare
        tier (the frame store holds its photos too)."""
        if isinstance(source, Image.Image):
            # Already decoded by a trusted caller; the pixel limit still holds.
            check_image_pixels(source.size, self.settings)
            return to_rgb(source)
        _require_str(source)
        name = decoder.name if decoder is not None else "cpu"
        decode = decoder.decode if decoder is not None else decode_image
        image: Image.Image | Pixels | DevicePhoto = self._load(
            source,
            "image",
            lambda data: decode(data, self.settings, downscale),
            image_bytes,
            _Prepared(None, downscale, tenant, name, prepared),
            *((downscale,) if name == "cpu" else (downscale, name)),
        )
        return image

    def load_video(
        self,
        source: str,
        fps: float | None = None,
        max_frames: int | None = None,
        downscale: Downscale | None = None,
        sampling: str | None = None,
        tenant: str | None = None,
        prepared: bool = False,
        decoder: VideoDecoder | None = None,
    ) -> DecodedVideo:
        """Frames sampled at ``fps`` (default ``settings.video_fps``), at most
        ``max_frames`` (never more than ``settings.video_max_frames``), ``sampling`` exact or
        keyframes (default ``settings.video_sampling``). ``decoder`` (a device decoder)
        replaces the CPU one; its frames are keyed apart and never stored."""
        _require_str(source)
        plan = resolve_sampling(self.settings, fps, max_frames, sampling)
        name = decoder.name if decoder is not None else "cpu"

        def decode(data: bytes) -> DecodedVideo:
            if decoder is not None:
                return decoder.decode(data, self.settings, plan, downscale)
            return decode_video(data, self.settings, fps, max_frames, downscale, sampling)

        params = (fps, max_frames, downscale) if plan.mode == "exact" else (plan, downscale)
        video: DecodedVideo = self._load(
            source,
            "video",
            decode,
            video_bytes,
            _Prepared(plan, downscale, tenant, name, prepared, stored=decoder is None),
            *(params if name == "cpu" else (*params, name)),
        )
        return video

    def _load(
        self,
        source: str,
        kind: MediaKind,
        decode: Callable[[bytes], T],
        size_of: Callable[[T], int],
        prepared: _Prepared,
        *params: object,
    ) -> T:
        """Fetch and decode through the cache: a remote source whose version tag is still
        current is served from it without a download; anything else by its bytes' hash.
        With the frame store: a source named without its bytes (staged, S3) is looked up
        before any download; any other once its bytes are in hand."""
        scope = None
        if prepared.stored:
            scope = self._frame_scope(kind, prepared.tenant, prepared.every_kind)
        if scope is not None:
            content = scope.id_before_fetch(source)
            if content is not None:
                key = self._frame_key(scope, content, prepared)
                # The worker's own cache stays shared by tenants, as for any other source;
                # only the fleet-wide store is kept per tenant.
                held = content_key(content.encode(), "named", kind, *params)
                return self._cached(
                    held, lambda: self._stored(scope, key, kind, decode, source), size_of
                )
        caching = self.cache.budget_bytes > 0
        known = self.versions.get(source) if caching else None
        data, tag = self.fetcher.fetch_versioned(source, kind, known)
        if data is None:  # not modified since ``known``
            assert known is not None
            cached = self.cache.peek(version_key(source, known, kind, *params))
            if cached is not None:
                self._count_hits(1)
                return cast(T, cached)
            data, tag = self.fetcher.fetch_versioned(source, kind)  # evicted: in full
            assert data is not None
        if tag is None:
            key = content_key(data, kind, *params)
        else:
            key = version_key(source, tag, kind, *params)
            if caching:
                self.versions.put(source, tag)
        body = data
        compute = partial(self._decoded, decode, body)
        if scope is not None:
            stored_key = self._frame_key(scope, content_id(source, body), prepared)
            compute = partial(self._stored, scope, stored_key, kind, decode, source, body)
        return self._cached(key, compute, size_of)

    def _frame_scope(
        self, kind: MediaKind, tenant: str | None, every_kind: bool = False
    ) -> FrameScope | None:
        """The frame store for this load, or None: off, not for this kind (unless
        ``every_kind``), or no tenant to key it by (and tenants do not share)."""
        store = self.frames
        if store is None or (kind not in store.settings.kinds and not every_kind):
            return None
        if tenant is None and not store.settings.share_across_tenants:
            return None
        return FrameScope(store, tenant, self.staging, partial(self.fetcher.s3_identity, kind=kind))

    def _frame_key(self, scope: FrameScope, content: str | None, prepared: _Prepared) -> str:
        assert content is not None  # bytes in hand always have an id
        return scope.key(content, prepared.sampling, prepared.resize, prepared.decoder)

    def _decoded(self, decode: Callable[[bytes], T], data: bytes) -> T:
        self._count("decodes")
        return decode(data)

    def _stored(
        self,
        scope: FrameScope,
        key: str,
        kind: MediaKind,
        decode: Callable[[bytes], T],
        source: str,
        data: bytes | None = None,
    ) -> T:
        """The prepared media from the frame store, or fetched (unless in hand), decoded and
        stored there."""
        held = scope.store.get(key)
        if held is not None and isinstance(held, DecodedVideo) == (kind == "video"):
            self._count("store_hits")
            return cast(T, held)
        if data is None:
            data = self.fetcher.fetch(source, kind)
        media = self._decoded(decode, data)
        # Device photos and frames stay in device memory: the store holds host pixels only.
        if scope.storable(source, data) and not _on_device(media):
            scope.store.put(key, cast(PreparedMedia, media))
        return media


def _on_device(media: object) -> bool:
    if isinstance(media, DecodedVideo):
        return isinstance(media.frames, DeviceFrames)
    return isinstance(media, DevicePhoto)


def _require_str(source: object) -> None:
    if not isinstance(source, str):
        raise InvalidRequest("media source must be a string")
