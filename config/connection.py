"""The one way vlmq opens Redis: the client, the API, the worker and the healthcheck.

Decided here, once, for every process:

* replies are decoded to ``str`` (``decode_responses``); undecodable bytes (a message pushed by
  some other producer) become U+FFFD instead of failing the whole reply, so such a message
  fails alone as an invalid request;
* bounded socket timeouts, so a hung Redis fails a call instead of holding it forever;
* a connection error is retried twice with a short exponential backoff before it reaches the
  caller (whose own loop backs off further); a timeout is not retried here, because the
  command may have run (the caller knows whether retrying it is safe).
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.retry import Retry

from vlmq.config.settings import Settings

__all__ = ["TRANSIENT_REDIS_ERRORS", "create_redis"]

# Replies that say "not now" rather than "never": unreachable or timed out (ConnectionError
# includes BusyLoadingError, a Redis still loading its data), a replica not yet promoted
# (READONLY), and a Redis over maxmemory (OOM). Callers back off and retry them.
TRANSIENT_REDIS_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
)


def create_redis(settings: Settings, *, timeout_s: float | None = None) -> redis.Redis:
    """A connection pool to ``settings.redis_url``; ``timeout_s`` overrides the socket
    timeout of ``settings.fleet.redis_socket_timeout_s`` (a probe wants a short one)."""
    timeout = timeout_s if timeout_s is not None else settings.fleet.redis_socket_timeout_s
    return redis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        encoding_errors="replace",
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=10,
        retry=Retry(
            ExponentialWithJitterBackoff(base=0.05, cap=1.0),
            retries=2,
            supported_errors=(redis.ConnectionError,),
        ),
    )
