"""Subscription bodies read into outbound entries, or refused with the reason."""

from __future__ import annotations

import base64
import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway.providers.subscription import (
    BodyError,
    ProxyContent,
    SubscriptionInfo,
    detect_format,
    parse_proxy_body,
    parse_userinfo,
)

CLASH = b"""\
proxies:
  - {name: "on", type: socks5, server: 127.0.0.1, port: 1080, username: no, password: off}
  - {name: hk-ss, type: ss, server: a.example, port: "8388", cipher: aes-256-gcm, password: x}
  - name: web
    type: http
    server: h.example
    port: 8080
  - {name: vm, type: vmess, server: 1.2.3.4, port: 443, alterId: 0, cipher: auto,
     uuid: 5a8d3d3a-6a3e-4d1e-9c1d-2d0d2d3b9e4f}
  - {name: chained, type: socks5, server: c.example, port: 1080, dialer-proxy: web}
  - {name: rc4, type: ss, server: r.example, port: 1, cipher: rc4-md5, password: x}
"""


def _names(content: ProxyContent) -> list[str]:
    return [e.name for e in content.entries]


def test_a_clash_body_carries_what_spliceway_has_and_skips_the_rest() -> None:
    content = parse_proxy_body(CLASH)
    assert content.format == "clash"
    assert _names(content) == ["on", "hk-ss", "web"]
    # YAML 1.2, as mihomo reads it: `on`, `no`, `off` stay strings; "8388" is a port.
    assert dict(content.entries[0].outbound) == {
        "protocol": "socks5",
        "server": "127.0.0.1",
        "port": 1080,
        "username": "no",
        "password": "off",
    }
    assert dict(content.entries[1].outbound) == {
        "protocol": "shadowsocks",
        "server": "a.example",
        "port": 8388,
        "method": "aes-256-gcm",
        "password": "x",
    }
    skipped = {s.name: (s.type, s.reason) for s in content.skipped}
    assert set(skipped) == {"vm", "chained", "rc4"}
    assert skipped["vm"][0] == "vmess" and "vmess" in skipped["vm"][1]
    assert "dialer-proxy 'web'" in skipped["chained"][1]
    assert "rc4-md5" in skipped["rc4"][1]


def _ss_link(name: str, method: str = "aes-128-gcm", server: str = "1.2.3.4") -> str:
    userinfo = base64.urlsafe_b64encode(f"{method}:pw".encode()).decode().rstrip("=")
    return f"ss://{userinfo}@{server}:8388#{name}"


LINKS = "\n".join(
    [
        _ss_link("A%20node"),
        "socks5://u:p@5.6.7.8:1080#S",
        "trojan://pw@t.example:443#T",
        "",
        "not a link",
    ]
)


@pytest.mark.parametrize(
    "body",
    [LINKS.encode(), base64.b64encode(LINKS.encode()), base64.urlsafe_b64encode(LINKS.encode())],
    ids=["plain", "base64", "base64-url-safe"],
)
def test_share_links_plain_or_base64(body: bytes) -> None:
    content = parse_proxy_body(body)
    assert content.format == "links"
    assert _names(content) == ["A node", "S"]
    assert content.entries[1].outbound == {
        "protocol": "socks5",
        "server": "5.6.7.8",
        "port": 1080,
        "username": "u",
        "password": "p",
    }
    reasons = [(s.name, s.type) for s in content.skipped]
    assert reasons == [("T", "trojan"), ("", "")]
    assert content.skipped[1].reason.startswith("line 5: not a share link")


YAML_OUTBOUNDS = b"""\
outbounds:
  - {tag: x, protocol: socks5, server: a.example, port: 1}
  - {tag: y, protocol: vmess, server: b.example, port: 2}
"""


def test_a_spliceway_body_in_json_or_yaml() -> None:
    doc = {
        "outbounds": [
            {"tag": "x", "protocol": "socks5", "server": "a.example", "port": 1},
            {"tag": "y", "protocol": "vmess", "server": "b.example", "port": 2},
        ]
    }
    for body in (
        json.dumps(doc).encode(),
        YAML_OUTBOUNDS,
    ):
        content = parse_proxy_body(body)
        assert content.format == "spliceway"
        assert _names(content) == ["x"]
        assert content.entries[0].outbound == {
            "protocol": "socks5",
            "server": "a.example",
            "port": 1,
        }
        assert [(s.name, s.type) for s in content.skipped] == [("y", "vmess")]
        assert "protocol" in content.skipped[0].reason


