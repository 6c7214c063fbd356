"""The gate every request passes before any route runs: Host, key, rate, body size.

It is plain ASGI middleware, so an unauthenticated or rate-limited caller is
turned away before a byte of its body is read, and the body cap is enforced
while the body streams in (a lying or absent Content-Length does not help).
A route's cap is what its body may need: an upload ``max_file_bytes``; a body that becomes
one queued message (a task, a chat completion) no more than a worker takes
(``fleet.max_message_bytes``: the body could only shrink to fit by staging inline media);
any other ``max_body_bytes``.
The caller a key stands for is left in the request's state for the routes
(``auth.caller_of``).
"""

from __future__ import annotations

import math
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmq.config.settings import ApiSettings
from vlmq.config.tenants import DEFAULT_TENANT, Caller
from vlmq.producers.api.auth import KeyBook, is_loopback_host, is_public
from vlmq.producers.api.errors import error_response
from vlmq.producers.api.limits import RateLimiter

__all__ = ["Gate"]

# Uploads have their own, larger cap (settings.api.max_file_bytes).
_UPLOAD_PATHS = frozenset({"/v1/files"})
# Bodies that become one queued message each: a worker's limit bounds them.
_MESSAGE_PATHS = frozenset({"/v1/tasks", "/v1/chat/completions"})


class _BodyTooLarge(Exception):
    """Raised from receive() once the body passes the cap."""


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        settings: ApiSettings,
        keys: KeyBook,
        limiter: RateLimiter,
        max_message_bytes: int,
    ) -> None:
        """``max_message_bytes``: the largest message a worker takes (``fleet``'s)."""
        self.app = app
        self.settings = settings
        self.keys = keys
        self.limiter = limiter
        self.max_message_bytes = max_message_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = await self._refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self._capped(scope, receive, send, self._body_cap(scope))

    async def _refusal(self, scope: Scope, headers: Headers) -> Any:
        """The response turning this request away before its body, or None."""
        if self.keys.open and not is_loopback_host(headers.get("host")):
            # No key guards this server: only a client on this machine, by a loopback name.
            return error_response(
                400, "invalid_host", "a server without API keys answers loopback host names only"
            )
        if not is_public(scope["path"]):
            refusal = await self._admit(scope, headers)
            if refusal is not None:
                return refusal
        declared, cap = headers.get("content-length", ""), self._body_cap(scope)
        if declared.isdigit() and int(declared) > cap:
            return _too_large(cap)
        return None

    async def _admit(self, scope: Scope, headers: Headers) -> Any:
        """Identify the caller and spend one of its tenant's tokens; a refusal or None."""
        if self.keys.open:
            caller: Caller | None = Caller(DEFAULT_TENANT, admin=True)
        else:
            caller = self.keys.caller(headers.get("authorization"))
        if caller is None:
            client = scope.get("client")
            address = client[0] if client else "unknown"
            wait = await run_in_threadpool(self.limiter.take_address, address)
            if wait > 0:
                return _rate_limited(wait)
            return error_response(
                401,
                "unauthorized",
                "a valid API key is required (Authorization: Bearer <key>)",
                {"WWW-Authenticate": "Bearer"},
            )
        wait = await run_in_threadpool(self.limiter.take_tenant, caller.tenant)
        if wait > 0:
            return _rate_limited(wait)
        scope.setdefault("state", {})["caller"] = caller
        return None

    def _body_cap(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"] in _UPLOAD_PATHS:
            return self.settings.max_file_bytes
        if scope["method"] == "POST" and scope["path"] in _MESSAGE_PATHS:
            return min(self.settings.max_body_bytes, self.max_message_bytes)
        return self.settings.max_body_bytes

    async def _capped(self, scope: Scope, receive: Receive, send: Send, cap: int) -> None:
        read = 0
        tripped = started = False

        async def capped_receive() -> Message:
            nonlocal read, tripped
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > cap:
                    tripped = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if tripped:
                return  # whatever the app made of the cut-off body; 413 follows
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except Exception:
            if not tripped:  # not ours: the outer error handler answers it
                raise
        if tripped and not started:
            await _too_large(cap)(scope, receive, send)


def _rate_limited(wait: float) -> Any:
    retry = str(max(1, math.ceil(min(wait, 3600))))
    return error_response(429, "rate_limited", "too many requests", {"Retry-After": retry})


def _too_large(cap: int) -> Any:
    return error_response(
        413, "body_too_large", f"the request body is too large: at most {cap:,} bytes here"
    )
