"""Fetching media: local roots, data URIs, http(s) SSRF guards, deadlines, S3.

The http tests run a real ``http.server`` on 127.0.0.1 in a thread; only
``allow_private_addresses=True`` (testing only) lets the fetcher reach it,
and the canary tests check that a refused fetch never even connects.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.samples import data_uri, make_image
from vlmq.config.errors import (
    InvalidRequest,
    MediaDecodeFailed,
    MediaFetchFailed,
    MediaFetchTransient,
    MediaForbidden,
    MediaTooLarge,
    VlmqError,
)
from vlmq.config.settings import MediaSettings
from vlmq.workers.media import MediaLoader
from vlmq.workers.media.fetch import MediaFetcher
from vlmq.workers.media.netpolicy import is_public_address, parse_http_url

pytestmark = pytest.mark.unit

IMAGE_BYTES = base64.b64decode(
    # A 1x1 PNG, so the module needs no fixture to know a valid image.
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


def png_bytes(size: tuple[int, int] = (32, 32), seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    make_image(size, seed).save(buffer, format="PNG")
    return buffer.getvalue()


# --- a local http server -------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _TestServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        route = self.server.routes.get(self.path.split("?")[0])
        if route is None:
            self._send(404, b"not found")
            return
        # The client hanging up is what the deadline tests expect.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            route(self)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class _TestServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.paths: list[str] = []
        self.sni_names: list[str | None] = []  # TLS server names seen (https tests)
        self.routes: dict[str, Callable[[_Handler], None]] = {}

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up or refusing our test certificate are expected

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1  # every accepted TCP connection, before any parsing
        return True

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _route_png(h: _Handler) -> None:
    h._send(200, png_bytes(), {"Content-Type": "image/png"})


def _route_huge_length(h: _Handler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(10**9))
    h.end_headers()
    h.wfile.write(b"\0" * 1024)


def _route_unbounded(h: _Handler) -> None:
    h.send_response(200)
    h.send_header("Connection", "close")
    h.end_headers()
    for _ in range(64):  # 4 MiB with no Content-Length
        h.wfile.write(b"\0" * 65536)


def _route_drip(h: _Handler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "100")
    h.end_headers()
    for _ in range(100):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.2)


def _route_drip_headers(h: _Handler) -> None:
    h.wfile.write(b"HTTP/1.1 200 OK\r\n")
    for byte in b"X-Slow: " + b"a" * 100:
        h.wfile.write(bytes([byte]))
        h.wfile.flush()
        time.sleep(0.2)


def _status(code: int) -> Callable[[_Handler], None]:
    return lambda h: h._send(code, b"status")


def _redirect(location: Callable[[_Handler], str]) -> Callable[[_Handler], None]:
    return lambda h: h._send(302, b"", {"Location": location(h)})


def _start_server() -> _TestServer:
    server = _TestServer()
    server.routes.update(
        {
            "/image.png": _route_png,
            "/huge-length": _route_huge_length,
            "/unbounded": _route_unbounded,
            "/drip": _route_drip,
            "/drip-headers": _route_drip_headers,
            "/403": _status(403),
            "/404": _status(404),
            "/408": _status(408),
            "/429": _status(429),
            "/500": _status(500),
            "/503": _status(503),
            "/redirect": _redirect(lambda h: "/image.png"),
            "/redirect-twice": _redirect(lambda h: "/redirect"),
            "/redirect-metadata": _redirect(lambda h: "http://169.254.169.254/latest/meta-data/"),
            "/redirect-other-host": _redirect(lambda h: "http://example.org/image.png"),
            "/redirect-file": _redirect(lambda h: "file:///etc/passwd"),
            "/redirect-rebind": _redirect(
                lambda h: f"http://rebind.example.com:{h.server.server_address[1]}/image.png"
            ),
        }
    )
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server


@pytest.fixture
def server() -> Iterator[_TestServer]:
    srv = _start_server()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


class RecordingResolver:
    """A resolver that records lookups and resolves nothing."""

    def __init__(self) -> None:
        self.hosts: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.hosts.append(host)
        return []


def http_settings(**overrides: Any) -> MediaSettings:
    values: dict[str, Any] = {
        "allowed_hosts": ["127.0.0.1"],
        "allow_private_addresses": True,
        "image_fetch_timeout_s": 1.0,
        "max_image_bytes": 1024 * 1024,
    }
    values.update(overrides)
    return MediaSettings(**values)


# --- http(s) -------------------------------------------------------------------


def test_http_fetch_with_allowlist_and_private_addresses(server: _TestServer) -> None:
    fetcher = MediaFetcher(http_settings())
    assert fetcher.fetch(f"{server.base}/image.png", "image") == png_bytes()


def test_http_image_through_loader(server: _TestServer) -> None:
    image = MediaLoader(http_settings()).load_image(f"{server.base}/image.png")
    assert image.mode == "RGB" and image.size == (32, 32)


@pytest.mark.parametrize(
    "overrides",
    [
        {"allowed_hosts": []},  # http off by default
        {"allowed_hosts": ["example.com"]},  # host not listed
        {"allow_private_addresses": False},  # listed, but loopback
    ],
    ids=["http-disabled", "host-not-listed", "loopback-refused"],
)
def test_refused_fetch_never_connects(server: _TestServer, overrides: dict[str, Any]) -> None:
    fetcher = MediaFetcher(http_settings(**overrides))
    with pytest.raises(MediaForbidden):
        fetcher.fetch(f"{server.base}/image.png", "image")
    assert server.connections == 0  # the canary: not even a TCP handshake


def test_localhost_name_resolving_to_loopback_is_refused(server: _TestServer) -> None:
    fetcher = MediaFetcher(
        http_settings(allowed_hosts=["localhost"], allow_private_addresses=False)
    )
    port = server.server_address[1]
    with pytest.raises(MediaForbidden):
        fetcher.fetch(f"http://localhost:{port}/image.png", "image")
    assert server.connections == 0


def test_connects_to_the_checked_address_with_the_url_host(server: _TestServer) -> None:
    """The resolver's answer is what is connected to; Host still names the URL host."""
    seen: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        seen.append(host)
        return ["127.0.0.1"]

    settings = http_settings(allowed_hosts=["media.example.com"])
    fetcher = MediaFetcher(settings, resolver=resolver)
    port = server.server_address[1]
    assert fetcher.fetch(f"http://media.example.com:{port}/image.png", "image") == png_bytes()
    assert seen == ["media.example.com"]
    assert server.connections == 1


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:8.8.8.8",
        "64:ff9b::7f00:1",
        "2002:7f00:1::1",
        "ff02::1",
    ],
)
def test_non_public_resolved_addresses_are_refused(address: str) -> None:
    settings = MediaSettings(allowed_hosts=["media.example.com"])
    fetcher = MediaFetcher(settings, resolver=lambda host, port: [address])
    with pytest.raises(MediaForbidden):
        fetcher.fetch("http://media.example.com/a.png", "image")


