"""One GET through an outbound: real loopback origins (HTTP and HTTPS with a test CA), a real
SOCKS5 upstream (microsocks), every bound of the fetch hit for real."""

from __future__ import annotations

import asyncio
import base64
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.config import DnsSettings, parse_config
from spliceway.dns import Resolver
from spliceway.engine.provider_fetch import MAX_REDIRECTS, USER_AGENT, Fetched, FetchError, fetch
from spliceway.flows.outbounds import DirectOutbound, build_outbound
from tests.helpers.provider_origin import Answer, ProviderOrigin, make_ca, provider_origin
from tests.helpers.upstreams import microsocks


def _direct() -> DirectOutbound:
    return DirectOutbound("direct", 2000, resolver=Resolver(DnsSettings()))


def get(url: str, outbound: Any = None, **options: Any) -> Fetched:
    options.setdefault("size_limit", 1 << 20)
    options.setdefault("deadline_s", 10.0)
    options.setdefault("stall_s", 5.0)

    async def run() -> Fetched:
        return await fetch(asyncio.get_running_loop(), outbound or _direct(), url, **options)

    return asyncio.run(run())


@pytest.fixture
def origin() -> Iterator[ProviderOrigin]:
    with provider_origin() as server:
        yield server


def test_a_plain_answer_with_its_headers(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(b"proxies: []\n", headers={"ETag": '"v1"', "X-A": "b"}))
    got = get(origin.url("/sub?token=secret"))
    assert (got.status, got.body, got.redirects) == (200, b"proxies: []\n", ())
    assert got.headers["etag"] == '"v1"' and got.headers["x-a"] == "b"
    head = origin.heads[-1].decode()
    assert head.startswith("GET /sub?token=secret HTTP/1.1\r\n")
    assert f"User-Agent: {USER_AGENT}\r\n" in head
    assert "Accept-Encoding: identity\r\n" in head
    assert f"Host: 127.0.0.1:{origin.port}\r\n" in head


def test_chunked_and_close_delimited_bodies(origin: ProviderOrigin) -> None:
    body = bytes(range(256)) * 1000
    origin.serve("/chunked", Answer(body, mode="stream"))
    assert get(origin.url("/chunked")).body == body


def test_request_headers_and_not_modified(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(status=304))
    got = get(origin.url("/sub"), headers={"If-None-Match": '"v1"'})
    assert got.status == 304 and got.body == b""
    assert 'If-None-Match: "v1"\r\n' in origin.heads[-1].decode()


def test_basic_credentials_from_the_url(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(b"ok"))
    get(f"http://us%40er:p%3Ass@127.0.0.1:{origin.port}/sub")
    expected = base64.b64encode(b"us@er:p:ss").decode()
    assert f"Authorization: Basic {expected}\r\n" in origin.heads[-1].decode()


def test_redirects_are_followed_and_bounded(origin: ProviderOrigin) -> None:
    origin.serve("/a", Answer(status=302, headers={"Location": "/b"}))
    origin.serve("/b", Answer(status=301, headers={"Location": origin.url("/c")}))
    origin.serve("/c", Answer(b"final"))
    got = get(origin.url("/a"))
    assert (got.body, got.url) == (b"final", origin.url("/c"))
    assert got.redirects == (origin.url("/b"), origin.url("/c"))
    origin.serve("/loop", Answer(status=307, headers={"Location": "/loop"}))
    with pytest.raises(FetchError, match=f"more than {MAX_REDIRECTS} redirects"):
        get(origin.url("/loop"))
    assert origin.count("/loop") == MAX_REDIRECTS + 1
    origin.serve("/ftp", Answer(status=302, headers={"Location": "ftp://127.0.0.1/x"}))
    with pytest.raises(FetchError, match="not an http:// or https:// URL"):
        get(origin.url("/ftp"))


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (Answer(b"<html>oops</html>", 500), "the origin answered HTTP 500"),
        (Answer(b"", 404), "HTTP 404"),
        (Answer(mode="reset"), "closed before an answer|reset"),
    ],
)
def test_error_answers(origin: ProviderOrigin, answer: Answer, message: str) -> None:
    origin.serve("/sub", answer)
    with pytest.raises(FetchError, match=message) as caught:
        get(origin.url("/sub"))
    if answer.status >= 400 and answer.mode == "":
        assert caught.value.status == answer.status


