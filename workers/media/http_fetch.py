"""http(s) media downloads that cannot be steered at internal addresses.

Each hop: parse once, check the host against the allowlist, resolve, check
every address, then connect to one of exactly those addresses (Host header and
TLS SNI/certificate check still use the URL's host). Redirects are only
followed when ``max_redirects`` allows it, and every hop is checked again.
A watchdog shuts the socket at the fetch deadline, so neither slow headers nor
a slow-drip body can stretch a download past its total budget.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import urljoin

from vlmq.config.errors import (
    InvalidRequest,
    MediaFetchFailed,
    MediaFetchTransient,
    MediaTooLarge,
    VlmqError,
)
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.deadline import Deadline
from vlmq.workers.media.netpolicy import (
    HttpTarget,
    IPAddress,
    Resolver,
    check_addresses,
    check_host_allowed,
    parse_http_url,
    resolve_host,
    system_resolver,
)
from vlmq.workers.media.pinned import SocketHook, pinned_connection

__all__ = ["HttpFetcher"]

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_TRANSIENT_4XX = frozenset({408, 429})
_CHUNK = 64 * 1024
_USER_AGENT = "vlmq-media/0.1"


@dataclass(frozen=True)
class _Hop:
    """One request's outcome: a body (with the server's version tag of it), "not modified"
    (the version the caller named is current), or where the server redirected to."""

    body: bytes | None = None
    location: str | None = None
    not_modified: bool = False
    version: str | None = None


class _Watchdog:
    """Shuts the connection's socket down at the deadline, waking any blocked
    recv (TLS handshake, headers, body). After it fires, whatever the reader
    saw (EOF, half a header) is reported as a timeout."""

    def __init__(self, deadline: Deadline) -> None:
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(deadline.remaining(), self._fire)
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.fired.is_set():
                _shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired.set()
            if self._sock is not None:
                _shutdown(self._sock)


def _shutdown(sock: socket.socket) -> None:
    # socket.socket.shutdown directly: an SSLSocket's own shutdown would try to
    # unwrap TLS from this (foreign) thread. The fd is shared, so this works
    # on the raw socket before and after wrapping.
    with contextlib.suppress(OSError):  # already closed
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class HttpFetcher:
    """Downloads one http(s) URL under a byte cap and a total deadline."""

    def __init__(
        self,
        settings: MediaSettings,
        resolver: Resolver | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._settings = settings
        self._resolver = resolver or system_resolver
        # A custom context may add a private CA; it must keep verification on.
        self._tls_context = tls_context or ssl.create_default_context()

    def fetch_versioned(
        self, url: str, cap: int, deadline: Deadline, known: str | None = None
    ) -> tuple[bytes | None, str | None]:
        """The body and the server's version tag of it (``etag:…`` or ``modified:…``, None
        when it sends neither); with ``known`` (a tag from before) a conditional GET, and
        (None, known) when the server answers 304: the copy behind ``known`` is current."""
        target = parse_http_url(url)
        redirects = 0
        while True:
            hop = self._fetch_hop(target, cap, deadline, known)
            if hop.not_modified:
                return None, known
            if hop.body is not None:
                return hop.body, hop.version
            if redirects >= self._settings.max_redirects:
                raise MediaFetchFailed("media URL redirects and redirects are not followed")
            redirects += 1
            target = _redirect_target(target, hop.location or "")

    def _fetch_hop(
        self, target: HttpTarget, cap: int, deadline: Deadline, known: str | None
    ) -> _Hop:
        check_host_allowed(target.host, self._settings.allowed_hosts)
        addresses = resolve_host(target.host, target.port, self._resolver, deadline)
        check_addresses(addresses, self._settings.allow_private_addresses)
        with _Watchdog(deadline) as watchdog:
            try:
                return self._connect_and_exchange(target, addresses, cap, deadline, watchdog, known)
            except VlmqError:
                if watchdog.fired.is_set():
                    raise _timed_out() from None
                raise
            except (OSError, http.client.HTTPException, ValueError) as exc:
                timed_out = watchdog.fired.is_set() or deadline.expired()
                raise (_timed_out() if timed_out else _network_error(exc)) from None

    def _connect_and_exchange(
        self,
        target: HttpTarget,
        addresses: list[IPAddress],
        cap: int,
        deadline: Deadline,
        watchdog: _Watchdog,
        known: str | None,
    ) -> _Hop:
        conn = self._connect(target, addresses, deadline, watchdog)
        try:
            hop = self._exchange(conn, target, cap, deadline, known)
        finally:
            conn.close()
        if watchdog.fired.is_set():
            raise _timed_out()  # the response was cut short, not complete
        return hop

    def _connect(
        self,
        target: HttpTarget,
        addresses: list[IPAddress],
        deadline: Deadline,
        watchdog: _Watchdog,
    ) -> http.client.HTTPConnection:
        """Try the checked addresses in resolver order; never anything else."""
        for address in addresses:
            conn = self._new_connection(target, address, deadline.check(), watchdog.attach)
            try:
                conn.connect()
                return conn
            except ssl.SSLCertVerificationError:
                conn.close()
                raise MediaFetchFailed("media server TLS certificate is not valid") from None
            except OSError:
                conn.close()
                if watchdog.fired.is_set():
                    raise
        deadline.check()
        raise MediaFetchTransient("could not connect to media server")

    def _new_connection(
        self, target: HttpTarget, address: IPAddress, timeout: float, on_socket: SocketHook
    ) -> http.client.HTTPConnection:
        return pinned_connection(target, address, timeout, self._tls_context, on_socket)

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        target: HttpTarget,
        cap: int,
        deadline: Deadline,
        known: str | None,
    ) -> _Hop:
        _send_request(conn, target, known)
        _set_timeout(conn, deadline)
        response = conn.getresponse()
        try:
            return _handle_response(conn, response, cap, deadline, known is not None)
        finally:
            response.close()  # the response holds the socket open via makefile()


def _handle_response(
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
    cap: int,
    deadline: Deadline,
    conditional: bool = False,
) -> _Hop:
    if conditional and response.status == 304:
        return _Hop(not_modified=True)
    if response.status in _REDIRECT_STATUSES:
        location = response.getheader("Location")
        if not location:
            raise MediaFetchFailed("media server sent a redirect without a location")
        return _Hop(location=location)
    _check_status(response.status)
    if response.length is not None and response.length > cap:
        raise MediaTooLarge("media is larger than the allowed size")
    return _Hop(body=_read_body(conn, response, cap, deadline), version=_version_of(response))


def _version_of(response: http.client.HTTPResponse) -> str | None:
    """The server's tag for this body: its ETag, else its Last-Modified date."""
    etag = response.getheader("ETag")
    if etag:
        return f"etag:{etag}"
    modified = response.getheader("Last-Modified")
    return f"modified:{modified}" if modified else None


