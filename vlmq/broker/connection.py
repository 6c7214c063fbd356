"""The one way vlmq opens Redis: the client, the API, the worker and the healthcheck.

Decided here, once, for every process:

* replies are decoded to ``str`` (``decode_responses``); undecodable bytes (a message pushed by
  some other producer) become U+FFFD instead of failing the whole reply, so such a message
  fails alone as an invalid request;
* bounded socket timeouts, so a hung Redis fails a call instead of holding it forever;
* a connection error is retried (five times, with a short exponential backoff) before it
  reaches the caller, whose own loop backs off further: a reply lost to a reset means the
  command may have run, and every write vlmq makes is safe to send again (the scripts that
  are not safe to repeat answer a resend of the same call with their first reply:
  ``vlmq/broker/scripts.py``). A timeout is not retried here; the caller retries it, as the same
  call where that matters.

``VLMQ_REDIS_URL`` is a plain ``redis://``, ``rediss://`` or ``unix://`` URL (redis-py's
``from_url``), or a Sentinel address::

    redis+sentinel://[[username]:password@]host1[:26379],host2[:26379],.../service[/db]

a comma-separated list of sentinels (port 26379 when omitted, ``[v6]:port`` for IPv6), the
service (master) name the sentinels monitor, and the database (0 when omitted). The
username and password, percent-encoded as in any URL, authenticate to the master (and its
replicas); the sentinels' own password is ``VLMQ_REDIS_SENTINEL_PASSWORD``. With such a URL
:func:`create_redis` returns redis-py's ``Sentinel(...).master_for(service)`` with the same
options: every new connection asks the sentinels where the master is, a connection error
reconnects to whichever node they name, and a ``READONLY`` reply (a demoted master) drops the
connection and is retried the same way (redis-py's ``SentinelManagedConnection`` turns it into
a ``ConnectionError``). :func:`celery_broker` gives Celery (kombu) the same address in its
own form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from vlmq.config.errors import ConfigError
from vlmq.config.settings import Settings

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "CONNECTION_RETRIES",
    "SENTINEL_SCHEME",
    "TRANSIENT_REDIS_ERRORS",
    "SentinelAddress",
    "celery_broker",
    "create_async_redis",
    "create_redis",
    "parse_sentinel_url",
]

# Replies that say "not now" rather than "never": unreachable or timed out (ConnectionError
# includes BusyLoadingError, a Redis still loading its data), a replica not yet promoted
# (READONLY), and a Redis over maxmemory (OOM). Callers back off and retry them.
TRANSIENT_REDIS_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
)

# Resends of a command whose connection failed (1 in 20 replies lost leaves a command failing
# all six tries once in 64 million).
CONNECTION_RETRIES = 5

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    """A master known by its service name to a set of sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"a sentinel address in {_redacted(url)} is not host[:port]")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"a sentinel address in {_redacted(url)} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"a sentinel port in {_redacted(url)} is not a port number")
    return host, int(port_text)


def _redacted(url: str) -> str:
    """The URL without its password (error messages end up in logs)."""
    scheme, sep, rest = url.partition("://")
    auth, at, tail = rest.rpartition("@")
    if not at:
        return url
    user = auth.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{tail}"


def parse_sentinel_url(url: str) -> SentinelAddress | None:
    """The Sentinel address of a ``redis+sentinel://`` URL; None for any other URL (those go
    to redis-py's ``from_url`` unchanged). Raises ConfigError for a malformed one."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != SENTINEL_SCHEME or not sep:
        return None
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"{_redacted(url)}: a Sentinel URL takes no query (the sentinels' password is "
            "VLMQ_REDIS_SENTINEL_PASSWORD)"
        )
    auth, at, location = rest.rpartition("@")
    netloc, _, path = location.partition("/")
    username = password = None
    if at:
        user, colon, secret = auth.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(part.strip(), url) for part in netloc.split(",") if part.strip())
    if not sentinels:
        raise ConfigError(f"{_redacted(url)} names no sentinel (host1:26379,host2:26379,...)")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ConfigError(f"{_redacted(url)}: the path must be /service or /service/db")
    service = unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ConfigError(f"{_redacted(url)}: the database must be a number")
        db = int(parts[1])
    return SentinelAddress(sentinels, service, db, username, password)


class _MasterConnection(SentinelManagedConnection):
    """A connection to the master that asks the sentinels where it is on every reconnect.

    redis-py's ``SentinelManagedConnection`` looks the master up when the pool hands a
    connection out, but redis-py 8 reconnects inside a command's retries through
    ``connect_check_health``, which skips that look-up (checked: after ``READONLY`` from a
    demoted master, all three tries of the command went back to the demoted node). Looking it
    up there too makes the retries of the failing command itself reach the new master."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._addressed = False  # connect_to has just set the address

    def connect_to(self, address: Any) -> None:
        self._addressed = True
        try:
            super().connect_to(address)
        finally:
            self._addressed = False

    def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sock and not self._addressed and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super().connect_check_health(*args, **kwargs)


