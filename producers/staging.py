"""Media staging: local media files and inline ``data:`` URIs uploaded once to a
content-addressed location every worker may read, and the request's references rewritten.

A worker on another machine cannot read the submitter's files, and a ``data:`` URI would sit
inside the queued Redis message for the whole wait. So before anything is enqueued a
producer uploads each such item to ``{staging_url}/sha256/<hex>.<ext>`` (``config/staging.py``)
and sends that URL instead; workers allow the staging location by themselves
(``workers/media/fleet.py``). The address is the content's hash, so an object is uploaded once
whoever references it: ``exists`` is asked first (a rerun or another job uploads nothing
again; an interrupted upload never becomes visible, so staging resumes), and within a process
a file is hashed once per (path, size, mtime) however many lines name it.

Local files are read only through ``producers/localfiles.py`` (a regular file, opened
non-blocking, never more than the byte cap), and only on a local user's say: a relative path
resolves against the input's folder and must stay inside it (``allow_outside_base`` lifts
that), and a file's first bytes must be an image or video format the workers accept.

Left as they are: remote sources (http(s), s3), files under ``media.local_roots`` (workers are
configured to read them in place), missing files (the fleet reports them per request, as
before), and every local path when the stager does not read local files (a server acting for
remote callers must never read its own disk on a request's say). Refused per request with
``InvalidRequest``: a file over the producer's size limit, one that is not a regular file,
not media, or outside the input's folder, and any local path of an input that is itself
remote (``remote_input``: it names no file here) unless workers read it in place; with
``StagingRefused``: a file no worker could read when staging is off or the store refused
the upload (its message names the settings that fix it).
"""

from __future__ import annotations

import hashlib
import logging
import mimetypes
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from vlmq.config.errors import (
    InvalidRequest,
    MediaDecodeFailed,
    MediaTooLarge,
    StagingRefused,
    VlmqError,
)
from vlmq.config.media_checks import decode_data_uri
from vlmq.config.schemas import Request
from vlmq.config.settings import Settings
from vlmq.config.staging import media_key, staging_url
from vlmq.producers.localfiles import LocalFile, file_info, open_local, resolve_local
from vlmq.stores.base import BlobWriter, ObjectStore
from vlmq.stores.urls import open_store

__all__ = ["MediaStager", "StagingProgress", "media_type"]

log = logging.getLogger(__name__)

_READ_BYTES = 1024 * 1024
_HEAD_BYTES = 64  # enough for every signature _sniff knows
# Files and objects remembered per process (a few hundred bytes each), and for how long.
_MEMO_ENTRIES = 65_536
_MEMO_TTL_S = 3600.0
# After the store refused an upload, later uploads fail at once for this long instead of each
# waiting out the store client's retries (a broken store refuses a 10M-line job quickly).
_REFUSAL_HOLD_S = 30.0
_PLAIN_EXT = re.compile(r"^[a-z0-9]{1,8}$")
_FIXES = (
    "set VLMQ_MEDIA__STAGING_URL to a store this machine can write and the workers can read "
    "(s3://bucket/prefix, or file:///dir on a shared disk), or add the file's folder to "
    "VLMQ_MEDIA__LOCAL_ROOTS (here and on every worker)"
)


@dataclass(frozen=True)
class StagingProgress:
    """What a stager has done so far (a snapshot)."""

    media: int = 0  # local file and data: references looked at
    uploaded: int = 0  # objects this stager uploaded
    already_stored: int = 0  # objects found in the store (an earlier line, job or run)
    in_place: int = 0  # references sent as they are (under local_roots, inline, missing)
    refused: int = 0  # references that failed their request
    bytes_uploaded: int = 0


@dataclass(frozen=True)
class _Media:
    """One local file or data: URI a request names. ``source`` is what the request carries
    when it is not staged (a relative path made absolute); ``path`` (resolved) is None for
    data: URIs and refusals; ``refused`` says why its request fails without reading it."""

    kind: str
    source: str
    path: str | None
    refused: str | None = None