def _redirect_target(current: HttpTarget, location: str) -> HttpTarget:
    """Resolve Location against the current URL, then the same parser and,
    back in the loop, the same host and address checks as the first hop."""
    try:
        return parse_http_url(urljoin(current.url, location))
    except InvalidRequest:
        raise MediaFetchFailed("media server redirected to an unusable URL") from None


def _send_request(
    conn: http.client.HTTPConnection, target: HttpTarget, known: str | None = None
) -> None:
    conn.putrequest("GET", target.request_target, skip_accept_encoding=True)
    if known is not None:
        kind, _, value = known.partition(":")
        conn.putheader("If-None-Match" if kind == "etag" else "If-Modified-Since", value)
    # identity: a compressed body would dodge the byte cap and fail to decode.
    conn.putheader("Accept-Encoding", "identity")
    conn.putheader("Accept", "*/*")
    conn.putheader("User-Agent", _USER_AGENT)
    conn.putheader("Connection", "close")
    conn.endheaders()


def _set_timeout(conn: http.client.HTTPConnection, deadline: Deadline) -> None:
    if conn.sock is not None:
        conn.sock.settimeout(deadline.check())


def _check_status(status: int) -> None:
    if status == 200:
        return
    if status in _TRANSIENT_4XX or status >= 500:
        raise MediaFetchTransient(f"media server returned HTTP {status}")
    if 400 <= status < 500:
        raise MediaFetchFailed(f"media server returned HTTP {status}")
    raise MediaFetchFailed(f"media server returned unexpected HTTP {status}")


def _read_body(
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
    cap: int,
    deadline: Deadline,
) -> bytes:
    """Read with one system call per chunk so the deadline is seen between chunks."""
    expected = response.length
    body = bytearray()
    while True:
        _set_timeout(conn, deadline)
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        body += chunk
        if len(body) > cap:
            raise MediaTooLarge("media is larger than the allowed size")
    if expected is not None and len(body) < expected:
        raise MediaFetchTransient("media server closed the connection early")
    return bytes(body)


def _timed_out() -> MediaFetchTransient:
    return MediaFetchTransient("media fetch timed out")


def _network_error(exc: BaseException) -> VlmqError:
    """Map socket / HTTP parsing failures to client-safe errors (no exc text)."""
    if isinstance(exc, TimeoutError):
        return _timed_out()
    if isinstance(exc, ssl.SSLCertVerificationError):
        return MediaFetchFailed("media server TLS certificate is not valid")
    if isinstance(exc, (http.client.IncompleteRead, http.client.RemoteDisconnected)):
        return MediaFetchTransient("media server closed the connection early")
    if isinstance(exc, http.client.HTTPException):
        return MediaFetchFailed("media server sent an invalid HTTP response")
    return MediaFetchTransient("network error while fetching media")