def create_redis(settings: Settings, *, timeout_s: float | None = None) -> redis.Redis:
    """A connection pool to ``settings.redis_url`` (the master, for a Sentinel URL);
    ``timeout_s`` overrides the socket timeout of ``settings.fleet.redis_socket_timeout_s``
    (a probe wants a short one)."""
    timeout = timeout_s if timeout_s is not None else settings.fleet.redis_socket_timeout_s
    options: dict[str, Any] = {
        "decode_responses": True,
        "encoding_errors": "replace",
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 10,
        "retry": Retry(
            ExponentialWithJitterBackoff(base=0.05, cap=1.0),
            retries=CONNECTION_RETRIES,
            supported_errors=(redis.ConnectionError,),
        ),
    }
    address = parse_sentinel_url(settings.redis_url)
    if address is None:
        return redis.Redis.from_url(settings.redis_url, **options)
    sentinel_kwargs = _sentinel_options(settings, timeout)
    sentinel = Sentinel(list(address.sentinels), sentinel_kwargs=sentinel_kwargs)
    master: redis.Redis = sentinel.master_for(
        address.service,
        connection_class=_MasterConnection,
        db=address.db,
        username=address.username,
        password=address.password,
        **options,
    )
    return master


def _sentinel_options(settings: Settings, timeout: float) -> dict[str, Any]:
    """The sentinels' own connection options (their timeout and password, not the master's)."""
    sentinel_timeout = min(timeout, settings.redis_sentinel_timeout_s)
    options: dict[str, Any] = {
        "socket_timeout": sentinel_timeout,
        "socket_connect_timeout": sentinel_timeout,
    }
    if settings.redis_sentinel_password:
        options["password"] = settings.redis_sentinel_password
    return options


def create_async_redis(settings: Settings) -> aioredis.Redis:
    """An asyncio client of ``settings.redis_url`` (the master, for a Sentinel URL) with the
    same decoding and timeouts as :func:`create_redis`, for an event loop's own work (the API's
    pub/sub listener). Its callers reconnect themselves: a command is not resent here."""
    import redis.asyncio as aioredis  # only an event loop's process pays for it
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    timeout = settings.fleet.redis_socket_timeout_s
    options: dict[str, Any] = {
        "decode_responses": True,
        "encoding_errors": "replace",
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }
    address = parse_sentinel_url(settings.redis_url)
    if address is None:
        return aioredis.Redis.from_url(settings.redis_url, **options)
    sentinel_kwargs = _sentinel_options(settings, timeout)
    sentinel = AsyncSentinel(list(address.sentinels), sentinel_kwargs=sentinel_kwargs)
    master: aioredis.Redis = sentinel.master_for(
        address.service,
        db=address.db,
        username=address.username,
        password=address.password,
        **options,
    )
    return master


def _kombu_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def celery_broker(settings: Settings) -> tuple[str, dict[str, Any]]:
    """Celery's broker URL and the transport options it needs for ``settings.redis_url``: the
    URL itself for a plain Redis; for a Sentinel URL, kombu's sentinel transport
    (``sentinel://h1:26379/db;sentinel://h2:26379/db;...`` with ``master_name``, and the
    sentinels' password as ``sentinel_kwargs``)."""
    address = parse_sentinel_url(settings.redis_url)
    if address is None:
        return settings.redis_url, {}
    # kombu takes the credentials (the master's) and the database from the first URL.
    auth = ""
    if address.username or address.password is not None:
        auth = f"{quote(address.username or '', safe='')}:{quote(address.password or '', safe='')}@"
    broker = ";".join(
        f"sentinel://{auth}{_kombu_host(host)}:{port}/{address.db}"
        for host, port in address.sentinels
    )
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": settings.redis_sentinel_timeout_s}
    if settings.redis_sentinel_password:
        sentinel_kwargs["password"] = settings.redis_sentinel_password
    return broker, {"master_name": address.service, "sentinel_kwargs": sentinel_kwargs}