def test_any_private_record_among_public_ones_refuses_the_host() -> None:
    settings = MediaSettings(allowed_hosts=["media.example.com"])
    fetcher = MediaFetcher(settings, resolver=lambda host, port: ["93.184.216.34", "10.0.0.1"])
    with pytest.raises(MediaForbidden):
        fetcher.fetch("http://media.example.com/a.png", "image")


def test_public_address_table() -> None:
    import ipaddress

    assert is_public_address(ipaddress.ip_address("93.184.216.34"))
    assert is_public_address(ipaddress.ip_address("2606:2800:220:1::1"))
    assert not is_public_address(ipaddress.ip_address("100.127.255.255"))
    assert not is_public_address(ipaddress.ip_address("64:ff9b::808:808"))


def test_dns_failure_is_transient() -> None:
    def resolver(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    fetcher = MediaFetcher(MediaSettings(allowed_hosts=["nx.example.com"]), resolver=resolver)
    with pytest.raises(MediaFetchTransient) as info:
        fetcher.fetch("http://nx.example.com/a.png", "image")
    assert "Name or service" not in info.value.message


def test_slow_dns_is_cut_by_the_deadline() -> None:
    def resolver(host: str, port: int) -> list[str]:
        time.sleep(3)
        return ["93.184.216.34"]

    settings = MediaSettings(allowed_hosts=["slow.example.com"], image_fetch_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(MediaFetchTransient):
        MediaFetcher(settings, resolver=resolver).fetch("http://slow.example.com/a", "image")
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("http://127.0.0.1:6666\\@1.1.1.1/a.png", InvalidRequest),
        ("http://user@127.0.0.1/a.png", InvalidRequest),
        ("http://user:pw@127.0.0.1/a.png", InvalidRequest),
        ("http://127.0.0.1 /a.png", InvalidRequest),
        ("http://127.0.0.1:99999/a.png", InvalidRequest),
        ("http:///a.png", InvalidRequest),
        ("http://[::1/a.png", InvalidRequest),
        ("http://[::1%25eth0]/a.png", InvalidRequest),
        ("http://%31%32%37.0.0.1/a.png", InvalidRequest),
        ("ftp://127.0.0.1/a.png", InvalidRequest),
        ("gopher://127.0.0.1/a.png", InvalidRequest),
        ("http://sub.example.com/a.png", MediaForbidden),  # no implicit subdomains
        ("http://example.com.evil.net/a.png", MediaForbidden),
        ("http://evil.net#@example.com/a.png", MediaForbidden),
        ("http://evil.net?@example.com/a.png", MediaForbidden),
    ],
)
def test_ambiguous_or_unlisted_urls_are_refused(url: str, error: type[Exception]) -> None:
    resolver = RecordingResolver()
    settings = MediaSettings(allowed_hosts=["example.com", "127.0.0.1"])
    with pytest.raises(error):
        MediaFetcher(settings, resolver=resolver).fetch(url, "image")
    assert resolver.hosts == []  # refused before any DNS lookup


