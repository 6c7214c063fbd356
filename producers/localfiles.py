"""Local media files, read only on a local user's say, and then one safe way.

A media path in a request is data, not a trusted name. The file a line names may be a device
(``/dev/ptmx``, ``/dev/zero``: a read that never ends), a FIFO (``open`` blocks until a writer
comes), a ``/proc`` or ``/sys`` file whose ``st_size`` says 0 whatever it holds
(``/proc/self/environ``: the submitter's credentials, past any byte cap taken from
``st_size``), or a ``..`` or symlink out of the folder the input came from. Media staging
(``producers/staging.py``) and the pre-flight estimate (``producers/preflight``) both read
such files, so both read them here, one way:

- **Only for a local caller.** A server acting for remote callers (the HTTP API,
  ``Client(local_media=False)``) never calls this module, nor does a submission whose input
  is itself remote (``vlmq submit s3://...``): nothing local is read on their say, not even
  to learn whether a file exists.
- **Relative paths stay in their folder.** A relative path resolves against the input's
  folder and, with ``confine``, must still be inside it once ``..`` and symlinks are
  resolved (``vlmq submit --allow-media-outside-input-dir`` lifts that). An absolute path or
  ``file://`` URL, written out by the local user, is taken as named.
- **A regular file or nothing.** The path is ``stat``-ed before anything is opened (opening a
  device can act by itself), then opened ``O_RDONLY | O_NONBLOCK | O_NOCTTY | O_NOFOLLOW``
  on its resolved name (a FIFO swapped in does not block the open, a symlink swapped in is
  not followed), and the open descriptor is ``fstat``-ed again: anything but the same regular
  file is refused.
- **Never more than the cap.** A file claiming 0 bytes is refused (``/proc`` and ``/sys``
  files claim 0 or a page whatever they hold; an empty file is no media either), one claiming
  more than the cap is refused unread, and a read never goes past the cap whatever
  ``st_size`` said: a file that yields more is refused as too large.

Errors are the worker's own codes for the same file (``MediaFetchFailed``, ``MediaTooLarge``)
so the pre-flight predicts them; a path out of its folder is ``InvalidRequest``. Staging turns
each into a refusal of that request alone.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from vlmq.config.errors import InvalidRequest, MediaFetchFailed, MediaTooLarge
from vlmq.config.media_checks import check_path_name

__all__ = ["LocalFile", "file_info", "open_local", "resolve_local"]

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)
OUTSIDE_FLAG = "--allow-media-outside-input-dir"


def resolve_local(path: str, base_dir: Path | None, *, confine: bool) -> str:
    """The absolute name, symlinks and ``..`` resolved, of a local media path; a relative one
    against ``base_dir`` (default: the working directory). With ``confine`` a relative path
    that leads outside ``base_dir`` raises InvalidRequest. Reads no file, only names."""
    check_path_name(path)
    if os.path.isabs(path):
        return os.path.realpath(path)
    base = os.path.realpath(base_dir if base_dir is not None else os.getcwd())
    real = os.path.realpath(os.path.join(base, path))
    if confine and os.path.commonpath([real, base]) != base:
        raise InvalidRequest(
            f"media path {_short(path)} leads outside the input's folder (through '..' or a "
            f"symbolic link): name it by an absolute path, or allow it with {OUTSIDE_FLAG}"
        )
    return real


def file_info(path: str, cap: int | None) -> os.stat_result | None:
    """``stat`` of a resolved path, None when nothing is there; raises unless it is a regular
    file of at least 1 byte and (``cap`` given) at most ``cap``. Opens nothing."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        raise MediaFetchFailed("media file could not be read") from None
    _check(info, cap)
    return info


def open_local(path: str, cap: int) -> LocalFile:
    """The regular file at a resolved path, open for reading at most ``cap`` bytes; raises
    MediaFetchFailed when there is none or it is anything else, MediaTooLarge past the cap."""
    info = file_info(path, cap)
    if info is None:
        raise MediaFetchFailed("media file not found")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(exc) from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise MediaFetchFailed("media file changed while it was opened")
        _check(opened, cap)
        return LocalFile(fd, cap, opened)
    except BaseException:
        os.close(fd)
        raise


class LocalFile(io.RawIOBase):
    """A local media file open for reading (seekable, as Pillow and PyAV want it) that never
    yields a byte past ``cap``: reading on at the cap raises MediaTooLarge when the file has
    more. ``info`` is the open descriptor's ``fstat``."""

    def __init__(self, fd: int, cap: int, info: os.stat_result) -> None:
        super().__init__()
        self._file = io.FileIO(fd, "rb", closefd=True)
        self._cap = cap
        self.info = info

    @property
    def size(self) -> int:
        return self.info.st_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        room = self._cap - self._file.tell()
        if room <= 0:
            if self._file.read(1):
                raise MediaTooLarge("media is larger than the allowed size")
            return 0
        view = memoryview(buffer)
        try:
            return self._file.readinto(view[: min(len(view), room)]) or 0
        except OSError:
            raise MediaFetchFailed("media file could not be read") from None

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def _check(info: os.stat_result, cap: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):  # directories, FIFOs, devices, sockets
        raise MediaFetchFailed("media path is not a regular file")
    if info.st_size == 0:
        raise MediaFetchFailed(
            "media file claims 0 bytes (empty, or not a file on disk, like those of /proc)"
        )
    if cap is not None and info.st_size > cap:
        raise MediaTooLarge("media is larger than the allowed size")


def _open_error(exc: OSError) -> Exception:
    if exc.errno == errno.ELOOP:  # the resolved name became a symlink after it was resolved
        return MediaFetchFailed("media file changed while it was opened")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return MediaFetchFailed("media file not found")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return MediaFetchFailed("media file is not readable")
    return MediaFetchFailed("media file could not be opened")


def _short(path: str, limit: int = 120) -> str:
    return repr(path if len(path) <= limit else "..." + path[-limit:])