class _Target:
    """The staging location inside a store: keys are relative to ``url``."""

    def __init__(self, store: ObjectStore, prefix: str, url: str) -> None:
        self.store, self.prefix, self.url = store, prefix, url

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def exists(self, key: str) -> bool:
        return self.store.exists(self._key(key))

    def writer(self, key: str, content_type: str) -> BlobWriter:
        return self.store.writer(self._key(key), content_type)

    def put_blob(self, key: str, data: bytes, content_type: str) -> None:
        self.store.put_blob(self._key(key), data, content_type)

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}"


class _Memo:
    """Values computed once per key at a time (single flight: concurrent callers wait for the
    first), the most recent ``size`` kept for ``ttl_s`` (a long-lived process notices an object
    a store's lifecycle rule removed). Failures are not kept: the next call tries again."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self._size, self._ttl_s = size, ttl_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[float, Future[str]]] = OrderedDict()

    def once(self, key: Hashable, compute: Callable[[], str]) -> str:
        future, waiting = self._claim(key)
        if waiting:
            return future.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                if self._entries.get(key, (0.0, None))[1] is future:
                    del self._entries[key]
            future.set_exception(exc)
            raise
        future.set_result(value)
        return value

    def _claim(self, key: Hashable) -> tuple[Future[str], bool]:
        """The key's future, and whether another caller computes (or computed) it."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            self._entries.pop(key, None)
            if entry is not None and entry[0] > now:
                self._entries[key] = entry  # now the most recent
                return entry[1], True
            future: Future[str] = Future()
            self._entries[key] = (now + self._ttl_s, future)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
            return future, False