def test_one_parser_for_check_and_request() -> None:
    target = parse_http_url("HTTP://Example.COM.:8080/a%20b.png?x=1#frag")
    assert (target.scheme, target.host, target.port) == ("http", "example.com", 8080)
    assert target.request_target == "/a%20b.png?x=1"
    assert parse_http_url("https://[::1]/x").host == "::1"


def test_content_length_over_cap_is_too_large(server: _TestServer) -> None:
    with pytest.raises(MediaTooLarge):
        MediaFetcher(http_settings()).fetch(f"{server.base}/huge-length", "image")


def test_body_without_length_is_capped_while_reading(server: _TestServer) -> None:
    with pytest.raises(MediaTooLarge):
        MediaFetcher(http_settings()).fetch(f"{server.base}/unbounded", "image")


@pytest.mark.parametrize("path", ["/drip", "/drip-headers"])
def test_slow_drip_is_cut_by_the_total_deadline(server: _TestServer, path: str) -> None:
    started = time.monotonic()
    with pytest.raises(MediaFetchTransient) as info:
        MediaFetcher(http_settings(image_fetch_timeout_s=1.0)).fetch(server.base + path, "image")
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 1.8, elapsed
    assert info.value.message == "media fetch timed out"


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/403", MediaFetchFailed),
        ("/404", MediaFetchFailed),
        ("/408", MediaFetchTransient),
        ("/429", MediaFetchTransient),
        ("/500", MediaFetchTransient),
        ("/503", MediaFetchTransient),
    ],
)
def test_http_status_classification(server: _TestServer, path: str, error: type[VlmqError]) -> None:
    with pytest.raises(error) as info:
        MediaFetcher(http_settings()).fetch(server.base + path, "image")
    assert info.value.retryable is (error is MediaFetchTransient)
    assert info.value.code == "media_fetch_failed"


def test_connection_refused_is_transient() -> None:
    with socket.socket() as sock:  # a port that is certainly closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MediaFetchTransient):
        MediaFetcher(http_settings()).fetch(f"http://127.0.0.1:{port}/a.png", "image")


