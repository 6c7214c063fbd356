"""API keys: ``Authorization: Bearer <key>`` against ``settings.api.api_keys``.

With no key configured the API is open (and ``vlmq serve`` binds to loopback
only). Keys are compared in constant time; a caller is identified to the rate
limiter by a hash of its key, so keys never sit in memory as dict keys or logs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi.security import HTTPBearer

__all__ = ["PUBLIC_PATHS", "bearer_scheme", "is_public", "principal_of"]

# Reachable without a key: liveness, readiness and the API description.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/redoc"})

# Declares the scheme in the OpenAPI document; the check itself runs in the
# gate middleware, before any body is read.
bearer_scheme = HTTPBearer(auto_error=False, description="An API key from VLMQ_API__API_KEYS")


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/docs/")


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def principal_of(authorization: str | None, keys: Sequence[str]) -> str | None:
    """The caller's identity for a valid key, else None.

    Every configured key is compared (no early exit), so timing does not tell
    which key nearly matched.
    """
    token = _bearer_token(authorization)
    if token is None:
        return None
    given = token.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        return None
    return "key:" + hashlib.sha256(given).hexdigest()[:16]