class MediaStager:
    """Stages the local media and data: URIs of requests; see the module docstring.

    ``store``: the store the caller already holds (usually the results store); used when the
    staging location lies inside it, else a store is opened on the staging URL. ``local_files``
    False: local paths are left to the workers' own allowlist, never read (a server acting for
    remote callers). ``allow_outside_base``: a relative path may lead out of ``base_dir``
    (through ``..`` or a symlink); by default that request is refused. ``on_progress`` is
    called on the staging caller's thread after each item.
    """

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore | None = None,
        *,
        local_files: bool = True,
        allow_outside_base: bool = False,
        on_progress: Callable[[StagingProgress], None] | None = None,
    ) -> None:
        self.settings = settings
        self.media = settings.media
        self.url = staging_url(settings)
        self.local_files = local_files
        self.allow_outside_base = allow_outside_base
        self.on_progress = on_progress
        self._given_store = store
        self._target: _Target | None = None
        self._roots = [os.path.realpath(root) for root in self.media.local_roots if root]
        self._memo = _Memo(_MEMO_ENTRIES, _MEMO_TTL_S)
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._progress = StagingProgress()
        self._pool: ThreadPoolExecutor | None = None
        self._refused: tuple[float, StagingRefused] | None = None
        self._warned_inline = False

    # public ------------------------------------------------------------------
    @property
    def progress(self) -> StagingProgress:
        return self._progress

    def stage(
        self, request: Request, base_dir: Path | None = None, *, remote_input: bool = False
    ) -> Request:
        """``request`` with its local media and data: URIs staged (relative paths resolved
        against ``base_dir``, default the working directory, and kept inside it); raises
        InvalidRequest (or StagingRefused) naming the part when one cannot be."""
        outcome = self.stage_all([request], base_dir, remote_input=remote_input)[0]
        if isinstance(outcome, InvalidRequest):
            raise outcome
        return outcome

    def stage_all(
        self,
        requests: Sequence[Request],
        base_dir: Path | None = None,
        *,
        remote_input: bool = False,
    ) -> list[Request | InvalidRequest]:
        """Each request staged, or the error that fails it alone; the distinct media of all of
        them are staged together (in parallel on S3). ``remote_input``: the requests come from
        a file read from elsewhere (``vlmq submit s3://...``), so a local path in them names
        no file here: it is never read, and its request fails unless workers read it in place
        (under ``media.local_roots``)."""
        base = base_dir or Path.cwd()
        with_media = [r for r in requests if r.media_sources()]  # text needs nothing
        wanted = {
            media: None for r in with_media for *_, media in self._media_of(r, base, remote_input)
        }
        staged = self._stage_each(list(wanted))
        return [
            self._rewritten(r, base, staged, remote_input) if r.media_sources() else r
            for r in requests
        ]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> MediaStager:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # which parts ----------------------------------------------------------------
    def _media_of(
        self, request: Request, base: Path, remote_input: bool
    ) -> Iterator[tuple[int, int, _Media]]:
        """(message index, part index, media) of each part this stager handles."""
        for m, message in enumerate(request.messages):
            for p, part in enumerate(message.content):
                source = getattr(part, "source", None)
                media = self._classify(part.type, source, base, remote_input) if source else None
                if media is not None:
                    yield m, p, media

    def _classify(self, kind: str, source: str, base: Path, remote_input: bool) -> _Media | None:
        if source.startswith("data:"):
            return _Media(kind, source, None)
        if not self.local_files:
            return None  # never read here: the workers' own allowlist decides
        url = source.startswith("file:")
        if url:
            path = _file_url_path(source)
            if path is None:
                return None  # a file URL the workers refuse anyway: they report it
        elif "://" in source:
            return None  # remote: the workers fetch it under their own allowlist
        else:
            path = source
        if remote_input:
            return self._local_in_remote_input(kind, source, path)
        try:
            real = resolve_local(path, base, confine=not self.allow_outside_base)
        except InvalidRequest as exc:
            return _Media(kind, source, None, exc.message)
        # Sent as it is when not staged: a file URL as given, a path made absolute.
        return _Media(kind, source if url else real, real)

    def _local_in_remote_input(self, kind: str, source: str, path: str) -> _Media | None:
        """A local path named by a remote input: nothing is read; it goes as it is when the
        workers read it in place (absolute, under ``media.local_roots``), else it fails."""
        absolute = os.path.isabs(path) and "\x00" not in path
        if absolute and self._readable_in_place(os.path.normpath(path)):
            return None
        return _Media(
            kind,
            source,
            None,
            f"local media path {_short(source)} in an input read from elsewhere is not read: "
            "it names no file on this machine; name the media by an s3:// or https:// URL or "
            "a data: URI, or by an absolute path under VLMQ_MEDIA__LOCAL_ROOTS (the workers "
            "read those in place)",
        )

    def _rewritten(
        self,
        request: Request,
        base: Path,
        staged: dict[_Media, str | InvalidRequest],
        remote_input: bool,
    ) -> Request | InvalidRequest:
        sources: dict[tuple[int, int], str] = {}
        for m, p, media in self._media_of(request, base, remote_input):
            outcome = staged[media]
            self._count(media=1)
            if isinstance(outcome, InvalidRequest):
                self._count(refused=1)
                return type(outcome)(outcome.message, field=f"messages.{m}.content.{p}")
            sources[(m, p)] = outcome
        return _with_sources(request, sources) if sources else request

    # staging ---------------------------------------------------------------------
    def _stage_each(self, items: list[_Media]) -> dict[_Media, str | InvalidRequest]:
        """Every item's staged source or error, in parallel where the store gains from it."""
        results: dict[_Media, str | InvalidRequest] = {}
        if len(items) > 1 and self._parallel():
            pool = self._executor()
            futures = {pool.submit(self._stage_one, item): item for item in items}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                self._report()
            return results
        for item in items:
            results[item] = self._stage_one(item)
            self._report()
        return results

    def _stage_one(self, media: _Media) -> str | InvalidRequest:
        try:
            if media.refused is not None:
                raise InvalidRequest(media.refused)
            if media.path is None:
                return self._stage_inline(media)
            return self._stage_file(media, media.path)
        except InvalidRequest as exc:
            return exc

    def _stage_file(self, media: _Media, real: str) -> str:
        """``real``: the resolved path (producers/localfiles.py ``resolve_local``)."""
        try:
            info = file_info(real, None)  # stat only: a FIFO or device is never opened
        except VlmqError as exc:
            raise InvalidRequest(exc.message) from None
        if info is None:
            self._count(in_place=1)
            return media.source  # missing: the fleet fails that request alone, as before
        self._check_size(info.st_size, media.kind)
        if self._readable_in_place(real):
            self._count(in_place=1)
            return media.source
        if not self.media.staging:
            raise StagingRefused(
                f"local media file {_short(real)} is outside VLMQ_MEDIA__LOCAL_ROOTS and media "
                "staging is off: set VLMQ_MEDIA__STAGING=true to upload it, or add its folder "
                "to VLMQ_MEDIA__LOCAL_ROOTS (here and on every worker)"
            )
        key = ("file", real, info.st_size, info.st_mtime_ns)
        url = self._memo.once(key, lambda: self._upload_file(real, media.kind))
        self._accepted_type(url.rsplit(".", 1)[-1], media.kind)  # memoised under another kind
        return url

    def _upload_file(self, path: str, kind: str) -> str:
        cap = self._cap(kind)
        # The type first, from the first bytes: what is not media is refused unhashed.
        ext, content_type = self._accepted_type(_sniffed_ext(_read_head(path, cap)), kind)
        digest, head = _hash_file(path, cap)
        if _sniffed_ext(head) != ext:
            raise InvalidRequest("media file changed while it was staged; submit it again")
        key = media_key(digest, ext)
        return self._memo.once(
            ("object", key), lambda: self._store_file(key, path, digest, content_type, cap)
        )

    def _accepted_type(self, ext: str | None, kind: str) -> tuple[str, str]:
        """(extension, content type) of a file whose first bytes said ``ext`` (``_sniff``);
        InvalidRequest unless the workers decode that format for ``kind`` (the media
        settings' ``image_formats`` / ``video_formats``)."""
        decoders = _DECODERS.get(ext or "")
        if kind == "video":
            allowed = list(self.media.video_formats)
            demuxer = decoders[1] if decoders else None
            ok = demuxer is not None and any(demuxer in f.split(",") for f in allowed)
        else:
            allowed = list(self.media.image_formats)
            image_format = decoders[0] if decoders else None
            ok = image_format is not None and image_format in {f.upper() for f in allowed}
        if not ok:
            what = f"{ext} data" if ext else "no image or video format the workers know"
            raise InvalidRequest(
                f"media file is not {'a video' if kind == 'video' else 'an image'} in a format "
                f"the workers accept ({'; '.join(allowed)}): its first bytes are {what}"
            )
        return ext or "", _CONTENT_TYPES[ext or ""]

    def _store_file(self, key: str, path: str, digest: str, content_type: str, cap: int) -> str:
        def upload(target: _Target) -> int:
            with target.writer(key, content_type) as out:
                return _copy_verified(path, digest, out, cap)

        return self._store(key, upload)

    def _stage_inline(self, media: _Media) -> str:
        if not self.media.staging:
            self._count(in_place=1)
            return media.source
        decoded = _decode_data_uri(media.source, self._cap(media.kind), _limit_name(media.kind))
        if decoded is None:
            self._count(in_place=1)
            return media.source  # malformed: the worker reports exactly what is wrong
        declared, data = decoded
        ext, content_type = media_type(data[:64], declared)
        key = media_key(hashlib.sha256(data).hexdigest(), ext)

        def upload(target: _Target) -> int:
            target.put_blob(key, data, content_type)
            return len(data)

        try:
            return self._memo.once(("object", key), lambda: self._store(key, upload))
        except StagingRefused:
            self._warn_inline()
            self._count(in_place=1)
            return media.source  # the workers can still read it from the message

    def _store(self, key: str, upload: Callable[[_Target], int]) -> str:
        """The URL of ``key``, uploading it unless the store has it already."""
        refused = self._refused
        if refused is not None and time.monotonic() < refused[0]:
            raise StagingRefused(refused[1].message)
        try:
            target = self._staging_target()
            if target.exists(key):
                self._count(already_stored=1)
                return target.url_of(key)
            size = upload(target)
        except InvalidRequest:
            raise
        except Exception as exc:  # store backends raise their own client errors too
            refusal = StagingRefused(
                f"media could not be staged to {self.url}: the store did not accept it; {_FIXES}"
            )
            self._refused = (time.monotonic() + _REFUSAL_HOLD_S, refusal)
            raise refusal from exc
        self._count(uploaded=1, bytes_uploaded=size)
        return target.url_of(key)

    # helpers -----------------------------------------------------------------------
    def _staging_target(self) -> _Target:
        with self._open_lock:  # staging threads ask at once; open one store
            if self._target is None:
                self._target = self._open_target()
            return self._target

    def _open_target(self) -> _Target:
        given = self._given_store
        if given is not None:
            root = given.url.rstrip("/")
            if self.url == root or self.url.startswith(root + "/"):
                return _Target(given, self.url[len(root) :].strip("/"), self.url)
        s = self.settings
        return _Target(open_store(self.url, s.s3_endpoint_url, s.s3_region), "", self.url)

    def _parallel(self) -> bool:
        if not self.media.staging:
            return False
        try:
            return self._staging_target().store.parallel_uploads
        except Exception:  # opening failed: each item reports the refusal itself
            return False

    def _executor(self) -> ThreadPoolExecutor:
        with self._open_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.media.staging_threads, thread_name_prefix="vlmq-stage"
                )
            return self._pool

    def _readable_in_place(self, real: str) -> bool:
        return any(os.path.commonpath([real, root]) == root for root in self._roots)

    def _cap(self, kind: str) -> int:
        return self.media.max_video_bytes if kind == "video" else self.media.max_image_bytes

    def _check_size(self, size: int, kind: str) -> None:
        cap = self._cap(kind)
        if size > cap:
            raise InvalidRequest(
                f"{kind} is {size} bytes, over the limit of {cap} ({_limit_name(kind)})"
            )

    def _count(self, **deltas: int) -> None:
        with self._lock:
            now = self._progress
            self._progress = replace(
                now, **{name: getattr(now, name) + delta for name, delta in deltas.items()}
            )

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self._progress)

    def _warn_inline(self) -> None:
        if not self._warned_inline:
            self._warned_inline = True
            log.warning("media staging store refused an upload; data: URIs are sent inline")


