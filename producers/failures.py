"""What a command says when Redis or the object store fails under it: one line, never a
traceback.

Every command's writes are safe to repeat (a submit with the same job id resumes the job; a
cancel cancels what is still queued; the rest only read), so a command that gives up says what
failed, whether the job is safe, and that running the same command again resumes it, and exits
with ``EX_TEMPFAIL`` (75: try again later) instead of 1, so a script can tell an outage from a
refusal.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Iterator

import click
from redis import RedisError

from vlmq.config.errors import StoreUnavailable

__all__ = ["EXIT_OUTAGE", "OutageError", "describe", "is_outage", "reported", "this_command"]

EXIT_OUTAGE = 75  # sysexits.h EX_TEMPFAIL

# The object store's own errors, when boto3 is installed (an S3 store): the S3 backend wraps
# most of them in StoreUnavailable, not every call site does.
try:
    from botocore.exceptions import BotoCoreError, ClientError

    _STORE_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, BotoCoreError, ClientError)
except ImportError:  # pragma: no cover - boto3 is a base dependency
    _STORE_ERRORS = (StoreUnavailable,)


class OutageError(click.ClickException):
    """A command gave up because Redis or the store failed (exit 75)."""

    exit_code = EXIT_OUTAGE


def is_outage(exc: BaseException) -> bool:
    return isinstance(exc, (RedisError, *_STORE_ERRORS))


def describe(exc: BaseException) -> str:
    """What failed, in a few words: the service and the error, on one line."""
    service = "Redis" if isinstance(exc, RedisError) else "the object store"
    cause = exc.__cause__ if isinstance(exc, StoreUnavailable) else None
    detail = f"{type(exc).__name__}: {exc}"
    if cause is not None:
        detail += f" ({type(cause).__name__}: {cause})"
    return f"{service} failed ({' '.join(detail.split())})"


def this_command(*extra: str) -> str:
    """The command line that ran this command, with ``extra`` arguments added (what to run
    again to resume it)."""
    return " ".join(["vlmq", *map(shlex.quote, [*sys.argv[1:], *extra])])


@contextlib.contextmanager
def reported(command: str, safety: str) -> Iterator[None]:
    """Run a command's body; a Redis or store failure ends it in one line: what failed, what
    is safe (``safety``), and that rerunning ``command`` resumes it."""
    try:
        yield
    except Exception as exc:
        if not is_outage(exc):
            raise
        raise OutageError(f"{describe(exc)}; {safety}; rerun `{command}` to resume") from None
