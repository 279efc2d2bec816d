"""spliceway.clash.links: share-link lists read as mihomo's ConvertsV2Ray reads them."""

from __future__ import annotations

import base64
import json

import pytest

from spliceway.clash.links import decode_base64, decode_body, looks_like_links, parse_links
from spliceway.clash.proxies import Converted, Skipped, convert_proxy


def _b64(text: str, *, urlsafe: bool = False, pad: bool = True) -> str:
    raw = text.encode()
    out = (base64.urlsafe_b64encode(raw) if urlsafe else base64.b64encode(raw)).decode()
    return out if pad else out.rstrip("=")


SIP002 = "ss://" + _b64("aes-256-gcm:s3cr3t", urlsafe=True, pad=False) + "@198.51.100.1:8388"
LEGACY = "ss://" + _b64("chacha20-ietf-poly1305:p@ss:w0rd@198.51.100.2:8389")
VMESS = "vmess://" + _b64(
    json.dumps(
        {
            "v": "2",
            "ps": "🇺🇸 US vmess",
            "add": "us.example.net",
            "port": 443,
            "id": "2f0b8f3e-0000-4000-8000-000000000000",
            "aid": "0",
            "scy": "auto",
            "net": "ws",
            "type": "none",
            "host": "cdn.example.net",
            "path": "/ray",
            "tls": "tls",
            "sni": "cdn.example.net",
        }
    )
)
LINES = [
    SIP002 + "#%F0%9F%87%AD%F0%9F%87%B0%20HK%2001",
    SIP002 + "/?plugin=obfs-local%3Bobfs%3Dhttp%3Bobfs-host%3Dbing.com#obfs",
    SIP002 + "/?plugin=v2ray-plugin%3Bmode%3Dwebsocket%3Btls%3Bhost%3Dh.example#v2",
    SIP002 + "/?plugin=kcptun%3Bkey%3Dx#kcp",
    LEGACY + "#legacy",
    "ss://2022-blake3-aes-256-gcm:YWJjZGVm%3D@198.51.100.3:443#ss2022",
    VMESS,
    "vmess://uuid-1@vm.example:443?encryption=auto&security=tls&type=ws&path=%2Fp&host=h#vm-url",
    "vless://2f0b8f3e-0000-4000-8000-000000000000@vl.example:443?encryption=none&security=reality"
    "&sni=www.microsoft.com&fp=chrome&pbk=PUBKEY&sid=ab&type=tcp&flow=xtls-rprx-vision#vless-reality",
    "trojan://pass%40word@tj.example:443?sni=tj.example&type=ws&path=%2Fws#trojan",
    "hysteria2://hy-pass@hy.example:8443?sni=hy.example&obfs=salamander&obfs-password=o&insecure=1#hy2",
    "hy2://p@hy.example/?sni=s#hy2-default-port",
    "tuic://uuid-2:tpass@tu.example:443?congestion_control=bbr&alpn=h3&udp_relay_mode=native#tuic",
    "socks5://user:pass@127.0.0.1:1080#local socks",
    "socks://" + _b64("u2:p2") + "@127.0.0.1:1081#v2rayN socks",
    "socks5://127.0.0.1:1082",
    "http://127.0.0.1:3128#squid",
    "https://user:pw@proxy.example:443#tls http",
    "",
    "not a link at all",
    "wireguard://x@h:1#wg",
    "vless://uuid@noport.example#vless-no-port",
    "ss://%%%#broken",
    "vmess://" + _b64("[1, 2]"),
    "vmess://" + _b64(json.dumps({"add": "h"})),
]


def _check_common(result_names: list[str]) -> None:
    assert result_names == [
        "🇭🇰 HK 01",
        "obfs",
        "v2",
        "kcp",
        "legacy",
        "ss2022",
        "🇺🇸 US vmess",
        "vm-url",
        "vless-reality",
        "trojan",
        "hy2",
        "hy2-default-port",
        "tuic",
        "local socks",
        "v2rayN socks",
        "127.0.0.1:1082",
        "squid",
        "tls http",
    ]


@pytest.mark.parametrize(
    "encode",
    [
        lambda t: t,
        lambda t: t.replace("\n", "\r\n"),
        lambda t: _b64(t),
        lambda t: _b64(t, pad=False),
        lambda t: _b64(t, urlsafe=True),
        lambda t: _b64(t, urlsafe=True, pad=False),
        # Line-wrapped base64, as some panels send it.
        lambda t: "\n".join(_b64(t)[i : i + 76] for i in range(0, len(_b64(t)), 76)),
    ],
)
def test_every_encoding_gives_the_same_proxies(encode: object) -> None:
    text = "\n".join(LINES)
    result = parse_links(encode(text))  # type: ignore[operator]
    _check_common([p["name"] for p in result.proxies])
    assert [(s.line, s.scheme) for s in result.skipped] == [
        (20, ""),
        (21, "wireguard"),
        (22, "vless"),
        (23, "ss"),
        (24, "vmess"),
        (25, "vmess"),
    ]