def _with_sources(request: Request, sources: dict[tuple[int, int], str]) -> Request:
    messages = [
        message.model_copy(
            update={
                "content": [
                    _with_source(part, sources.get((m, p)))
                    for p, part in enumerate(message.content)
                ]
            }
        )
        for m, message in enumerate(request.messages)
    ]
    return request.model_copy(update={"messages": messages})


def _with_source(part: Any, source: str | None) -> Any:
    if source is None or source == part.source:
        return part
    return part.model_copy(update={"source": source})


def _file_url_path(url: str) -> str | None:
    """The local path of a file:// URL; None for one the workers refuse anyway (a remote
    host, a query), which is then left for them to report."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme != "file" or parts.netloc not in ("", "localhost") or parts.query:
        return None
    path = unquote(parts.path)
    return path if os.path.isabs(path) and "\x00" not in path else None


def _local(path: str, cap: int) -> LocalFile:
    """The file open through producers/localfiles.py (a regular file, at most ``cap`` bytes);
    its errors fail the request alone."""
    try:
        return open_local(path, cap)
    except VlmqError as exc:
        raise InvalidRequest(exc.message) from None


def _chunks(file: LocalFile) -> Iterator[bytes]:
    """The file's bytes; InvalidRequest when they are not as many as it claimed (it changed,
    or it is not a file on disk) or pass the cap."""
    size = 0
    try:
        while chunk := file.read(_READ_BYTES):
            size += len(chunk)
            yield chunk
    except VlmqError as exc:
        raise InvalidRequest(exc.message) from None
    except OSError:
        raise InvalidRequest("media file could not be read") from None
    if size != file.size:
        raise InvalidRequest("media file changed while it was staged; submit it again")


def _read_head(path: str, cap: int) -> bytes:
    with _local(path, cap) as file:
        try:
            return file.read(_HEAD_BYTES) or b""
        except (VlmqError, OSError):
            raise InvalidRequest("media file could not be read") from None


def _hash_file(path: str, cap: int) -> tuple[str, bytes]:
    """The file's SHA-256 and its first bytes (for its type), reading at most ``cap``."""
    digest = hashlib.sha256()
    head = b""
    with _local(path, cap) as file:
        for chunk in _chunks(file):
            head = head or chunk[:_HEAD_BYTES]
            digest.update(chunk)
    return digest.hexdigest(), head