def test_redirects_are_refused_by_default(server: _TestServer) -> None:
    with pytest.raises(MediaFetchFailed):
        MediaFetcher(http_settings()).fetch(f"{server.base}/redirect", "image")
    assert server.paths == ["/redirect"]


def test_redirects_followed_when_allowed_and_counted(server: _TestServer) -> None:
    fetcher = MediaFetcher(http_settings(max_redirects=1))
    assert fetcher.fetch(f"{server.base}/redirect", "image") == png_bytes()
    with pytest.raises(MediaFetchFailed):
        fetcher.fetch(f"{server.base}/redirect-twice", "image")


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/redirect-metadata", MediaForbidden),
        ("/redirect-other-host", MediaForbidden),
        ("/redirect-file", MediaFetchFailed),
    ],
)
def test_every_redirect_hop_is_checked(
    server: _TestServer, path: str, error: type[VlmqError]
) -> None:
    resolver = RecordingResolver()
    fetcher = MediaFetcher(http_settings(max_redirects=3), resolver=resolver)
    with pytest.raises(error):
        fetcher.fetch(server.base + path, "image")
    assert resolver.hosts == []  # the first hop is a literal IP; no later hop got that far


def test_redirect_hop_is_resolved_and_address_checked_again(server: _TestServer) -> None:
    """Even the testing escape hatch refuses 0.0.0.0: a later hop resolving
    there is refused although its host is allowlisted."""
    answers = {"media.example.com": ["127.0.0.1"], "rebind.example.com": ["0.0.0.0"]}
    looked_up: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return answers[host]

    settings = http_settings(
        allowed_hosts=["media.example.com", "rebind.example.com"], max_redirects=2
    )
    port = server.server_address[1]
    with pytest.raises(MediaForbidden):
        MediaFetcher(settings, resolver=resolver).fetch(
            f"http://media.example.com:{port}/redirect-rebind", "image"
        )
    assert looked_up == ["media.example.com", "rebind.example.com"]
    assert server.paths == ["/redirect-rebind"]


# --- data: URIs ----------------------------------------------------------------


def test_data_uri_round_trip() -> None:
    fetcher = MediaFetcher(MediaSettings())
    assert fetcher.fetch(data_uri(IMAGE_BYTES, "image/png"), "image") == IMAGE_BYTES
    wrapped = "data:image/png;base64," + "\n".join(
        base64.b64encode(IMAGE_BYTES).decode()[i : i + 16] for i in range(0, 200, 16)
    )
    assert fetcher.fetch(wrapped, "image") == IMAGE_BYTES  # MIME line breaks allowed


@pytest.mark.parametrize(
    ("uri", "error", "message"),
    [
        ("data:image/png;base64,@@@notbase64@@@", MediaDecodeFailed, "not valid base64"),
        ("data:image/png;base64,QUJ", MediaDecodeFailed, "not valid base64"),
        ("data:image/png;base64,", MediaDecodeFailed, "empty"),
        ("data:image/png,rawbytes", InvalidRequest, "base64"),
        ("data:image/png;base64", InvalidRequest, "malformed"),
    ],
)
def test_bad_data_uris_fail_clearly(uri: str, error: type[VlmqError], message: str) -> None:
    with pytest.raises(error) as info:
        MediaFetcher(MediaSettings()).fetch(uri, "image")
    assert message in info.value.message


def test_oversized_data_uri_rejected_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_decode(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("decoded an oversized data URI")

    monkeypatch.setattr(base64, "b64decode", must_not_decode)
    settings = MediaSettings(max_image_bytes=1000)
    with pytest.raises(MediaTooLarge):
        MediaFetcher(settings).fetch("data:image/png;base64," + "A" * 1400, "image")


def test_data_uri_at_the_cap_is_accepted() -> None:
    payload = os.urandom(999)
    settings = MediaSettings(max_image_bytes=999)
    assert MediaFetcher(settings).fetch(data_uri(payload, "image/png"), "image") == payload
    with pytest.raises(MediaTooLarge):
        MediaFetcher(settings).fetch(data_uri(payload + b"x", "image/png"), "image")


# --- local files ---------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(IMAGE_BYTES)
    (root / "sub" / "with space.png").write_bytes(IMAGE_BYTES)
    (tmp_path / "secret.png").write_bytes(IMAGE_BYTES)
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "escape-dir").symlink_to(tmp_path)
    (root / "inside-link.png").symlink_to(root / "a.png")
    return root


