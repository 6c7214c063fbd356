"""Which network destinations media may come from.

One parser (:func:`parse_http_url`) produces the :class:`HttpTarget` that is
both checked and requested, so the check and the connection can never disagree
about the host (CVE-2026-46526 was two parsers reading
``http://127.0.0.1:6666\\@1.1.1.1`` differently). Addresses are checked after
DNS resolution and the caller connects to exactly the addresses returned here.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from vlmq.config.errors import InvalidRequest, MediaFetchTransient, MediaForbidden
from vlmq.workers.media.deadline import Deadline, call_with_deadline

__all__ = [
    "HttpTarget",
    "IPAddress",
    "Resolver",
    "check_addresses",
    "check_host_allowed",
    "is_public_address",
    "normalize_host",
    "parse_http_url",
    "resolve_host",
    "system_resolver",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (host, port) -> textual addresses; injectable so tests never need real DNS.
Resolver = Callable[[str, int], list[str]]

MAX_URL_LENGTH = 8192
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = r"[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")

# Ranges that ``ip.is_global`` lets through on some Python versions but that
# must never be fetched: multicast, NAT64 and 6to4/Teredo (which embed an IPv4
# address that may be private), IPv4-compatible IPv6, benchmarking, reserved.
_BLOCKED_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "192.0.0.0/24",
        "198.18.0.0/15",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/96",
        "::ffff:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2001::/32",
        "2002::/16",
        "fc00::/7",
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)


@dataclass(frozen=True)
class HttpTarget:
    """A parsed http(s) URL: what is checked is exactly what is requested."""

    url: str
    scheme: str
    host: str  # normalized: lowercase, no brackets, no trailing dot
    port: int
    request_target: str  # path and query, sent verbatim on the request line

    @property
    def is_tls(self) -> bool:
        return self.scheme == "https"


def parse_http_url(url: str) -> HttpTarget:
    """Parse and validate an http(s) URL, refusing every ambiguous form."""
    _check_url_characters(url)
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host
        raise InvalidRequest("media URL is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise InvalidRequest("media URL must use http or https")
    if "@" in parts.netloc:
        raise InvalidRequest("media URL must not contain user info")
    try:
        hostname, port = parts.hostname, parts.port
    except ValueError:
        raise InvalidRequest("media URL has an invalid host or port") from None
    if not hostname:
        raise InvalidRequest("media URL has no host")
    host = normalize_host(hostname)
    path = parts.path or "/"
    request_target = f"{path}?{parts.query}" if parts.query else path
    return HttpTarget(
        url=url,
        scheme=scheme,
        host=host,
        port=port if port is not None else _DEFAULT_PORTS[scheme],
        request_target=request_target,
    )


def _check_url_characters(url: str) -> None:
    if len(url) > MAX_URL_LENGTH:
        raise InvalidRequest("media URL is too long")
    if not url.isascii():
        raise InvalidRequest("media URL must be ASCII (percent-encode paths, punycode hosts)")
    if "\\" in url:
        # Browsers and some parsers treat "\" as "/", urllib does not.
        raise InvalidRequest("media URL must not contain backslashes")
    if any(ch <= " " or ch == "\x7f" for ch in url):
        raise InvalidRequest("media URL must not contain spaces or control characters")


def normalize_host(host: str) -> str:
    """Lowercase, strip IPv6 brackets and a trailing dot; reject odd forms."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.endswith("."):
        host = host[:-1]  # "example.com." is the same host as "example.com"
    if "%" in host:
        # Percent-encoded hosts and IPv6 zone ids ("%eth0") mean different
        # things to different parsers; none is needed for a media URL.
        raise InvalidRequest("media URL has an invalid host")
    if ":" in host:
        # Only an IPv6 literal may contain ':'.
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise InvalidRequest("media URL has an invalid host") from None
    if not _HOSTNAME_RE.match(host):
        raise InvalidRequest("media URL has an invalid host")
    return host


def check_host_allowed(host: str, allowed_hosts: Iterable[str]) -> None:
    """Exact host match against the allowlist; no implicit subdomains."""
    allowed = {_normalize_allowlist_entry(entry) for entry in allowed_hosts}
    allowed.discard(None)
    if not allowed:
        raise MediaForbidden("remote media URLs are not enabled")
    if host not in allowed:
        raise MediaForbidden("media host is not allowed")


def _normalize_allowlist_entry(entry: str) -> str | None:
    try:
        return normalize_host(entry)
    except InvalidRequest:
        return None  # a malformed entry matches nothing


def is_public_address(ip: IPAddress) -> bool:
    """True only for globally routable unicast addresses."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return False
    if not ip.is_global or ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return False
    return not any(ip in net for net in _BLOCKED_NETWORKS if net.version == ip.version)


def _is_usable_when_private_allowed(ip: IPAddress) -> bool:
    # Even the testing escape hatch never connects to "any" or to a group.
    return not (ip.is_unspecified or ip.is_multicast)


def check_addresses(addresses: list[IPAddress], allow_private: bool) -> list[IPAddress]:
    """Refuse the host if ANY address is not public (mixed records included)."""
    if not addresses:
        raise MediaFetchTransient("could not resolve media host")
    allowed = _is_usable_when_private_allowed if allow_private else is_public_address
    if not all(allowed(ip) for ip in addresses):
        raise MediaForbidden("media host resolves to a non-public address")
    return addresses


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


def resolve_host(host: str, port: int, resolver: Resolver, deadline: Deadline) -> list[IPAddress]:
    """Resolve within the fetch deadline; literals skip DNS. Order kept, dups dropped."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        raw = call_with_deadline(lambda: resolver(host, port), deadline)
    except (OSError, UnicodeError):
        raise MediaFetchTransient("could not resolve media host") from None
    addresses: list[IPAddress] = []
    for text in raw:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise MediaFetchTransient("could not resolve media host") from None
        if ip not in addresses:
            addresses.append(ip)
    return addresses