def _copy_verified(path: str, digest: str, out: BlobWriter, cap: int) -> int:
    """Copy the file into ``out``, hashing again: a file that changed since it was hashed is
    refused (raising aborts the writer), so an object always holds what its name says."""
    check = hashlib.sha256()
    size = 0
    with _local(path, cap) as file:
        for chunk in _chunks(file):
            check.update(chunk)
            out.write(chunk)
            size += len(chunk)
    if check.hexdigest() != digest:
        raise InvalidRequest("media file changed while it was staged; submit it again")
    return size


def _limit_name(kind: str) -> str:
    return f"VLMQ_MEDIA__MAX_{kind.upper()}_BYTES"


def _decode_data_uri(uri: str, cap: int, limit: str) -> tuple[str, bytes] | None:
    """(declared type, bytes) of a base64 data: URI (config/media_checks.py, the worker's
    rules); None when it is malformed (it goes as it is, and fails alone at the worker)."""
    try:
        return decode_data_uri(uri, cap)
    except MediaTooLarge:
        raise InvalidRequest(f"inline media is over the limit of {cap} bytes ({limit})") from None
    except (InvalidRequest, MediaDecodeFailed):
        return None


def media_type(head: bytes, declared: str) -> tuple[str, str]:
    """(extension, content type) of media from its first bytes, else from what was declared
    (a file suffix like ``.png`` or a MIME type like ``image/png``)."""
    detected = _sniff(head)
    if detected is not None:
        return detected
    if "/" in declared:
        ext = mimetypes.guess_extension(declared) or ""
        content_type = declared
    else:
        ext = declared
        content_type = mimetypes.types_map.get(declared.lower(), "application/octet-stream")
    ext = ext.lstrip(".").lower().replace("jpeg", "jpg")
    if not _PLAIN_EXT.match(ext):
        return "bin", "application/octet-stream"
    return ext, content_type