def local_fetcher(root: Path, **overrides: Any) -> MediaFetcher:
    return MediaFetcher(MediaSettings(local_roots=[str(root)], **overrides))


@pytest.mark.parametrize(
    "source",
    [
        "{root}/a.png",
        "file://{root}/a.png",
        "file://localhost{root}/a.png",
        "file://{root}/sub/with%20space.png",
        "{root}/sub/../a.png",
        "{root}/inside-link.png",
    ],
)
def test_local_files_under_a_root(media_root: Path, source: str) -> None:
    fetched = local_fetcher(media_root).fetch(source.format(root=media_root), "image")
    assert fetched == IMAGE_BYTES


@pytest.mark.parametrize(
    "source",
    [
        "{root}/../secret.png",
        "file://{root}/../secret.png",
        "{root}/escape.png",
        "file://{root}/escape.png",
        "{root}/escape-dir/secret.png",
        "{root}/escape-dir/does-not-exist.png",
        "/etc/passwd",
        "file:///etc/passwd",
        "file://{root}/%2E%2E/secret.png",
    ],
)
def test_local_files_outside_roots_are_forbidden(media_root: Path, source: str) -> None:
    with pytest.raises(MediaForbidden):
        local_fetcher(media_root).fetch(source.format(root=media_root), "image")


def test_local_files_forbidden_without_roots(media_root: Path) -> None:
    with pytest.raises(MediaForbidden):
        MediaFetcher(MediaSettings()).fetch(str(media_root / "a.png"), "image")


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("{root}/missing.png", MediaFetchFailed),
        ("{root}/sub", MediaFetchFailed),
        ("relative/a.png", InvalidRequest),
        ("file://otherhost{root}/a.png", MediaForbidden),
        ("{root}/a\x00.png", InvalidRequest),
        ("javascript:alert(1)", InvalidRequest),
    ],
)
def test_local_file_errors(media_root: Path, source: str, error: type[VlmqError]) -> None:
    with pytest.raises(error):
        local_fetcher(media_root).fetch(source.format(root=media_root), "image")


def test_local_file_over_cap(media_root: Path) -> None:
    with pytest.raises(MediaTooLarge):
        local_fetcher(media_root, max_image_bytes=10).fetch(str(media_root / "a.png"), "image")


def test_video_kind_uses_video_cap(media_root: Path) -> None:
    fetcher = local_fetcher(media_root, max_image_bytes=10)
    assert fetcher.fetch(str(media_root / "a.png"), "video") == IMAGE_BYTES
    with pytest.raises(InvalidRequest):
        fetcher.fetch(str(media_root / "a.png"), "audio")  # type: ignore[arg-type]


# --- s3 (moto server over real HTTP, never in-process mocks) --------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_factory(s3_endpoint: str) -> Callable[[], Any]:
    import boto3
    from botocore.config import Config

    def factory() -> Any:
        return boto3.client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(connect_timeout=2, read_timeout=2, retries={"max_attempts": 1}),
        )

    client = factory()
    client.create_bucket(Bucket="media-in")
    client.create_bucket(Bucket="other")
    client.put_object(Bucket="media-in", Key="imgs/a.png", Body=IMAGE_BYTES)
    client.put_object(Bucket="other", Key="a.png", Body=IMAGE_BYTES)
    return factory


def test_s3_fetch_from_allowed_bucket(s3_factory: Callable[[], Any]) -> None:
    fetcher = MediaFetcher(MediaSettings(allowed_buckets=["media-in"]), s3_factory)
    assert fetcher.fetch("s3://media-in/imgs/a.png", "image") == IMAGE_BYTES