def test_a_stalled_origin_fails_at_the_stall_timeout(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(b"x" * 100, mode="stall", headers={"Content-Length": "100"}))
    started = time.monotonic()
    with pytest.raises(FetchError, match=r"sent nothing for 0.5 s \(stalled\)"):
        get(origin.url("/sub"), stall_s=0.5, deadline_s=10)
    assert time.monotonic() - started < 5


def test_the_deadline_bounds_an_origin_that_trickles(origin: ProviderOrigin) -> None:
    # Bytes keep coming (each within the stall timeout) but the whole takes too long.
    release = threading.Event()

    class Trickle(ProviderOrigin):
        def _send(self, conn: Any, answer: Answer) -> None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(1000):
                if release.wait(0.05):
                    return
                conn.sendall(b"x")

    with Trickle() as slow:
        slow.serve("/sub", Answer())
        try:
            with pytest.raises(FetchError, match=r"no complete answer within 0\.5 s"):
                get(slow.url("/sub"), stall_s=2, deadline_s=0.5)
        finally:
            release.set()


def test_the_size_limit_is_enforced_while_reading(origin: ProviderOrigin) -> None:
    big = b"y" * (3 << 20)
    origin.serve("/declared", Answer(big))
    with pytest.raises(FetchError, match=r"larger than size_limit_bytes \(1048576\) \(it declares"):
        get(origin.url("/declared"))
    origin.serve("/streamed", Answer(big, mode="stream"))
    with pytest.raises(FetchError, match=r"larger than size_limit_bytes \(1048576\)$"):
        get(origin.url("/streamed"))
    origin.serve("/exact", Answer(b"z" * (1 << 20)))
    assert len(get(origin.url("/exact")).body) == 1 << 20


def test_a_huge_head_is_refused(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(b"x", headers={f"X-{i}": "v" * 1000 for i in range(80)}))
    with pytest.raises(FetchError, match="head is longer than"):
        get(origin.url("/sub"))


def test_not_http_at_all() -> None:
    class Garbage(ProviderOrigin):
        def _send(self, conn: Any, answer: Answer) -> None:
            conn.sendall(b"\x16\x03\x01 this is not http\r\n\r\n")

    with Garbage() as bad:
        bad.serve("/", Answer())
        with pytest.raises(FetchError, match="not an HTTP answer"):
            get(bad.url("/"))


def test_an_unreachable_origin_names_the_outbound() -> None:
    with provider_origin() as gone:
        url = gone.url("/sub")
    with pytest.raises(FetchError, match=r"cannot reach 127\.0\.0\.1:\d+ through 'direct'"):
        get(url)


def test_https_with_the_tests_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, context = make_ca(tmp_path)
    with provider_origin(context) as secure:
        secure.serve("/sub", Answer(b"over tls", headers={"ETag": "t"}))
        # Not trusted yet: the system's store does not know the test CA.
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
        with pytest.raises(FetchError, match="TLS: CERTIFICATE_VERIFY_FAILED"):
            get(secure.url("/sub"))
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        got = get(secure.url("/sub"))
        assert (got.body, got.headers["etag"]) == (b"over tls", "t")
        secure.serve("/big", Answer(b"b" * 300_000, mode="stream"))
        assert len(get(secure.url("/big")).body) == 300_000


def test_through_a_socks5_upstream(origin: ProviderOrigin) -> None:
    origin.serve("/sub", Answer(b"via socks"))
    with microsocks() as port:
        spec = parse_config(
            {
                "outbounds": [
                    {"tag": "up", "protocol": "socks5", "server": "127.0.0.1", "port": port}
                ]
            }
        ).find_outbound("up")
        outbound = build_outbound(spec, Resolver(DnsSettings()))
        assert get(origin.url("/sub"), outbound).body == b"via socks"
    with pytest.raises(FetchError, match="through 'up'"):
        get(origin.url("/sub"), outbound)


def test_tls_errors_are_failures_not_exceptions(origin: ProviderOrigin) -> None:
    # An https URL to a plain-HTTP origin: the handshake meets HTTP.
    origin.serve("/sub", Answer(b"plain"))
    url = origin.url("/sub").replace("http://", "https://")
    with pytest.raises(FetchError) as caught:
        get(url)
    assert isinstance(caught.value, FetchError) and not isinstance(caught.value, ssl.SSLError)
