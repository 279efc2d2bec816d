"""spliceway.clash.proxies: Clash proxies as spliceway outbounds, or why not."""

from __future__ import annotations

from typing import Any

import pytest

from spliceway.clash.proxies import Converted, Skipped, convert_proxy, outbound_protocols
from spliceway.clash.yaml12 import load
from spliceway.config import parse_config

# The shapes subscriptions really carry (subconverter output, hand-written files).
PROXIES = load(
    """\
proxies:
  - name: 🇭🇰 香港 01
    server: hk.example.net
    port: 8388
    type: ss
    cipher: chacha20-ietf-poly1305
    password: "no"
    udp: true
  - name: jp-aes
    server: 203.0.113.7
    port: "443"
    type: ss
    cipher: aes-256-gcm
    password: 123456
    udp: true
  - name: ss2022
    server: 203.0.113.8
    port: 443
    type: ss
    cipher: 2022-blake3-aes-128-gcm
    password: c2VjcmV0c2VjcmV0c2VjcmV0
  - name: obfs-node
    type: ss
    server: 203.0.113.9
    port: 8388
    cipher: aes-128-gcm
    password: pw
    plugin: obfs
    plugin-opts: {mode: tls, host: bing.com}
  - name: v2p
    type: ss
    server: h
    port: 443
    cipher: aes-128-gcm
    password: pw
    plugin: v2ray-plugin
    plugin-opts: {mode: websocket, tls: true}
  - name: stls
    type: ss
    server: h
    port: 443
    cipher: aes-128-gcm
    password: pw
    plugin: shadow-tls
    plugin-opts: {host: cloud.tencent.com, password: x, version: 3}
  - name: rc4
    type: ss
    server: h
    port: 443
    cipher: rc4-md5
    password: pw
  - name: s5
    type: socks5
    server: 127.0.0.1
    port: 1080
  - name: s5-auth
    type: socks5
    server: 127.0.0.1
    port: 1081
    username: user
    password: "on"
    udp: true
  - name: s5-tls
    type: socks5
    server: 127.0.0.1
    port: 1082
    tls: true
    skip-cert-verify: true
  - name: s5-nopass
    type: socks5
    server: 127.0.0.1
    port: 1083
    username: user
  - name: web
    type: http
    server: 127.0.0.1
    port: 8080
    username: u
    password: ""
  - name: web-tls
    type: http
    server: 127.0.0.1
    port: 8443
    tls: true
    sni: proxy.example
  - name: web-h
    type: http
    server: 127.0.0.1
    port: 8081
    headers: {X-Token: abc}
  - name: vm
    type: vmess
    server: h
    port: 443
    uuid: 2f0b8f3e-0000-4000-8000-000000000000
    alterId: 0
    cipher: auto
  - name: vl
    type: vless
    server: h
    port: 443
    uuid: 2f0b8f3e-0000-4000-8000-000000000000
    tls: true
  - name: tj
    type: trojan
    server: h
    port: 443
    password: pw
  - name: hy2
    type: hysteria2
    server: h
    port: 443
    password: pw
  - name: tu
    type: tuic
    server: h
    port: 443
    uuid: u
    password: p
  - name: wg
    type: wireguard
    server: h
    port: 51820
    private-key: k
    public-key: p
    ip: 10.0.0.2
  - name: ssr1
    type: ssr
    server: h
    port: 443
    cipher: aes-128-cfb
    password: p
    obfs: plain
    protocol: origin
  - name: sn
    type: snell
    server: h
    port: 443
    psk: p
  - name: d
    type: direct
  - name: r
    type: reject
  - name: weird
    type: teleport
    server: h
    port: 1
"""
)["proxies"]


def _by_name() -> dict[str, Converted | Skipped]:
    return {p["name"]: convert_proxy(p) for p in PROXIES}


def test_carried_proxies_validate_together() -> None:
    results = _by_name()
    carried = [r.outbound for r in results.values() if isinstance(r, Converted)]
    tags = [o["tag"] for o in carried]
    assert tags == ["🇭🇰 香港 01", "jp-aes", "s5", "s5-auth", "web", "web-h", "d", "r"]
    cfg = parse_config({"outbounds": carried})
    assert cfg.find_outbound("🇭🇰 香港 01") is not None


