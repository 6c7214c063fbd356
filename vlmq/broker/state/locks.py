"""Named leases: one holder at a time of a named activity, renewed while it works."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator

import redis as redis_py

from vlmq.broker.scripts import Scripts

__all__ = ["NamedLeases"]


class NamedLeases:
    """One holder at a time of a named activity (an API process feeding or finalizing a
    batch): taken with a token of the holder's own, renewed while it works, released only by
    its owner. A holder that dies leaves a lease that lapses."""

    def __init__(self, redis: redis_py.Redis, scripts: Scripts) -> None:
        self.redis = redis
        self.scripts = scripts

    def take(self, key: str, ttl_s: float) -> str | None:
        """The lease's token if the caller got it (a retried take finds its own token)."""
        token = secrets.token_hex(8)
        if self.redis.set(key, token, nx=True, ex=max(1, int(ttl_s))):
            return token
        return token if self.redis.get(key) == token else None

    def renew(self, key: str, token: str, ttl_s: float) -> bool:
        """Extend it; False when the caller no longer owns it."""
        return bool(self.scripts("renew_named", [key], [token, max(1, int(ttl_s))]))

    def release(self, key: str, token: str) -> None:
        self.scripts("release_named", [key], [token])

    def held(self, key: str) -> bool:
        return bool(self.redis.exists(key))

    @contextlib.contextmanager
    def holding(self, key: str, ttl_s: float) -> Iterator[bool]:
        """Take the lease and keep it (renewed every third of ``ttl_s``) while the block runs;
        yields whether it was taken. The block runs as long as it needs: its lease never
        lapses under a live holder."""
        token = self.take(key, ttl_s)
        if token is None:
            yield False
            return
        stop = threading.Event()
        renewer = threading.Thread(
            target=self._keep, args=(key, token, ttl_s, stop), name="lease-renewal", daemon=True
        )
        renewer.start()
        try:
            yield True
        finally:
            stop.set()
            renewer.join()
            with contextlib.suppress(redis_py.RedisError):
                self.release(key, token)

    def _keep(self, key: str, token: str, ttl_s: float, stop: threading.Event) -> None:
        while not stop.wait(max(0.1, ttl_s / 3)):
            with contextlib.suppress(redis_py.RedisError):
                self.renew(key, token, ttl_s)