def test_fields() -> None:
    proxies = {p["name"]: p for p in parse_links("\n".join(LINES)).proxies}
    assert proxies["🇭🇰 HK 01"] == {
        "name": "🇭🇰 HK 01",
        "type": "ss",
        "server": "198.51.100.1",
        "port": "8388",
        "cipher": "aes-256-gcm",
        "password": "s3cr3t",
        "udp": True,
    }
    assert proxies["obfs"]["plugin"] == "obfs"
    assert proxies["obfs"]["plugin-opts"] == {"mode": "http", "host": "bing.com"}
    assert proxies["v2"]["plugin-opts"] == {
        "mode": "websocket",
        "host": "h.example",
        "path": "",
        "tls": True,
    }
    assert proxies["kcp"]["plugin"] == "kcptun"
    assert proxies["legacy"]["password"] == "p@ss:w0rd"
    assert proxies["legacy"]["server"] == "198.51.100.2"
    assert proxies["ss2022"]["password"] == "YWJjZGVm="
    vm = proxies["🇺🇸 US vmess"]
    assert (vm["server"], vm["port"], vm["network"], vm["tls"]) == (
        "us.example.net",
        443,
        "ws",
        True,
    )
    assert vm["ws-opts"] == {"path": "/ray", "headers": {"Host": "cdn.example.net"}}
    assert vm["servername"] == "cdn.example.net"
    assert proxies["vm-url"]["cipher"] == "auto" and proxies["vm-url"]["alterId"] == 0
    vl = proxies["vless-reality"]
    assert vl["reality-opts"] == {"public-key": "PUBKEY", "short-id": "ab"}
    assert vl["flow"] == "xtls-rprx-vision" and vl["tls"] is True
    assert proxies["trojan"]["password"] == "pass@word"
    assert proxies["trojan"]["ws-opts"]["path"] == "/ws"
    assert proxies["hy2"]["skip-cert-verify"] is True
    assert proxies["hy2-default-port"]["port"] == "443"
    assert proxies["tuic"]["uuid"] == "uuid-2" and proxies["tuic"]["alpn"] == ["h3"]
    assert proxies["local socks"]["username"] == "user"
    assert proxies["v2rayN socks"]["password"] == "p2"
    assert "username" not in proxies["127.0.0.1:1082"]
    assert proxies["tls http"]["tls"] is True


def test_skip_reasons() -> None:
    reasons = [s.reason for s in parse_links("\n".join(LINES)).skipped]
    assert reasons == [
        "not a share link (no scheme://)",
        "unknown share-link scheme wireguard://",
        "no port in the link",
        "ss link has neither userinfo@host:port nor a base64 body",
        "vmess link is base64 but not of a JSON object",
        "vmess JSON has no string 'ps' (name)",
    ]


def test_repeated_names_are_numbered_as_mihomo() -> None:
    text = "\n".join(["socks5://h:1#n", "socks5://h:2#n", "socks5://h:3#n", "socks5://h:4#n-01"])
    assert [p["name"] for p in parse_links(text).proxies] == ["n", "n-01", "n-02", "n-01-01"]


def test_links_feed_convert_proxy() -> None:
    results = [convert_proxy(p) for p in parse_links("\n".join(LINES)).proxies]
    carried = {r.name for r in results if isinstance(r, Converted)}
    assert carried == {
        "🇭🇰 HK 01",
        "legacy",
        "local socks",
        "v2rayN socks",
        "127.0.0.1:1082",
        "squid",
    }
    skipped = {r.name: r.reason for r in results if isinstance(r, Skipped)}
    assert "plugin 'kcptun'" in skipped["kcp"]
    assert "2022" in skipped["ss2022"]
    assert "over TLS" in skipped["tls http"]


def test_garbage_bodies() -> None:
    for body in (
        b"",
        b"\x00\xff\xfe garbage",
        b"<html><body>502 Bad Gateway</body></html>",
        b"proxies: []\n",
    ):
        result = parse_links(body)
        assert result.proxies == []
    assert not looks_like_links(b"<html>502</html>")
    assert not looks_like_links("proxies:\n  - {name: a}\n")
    assert looks_like_links(_b64("trojan://p@h:1#x"))
    assert looks_like_links("\n\nss://abc@h:1\n")


def test_decode_helpers() -> None:
    assert decode_base64("aGVsbG8") == b"hello"
    assert decode_base64("aGVs\nbG8=") == b"hello"
    assert decode_base64("-_8") == b"\xfb\xff"
    assert decode_base64("a") is None
    assert decode_base64("ss://x") is None
    assert decode_base64("") is None
    assert decode_body(b"aGVsbG8=") == ("hello", True)
    assert decode_body("plain text") == ("plain text", False)
    # base64 of bytes that are not text: kept as it came.
    assert decode_body(base64.b64encode(b"\xff\xfe")) == ("//4=", False)