def test_ss_fields() -> None:
    hk = _by_name()["🇭🇰 香港 01"]
    assert isinstance(hk, Converted)
    assert hk.outbound == {
        "tag": "🇭🇰 香港 01",
        "protocol": "shadowsocks",
        "server": "hk.example.net",
        "port": 8388,
        "method": "chacha20-ietf-poly1305",
        "password": "no",
    }
    assert hk.changes == ()
    jp = _by_name()["jp-aes"]
    assert isinstance(jp, Converted)
    # Weak typing: a quoted port, a numeric password.
    assert jp.outbound["port"] == 443 and jp.outbound["password"] == "123456"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("ss2022", "2022-blake3-aes-128-gcm (Shadowsocks 2022) is not supported"),
        ("obfs-node", "plugin 'obfs' is not supported"),
        ("v2p", "plugin 'v2ray-plugin' is not supported"),
        ("stls", "plugin 'shadow-tls' is not supported"),
        ("rc4", "cipher 'rc4-md5' is not supported"),
        ("s5-tls", "socks5 over TLS is not supported"),
        ("s5-nopass", "username without a password"),
        ("web-tls", "http over TLS is not supported"),
        ("vm", "no vmess outbound"),
        ("vl", "no vless outbound"),
        ("tj", "no trojan outbound"),
        ("hy2", "no hysteria2 outbound"),
        ("tu", "no tuic outbound"),
        ("wg", "no wireguard outbound"),
        ("ssr1", "ShadowsocksR is not supported"),
        ("sn", "Snell is not supported"),
        ("weird", "unsupported proxy type: teleport"),
    ],
)
def test_skipped_with_reason(name: str, reason: str) -> None:
    result = _by_name()[name]
    assert isinstance(result, Skipped), result
    assert result.name == name
    assert reason in result.reason


def test_changes_reported() -> None:
    s5 = _by_name()["s5"]
    assert isinstance(s5, Converted)
    assert [c.key for c in s5.changes] == ["udp"]
    s5_auth = _by_name()["s5-auth"]
    assert isinstance(s5_auth, Converted) and s5_auth.changes == ()
    assert s5_auth.outbound["password"] == "on"
    web_h = _by_name()["web-h"]
    assert isinstance(web_h, Converted)
    assert [(c.key, c.why) for c in web_h.changes] == [
        ("headers", "extra CONNECT headers are not sent (X-Token)")
    ]
    web = _by_name()["web"]
    assert isinstance(web, Converted)
    assert web.outbound == {
        "tag": "web",
        "protocol": "http",
        "server": "127.0.0.1",
        "port": 8080,
        "username": "u",
        "password": "",
    }


def test_basic_options_become_changes() -> None:
    result = convert_proxy(
        {
            "name": "x",
            "type": "ss",
            "server": "h",
            "port": 1,
            "cipher": "aes-128-gcm",
            "password": "p",
            "udp": True,
            "tfo": True,
            "mptcp": 1,
            "interface-name": "eth1",
            "routing-mark": 6666,
            "ip-version": "ipv4",
            "smux": {"enabled": True, "protocol": "h2mux"},
            "udp-over-tcp": True,
            "dialer-proxy": "hop",
            "client-fingerprint": "chrome",
            "bogus": 1,
        }
    )
    assert isinstance(result, Converted)
    assert [c.key for c in result.changes] == [
        "udp-over-tcp",
        "tfo",
        "mptcp",
        "interface-name",
        "routing-mark",
        "ip-version",
        "smux",
        "bogus",
    ]
    assert result.dialer_proxy == "hop"


def _p(ptype: str, **fields: Any) -> dict[str, Any]:
    return {"name": "a", "type": ptype, **{k.replace("_", "-"): v for k, v in fields.items()}}


SS = {"server": "h", "port": 1, "cipher": "aes-128-gcm"}


@pytest.mark.parametrize(
    ("mapping", "reason"),
    [
        (_p("ss", **SS), "key 'password' missing"),
        (_p("ss", port=1, cipher="aes-128-gcm", password="p"), "key 'server' missing"),
        (_p("socks5", server="h"), "key 'port' missing"),
        (_p("socks5", server="h", port=0), "port 0 is not 1..65535"),
        (_p("socks5", server="h", port="x"), "cannot parse 'port'"),
        (_p("socks5", server="h", port=True), "'port' expected type 'int'"),
        (_p("socks5", server="", port=1), "server is empty"),
        (_p("socks5", server="h", port=1, udp="true"), "'udp' expected type 'bool'"),
        (_p("ss", **SS, password=""), "password is empty"),
        (
            _p("socks5", server="h", port=1, username="u" * 300, password="p"),
            "not a valid spliceway outbound",
        ),
        ({"name": "a"}, "missing type"),
        ({"name": "a", "type": 5}, "missing type"),
        ({"type": "ss"}, "key 'name' missing"),
        ({"name": "", "type": "ss"}, "name is empty"),
        ({"name": ["x"], "type": "ss"}, "'name' expected type 'string'"),
        ("not a mapping", "a proxy must be a mapping"),
        (None, "a proxy must be a mapping"),
    ],
)
def test_bad_proxies_are_skipped_never_raised(mapping: Any, reason: str) -> None:
    result = convert_proxy(mapping)
    assert isinstance(result, Skipped)
    assert reason in result.reason


def test_keys_are_case_insensitive_and_underscored() -> None:
    result = convert_proxy(
        {"Name": "a", "type": "socks5", "Server": "h", "PORT": "1080", "User_Name": "x"}
    )
    assert isinstance(result, Converted)
    assert result.outbound["server"] == "h" and result.outbound["port"] == 1080


def test_outbound_protocols_of_this_build() -> None:
    protocols = outbound_protocols()
    assert {"direct", "block", "socks5", "http", "shadowsocks"} <= set(protocols)
    assert "method" in protocols["shadowsocks"]
