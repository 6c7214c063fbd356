"""Every error the API answers is JSON ``{"error": {"code", "message"}}``.

Codes are stable and machine-readable; messages are short and written by us,
never an exception's text, a stack trace or an object repr. Handlers here turn
our own errors, FastAPI's validation errors, routing errors and anything
unexpected (500 ``internal_error``) into that one shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmq.config.connection import TRANSIENT_REDIS_ERRORS
from vlmq.config.errors import InvalidRequest, QuotaExceeded, RetryableError, VlmqError

__all__ = [
    "ApiError",
    "ErrorBody",
    "error_response",
    "error_responses",
    "install_error_handlers",
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


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries declaring the error body for these statuses."""
    return {status: {"model": ErrorBody} for status in statuses}


class ApiError(Exception):
    """An error with an HTTP status, raised anywhere inside a request."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    """'field.path: reason' of the first problem; never echoes the input."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    # FastAPI prefixes the location with where it came from ("body", "query").
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    reason = str(first.get("msg", "invalid value"))
    return f"{'.'.join(loc)}: {reason}" if loc else reason


def _status_of(exc: VlmqError) -> int:
    if isinstance(exc, InvalidRequest):
        return 422
    if isinstance(exc, QuotaExceeded):
        return 429
    if isinstance(exc, RetryableError):
        return 503
    return 500


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.headers)


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
    return error_response(status, code, message, headers)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, "invalid_request", _validation_message(exc))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
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