@pytest.mark.parametrize(
    ("source", "overrides", "error"),
    [
        ("s3://other/a.png", {}, MediaForbidden),
        ("s3://media-in/missing.png", {}, MediaFetchFailed),
        ("s3://media-in/imgs/a.png", {"max_image_bytes": 10}, MediaTooLarge),
        ("s3://media-in", {}, InvalidRequest),
        ("s3://Bad_Bucket/a.png", {}, InvalidRequest),
    ],
)
def test_s3_errors(
    s3_factory: Callable[[], Any], source: str, overrides: dict[str, Any], error: type[VlmqError]
) -> None:
    settings = MediaSettings(allowed_buckets=["media-in"], **overrides)
    with pytest.raises(error):
        MediaFetcher(settings, s3_factory).fetch(source, "image")


def test_s3_without_factory_is_forbidden() -> None:
    with pytest.raises(MediaForbidden):
        MediaFetcher(MediaSettings(allowed_buckets=["media-in"])).fetch("s3://media-in/a", "image")


def test_s3_unreachable_endpoint_is_transient() -> None:
    import boto3
    from botocore.config import Config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def factory() -> Any:
        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(connect_timeout=1, retries={"max_attempts": 1}),
        )

    settings = MediaSettings(allowed_buckets=["media-in"])
    with pytest.raises(MediaFetchTransient):
        MediaFetcher(settings, factory).fetch("s3://media-in/a.png", "image")


# --- what clients see ------------------------------------------------------------


def test_error_messages_never_carry_reprs_or_exception_text(
    server: _TestServer, media_root: Path
) -> None:
    fetcher = MediaFetcher(http_settings(local_roots=[str(media_root)]))
    sources = [
        f"{server.base}/404",
        f"{server.base}/503",
        f"{server.base}/redirect",
        f"{server.base}/drip",
        "http://127.0.0.1:1/a.png",
        "data:image/png;base64,@@@",
        str(media_root / "missing.png"),
        str(media_root / "escape.png"),
        "s3://media-in/a.png",
    ]
    for source in sources:
        with pytest.raises(VlmqError) as info:
            fetcher.fetch(source, "image")
        record = info.value.to_dict()
        for marker in ("<", ">", "0x", "Traceback", "Errno", "object at", str(media_root)):
            assert marker not in record["message"], (source, record)


# --- https: pinned address, SNI and certificate check on the URL host -----------


@pytest.fixture(scope="module")
def tls_material() -> tuple[bytes, bytes]:
    """A self-signed certificate for media.test and 127.0.0.1 (cert PEM, key PEM)."""
    pytest.importorskip("cryptography")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "media.test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("media.test"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture
def tls_server(tls_material: tuple[bytes, bytes], tmp_path: Path) -> Iterator[_TestServer]:
    import ssl

    cert_pem, key_pem = tls_material
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    srv = _TestServer()
    srv.routes["/image.png"] = _route_png

    def record_sni(sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: Any) -> None:
        srv.sni_names.append(name)

    context.sni_callback = record_sni
    # Handshake in the handler thread, not in the accept loop.
    srv.socket = context.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_https_pins_address_and_verifies_the_url_host(
    tls_server: _TestServer, tls_material: tuple[bytes, bytes]
) -> None:
    import ssl

    trust = ssl.create_default_context(cadata=tls_material[0].decode())
    settings = http_settings(allowed_hosts=["media.test", "wrong.test"])
    fetcher = MediaFetcher(settings, resolver=lambda h, p: ["127.0.0.1"], tls_context=trust)
    port = tls_server.server_address[1]
    assert fetcher.fetch(f"https://media.test:{port}/image.png", "image") == png_bytes()
    assert tls_server.sni_names == ["media.test"]
    with pytest.raises(MediaFetchFailed):  # same address, but the cert is not for this host
        fetcher.fetch(f"https://wrong.test:{port}/image.png", "image")


def test_https_untrusted_certificate_is_permanent_failure(tls_server: _TestServer) -> None:
    port = tls_server.server_address[1]
    with pytest.raises(MediaFetchFailed) as info:
        MediaFetcher(http_settings()).fetch(f"https://127.0.0.1:{port}/image.png", "image")
    assert info.value.message == "media server TLS certificate is not valid"


