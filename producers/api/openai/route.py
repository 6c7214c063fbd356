"""The routes OpenAI's own clients call directly (chat completions, models) answer a bad
request as OpenAI does: 400 ``invalid_request_error`` naming the field in ``param``.

The rest of the API answers 422 for the same problems (``errors.py``); here the official
client raises its ``BadRequestError``, which is what an application written against OpenAI
catches. Every other error is left to the app's handlers (the one error shape, which carries
OpenAI's ``type`` and ``param`` everywhere), a request too large for the workers (413) too.
Bodies are parsed off the event loop (``bodies.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response

from vlmq.config.errors import InvalidRequest, RequestTooLarge
from vlmq.producers.api.bodies import BodyRoute
from vlmq.producers.api.errors import ApiError, validation_problem

__all__ = ["OpenAIRoute"]


class OpenAIRoute(BodyRoute):
    """An APIRoute whose invalid requests are 400s."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                field, message = validation_problem(exc)
                raise ApiError(400, "invalid_request", message, param=field) from None
            except RequestTooLarge:
                raise
            except InvalidRequest as exc:
                raise ApiError(400, exc.code, exc.message, param=exc.field) from None

        return openai_handler
