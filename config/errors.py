"""The one exception hierarchy of vlmq.

Every error a client can see carries a stable ``code`` and a short ``message``
that never contains a raw exception text, a stack trace or an object repr.

    VlmqError
    ├── PermanentError            the task fails; retrying cannot help
    │   ├── InvalidRequest        invalid_request
    │   │   ├── StagingRefused    staging_refused (media no store took and no worker could read)
    │   │   └── RequestTooLarge   request_too_large (its message would pass what workers take)
    │   ├── MediaError
    │   │   ├── MediaFetchFailed  media_fetch_failed (4xx, missing file, bad URL)
    │   │   ├── MediaTooLarge     media_too_large
    │   │   ├── MediaForbidden    media_forbidden
    │   │   └── MediaDecodeFailed media_decode_failed
    │   ├── TooManyMedia          too_many_media
    │   ├── PromptTooLong         prompt_too_long
    │   ├── GenerationFailed      generation_failed
    │   ├── DeadLettered          dead_lettered
    │   ├── ResultNotStored       result_not_stored (the store refused its object for good)
    │   └── Expired               expired
    ├── RetryableError            transient; retried with backoff, then failed
    │   ├── MediaFetchTransient   media_fetch_failed (5xx, 429, timeout, DNS)
    │   ├── StoreUnavailable      store_unavailable
    │   └── QuotaExceeded         quota_exceeded (a tenant's queued tasks or tokens; submit later)
    └── ConfigError               configuration_error (operator mistake, not a task error)
        └── LayoutUnreadable      layout_unreadable (a newer task layout is in force than
                                  this process's version reads: update it; retryable, as an
                                  updated process serves the request)

``OutOfMemory`` is internal to the engine: it halves the micro-batch and is
never reported unless a batch of one still runs out of memory.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "DeadLettered",
    "Expired",
    "GenerationFailed",
    "InvalidRequest",
    "LayoutUnreadable",
    "MediaDecodeFailed",
    "MediaError",
    "MediaFetchFailed",
    "MediaFetchTransient",
    "MediaForbidden",
    "MediaTooLarge",
    "OutOfMemory",
    "PermanentError",
    "PromptTooLong",
    "QuotaExceeded",
    "RequestTooLarge",
    "ResultNotStored",
    "RetryableError",
    "StagingRefused",
    "StoreUnavailable",
    "TooManyMedia",
    "VlmqError",
    "error_record",
]


class VlmqError(Exception):
    """Root of every vlmq error; ``code`` is stable and machine-readable."""

    code: str = "internal_error"
    retryable: bool = False

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message()
        super().__init__(self.message)

    @classmethod
    def default_message(cls) -> str:
        return cls.code.replace("_", " ")

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


class PermanentError(VlmqError):
    """The task fails; running it again gives the same answer."""


class RetryableError(VlmqError):
    """A transient failure (network, store, broker): retry with backoff."""

    retryable = True


class ConfigError(VlmqError):
    code = "configuration_error"


class LayoutUnreadable(ConfigError):
    """A newer task layout is in force than this version reads (vlmq/broker/layouts.py):
    Redis refused the call whole. This process must be updated; a client's retry of what it
    asked (served by an updated process) is not refused."""

    code = "layout_unreadable"
    retryable = True


class InvalidRequest(PermanentError):
    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class StagingRefused(InvalidRequest):
    """A request's local media could not be staged and no worker could read it in place; the
    message names the setting that fixes it. Raised before anything is enqueued."""

    code = "staging_refused"


class RequestTooLarge(InvalidRequest):
    """A request whose queued message would be larger than the workers take
    (``fleet.max_message_bytes``). Raised before anything is enqueued."""

    code = "request_too_large"


class MediaError(PermanentError):
    code = "media_error"


class MediaFetchFailed(MediaError):
    code = "media_fetch_failed"


class MediaTooLarge(MediaError):
    code = "media_too_large"


class MediaForbidden(MediaError):
    code = "media_forbidden"


class MediaDecodeFailed(MediaError):
    code = "media_decode_failed"


class TooManyMedia(PermanentError):
    code = "too_many_media"


class PromptTooLong(PermanentError):
    code = "prompt_too_long"


class GenerationFailed(PermanentError):
    code = "generation_failed"


class DeadLettered(PermanentError):
    """Delivered too many times without finishing (its worker died each time)."""

    code = "dead_lettered"


class ResultNotStored(PermanentError):
    code = "result_not_stored"


class Expired(PermanentError):
    code = "expired"


class MediaFetchTransient(RetryableError):
    code = "media_fetch_failed"


class StoreUnavailable(RetryableError):
    code = "store_unavailable"


class QuotaExceeded(RetryableError):
    """A submission would take its tenant past a quota; nothing of it was enqueued. It may be
    submitted again once some of the tenant's queued work ran (``retry_after_s``)."""

    code = "quota_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class OutOfMemory(VlmqError):
    """Raised (or injected) when a micro-batch does not fit on the device."""

    code = "out_of_memory"
    retryable = True


def error_record(exc: BaseException) -> dict[str, Any]:
    """The client-facing form of any exception: never leaks its text or repr."""
    if isinstance(exc, VlmqError):
        return exc.to_dict()
    return {"code": "internal_error", "message": "internal error", "retryable": False}