# What each signature _sniff knows is to the workers: (Pillow's format name for an image,
# PyAV's demuxer name for a video); the media settings say which of them they accept.
_DECODERS: dict[str, tuple[str | None, str | None]] = {
    "png": ("PNG", None),
    "jpg": ("JPEG", None),
    "gif": ("GIF", "gif"),
    "webp": ("WEBP", None),
    "bmp": ("BMP", None),
    "tif": ("TIFF", None),
    "mp4": (None, "mp4"),
    "mov": (None, "mov"),
    "mkv": (None, "matroska"),
    "avi": (None, "avi"),
}
_CONTENT_TYPES = {
    "png": "image/png",
    "jpg": "image/jpeg",
    "gif": "image/gif",
    "webp": "image/webp",
    "bmp": "image/bmp",
    "tif": "image/tiff",
    "mp4": "video/mp4",
    "mov": "video/quicktime",
    "mkv": "video/x-matroska",
    "avi": "video/x-msvideo",
    "": "application/octet-stream",
}
# QuickTime files may open with another top-level atom than ftyp.
_QUICKTIME_ATOMS = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")


def _sniffed_ext(head: bytes) -> str | None:
    detected = _sniff(head)
    return detected[0] if detected else None


def _sniff(head: bytes) -> tuple[str, str] | None:
    """The type of the formats workers decode, by their signatures."""
    ext = _signature(head)
    return (ext, _CONTENT_TYPES[ext]) if ext else None


def _signature(head: bytes) -> str | None:
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[4:8] == b"ftyp":
        return "mov" if head[8:12] == b"qt  " else "mp4"
    if head[4:8] in _QUICKTIME_ATOMS:
        return "mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "mkv"
    if head[:2] == b"BM" and len(head) >= 26 and head[6:10] == b"\0\0\0\0":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tif"
    return None


def _short(path: str, limit: int = 120) -> str:
    return repr(path if len(path) <= limit else "..." + path[-limit:])
