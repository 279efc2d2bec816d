"""HTTP/1.x proxy heads: known requests, fuzzing, prefix and round-trip properties."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.protocols import NEED_MORE, ProtocolError
from spliceway.protocols import http as h
from tests.protocols import contract
from tests.protocols.contract import check_prefixes, mutated

FUZZ = settings.get_profile("protocols")

# What curl 8 sends to an HTTP proxy, for a plain http URL and for https (CONNECT).
CURL_GET = (
    b"GET http://example.com/path?q=1 HTTP/1.1\r\n"
    b"Host: example.com\r\n"
    b"User-Agent: curl/8.5.0\r\n"
    b"Accept: */*\r\n"
    b"Proxy-Connection: Keep-Alive\r\n"
    b"\r\n"
)
CURL_CONNECT = (
    b"CONNECT example.com:443 HTTP/1.1\r\n"
    b"Host: example.com:443\r\n"
    b"User-Agent: curl/8.5.0\r\n"
    b"Proxy-Connection: Keep-Alive\r\n"
    b"\r\n"
)
# Firefox with proxy credentials (user "alice", password "s3cr:t").
FIREFOX_CONNECT = (
    b"CONNECT www.mozilla.org:443 HTTP/1.1\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0\r\n"
    b"Proxy-Connection: keep-alive\r\n"
    b"Connection: keep-alive\r\n"
    b"Host: www.mozilla.org:443\r\n"
    b"Proxy-Authorization: Basic YWxpY2U6czNjcjp0\r\n"
    b"\r\n"
)
POST_WITH_BODY = (
    b"POST http://api.example/v1 HTTP/1.1\r\n"
    b"Host: api.example\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: 2\r\n"
    b"\r\n"
    b"{}"
)
UPSTREAM_OK = b"HTTP/1.1 200 Connection established\r\nProxy-Agent: squid/6\r\n\r\n"
UPSTREAM_407 = (
    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
    b'Proxy-Authenticate: Basic realm="squid"\r\n'
    b"Content-Length: 0\r\n"
    b"\r\n"
)

REQUEST_SEEDS = [
    CURL_GET,
    CURL_CONNECT,
    FIREFOX_CONNECT,
    POST_WITH_BODY,
    b"GET http://a/ HTTP/1.0\n\n",
    b"\r\nGET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
]
RESPONSE_SEEDS = [
    UPSTREAM_OK,
    UPSTREAM_407,
    b"HTTP/1.0 200\n\n",
    b"HTTP/1.1 502 Bad Gateway\r\n\r\n",
]


def check_contract(parser: Callable[[bytes], Any], buf: bytes) -> Any:
    return contract.check_contract(parser, buf, b"GET / HTTP/1.1\r\n")


def status_of(exc: ProtocolError) -> int:
    assert exc.reply is not None
    return int(exc.reply.split(b" ", 2)[1])


# -- parse_request_head ------------------------------------------------------------------


def test_parse_curl_get():
    head = h.parse_request_head(CURL_GET)
    assert head == h.RequestHead(
        "GET",
        "http://example.com/path?q=1",
        "HTTP/1.1",
        (
            ("Host", "example.com"),
            ("User-Agent", "curl/8.5.0"),
            ("Accept", "*/*"),
            ("Proxy-Connection", "Keep-Alive"),
        ),
        len(CURL_GET),
    )
    assert head.header("host") == head.header("HOST") == "example.com"
    assert head.header("Cookie") is None


def test_parse_connect_keeps_early_data_for_the_caller():
    client_hello = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1"
    head = h.parse_request_head(CURL_CONNECT + client_hello)
    assert head is not NEED_MORE
    assert (head.method, head.target, head.consumed) == (
        "CONNECT",
        "example.com:443",
        len(CURL_CONNECT),
    )


def test_parse_post_does_not_consume_the_body():
    head = h.parse_request_head(POST_WITH_BODY)
    assert head is not NEED_MORE
    assert POST_WITH_BODY[head.consumed :] == b"{}"
    assert head.header("content-length") == "2"


@pytest.mark.parametrize(
    ("buf", "method", "headers"),
    [
        (b"GET http://a/ HTTP/1.1\nHost: a\n\n", "GET", (("Host", "a"),)),  # bare LF
        (b"GET http://a/ HTTP/1.1\r\nHost: a\n\r\n", "GET", (("Host", "a"),)),  # mixed
        (b"\r\n\r\nGET http://a/ HTTP/1.1\r\n\r\n", "GET", ()),  # leading empty lines
        (b"GET http://a/ HTTP/1.1\r\nX:  v  \t\r\n\r\n", "GET", (("X", "v"),)),  # OWS
        (b"GET http://a/ HTTP/1.1\r\nX:\r\n\r\n", "GET", (("X", ""),)),  # empty value
        (b"M-SEARCH * HTTP/1.1\r\n\r\n", "M-SEARCH", ()),
        (b"GET http://a/ HTTP/1.1\r\nX: caf\xe9\r\n\r\n", "GET", (("X", "caf\xe9"),)),
        (
            b"GET http://a/ HTTP/1.1\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n",
            "GET",
            (("Content-Length", "5, 5"), ("Content-Length", "5")),
        ),
    ],
)
def test_parse_request_head_variants(buf, method, headers):
    head = h.parse_request_head(buf)
    assert head is not NEED_MORE
    assert (head.method, head.headers, head.consumed) == (method, headers, len(buf))


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"\r",
        b"\r\n",
        b"G",
        b"GET http://a/ HTTP/1.1",
        b"GET http://a/ HTTP/1.1\r",
        b"GET http://a/ HTTP/1.1\r\n",
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\n",
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r",
    ],
)
def test_parse_request_head_needs_more(buf):
    assert h.parse_request_head(buf) is NEED_MORE


@pytest.mark.parametrize(
    "buf",
    [
        b"GET http://a/ HTTP/1.1\r\nX: a\r\n  folded\r\n\r\n",  # obs-fold
        b"GET http://a/ HTTP/1.1\r\nX: a\x00b\r\n\r\n",  # NUL in a value
        b"GET http://a/ HTTP/1.1\r\nX : a\r\n\r\n",  # space before colon
        b"GET http://a/ HTTP/1.1\r\nno colon\r\n\r\n",
        b"GET http://a/ HTTP/1.1\r\n: a\r\n\r\n",  # empty name
        b"GET http://a/ HTTP/1.1\r\nX: a\rb\r\n\r\n",  # bare CR
        b"GET http://a/ HTTP/1.1\r\nX: a\x01\r\n\r\n",  # control character
        b"GE(T http://a/ HTTP/1.1\r\n\r\n",  # not a token
        b"GET  http://a/ HTTP/1.1\r\n\r\n",  # two spaces
        b"GET http://a/ HTTP/1.1 \r\n\r\n",
        b"GET http://a/\r\n\r\n",  # HTTP/0.9
        b"GET http://a/ http/1.1\r\n\r\n",
        b"GET http://a/ HTTP/1.10\r\n\r\n",
        b"GET http://a/\x7f HTTP/1.1\r\n\r\n",
        b"\tGET http://a/ HTTP/1.1\r\n\r\n",
        # Framing a second parser could read differently (request smuggling).
        b"POST http://a/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST http://a/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"POST http://a/ HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n",
        b"POST http://a/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST http://a/ HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    ],
)
def test_parse_request_head_rejects_with_400(buf):
    with pytest.raises(ProtocolError) as info:
        h.parse_request_head(buf)
    assert status_of(info.value) == 400
    assert info.value.reply is not None
    assert info.value.reply.endswith(b"\r\n\r\nBad Request\n")
    assert b"Connection: close\r\n" in info.value.reply


@pytest.mark.parametrize(
    "buf",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
        b"\x05\x01\x00",  # a SOCKS5 greeting
        b"SSH-2.0-OpenSSH_9.6\r",
        b"GET http://a/ HTTP/1.1 extra\r\n",  # the first line alone is enough
        b"GET http://a/ HTTP/1.1\x00",
    ],
)
def test_parse_request_head_rejects_garbage_early(buf):
    with pytest.raises(ProtocolError) as info:
        h.parse_request_head(buf)
    assert status_of(info.value) == 400


def test_parse_request_head_rejects_other_versions_with_505():
    with pytest.raises(ProtocolError) as info:
        h.parse_request_head(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert status_of(info.value) == 505


def test_parse_request_head_size_bound():
    head = b"GET http://a/ HTTP/1.1\r\nX: " + b"y" * 100 + b"\r\n\r\n"
    assert h.parse_request_head(head, max_size=len(head)) != NEED_MORE
    for buf in (head, head[:-1], head + b"more"):
        with pytest.raises(ProtocolError) as info:
            h.parse_request_head(buf, max_size=len(head) - 1)
        assert status_of(info.value) == 431
    # Default bound: 64 KiB of headers without an end is refused, not waited on forever.
    endless = b"GET http://a/ HTTP/1.1\r\n" + b"X-Pad: " + b"p" * 70000
    with pytest.raises(ProtocolError) as info:
        h.parse_request_head(endless)
    assert status_of(info.value) == 431
    # Leading empty lines count too.
    with pytest.raises(ProtocolError):
        h.parse_request_head(b"\r\n" * 40000)


def test_parse_request_head_accepts_bytearray():
    assert h.parse_request_head(bytearray(CURL_GET)) == h.parse_request_head(CURL_GET)


# -- targets -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("example.com:443", ("example.com", 443)),
        ("EXAMPLE.com:443", ("example.com", 443)),
        ("1.2.3.4:80", ("1.2.3.4", 80)),
        ("[::1]:8443", ("::1", 8443)),
        ("[2001:DB8:0:0:0:0:0:1]:443", ("2001:db8::1", 443)),
        ("_acme.example:1", ("_acme.example", 1)),
        ("example.com:00443", ("example.com", 443)),
    ],
)
def test_connect_authority(target, expected):
    assert h.connect_authority(target) == expected


@pytest.mark.parametrize(
    "target",
    [
        "example.com",
        "example.com:",
        ":443",
        "[::1]",
        "[::1]443",
        "[::1",
        "[fe80::1%25eth0]:443",
        "[zz]:443",
        "host:0",
        "host:65536",
        "host:99999999",
        "host:+1",
        "host:\u0661\u0662",  # Arabic-Indic digits
        "user@host:443",
        "http://host:443",
        "host:443/path",
        "",
    ],
)
def test_connect_authority_rejects(target):
    with pytest.raises(ProtocolError) as info:
        h.connect_authority(target)
    assert status_of(info.value) == 400


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("http://example.com/a?b=1", ("http", "example.com", 80, "/a?b=1")),
        ("HTTP://Example.COM:8080", ("http", "example.com", 8080, "/")),
        ("http://example.com?x=1", ("http", "example.com", 80, "/?x=1")),
        ("http://[::1]:8080/x#frag", ("http", "::1", 8080, "/x")),
        ("http://example.com:/", ("http", "example.com", 80, "/")),
        ("http://example.com#f", ("http", "example.com", 80, "/")),
        ("http://10.0.0.1/%7Euser/", ("http", "10.0.0.1", 80, "/%7Euser/")),
    ],
)
def test_split_absolute_uri(target, expected):
    assert h.split_absolute_uri(target) == expected


@pytest.mark.parametrize(
    "target",
    [
        "https://example.com/",  # would need TLS to the origin: clients CONNECT instead
        "ftp://example.com/",
        "/relative",
        "*",
        "example.com:443",
        "http://",
        "http:///path",
        "http://user:pw@host/",
        "http://host:99999/",
        "http://host:0/",
        "http://ho st/",
    ],
)
def test_split_absolute_uri_rejects(target):
    with pytest.raises(ProtocolError) as info:
        h.split_absolute_uri(target)
    assert status_of(info.value) == 400


# -- credentials -------------------------------------------------------------------------


def head_with(*headers: tuple[str, str]) -> h.RequestHead:
    return h.RequestHead("CONNECT", "a:1", "HTTP/1.1", headers, 1)


def basic(raw: bytes) -> str:
    return "Basic " + base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ((("Proxy-Authorization", basic(b"user:pass")),), ("user", "pass")),
        ((("proxy-authorization", "basic " + basic(b"u:p")[6:]),), ("u", "p")),
        ((("Proxy-Authorization", basic(b"u:p:q")),), ("u", "p:q")),
        ((("Proxy-Authorization", basic(b":")),), ("", "")),
        ((("Proxy-Authorization", basic("ü:€".encode())),), ("ü", "€")),
        ((), None),
        ((("Authorization", basic(b"u:p")),), None),  # the origin's, not ours
        ((("Proxy-Authorization", "Bearer abc"),), None),
        ((("Proxy-Authorization", "Basic !!!!"),), None),
        ((("Proxy-Authorization", "Basic"),), None),
        ((("Proxy-Authorization", basic(b"nocolon")),), None),
        ((("Proxy-Authorization", basic(b"\xff:\xfe")),), None),
    ],
)
def test_proxy_basic_credentials(headers, expected):
    assert h.proxy_basic_credentials(head_with(*headers)) == expected


def test_firefox_credentials():
    head = h.parse_request_head(FIREFOX_CONNECT)
    assert head is not NEED_MORE
    assert h.proxy_basic_credentials(head) == ("alice", "s3cr:t")
    assert h.connect_authority(head.target) == ("www.mozilla.org", 443)


# -- origin_request ----------------------------------------------------------------------


def test_origin_request_for_curl():
    head = h.parse_request_head(CURL_GET)
    assert head is not NEED_MORE
    _, _, _, path = h.split_absolute_uri(head.target)
    assert h.origin_request(head, path, "example.com") == (
        b"GET /path?q=1 HTTP/1.1\r\n"
        b"Host: example.com\r\n"
        b"User-Agent: curl/8.5.0\r\n"
        b"Accept: */*\r\n"
        b"Connection: close\r\n"
        b"\r\n"
    )


def test_origin_request_drops_hop_by_hop_fields():
    head = h.parse_request_head(
        b"POST http://a.example:8080/x HTTP/1.1\r\n"
        b"Connection: keep-alive, X-Hop, Content-Length, host\r\n"
        b"X-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"Proxy-Authorization: Basic dTpw\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Content-Length: 3\r\n"
        b"X-End-To-End: 2\r\n"
        b"\r\n"
    )
    assert head is not NEED_MORE
    assert h.origin_request(head, "/x", "a.example:8080") == (
        b"POST /x HTTP/1.1\r\n"
        b"Host: a.example:8080\r\n"  # added right after the request line
        b"Content-Length: 3\r\n"  # naming it in Connection does not strip it
        b"X-End-To-End: 2\r\n"
        b"Connection: close\r\n"
        b"\r\n"
    )


def test_origin_request_replaces_a_mismatched_host_in_place():
    # RFC 9112 3.2.2: for absolute-form the target's authority wins over Host.
    head = h.parse_request_head(
        b"GET http://good.example/ HTTP/1.0\r\nAccept: */*\r\nhost: evil.example\r\n\r\n"
    )
    assert head is not NEED_MORE
    assert h.origin_request(head, "/", "good.example") == (
        b"GET / HTTP/1.0\r\nAccept: */*\r\nhost: good.example\r\nConnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("path", "host"), [("/a\r\nX: y", "a"), ("/", "a\r\nX: y"), ("", "a"), ("/", "")]
)
def test_origin_request_refuses_injection(path, host):
    head = h.parse_request_head(CURL_GET)
    assert head is not NEED_MORE
    with pytest.raises(ValueError, match="invalid"):
        h.origin_request(head, path, host)


# -- response ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((200, "Connection established"), {}, b"HTTP/1.1 200 Connection established\r\n\r\n"),
        ((204,), {}, b"HTTP/1.1 204 No Content\r\n\r\n"),
        (
            (407,),
            {"headers": [("Proxy-Authenticate", 'Basic realm="spliceway"')]},
            b"HTTP/1.1 407 Proxy Authentication Required\r\n"
            b'Proxy-Authenticate: Basic realm="spliceway"\r\n'
            b"Content-Length: 0\r\n"
            b"Connection: close\r\n\r\n",
        ),
        (
            (502,),
            {"body": b"upstream refused\n"},
            b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 17\r\nConnection: close\r\n\r\n"
            b"upstream refused\n",
        ),
        (
            (403, "Nope"),
            {"headers": [("Connection", "keep-alive"), ("Content-Length", "0")]},
            b"HTTP/1.1 403 Nope\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
        ),
        ((599,), {}, b"HTTP/1.1 599 \r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
        ((200,), {"body": b"ok"}, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    ],
)
def test_response(args, kwargs, expected):
    assert h.response(*args, **kwargs) == expected


def test_connect_established_constant():
    assert h.response(200, "Connection established") == h.CONNECT_ESTABLISHED


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((42,), {}),
        ((1000,), {}),
        ((400, "Bad\r\nX: y"), {}),
        ((400,), {"headers": [("Bad Name", "v")]}),
        ((400,), {"headers": [("X", "v\r\nY: z")]}),
    ],
)
def test_response_rejects_bad_arguments(args, kwargs):
    with pytest.raises(ValueError, match="invalid"):
        h.response(*args, **kwargs)


# -- client side -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("example.com", 443, None),
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        ),
        (
            ("2001:db8::1", 443, None),
            b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: [2001:db8::1]:443\r\n\r\n",
        ),
        (("[::1]", 22, None), b"CONNECT [::1]:22 HTTP/1.1\r\nHost: [::1]:22\r\n\r\n"),
        (
            ("10.1.2.3", 8443, ("alice", "s3cr:t")),
            b"CONNECT 10.1.2.3:8443 HTTP/1.1\r\nHost: 10.1.2.3:8443\r\n"
            b"Proxy-Authorization: Basic YWxpY2U6czNjcjp0\r\n\r\n",
        ),
    ],
)
def test_connect_request(args, expected):
    assert h.connect_request(*args) == expected


@pytest.mark.parametrize(
    "args",
    [
        ("example.com", 0, None),
        ("example.com", 65536, None),
        ("a\r\nX: y", 1, None),
        ("a b", 1, None),
        ("", 1, None),
        ("a:b", 1, None),
        ("a", 1, ("us:er", "p")),
    ],
)
def test_connect_request_rejects(args):
    with pytest.raises(ValueError):  # noqa: PT011 - several distinct messages
        h.connect_request(*args)


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (
            UPSTREAM_OK + b"\x16\x03\x03",
            h.ResponseHead(
                "HTTP/1.1",
                200,
                "Connection established",
                (("Proxy-Agent", "squid/6"),),
                len(UPSTREAM_OK),
            ),
        ),
        (
            UPSTREAM_407,
            h.ResponseHead(
                "HTTP/1.1",
                407,
                "Proxy Authentication Required",
                (("Proxy-Authenticate", 'Basic realm="squid"'), ("Content-Length", "0")),
                len(UPSTREAM_407),
            ),
        ),
        (b"HTTP/1.0 200\n\n", h.ResponseHead("HTTP/1.0", 200, "", (), 14)),
        (b"HTTP/1.1 200 \r\n\r\n", h.ResponseHead("HTTP/1.1", 200, "", (), 17)),
        (
            b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n",  # obs-fold unfolded (RFC 9112 5.2)
            h.ResponseHead("HTTP/1.1", 200, "OK", (("X", "a b"),), 29),
        ),
    ],
)
def test_parse_response_head(buf, expected):
    assert h.parse_response_head(buf) == expected


def test_response_head_header_lookup():
    head = h.parse_response_head(UPSTREAM_407)
    assert head is not NEED_MORE
    assert head.header("proxy-authenticate") == 'Basic realm="squid"'
    assert head.header("Via") is None


@pytest.mark.parametrize(
    "buf",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"\x05\x00",
        b"HTTP/2 200\r\n",  # judged as soon as the status line is complete
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 099 Low\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 O\x01K\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n X: folded first\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\x00\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * 70000,
    ],
)
def test_parse_response_head_rejects(buf):
    with pytest.raises(ProtocolError) as info:
        h.parse_response_head(buf)
    assert info.value.reply is None


@pytest.mark.parametrize("message", REQUEST_SEEDS)
def test_request_prefixes_need_more(message):
    head = check_contract(h.parse_request_head, message)
    check_prefixes(h.parse_request_head, message[: head.consumed])


@pytest.mark.parametrize("message", RESPONSE_SEEDS)
def test_response_prefixes_need_more(message):
    head = check_contract(h.parse_response_head, message)
    check_prefixes(h.parse_response_head, message[: head.consumed])


# -- properties --------------------------------------------------------------------------

tokens = st.from_regex(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,12}", fullmatch=True)
values = st.from_regex(
    r"([\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff]{0,20}[\x21-\x7e\x80-\xff])?)?", fullmatch=True
)
domains = st.from_regex(
    r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9-]{1,12}){0,3}", fullmatch=True
)
hosts = st.one_of(domains, st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))
ports = st.integers(1, 65535)
credentials = st.none() | st.tuples(
    st.text(max_size=20).filter(lambda u: ":" not in u), st.text(max_size=20)
)


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_parse_request_head(buf):
    check_contract(h.parse_request_head, buf)


@FUZZ
@given(mutated(REQUEST_SEEDS))
def test_fuzz_mutated_requests(buf):
    result = check_contract(h.parse_request_head, buf)
    if isinstance(result, h.RequestHead):
        check_prefixes(h.parse_request_head, buf[: result.consumed])


@FUZZ
@given(st.binary(min_size=64, max_size=200))
def test_fuzz_never_waits_past_max_size(buf):
    # However the bytes look, once max_size have arrived the answer is final.
    with contextlib.suppress(ProtocolError):
        assert h.parse_request_head(buf, max_size=64) is not NEED_MORE


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_parse_response_head(buf):
    check_contract(h.parse_response_head, buf)


@FUZZ
@given(mutated(RESPONSE_SEEDS))
def test_fuzz_mutated_responses(buf):
    result = check_contract(h.parse_response_head, buf)
    if isinstance(result, h.ResponseHead):
        check_prefixes(h.parse_response_head, buf[: result.consumed])


@FUZZ
@given(st.text(max_size=60))
def test_fuzz_targets(target):
    for split in (h.connect_authority, h.split_absolute_uri):
        try:
            parts = split(target)
        except ProtocolError as exc:
            error = exc
        else:
            error = None
        if error is not None:
            assert status_of(error) == 400
        else:
            assert isinstance(parts, tuple)
            assert 0 < parts[-1 if split is h.connect_authority else 2] <= 65535


@FUZZ
@given(st.text(max_size=60))
def test_fuzz_credentials_never_raise(value):
    head = head_with(("Proxy-Authorization", value))
    result = h.proxy_basic_credentials(head)
    assert result is None or len(result) == 2


@FUZZ
@given(hosts, ports, credentials)
def test_connect_request_round_trip(host, port, creds):
    wire = h.connect_request(host, port, creds)
    head = check_contract(h.parse_request_head, wire)
    assert (head.method, head.consumed) == ("CONNECT", len(wire))
    parsed_host, parsed_port = h.connect_authority(head.target)
    assert parsed_port == port
    assert h.connect_authority(head.header("Host")) == (parsed_host, port)
    assert h.connect_request(parsed_host, parsed_port, creds) == wire
    assert h.proxy_basic_credentials(head) == creds


@FUZZ
@given(
    st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]),
    hosts,
    ports,
    st.from_regex(
        r"(/[A-Za-z0-9._~%!$&'()*+,;=:@-]{0,8}){0,3}(\?[A-Za-z0-9=&]{0,10})?", fullmatch=True
    ),
    st.lists(st.tuples(tokens, values), max_size=6),
)
def test_origin_request_round_trip(method, host, port, path, headers):
    bracketed = f"[{host}]" if ":" in host else host
    target = f"http://{bracketed}:{port}{path}"
    raw = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    try:
        head = h.parse_request_head((raw + "\r\n").encode("latin-1"))
    except ProtocolError:
        return  # e.g. generated conflicting Content-Length or two Host fields
    assert head is not NEED_MORE
    assert head.headers == tuple(headers)
    _, uri_host, uri_port, origin_path = h.split_absolute_uri(head.target)
    assert uri_port == port
    host_header = f"[{uri_host}]:{uri_port}" if ":" in uri_host else f"{uri_host}:{uri_port}"
    wire = h.origin_request(head, origin_path, host_header)
    forwarded = check_contract(h.parse_request_head, wire)
    assert forwarded.target == origin_path
    assert forwarded.header("Host") == host_header
    assert forwarded.header("Connection") == "close"
    lowered = {k.lower() for k, _ in forwarded.headers}
    assert not lowered & {"proxy-authorization", "proxy-connection", "keep-alive"}


@FUZZ
@given(
    st.integers(100, 999),
    st.none() | st.from_regex(r"[A-Za-z ]{0,20}", fullmatch=True),
    st.lists(st.tuples(tokens, values), max_size=4),
    st.binary(max_size=20),
)
def test_response_round_trip(status, reason, headers, body):
    wire = h.response(status, reason, headers, body)
    head = check_contract(h.parse_response_head, wire)
    assert head.status == status
    if reason is not None:
        assert head.reason == reason
    assert wire[head.consumed :] == body
