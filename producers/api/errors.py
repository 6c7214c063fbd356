"""Every error the API answers is JSON ``{"error": {"code", "message", "type", "param"}}``.

Codes are stable and machine-readable; messages are short and written by us,
never an exception's text, a stack trace or an object repr. ``type`` (the kind of error,
from the status) and ``param`` (the field at fault, or null) make the body OpenAI's error
object as well, so an OpenAI client reads every error alike. Handlers here turn
our own errors, FastAPI's validation errors, routing errors and anything
unexpected (500 ``internal_error``) into that one shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import redis
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.errors import (
    InvalidRequest,
    QuotaExceeded,
    RequestTooLarge,
    VlmqError,
)

__all__ = [
    "ApiError",
    "ApiErrorDetail",
    "BodyTooLarge",
    "ErrorBody",
    "error_body",
    "error_response",
    "error_responses",
    "error_type",
    "install_error_handlers",
    "validation_problem",
]

log = logging.getLogger(__name__)

# Status codes of routing errors Starlette raises itself, by code.
_HTTP_CODES = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


# OpenAI's error ``type`` by status (its own names; 5xx not listed: server_error).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``type`` of an error answered with ``status``."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ErrorDetail(BaseModel):
    code: str
    message: str


class ApiErrorDetail(ErrorDetail):
    type: str | None = Field(None, description="OpenAI's error type (from the status)")
    param: str | None = Field(None, description="The request field at fault, when one is")


class ErrorBody(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ApiErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries declaring the error body for these statuses."""
    return {status: {"model": ErrorBody} for status in statuses}


class ApiError(Exception):
    """An error with an HTTP status, raised anywhere inside a request."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        *,
        param: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.param = param
        self.extra = extra


class BodyTooLarge(HTTPException):
    """A body refused while it is read or parsed (413 ``body_too_large``, with its reason).
    An HTTPException: FastAPI passes it on from a body read, where it turns any other
    exception into a 400."""

    def __init__(self, message: str) -> None:
        super().__init__(413, detail=message)
        self.message = message


def error_body(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The error object; ``extra`` fields (vlmq's own, e.g. a task's status URL) follow."""
    error = {"code": code, "message": message, "type": error_type(status), "param": param}
    return {"error": {**error, **(extra or {})}}


def error_response(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    param: str | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = error_body(status, code, message, param, extra)
    return JSONResponse(body, status_code=status, headers=headers)


def validation_problem(exc: RequestValidationError) -> tuple[str | None, str]:
    """The field of the first problem (or None) and 'field.path: reason'; never echoes the
    input."""
    errors = exc.errors()
    if not errors:
        return None, "invalid request"
    first = errors[0]
    # FastAPI prefixes the location with where it came from ("body", "query").
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    reason = str(first.get("msg", "invalid value"))
    field = ".".join(loc) or None
    return field, f"{field}: {reason}" if field else reason


def _status_of(exc: VlmqError) -> int:
    if isinstance(exc, RequestTooLarge):
        return 413
    if isinstance(exc, InvalidRequest):
        return 422
    if isinstance(exc, QuotaExceeded):
        return 429
    if exc.retryable:  # (a transient failure, or a server not yet updated: another serves it)
        return 503
    return 500


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status, exc.code, exc.message, exc.headers, param=exc.param, extra=exc.extra
    )


async def _on_vlmq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, VlmqError)
    status = _status_of(exc)
    if status >= 500:
        log.warning("request failed: %s", exc.code)
    message = exc.message if status < 500 or exc.retryable else "internal error"
    code = exc.code if status < 500 or exc.retryable else "internal_error"
    headers = None
    if isinstance(exc, QuotaExceeded):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    param = exc.field if isinstance(exc, InvalidRequest) else None
    return error_response(status, code, message, headers, param=param)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    field, message = validation_problem(exc)
    return error_response(422, "invalid_request", message, param=field)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyTooLarge):
        return error_response(413, "body_too_large", exc.message)
    if exc.status_code == 400:
        # FastAPI's only 400: a body it could not decode. Same answer as bad JSON.
        return error_response(422, "invalid_request", "body: could not be parsed")
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    # Starlette's own details are fixed phrases ("Not Found"); keep ours short too.
    message = code.replace("_", " ")
    return error_response(exc.status_code, code, message, getattr(exc, "headers", None))


async def _on_redis_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, redis.ResponseError) and not isinstance(exc, TRANSIENT_REDIS_ERRORS):
        # Redis answered, and refused the command: a bug or a misconfigured Redis, not an
        # outage (READONLY during a failover and OOM are transient: 503 below).
        log.error("redis refused a command on %s: %s", request.url.path, type(exc).__name__)
        return error_response(500, "internal_error", "internal error")
    log.warning("redis unavailable: %s", type(exc).__name__)
    return error_response(503, "broker_unavailable", "the queue is not reachable")


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Logged with its traceback for the operator; the client sees only a code.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(VlmqError, _on_vlmq_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(redis.exceptions.RedisError, _on_redis_error)
    app.add_exception_handler(Exception, _on_unexpected)
