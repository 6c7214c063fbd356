"""HTTP(S) connections to an address that was already checked, never resolved again.

The media fetcher and the webhook sender resolve a host, check every address against the
network policy (``netpolicy.check_addresses``), then connect here to one of exactly those
addresses: a second lookup (DNS rebinding) cannot steer the connection elsewhere. The Host
header, TLS SNI and the certificate check still use the URL's host.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Callable

from vlmq.workers.media.netpolicy import HttpTarget, IPAddress

__all__ = ["SocketHook", "pinned_connection"]

SocketHook = Callable[[socket.socket], None]


def _no_hook(sock: socket.socket) -> None:
    """No watchdog to attach."""


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to a checked address; the Host header still names the host."""

    def __init__(
        self, target: HttpTarget, address: IPAddress, timeout: float, on_socket: SocketHook
    ) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = address
        self._on_socket = on_socket

    def connect(self) -> None:
        self.sock = _open_socket(self._address, self.port, self.timeout, self._on_socket)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """TLS to a checked address, with SNI and certificate check for the host."""

    def __init__(
        self,
        target: HttpTarget,
        address: IPAddress,
        timeout: float,
        on_socket: SocketHook,
        context: ssl.SSLContext,
    ) -> None:
        super().__init__(target.host, target.port, timeout=timeout, context=context)
        self._address = address
        self._on_socket = on_socket
        self._tls_context = context

    def connect(self) -> None:
        raw = _open_socket(self._address, self.port, self.timeout, self._on_socket)
        try:
            self.sock = self._tls_context.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise


def _open_socket(
    address: IPAddress, port: int, timeout: float | None, on_socket: SocketHook
) -> socket.socket:
    sock = socket.create_connection((str(address), port), timeout=timeout)
    # Before the TLS handshake, so a dripping handshake is cut at the deadline too.
    on_socket(sock)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def pinned_connection(
    target: HttpTarget,
    address: IPAddress,
    timeout: float,
    tls_context: ssl.SSLContext,
    on_socket: SocketHook = _no_hook,
) -> http.client.HTTPConnection:
    """A connection to ``address`` for ``target`` (TLS when its scheme is https)."""
    if target.is_tls:
        return _PinnedHTTPSConnection(target, address, timeout, on_socket, tls_context)
    return _PinnedHTTPConnection(target, address, timeout, on_socket)