@pytest.fixture
def dripping_tls_server() -> Iterator[int]:
    """Accepts TCP and drips a never-ending TLS record, one byte per 0.2 s."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.sendall(b"\x16\x03\x03\x40\x00")  # a handshake record of 16 KiB...
            while not stop.wait(0.2):
                conn.sendall(b"\x00")  # ...that never completes

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


def test_slow_tls_handshake_is_cut_by_the_total_deadline(dripping_tls_server: int) -> None:
    started = time.monotonic()
    with pytest.raises(MediaFetchTransient) as info:
        MediaFetcher(http_settings(image_fetch_timeout_s=1.0)).fetch(
            f"https://127.0.0.1:{dripping_tls_server}/a.png", "image"
        )
    assert time.monotonic() - started < 1.8
    assert info.value.message == "media fetch timed out"


# --- versioned sources: a cached decode stands while the source says it is current ------


def _versioned_route(state: dict[str, Any]) -> Callable[[_Handler], None]:
    """Serves ``state["body"]`` under ``state["header"]``/``state["tag"]``; a matching
    conditional GET gets 304 and no body."""

    def route(h: _Handler) -> None:
        asked = h.headers.get("If-None-Match") or h.headers.get("If-Modified-Since")
        state["conditional"].append(asked)
        if asked == state["tag"]:
            h._send(304, b"")
            return
        h._send(200, state["body"], {state["header"]: state["tag"]})

    return route


@pytest.mark.parametrize(
    ("header", "tag"),
    [("ETag", '"v1"'), ("Last-Modified", "Tue, 01 Dec 2026 10:00:00 GMT")],
)
def test_a_remote_image_still_current_is_not_downloaded_again(
    server: _TestServer, header: str, tag: str
) -> None:
    state: dict[str, Any] = {
        "body": png_bytes((40, 30)),
        "header": header,
        "tag": tag,
        "conditional": [],
    }
    server.routes["/versioned.png"] = _versioned_route(state)
    loader = MediaLoader(http_settings())
    url = f"{server.base}/versioned.png"
    first = loader.load_image(url)
    again = loader.load_image(url)
    assert state["conditional"] == [None, tag]  # the second GET named the version it holds
    assert again is first and loader.cache.stats.hits == 1
    # A new version: downloaded and decoded afresh.
    state["body"], state["tag"] = png_bytes((50, 20)), tag.replace("1", "2")
    changed = loader.load_image(url)
    assert changed.size == (50, 20)


def test_without_a_cache_no_version_is_remembered(server: _TestServer) -> None:
    state: dict[str, Any] = {
        "body": png_bytes(),
        "header": "ETag",
        "tag": '"v1"',
        "conditional": [],
    }
    server.routes["/versioned.png"] = _versioned_route(state)
    loader = MediaLoader(http_settings(cache_bytes=0))
    for _ in range(2):
        loader.load_image(f"{server.base}/versioned.png")
    assert state["conditional"] == [None, None]


def test_an_s3_object_still_current_is_not_downloaded_again(
    s3_factory: Callable[[], Any],
) -> None:
    gets: list[str] = []

    def counting() -> Any:
        client = s3_factory()
        get_object = client.get_object

        def get(**kwargs: Any) -> Any:
            gets.append(kwargs["Key"])
            return get_object(**kwargs)

        client.get_object = get
        return client

    loader = MediaLoader(MediaSettings(allowed_buckets=["media-in"]), counting)
    first = loader.load_image("s3://media-in/imgs/a.png")
    assert loader.load_image("s3://media-in/imgs/a.png") is first
    assert gets == ["imgs/a.png"]  # HEAD showed the same ETag: no second download
    s3_factory().put_object(Bucket="media-in", Key="imgs/a.png", Body=png_bytes((20, 10)))
    assert loader.load_image("s3://media-in/imgs/a.png").size == (20, 10)
    assert len(gets) == 2
