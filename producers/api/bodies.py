"""JSON request bodies parsed off the event loop, and bounded in what they build.

FastAPI reads a route's JSON body with ``await request.json()``, which is ``json.loads`` on
the event loop: a 30 MB body held every other request, ``/healthz`` included, for as long
as it took (docs/reliability.md). The routes of :class:`BodyRoute` get a request whose
``json()`` parses in the thread pool, so the loop only awaits the body's chunks (the gate
caps their bytes as they come: ``gate.py``).

A body is also bounded in the Python objects it builds: at most ``api.max_body_objects``
JSON objects and arrays (each costs 60-70 bytes once parsed against two or three of JSON: 32
MiB of ``{},`` took 800 MB). A body that cannot hold more (fewer ``{`` and ``[`` in all its
bytes) is parsed by ``json.loads``; any other by json's own pure-Python scanner, counting as
it builds and stopping at the first container past the bound (413 ``body_too_large``).
What FastAPI then validates on the loop is bounded by the body models: a conversation's
parts are counted before any turn is built (``config/schemas.py``, ``MAX_PARTS``).
Multipart uploads are Starlette's, read and spooled a chunk at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from json.decoder import JSONArray, JSONObject  # type: ignore[attr-defined]
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from typing import Any

from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from vlmq.producers.api.context import context
from vlmq.producers.api.errors import BodyTooLarge

__all__ = ["BodyRoute", "parse_json_body"]

_UNREAD = object()


class _CountingDecoder(json.JSONDecoder):
    """json's pure-Python scanner with every object and array counted as it is begun. (The
    scanner and its object and array parsers have been in CPython's json since 2.6, though
    not in its type stubs; tests/unit/test_body_bounds.py runs both paths.)"""

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = self.left = bound
        self.parse_object = self._counted(JSONObject)
        self.parse_array = self._counted(JSONArray)
        self.scan_once = py_make_scanner(self)

    def _counted(self, parse: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            self.left -= 1
            if self.left < 0:
                raise BodyTooLarge(
                    f"the request body holds more than {self.bound:,} JSON objects and arrays"
                )
            return parse(*args)

        return counted


def parse_json_body(raw: bytes, bound: int) -> Any:
    """``raw`` parsed as ``json.loads`` does; BodyTooLarge past ``bound`` objects and
    arrays, raised before the rest is built."""
    if raw.count(b"{") + raw.count(b"[") <= bound:
        return json.loads(raw)
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    return _CountingDecoder(bound).decode(text)


class _ThreadParsedRequest(Request):
    """A request whose JSON body is parsed in the thread pool (once)."""

    _parsed: Any = _UNREAD

    async def json(self) -> Any:
        if self._parsed is _UNREAD:
            ctx = context(self)
            bound = ctx.settings.api.max_body_objects
            self._parsed = await run_in_threadpool(parse_json_body, await self.body(), bound)
        return self._parsed


class BodyRoute(APIRoute):
    """An APIRoute whose JSON body is parsed off the event loop, and bounded."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_off_loop(request: Request) -> Response:
            return await handler(_ThreadParsedRequest(request.scope, request.receive))

        return parsed_off_loop
