"""API keys and the callers they stand for: ``Authorization: Bearer <key>``.

Keys come from ``settings.api``: ``api_keys`` (the default tenant), ``tenant_keys`` (key ->
tenant) and ``admin_keys`` (every tenant's work). With no key at all the API is open, binds
to loopback only (``vlmq serve``) and answers loopback ``Host`` names only, so a web page in a
browser on the same machine cannot reach it through DNS rebinding.

Keys are compared in constant time, all of them, so timing does not tell which key nearly
matched; a caller is known to the rate limiter by its tenant (keys never sit in logs or
Redis).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi import Request
from fastapi.security import HTTPBearer

from vlmq.config.errors import ConfigError
from vlmq.config.settings import ApiSettings
from vlmq.config.tenants import DEFAULT_TENANT, TENANT_PATTERN, Caller, valid_tenant

__all__ = [
    "PUBLIC_PATHS",
    "KeyBook",
    "bearer_scheme",
    "caller_of",
    "is_loopback_host",
    "is_public",
]

# Reachable without a key: liveness, readiness and the API description.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/redoc"})

# Declares the scheme in the OpenAPI document; the check itself runs in the
# gate middleware, before any body is read.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API key from VLMQ_API__API_KEYS, VLMQ_API__TENANT_KEYS or VLMQ_API__ADMIN_KEYS",
)

# What a keyless server answers to: a browser page reaching it by another name (DNS
# rebinding) sends that name as its Host.
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/docs/")


def is_loopback_host(host_header: str | None) -> bool:
    """Whether a ``Host`` header names this machine's loopback (any port)."""
    if not host_header:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host in _LOOPBACK_HOSTS


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class KeyBook:
    """Every configured key with the caller it stands for; checked once, at start."""

    def __init__(self, settings: ApiSettings) -> None:
        entries = [(key, Caller(DEFAULT_TENANT)) for key in settings.api_keys]
        entries += [(key, Caller(tenant)) for key, tenant in settings.tenant_keys.items()]
        entries += [(key, Caller(DEFAULT_TENANT, admin=True)) for key in settings.admin_keys]
        _check(entries, settings.min_key_length)
        self._entries = [(key.encode(), caller) for key, caller in entries]

    @property
    def open(self) -> bool:
        """No key configured: no authentication (loopback only)."""
        return not self._entries

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller a valid key stands for, else None (every key is compared)."""
        token = _bearer_token(authorization)
        if token is None:
            return None
        given = token.encode()
        found = None
        for key, caller in self._entries:
            if hmac.compare_digest(given, key) and found is None:
                found = caller
        return found


def _check(entries: Iterable[tuple[str, Caller]], min_length: int) -> None:
    seen: dict[str, Caller] = {}
    for key, caller in entries:
        if len(key) < min_length:
            raise ConfigError(
                f"an API key is shorter than {min_length} characters "
                "(VLMQ_API__MIN_KEY_LENGTH): use a long random key"
            )
        if not valid_tenant(caller.tenant):
            raise ConfigError(f"tenant names must match {TENANT_PATTERN}: {caller.tenant[:64]!r}")
        if seen.get(key, caller) != caller:
            raise ConfigError("one API key is configured for two tenants or roles")
        seen[key] = caller


def caller_of(request: Request) -> Caller:
    """FastAPI dependency: who the gate let in (a keyless server's callers are admins of the
    default tenant: there is no one to tell apart)."""
    caller: Caller | None = getattr(request.state, "caller", None)
    return caller or Caller(DEFAULT_TENANT, admin=True)
