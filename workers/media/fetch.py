"""Fetch the raw bytes of one media item from a client-supplied source.

Sources: ``data:`` base64 URIs, absolute local paths and ``file://`` URLs
(only under ``local_roots``), ``http(s)://`` (only allowlisted hosts with
public addresses) and ``s3://bucket/key`` (only allowlisted buckets). Every
limit comes from :class:`MediaSettings`; every failure is a
:class:`config.errors.MediaError` (or ``InvalidRequest`` /
``MediaFetchTransient``) with a short message that never echoes exception
text.
"""

from __future__ import annotations

import errno
import os
import re
import ssl
import stat
from typing import Literal
from urllib.parse import unquote, urlsplit

from vlmq.config.errors import (
    InvalidRequest,
    MediaFetchFailed,
    MediaForbidden,
    MediaTooLarge,
)
from vlmq.config.media_checks import check_path_name, decode_data_uri
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.deadline import Deadline
from vlmq.workers.media.http_fetch import HttpFetcher
from vlmq.workers.media.netpolicy import Resolver
from vlmq.workers.media.s3_fetch import S3ClientFactory, S3Fetcher

__all__ = ["MediaFetcher", "MediaKind", "decode_data_uri"]

MediaKind = Literal["image", "video"]

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class MediaFetcher:
    """Turns a source string into bytes, enforcing the per-kind byte cap and
    the per-kind total deadline from ``settings``."""

    def __init__(
        self,
        settings: MediaSettings,
        s3_client_factory: S3ClientFactory | None = None,
        resolver: Resolver | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._settings = settings
        self._http = HttpFetcher(settings, resolver, tls_context)
        self._s3 = S3Fetcher(settings, s3_client_factory)

    def fetch(self, source: str, kind: MediaKind) -> bytes:
        data, _ = self.fetch_versioned(source, kind)
        assert data is not None  # nothing was named as known
        return data

    def fetch_versioned(
        self, source: str, kind: MediaKind, known: str | None = None
    ) -> tuple[bytes | None, str | None]:
        """The bytes and, for a remote source, its version tag (ETag or Last-Modified):
        with ``known`` (a tag seen before) a remote source is asked whether it changed, and
        (None, known) means it did not (nothing downloaded). Local and inline sources have
        no tag: their bytes are their identity."""
        if not isinstance(source, str) or not source:
            raise InvalidRequest("media source must be a non-empty string")
        cap, deadline = self._limits(kind)
        scheme = _scheme_of(source)
        if scheme in ("http", "https"):
            return self._http.fetch_versioned(source, cap, deadline, known)
        if scheme == "s3":
            return self._s3.fetch_versioned(source, cap, deadline, known)
        if scheme == "data":
            return decode_data_uri(source, cap)[1], None
        if scheme == "file":
            return self._read_local(_file_url_path(source), cap), None
        if scheme is None:
            return self._read_local(source, cap), None
        raise InvalidRequest("unsupported media source scheme")

    def s3_identity(self, source: str, kind: MediaKind = "video") -> tuple[str, int]:
        """(ETag, size) of an ``s3://`` source from a HEAD, within the kind's size cap and
        deadline; nothing downloaded."""
        if _scheme_of(source) != "s3":
            raise InvalidRequest("not an s3:// media source")
        cap, deadline = self._limits(kind)
        return self._s3.identity(source, cap, deadline)

    def _limits(self, kind: str) -> tuple[int, Deadline]:
        """The byte cap, and a deadline that starts now and covers every step."""
        s = self._settings
        if kind == "image":
            return s.max_image_bytes, Deadline(s.image_fetch_timeout_s)
        if kind == "video":
            return s.max_video_bytes, Deadline(s.video_fetch_timeout_s)
        raise InvalidRequest("media kind must be 'image' or 'video'")

    def _read_local(self, path: str, cap: int) -> bytes:
        roots = _resolved_roots(self._settings.local_roots)
        if not roots:
            raise MediaForbidden("local media files are not enabled")
        resolved = _resolve_local_path(path)
        if not _is_under_any(resolved, roots):
            raise MediaForbidden("media path is outside the allowed directories")
        return _read_regular_file(resolved, roots, cap)


def _scheme_of(source: str) -> str | None:
    match = _SCHEME_RE.match(source)
    return match.group(1).lower() if match else None


# --- data: URIs -------------------------------------------------------------


# --- local files --------------------------------------------------------------


def _file_url_path(url: str) -> str:
    """Resolve file:// ourselves (transformers refuses it); only local hosts."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise InvalidRequest("file URL is malformed") from None
    if parts.netloc not in ("", "localhost"):
        raise MediaForbidden("file URLs must not name a remote host")
    if parts.query or parts.fragment:
        raise InvalidRequest("file URLs must not have a query or fragment")
    return unquote(parts.path)


def _resolved_roots(roots: list[str]) -> list[str]:
    return [os.path.realpath(root) for root in roots if root]


def _resolve_local_path(path: str) -> str:
    check_path_name(path)
    if not os.path.isabs(path):
        # A relative path would depend on each worker's current directory.
        raise InvalidRequest("local media path must be absolute")
    return os.path.realpath(path)  # resolves symlinks and '..'


def _is_under_any(path: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def _read_regular_file(resolved: str, roots: list[str], cap: int) -> bytes:
    """Open without following a final symlink, then check what was actually
    opened: a symlink swapped in after ``realpath`` cannot escape the roots."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        raise _open_error(exc) from None
    try:
        _check_opened_file(fd, roots, cap)
        data = _read_fd(fd, cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise MediaTooLarge("media is larger than the allowed size")
    return data


def _check_opened_file(fd: int, roots: list[str], cap: int) -> None:
    opened = _fd_path(fd)
    if opened is not None and not _is_under_any(opened, roots):
        raise MediaForbidden("media path is outside the allowed directories")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # directories, FIFOs, devices
        raise MediaFetchFailed("media path is not a regular file")
    if info.st_size > cap:
        raise MediaTooLarge("media is larger than the allowed size")


def _read_fd(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        while size < limit:
            chunk = os.read(fd, min(1 << 20, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        raise MediaFetchFailed("media file could not be read") from None
    return b"".join(chunks)


def _fd_path(fd: int) -> str | None:
    """The kernel's view of an open file's path (Linux); None elsewhere."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _open_error(exc: OSError) -> Exception:
    if exc.errno == errno.ELOOP:  # the last component became a symlink
        return MediaForbidden("media path is outside the allowed directories")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return MediaFetchFailed("media file not found")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return MediaFetchFailed("media file is not readable")
    return MediaFetchFailed("media file could not be opened")