def test_the_format_is_detected_as_mihomo_does() -> None:
    assert detect_format(CLASH.decode()) == "clash"
    assert detect_format('{"outbounds": []}') == "spliceway"
    assert detect_format(LINKS) == "links"
    assert detect_format(base64.b64encode(LINKS.encode()).decode()) == "links"
    # A configured format wins: a Clash document read as links has none.
    with pytest.raises(BodyError, match="no share link"):
        parse_proxy_body(CLASH, "links")
    with pytest.raises(BodyError, match="no `outbounds` list"):
        parse_proxy_body(CLASH, "spliceway")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty"),
        (b"  \n\t\n", "empty"),
        (b"\xff\xfe\x00garbage", "not UTF-8 text"),
        (b"proxies: []\x00", "NUL"),
        (b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>", "an HTML page"),
        (b"<html>\n<head><title>403</title></head>\n</html>\n", "an HTML page"),
        (b"proxies: []\n", "the `proxies` list is empty"),
        (b"proxies: {a: 1}\n", "`proxies` is not a list"),
        (b"hello world", "no share link could be read"),
        (b"# only a comment\n", "no share link in it"),
        (
            b"proxies:\n  - {name: a, type: socks5, server: x, port: 1}\n"
            b"  - {name: a, type: http, server: y, port: 2}\n",
            "two proxies are named 'a' \\(#1 and #2\\)",
        ),
        (b"proxies:\n  - {type: socks5, server: x, port: 1}\n", "proxy #1 has no name"),
        (b"proxies:\n  - {name: '', type: socks5, server: x, port: 1}\n", "proxy #1 has no name"),
        (
            b'{"outbounds": [{"tag": "a", "protocol": "direct"}, '
            b'{"tag": "a", "protocol": "block"}]}',
            "two proxies are named 'a'",
        ),
        (b'{"outbounds": []}', "the `outbounds` list is empty"),
        (b'{"outbounds": [3]}', "outbound #1 is not an object"),
    ],
)
def test_bodies_that_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        parse_proxy_body(body)


def test_a_broken_yaml_document_with_proxies_is_refused_as_clash() -> None:
    with pytest.raises(BodyError, match="not a YAML document"):
        parse_proxy_body(b"proxies:\n  - {name: a, type: [\n", "clash")


@given(st.binary(max_size=512))
def test_any_bytes_give_content_or_a_body_error(body: bytes) -> None:
    with contextlib.suppress(BodyError):
        parse_proxy_body(body)


@given(
    st.lists(
        st.sampled_from(
            [
                "proxies:",
                "  - ",
                "{name: a, type: socks5, server: x, port: 1}",
                "ss://",
                "\n",
                "#",
                ":",
            ]
        ),
        max_size=30,
    )
)
def test_near_miss_documents_never_raise_anything_else(parts: list[str]) -> None:
    with contextlib.suppress(BodyError):
        parse_proxy_body("".join(parts).encode())


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (
            "upload=455727941; download=6174315083; total=1073741824000; expire=1671815872",
            SubscriptionInfo(455727941, 6174315083, 1073741824000, 1671815872),
        ),
        ("Upload = 1; DOWNLOAD=2;total=3.9", SubscriptionInfo(1, 2, 3, 0)),
        ("upload=x; download=2; other=5; total", SubscriptionInfo(0, 2, 0, 0)),
        ("upload=-5; expire=1e3", SubscriptionInfo(0, 0, 0, 1000)),
        ("", SubscriptionInfo()),
    ],
)
def test_subscription_userinfo_as_mihomo_reads_it(header: str, expected: SubscriptionInfo) -> None:
    assert parse_userinfo(header) == expected
    assert set(expected.to_dict()) == {"upload", "download", "total", "expire"}
