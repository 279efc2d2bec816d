"""spliceway.clash.importer: whole mihomo files in, validated spliceway configurations and
their reports out."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spliceway.clash.importer import (
    SECRET_ENV,
    ClashImportError,
    ImportResult,
    import_document,
    import_links,
    import_text,
)
from spliceway.clash.report import Item
from spliceway.clash.yaml12 import load
from spliceway.config import parse_config
from spliceway.config.models_outbounds import SelectorGroup
from tests.clash.clash_files import (
    Upstreams,
    mixed_file,
    provider_body,
    provider_file,
    subconverter_file,
    write_geodata,
)

UP = Upstreams(socks=1080, ss=8388, http=3128, refused=9, origin=8080)


def _import(text: str, tmp_path: Path) -> ImportResult:
    return import_text(text, home=str(tmp_path), files_dir=str(tmp_path / "out.providers"))


def _doc(text: str, tmp_path: Path) -> ImportResult:
    return import_document(load(text), home=str(tmp_path), files_dir=str(tmp_path / "files"))


def _items(items: list[Item], path_prefix: str = "") -> dict[str, Item]:
    return {f"{i.path}|{i.name}": i for i in items if i.path.startswith(path_prefix)}


def _skipped_names(result: ImportResult, prefix: str) -> set[str]:
    return {i.name for i in result.report.skipped if i.path.startswith(prefix)}


def _group(config: dict[str, Any], tag: str) -> dict[str, Any]:
    return next(g for g in config["outbound_groups"] if g["tag"] == tag)


# ---------------------------------------------------------------------------
# The three realistic files
# ---------------------------------------------------------------------------


def test_subconverter_file(tmp_path: Path) -> None:
    text, gen = subconverter_file(UP, rule_count=3000)
    started = time.monotonic()
    result = _import(text, tmp_path)
    elapsed = time.monotonic() - started
    config = result.config
    cfg = parse_config(config)
    assert elapsed < 10, f"3000 rules took {elapsed:.1f} s"
    # Inbounds: port and socks-port on every address (allow-lan), not sniffing (mihomo's
    # sniffer is off by default).
    assert [(i["tag"], i["protocol"], i["listen"]) for i in config["inbounds"]] == [
        ("DEFAULT-HTTP", "http", {"address": "0.0.0.0", "port": 7890}),
        ("DEFAULT-SOCKS", "socks5", {"address": "0.0.0.0", "port": 7891}),
    ]
    assert all(i["sniff"] is False for i in config["inbounds"])
    assert config["mode"] == {"kind": "rule"}
    # Proxies: three carried, one dead-but-carried, four skipped by name and why.
    assert [o["tag"] for o in config["outbounds"]] == [
        "🇭🇰 香港 01",
        "🇯🇵 日本 01",
        "🇸🇬 新加坡 01",
        "🇹🇼 台湾 01",
        "REJECT",
    ]
    skipped = {i.name: i.why for i in result.report.skipped if i.path.startswith("proxies[")}
    assert set(skipped) == {"🇺🇸 美国 01", "🇰🇷 韩国 01", "🇬🇧 英国 01", "🇩🇪 德国 01"}
    assert "vmess" in skipped["🇺🇸 美国 01"]
    assert "trojan" in skipped["🇰🇷 韩国 01"]
    assert "2022" in skipped["🇬🇧 英国 01"]
    assert "plugin 'obfs'" in skipped["🇩🇪 德国 01"]
    # The ss password "no" stayed a string (YAML 1.2).
    jp = next(o for o in config["outbounds"] if o["tag"] == "🇯🇵 日本 01")
    assert jp["password"] == "no" and jp["port"] == 8388
    # Groups: emoji names kept, lost members dropped, the US group refusing traffic.
    assert _group(config, "🚀 节点选择")["outbounds"] == [
        "♻️ 自动选择",
        "🇭🇰 香港 01",
        "🇯🇵 日本 01",
        "🇸🇬 新加坡 01",
        "direct",
    ]
    auto = _group(config, "♻️ 自动选择")
    assert auto == {
        "tag": "♻️ 自动选择",
        "kind": "url_test",
        "outbounds": ["🇭🇰 香港 01", "🇹🇼 台湾 01"],
        "url": "http://127.0.0.1:8080/generate_204",
        "interval_seconds": 300,
        "tolerance_ms": 50,
    }
    assert _group(config, "🇺🇸 美国节点")["outbounds"] == ["REJECT"]
    marked = [i for i in result.report.changed if i.path == "proxy-groups[4]"]
    assert len(marked) == 1 and "lost every proxy" in marked[0].why
    assert _group(config, "🛑 全球拦截")["outbounds"] == ["REJECT", "direct"]
    # Rules: every generated line, in order, plus the head; MATCH is the final.
    rules = config["rules"]
    assert len(rules) == 5 + 3000 + 1  # head rules carried, generated, GEOIP
    assert rules[0] == {"domain": ["vm"], "outbound": "🇯🇵 日本节点"}
    assert rules[3] == {"ip_cidr": ["127.0.0.2/32"], "no_resolve": True, "outbound": "🛑 全球拦截"}
    assert rules[5] == {"domain_suffix": ["s0.example"], "outbound": "🎯 全球直连"}
    assert rules[-1] == {"geoip": ["cn"], "outbound": "🎯 全球直连"}
    assert config["route"] == {"final": "🐟 漏网之鱼"}
    assert len(cfg.rules) == len(rules)
    rule_skips = [i for i in result.report.skipped if i.path.startswith("rules[")]
    assert [(i.path, i.what) for i in rule_skips] == [
        ("rules[4]", "SRC-IP-SUFFIX,10.0.0.1/32,DIRECT")
    ]
    assert gen.lines[0] == "DOMAIN-SUFFIX,s0.example,🎯 全球直连"
    # GEOIP reads mihomo's database file from its home; nothing is downloaded.
    assert config["runtime"]["geodata"] == {"geoip_path": str(tmp_path / "geoip.metadb")}
    # DNS: the plain server carried, DoH/DoT and the filter reported, fake-ip kept.
    dns = config["runtime"]["dns"]
    assert dns["servers"] == ["udp://114.114.114.114"]
    assert dns["answer"] == {"type": "fake_ip", "fake_ip_range": "198.18.0.0/16"}
    assert dns["listen"] == {"address": "0.0.0.0", "port": 1053}
    dns_skips = {i.name for i in result.report.skipped if i.path.startswith("dns.")}
    assert {"https://doh.pub/dns-query", "tls://223.5.5.5:853"} <= dns_skips
    assert any(i.path == "dns.fake-ip-filter" for i in result.report.skipped)
    # The controller: no secret, so loopback only (reported); spliceway's API off.
    assert config["api"]["clash"] == {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 9090},
    }
    assert config["api"]["control"] == {"enabled": False}
    assert any(i.path == "external-controller" for i in result.report.changed)
    # Keys not carried are named with why.
    assert {"geo-auto-update", "unified-delay", "ipv6"} <= {i.path for i in result.report.skipped}


def test_subconverter_file_starts_an_engine(
    tmp_path: Path, make_engine: Callable[..., Any]
) -> None:
    write_geodata(tmp_path)  # the Country.mmdb GEOIP,CN reads, in mihomo's home
    text, _ = subconverter_file(UP, rule_count=3000)
    config = copy.deepcopy(_import(text, tmp_path).config)
    assert config["runtime"]["geodata"] == {"geoip_path": str(tmp_path / "Country.mmdb")}
    for inbound in config["inbounds"]:
        inbound["listen"] = {"address": "127.0.0.1", "port": 0}
    config["runtime"]["dns"]["listen"]["port"] = 0
    config["runtime"]["dns"]["listen"]["address"] = "127.0.0.1"
    config["api"]["clash"]["listen"]["port"] = 0
    config["api"]["ipc"] = {"enabled": False}
    engine = make_engine(config)
    assert engine.running
    policies = engine.query("policies")
    tags = {p["tag"] for p in policies["policies"]}
    assert {"🚀 节点选择", "♻️ 自动选择", "🐟 漏网之鱼", "🇺🇸 美国节点"} <= tags


def test_mixed_file_names_every_skipped_item(tmp_path: Path) -> None:
    result = _import(mixed_file(UP, relay=True), tmp_path)
    config = result.config
    parse_config(config)
    assert _skipped_names(result, "proxies[") == {
        "ss-2022",
        "ss-cfb",
        "ss-obfs",
        "ss-v2ray",
        "ss-shadowtls",
        "socks-tls",
        "http-tls",
        "vmess-ws",
        "vless-reality",
        "trojan-1",
        "hy2-1",
        "tuic-1",
        "wg-1",
        "snell-1",
    }
    reasons = {i.name: i.why for i in result.report.skipped if i.path.startswith("proxies[")}
    assert "plugin 'shadow-tls'" in reasons["ss-shadowtls"]
    assert "aes-256-cfb" in reasons["ss-cfb"]
    assert "over TLS" in reasons["socks-tls"]
    carried = [o["tag"] for o in config["outbounds"]]
    assert carried == [
        "ss-ok",
        "ss-chacha",
        "socks-ok",
        "http-ok",
        "http-chained (last hop)",
        "REJECT",
    ]
    # dialer-proxy: a relay under the proxy's name, through the dialer.
    assert _group(config, "http-chained") == {
        "tag": "http-chained",
        "kind": "relay",
        "outbounds": ["socks-ok", "http-chained (last hop)"],
    }
    assert _group(config, "Modern")["outbounds"] == ["REJECT"]
    plugins = _group(config, "Plugins")
    assert plugins["kind"] == "fallback" and plugins["outbounds"] == ["ss-ok"]
    assert _group(config, "Balance")["strategy"] == "consistent_hashing"
    assert _group(config, "Chain") == {
        "tag": "Chain",
        "kind": "relay",
        "outbounds": ["socks-ok", "http-ok"],
    }
    assert _group(config, "Proxy")["outbounds"] == ["ss-ok", "socks-ok", "http-ok", "direct"]
    # Every skipped proxy some group named is reported as dropped there.
    dropped = {i.what for i in result.report.changed if i.path.startswith("proxy-groups[")}
    assert "member 'vmess-ws' dropped" in dropped


@pytest.mark.skipif(
    "providers" not in SelectorGroup.model_fields,
    reason="groups take `providers` once the providers helper's model lands on main",
)
def test_provider_file(tmp_path: Path) -> None:
    airport = tmp_path / "proxy_providers" / "airport.yaml"
    airport.parent.mkdir()
    airport.write_text(provider_body(UP))
    lan = tmp_path / "ruleset" / "lan.txt"
    lan.parent.mkdir()
    lan.write_text("192.168.0.0/16\n10.0.0.0/8\n")
    text = provider_file(UP, "./proxy_providers/airport.yaml", "./ruleset/lan.txt")
    result = _import(text, tmp_path)
    config = result.config
    parse_config(config)
    providers = config["providers"]["proxies"]
    assert providers["airport"]["path"] == str(airport)
    assert providers["airport"]["health_check"] == {
        "enabled": True,
        "url": "http://127.0.0.1:8080/generate_204",
        "interval_seconds": 600,
    }
    assert providers["backup"]["url"].startswith("https://sub.example.net/")
    assert providers["backup"]["interval_seconds"] == 86400
    assert providers["backup"]["override"] == {"name_prefix": "[备] "}
    assert "via" not in providers["backup"]
    pinned = providers["pinned"]["path"]
    assert (
        pinned in result.files
        and json.loads(result.files[pinned])["proxies"][0]["name"] == "pinned-s5"
    )
    rules = config["providers"]["rules"]
    assert rules["reject"] == {
        "url": "https://cdn.example.net/rules/reject.txt",
        "behavior": "domain",
        "format": "yaml",
        "interval_seconds": 86400,
    }
    assert rules["lan"] == {"path": str(lan), "behavior": "ipcidr", "format": "text"}
    assert rules["apps"]["path"] in result.files
    assert config["rules"][0] == {"rule_set": ["reject"], "outbound": "REJECT"}
    # A group's filters are its own: one provider, however many groups filter it.
    assert set(providers) == {"airport", "backup", "pinned"}
    assert "filter" not in providers["airport"] and "exclude_filter" not in providers["airport"]
    auto = _group(config, "Auto")
    assert auto["providers"] == ["airport"]
    assert auto["filter"] == ["(?i)hk|香港|jp"] and "exclude_filter" not in auto
    hk = _group(config, "HK")
    assert hk["providers"] == ["airport"]
    assert hk["filter"] == ["港|HK"] and hk["exclude_filter"] == ["(?i)expire|剩余"]
    assert not any("copy" in i.what for i in result.report.changed)
    assert _group(config, "Proxy")["providers"] == ["airport", "backup"]
    every = _group(config, "Everything")
    assert every["outbounds"] == ["home-socks"]
    assert set(every["providers"]) == {"airport", "backup", "pinned"}
    skipped = {i.path for i in result.report.skipped}
    assert "proxy-providers.backup.header" in skipped
    assert "proxy-providers.backup.override.udp" in skipped


def test_provider_file_report_without_group_providers(tmp_path: Path) -> None:
    # The provider passes themselves work whatever the group model: providers carried,
    # inline payloads written beside the output.
    airport = tmp_path / "airport.yaml"
    airport.write_text(provider_body(UP))
    text = provider_file(UP, str(airport), str(tmp_path / "lan.txt"))
    doc = load(text)
    for group in doc["proxy-groups"]:
        group.pop("use", None)
        group.pop("filter", None)
        group.pop("exclude-filter", None)
        group.setdefault("proxies", ["DIRECT"])
    doc["proxy-groups"][3].pop("include-all")
    result = import_document(doc, home=str(tmp_path), files_dir=str(tmp_path / "files"))
    parse_config(result.config)
    assert set(result.config["providers"]["proxies"]) == {"airport", "backup", "pinned"}
    assert set(result.config["providers"]["rules"]) == {"reject", "lan", "apps"}
    assert len(result.files) == 2
    assert all(p.startswith(str(tmp_path / "files")) for p in result.files)
    assert result.config["api"]["clash"]["secret_env"] == SECRET_ENV
    assert "s3cr3t" not in json.dumps(result.config)
    assert any(SECRET_ENV in n for n in result.report.notes)


# ---------------------------------------------------------------------------
# Names, groups, rules
# ---------------------------------------------------------------------------

BASE = """\
mixed-port: 7890
proxies:
  - {name: a, type: socks5, server: 127.0.0.1, port: 1080}
  - {name: b, type: http, server: 127.0.0.1, port: 3128}
"""


def test_duplicate_names_are_renamed_and_reported(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
  - {name: a, type: socks5, server: 127.0.0.1, port: 1081}
  - {name: direct, type: socks5, server: 127.0.0.1, port: 1082}
  - {name: REJECT, type: socks5, server: 127.0.0.1, port: 1083}
proxy-groups:
  - {name: a, type: select, proxies: [b]}
  - {name: g, type: select, proxies: [a, direct, REJECT]}
rules:
  - MATCH,a
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    assert [o["tag"] for o in config["outbounds"]] == [
        "a",
        "b",
        "a (2)",
        "direct (2)",
        "REJECT (2)",
        "REJECT",
    ]
    # References mean the first one; the renamed group is still there.
    assert _group(config, "g")["outbounds"] == ["a", "direct (2)", "REJECT"]
    assert _group(config, "a (3)")["outbounds"] == ["b"]
    assert config["route"]["final"] == "a"
    renamed = [i for i in result.report.changed if "renamed" in i.what]
    assert len(renamed) == 3


def test_group_cycles_are_broken_and_unknown_members_dropped(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
proxy-groups:
  - {name: x, type: select, proxies: [y, a]}
  - {name: y, type: select, proxies: [z, b]}
  - {name: z, type: select, proxies: [x, nowhere]}
  - {name: only-unknown, type: select, proxies: [ghost]}
  - {name: self, type: select, proxies: [self, a]}
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    assert _group(config, "x")["outbounds"] == ["y", "a"]
    assert _group(config, "y")["outbounds"] == ["z", "b"]
    assert _group(config, "z")["outbounds"] == ["REJECT"]
    assert _group(config, "only-unknown")["outbounds"] == ["REJECT"]
    assert _group(config, "self")["outbounds"] == ["a"]
    whys = [i.why for i in result.report.skipped if i.path.startswith("proxy-groups")]
    assert sum("cycle" in w for w in whys) == 2
    assert sum("no proxy or group has this name" in w for w in whys) == 2


def test_group_kinds_and_options(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
proxy-groups:
  - {name: ut, type: url-test, proxies: [a, b], tolerance: "50", lazy: false, timeout: 3000}
  - name: fb
    type: fallback
    proxies: [a, b]
    url: "https://www.gstatic.com/generate_204"
    interval: 0
  - {name: lb, type: load-balance, proxies: [a, b], strategy: sticky-sessions}
  - {name: lb2, type: load-balance, proxies: [a, b], strategy: round-robin, interval: 120}
  - {name: bad, type: teleport, proxies: [a]}
  - {name: ex, type: select, proxies: [a, b, DIRECT], exclude-filter: "^a$", exclude-type: "Http"}
  - {name: all, type: select, include-all-proxies: true, filter: "b|a"}
  - {name: hidden, type: select, proxies: [a], hidden: true, icon: "https://x/i.png", foo: 1}
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    assert _group(config, "ut") == {
        "tag": "ut",
        "kind": "url_test",
        "outbounds": ["a", "b"],
        "interval_seconds": 300,
        "tolerance_ms": 0,
    }
    assert _group(config, "fb")["url"] == "https://www.gstatic.com/generate_204"
    assert _group(config, "fb")["interval_seconds"] == 300
    assert _group(config, "lb")["strategy"] == "sticky_sessions"
    assert _group(config, "lb2")["strategy"] == "round_robin"
    assert _group(config, "lb2")["interval_seconds"] == 120
    assert _group(config, "bad")["outbounds"] == ["REJECT", "a"]
    assert _group(config, "ex")["outbounds"] == ["direct"]
    # Every proxy (sorted by name) the filter keeps, as mihomo's include-all-proxies.
    assert _group(config, "all")["outbounds"] == ["a", "b"]
    skipped = {i.path for i in result.report.skipped}
    assert {"proxy-groups[0].lazy", "proxy-groups[0].timeout", "proxy-groups[7].hidden"} <= skipped
    assert "proxy-groups[7].foo" in skipped
    changed = {i.path: i.why for i in result.report.changed}
    assert "not an integer" in changed["proxy-groups[0].tolerance"]
    assert "unsupported group type" in changed["proxy-groups[4]"]


def test_rules_targets_and_match(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
  - {name: gone, type: vmess, server: h, port: 1, uuid: u, alterId: 0, cipher: auto}
proxy-groups:
  - {name: P, type: select, proxies: [a, b]}
rules:
  - DOMAIN,a.example,P
  - DOMAIN,b.example,gone
  - DOMAIN,c.example,REJECT
  - DOMAIN,d.example,REJECT-DROP
  - DOMAIN,e.example,PASS
  - DOMAIN,f.example,nowhere
  - DOMAIN,g.example,GLOBAL
  - AND,((DOMAIN,h.example),(NETWORK,UDP)),P
  - OR,((DOMAIN,i.example),(DST-PORT,8443)),DIRECT
  - NOT,((DOMAIN-SUFFIX,j.example)),P
  - DST-PORT,80/443,P
  - PROCESS-NAME,curl,DIRECT
  - IN-PORT,7890,P
  - IN-TYPE,HTTP,P
  - RULE-SET,missing,P
  - UID,1000,P
  - 42
  - MATCH,P
  - DOMAIN,late.example,DIRECT
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    rules = config["rules"]
    outbound = [r["outbound"] for r in rules]
    assert outbound == [
        "P",
        "REJECT",
        "REJECT",
        "REJECT",
        "GLOBAL",
        "P",
        "direct",
        "P",
        "P",
        "direct",
        "P",
        "P",
    ]
    assert rules[5] == {"domain": ["h.example"], "network": "udp", "outbound": "P"}
    assert rules[7]["invert"] is True
    assert rules[10] == {"inbound_tag": ["DEFAULT-MIXED"], "outbound": "P"}
    assert config["route"]["final"] == "P"
    glob = _group(config, "GLOBAL")
    assert glob["outbounds"] == ["direct", "REJECT", "a", "b", "P"]
    skipped = {i.path: i.why for i in result.report.skipped if i.path.startswith("rules")}
    assert set(skipped) == {"rules[5]", "rules[14]", "rules[15]", "rules[16]", "rules[18]"}
    assert "not found" in skipped["rules[5]"]
    assert "never reached" in skipped["rules[18]"]
    changed = {i.path for i in result.report.changed}
    assert "rules[1]" in changed  # gone was skipped: refused, not sent elsewhere
    assert "rules" in changed  # IN-TYPE on a mixed inbound


def test_mode_global_and_direct(tmp_path: Path) -> None:
    result = _doc(BASE + "mode: GLOBAL\n", tmp_path)
    assert result.config["mode"] == {"kind": "global", "outbound": "GLOBAL"}
    parse_config(result.config)
    result = _doc(BASE + "mode: Direct\n", tmp_path)
    assert result.config["mode"] == {"kind": "direct"}
    result = _doc(BASE + "mode: script\n", tmp_path)
    assert result.config["mode"] == {"kind": "rule"}
    user_global = (
        BASE + "mode: global\nproxy-groups:\n  - {name: GLOBAL, type: select, proxies: [b]}\n"
    )
    result = _doc(user_global, tmp_path)
    assert result.config["mode"] == {"kind": "global", "outbound": "GLOBAL"}
    assert _group(result.config, "GLOBAL")["outbounds"] == ["b"]


def test_inbounds_users_and_listeners(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
port: 8080
socks-port: 0
allow-lan: true
bind-address: 192.168.1.10
authentication: ["alice:s3cret", "bob:", "broken", "c:d:e"]
listeners:
  - {name: in-socks, type: socks, port: 10808, listen: 127.0.0.1, udp: false, users: []}
  - {name: in-http, type: http, port: "10809", proxy: b}
  - {name: in-tun, type: tun, port: 1}
  - {name: in-mixed, type: mixed, port: 10810, users: [{username: u, password: p}], rule: sub1}
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    by_tag = {i["tag"]: i for i in config["inbounds"]}
    assert set(by_tag) == {"DEFAULT-HTTP", "DEFAULT-MIXED", "in-socks", "in-http", "in-mixed"}
    assert by_tag["DEFAULT-HTTP"]["listen"] == {"address": "192.168.1.10", "port": 8080}
    users = [{"username": "alice", "password": "s3cret"}, {"username": "c", "password": "d:e"}]
    assert by_tag["DEFAULT-HTTP"]["users"] == users
    assert by_tag["in-socks"]["udp"] is False and "users" not in by_tag["in-socks"]
    assert by_tag["in-socks"]["listen"] == {"address": "127.0.0.1", "port": 10808}
    assert by_tag["in-http"]["users"] == users
    assert by_tag["in-http"]["listen"]["address"] == "0.0.0.0"
    assert by_tag["in-mixed"]["users"] == [{"username": "u", "password": "p"}]
    assert config["rules"][0] == {"inbound_tag": ["in-http"], "outbound": "b"}
    skipped = {i.path for i in result.report.skipped}
    assert {
        "authentication[1]",
        "authentication[2]",
        "listeners[2]",
        "listeners[3].rule",
    } <= skipped


def test_dns_and_tun(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
dns:
  enable: true
  listen: :53
  ipv6: true
  enhanced-mode: redir-host
  nameserver: [tcp://1.1.1.1, "8.8.8.8#Proxy", "quic://dns.adguard.com", "dhcp://en0", system]
  fallback: [tls://8.8.4.4]
  nameserver-policy: {"+.cn": 223.5.5.5}
tun:
  enable: true
  stack: mixed
  device: utun9
  mtu: 9000
  auto-route: true
  strict-route: true
  dns-hijack: [any:53, tcp://any:53]
  route-exclude-address: [192.168.0.0/16]
  auto-detect-interface: true
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    dns = config["runtime"]["dns"]
    assert dns["servers"] == ["tcp://1.1.1.1", "udp://8.8.8.8", "system"]
    assert "answer" not in dns
    assert dns["listen"] == {"address": "0.0.0.0", "port": 53}
    tun = config["runtime"]["tun"]
    assert tun == {
        "addr": "198.18.0.1",
        "mask": "255.255.255.252",
        "tag": "DEFAULT-TUN",
        "name": "utun9",
        "mtu": 9000,
        "auto_route": True,
        "strict_route": True,
        "dns_hijack": True,
        "dual_stack": True,
        "exclude_cidrs": ["192.168.0.0/16"],
    }
    skipped = {i.path for i in result.report.skipped}
    assert {"dns.fallback", "dns.nameserver-policy", "dns.ipv6", "tun.stack"} <= skipped
    assert {"dns.nameserver[2]", "dns.nameserver[3]", "tun.auto-detect-interface"} <= skipped
    changed = {i.path for i in result.report.changed}
    assert {"dns.nameserver[1]", "tun.dns-hijack"} <= changed


def test_dns_without_usable_servers_and_disabled(tmp_path: Path) -> None:
    text = (
        BASE
        + "dns: {enable: true, nameserver: ['https://1.1.1.1/dns-query'],"
        + " default-nameserver: [223.5.5.5]}\n"
    )
    result = _doc(text, tmp_path)
    assert result.config["runtime"]["dns"]["servers"] == ["udp://223.5.5.5"]
    text = BASE + "dns: {enable: true, nameserver: ['https://1.1.1.1/dns-query']}\n"
    assert _doc(text, tmp_path).config["runtime"]["dns"]["servers"] == ["system"]
    text = BASE + "dns: {enable: false, nameserver: [1.1.1.1]}\n"
    result = _doc(text, tmp_path)
    assert "dns" not in result.config["runtime"]
    assert "dns.nameserver" in {i.path for i in result.report.skipped}


def test_top_level_keys_reported(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
redir-port: 7892
tproxy-port: 7893
hosts: {router.lan: 192.168.1.1}
sniffer: {enable: true, sniff: {TLS: {ports: [443]}}}
Proxy: []
"Proxy Group": []
Rule: []
colour: blue
log-level: silent
find-process-mode: strict
"""
    )
    result = _doc(text, tmp_path)
    config = result.config
    skipped = {i.path: i.why for i in result.report.skipped}
    assert "TProxy" in skipped["tproxy-port"]
    assert "redirect" in skipped["redir-port"]
    assert "hosts" in skipped
    assert "legacy" in skipped["Proxy"] and "proxy-groups" in skipped["Proxy Group"]
    assert "unknown key" in skipped["colour"]
    assert config["runtime"]["log_level"] == "error"
    assert config["runtime"]["process_lookup"] == "auto"
    assert all(i["sniff"] is True for i in config["inbounds"])


def test_controller_with_secret_ui_and_cors(tmp_path: Path) -> None:
    text = (
        BASE
        + """\
external-controller: 0.0.0.0:9090
secret: "no"
external-ui: ui
external-controller-cors: {allow-origins: ["https://metacubex.github.io"]}
"""
    )
    (tmp_path / "ui").mkdir()
    result = _doc(text, tmp_path)
    clash = result.config["api"]["clash"]
    assert clash == {
        "enabled": True,
        "listen": {"address": "0.0.0.0", "port": 9090},
        "secret_env": SECRET_ENV,
        "external_ui": str(tmp_path / "ui"),
        "cors_allow_origins": ["https://metacubex.github.io"],
    }
    assert '"no"' not in json.dumps(result.config["api"])
    (tmp_path / "ui").rmdir()
    result = _doc(text, tmp_path)
    assert "external_ui" not in result.config["api"]["clash"]
    assert "external-ui" in {i.path for i in result.report.skipped}
    result = _doc(text.replace("external-ui: ui", "external-ui: /usr/share"), tmp_path)
    assert "external_ui" not in result.config["api"]["clash"]
    assert "outside mihomo's home" in {i.path: i.why for i in result.report.skipped}["external-ui"]


def test_geodata_paths_found_in_home(tmp_path: Path) -> None:
    (tmp_path / "country.MMDB").write_bytes(b"")
    text = (
        BASE
        + """\
geox-url:
  mmdb: "https://example.net/Country.mmdb"
  geosite: "https://example.net/GeoSite.dat"
  geoip: "https://example.net/GeoIP.dat"
  asn: "https://example.net/ASN.mmdb"
rules:
  - GEOIP,CN,DIRECT
  - GEOSITE,google,a
  - IP-ASN,13335,b
"""
    )
    result = _doc(text, tmp_path)
    assert result.config["runtime"]["geodata"] == {
        "geoip_path": str(tmp_path / "country.MMDB"),
        "asn_path": str(tmp_path / "ASN.mmdb"),
        "geosite_path": str(tmp_path / "GeoSite.dat"),
        "geoip_url": "https://example.net/Country.mmdb",
        "geosite_url": "https://example.net/GeoSite.dat",
    }
    parse_config(result.config)
    skipped = {i.path for i in result.report.skipped}
    assert {"geox-url.geoip", "geox-url.asn"} <= skipped
    assert {"geox-url.mmdb", "geox-url.geosite"} <= {i.path for i in result.report.converted}


def test_dialer_proxy_variants(tmp_path: Path) -> None:
    text = """\
proxies:
  - {name: hop, type: socks5, server: 127.0.0.1, port: 1080}
  - {name: ss, type: ss, server: 127.0.0.1, port: 8388, cipher: aes-128-gcm, password: p,
     dialer-proxy: hop}
  - {name: via-group, type: http, server: 127.0.0.1, port: 3128, dialer-proxy: G}
  - {name: via-ss, type: http, server: 127.0.0.1, port: 3129, dialer-proxy: ss}
  - {name: direct-dial, type: http, server: 127.0.0.1, port: 3130, dialer-proxy: DIRECT}
proxy-groups:
  - {name: G, type: select, proxies: [hop]}
"""
    result = _doc(text, tmp_path)
    config = result.config
    parse_config(config)
    assert _group(config, "ss")["outbounds"] == ["hop", "ss (last hop)"]
    changed = {i.name: i for i in result.report.changed if i.path.endswith("dialer-proxy")}
    assert "is a group" in changed["via-group"].why
    assert "connects directly" in changed["via-ss"].what
    assert "direct-dial" not in changed


# ---------------------------------------------------------------------------
# Share links and bad input
# ---------------------------------------------------------------------------


def test_share_link_list_becomes_a_selector(tmp_path: Path) -> None:
    links = "\n".join(
        [
            "socks5://127.0.0.1:1080#🇭🇰 HK",
            "ss://"
            + base64.urlsafe_b64encode(b"aes-256-gcm:pw").decode().rstrip("=")
            + "@127.0.0.1:8388#🇯🇵 JP",
            "vmess://"
            + base64.b64encode(
                json.dumps({"ps": "vm", "add": "h", "port": 1, "id": "u"}).encode()
            ).decode(),
            "nonsense",
        ]
    )
    for body in (links, base64.b64encode(links.encode()).decode()):
        result = _import(body, tmp_path)
        assert result.source == "links"
        config = result.config
        parse_config(config)
        assert [o["tag"] for o in config["outbounds"]] == ["🇭🇰 HK", "🇯🇵 JP"]
        assert config["outbound_groups"] == [
            {"tag": "Proxy", "kind": "selector", "outbounds": ["🇭🇰 HK", "🇯🇵 JP"]}
        ]
        assert config["route"] == {"final": "Proxy"}
        assert {i.name for i in result.report.skipped} == {"vm", ""}
    with pytest.raises(ClashImportError, match="no share link could be carried"):
        import_links("vmess://" + base64.b64encode(b'{"ps": "x"}').decode())


def test_proxies_alone_become_a_selector(tmp_path: Path) -> None:
    text = "proxies:\n  - {name: s, type: socks5, server: 127.0.0.1, port: 1080}\n"
    text += "  - {name: v, type: vmess, server: h, port: 1, uuid: u}\n"
    result = _import(text + "subscription-info: x\n", tmp_path)
    assert result.config["outbound_groups"] == [
        {"tag": "Proxy", "kind": "selector", "outbounds": ["s"]}
    ]
    assert {i.path for i in result.report.skipped} == {"proxies[1]", "subscription-info"}
    with pytest.raises(ClashImportError, match="no proxy could be carried"):
        _import("proxies:\n  - {name: v, type: vmess, server: h, port: 1, uuid: u}\n", tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a Clash configuration"),
        ("- a\n- b\n", "not a Clash configuration"),
        ("just words\n", "not a Clash configuration"),
        ("foo: 1\nbar: 2\n", "none of mihomo's keys"),
        ("proxies: [\n", "not valid YAML"),
        ("mode: rule\nmode: global\n", "already defined"),
        ("<html><body>502 Bad Gateway</body></html>", "not a Clash configuration"),
        ("\x00\x01\x02", "not"),
        ("inbounds: []\nrules: []\n", "spliceway configuration"),
    ],
)
def test_nothing_usable(text: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ClashImportError, match=message):
        _import(text, tmp_path)


@pytest.mark.parametrize(
    "doc",
    [
        {
            "proxies": "x",
            "proxy-groups": 5,
            "rules": {"a": 1},
            "dns": [],
            "tun": 3,
            "listeners": "l",
        },
        {
            "proxies": [None, 1, "x", {"name": None}],
            "proxy-groups": [None, {"name": 5}, {"name": "g"}],
        },
        {
            "proxy-providers": {"p": 5, "q": {"type": "ftp"}},
            "rule-providers": {"r": {"behavior": "x"}},
        },
        {"port": "abc", "socks-port": 70000, "mixed-port": True, "authentication": "x"},
        {"external-controller": "nonsense", "mode": 5, "log-level": [1]},
        {"dns": {"enable": "yes"}, "tun": {"enable": True, "mtu": "big"}},
        {"rules": ["MATCH"], "proxy-groups": [{"name": "g", "type": "select"}]},
    ],
)
def test_garbage_never_crashes(doc: dict[str, Any], tmp_path: Path) -> None:
    result = import_document(doc, home=str(tmp_path), files_dir=str(tmp_path))
    parse_config(result.config)
    assert result.report.skipped or result.report.changed


# ---------------------------------------------------------------------------
# Any document of mihomo's vocabulary: a valid configuration, never a crash
# ---------------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "c", "g", "h", "direct", "REJECT", "GLOBAL", "🚀 节点"])
_MEMBERS = st.sampled_from(
    ["a", "b", "c", "g", "h", "DIRECT", "REJECT", "REJECT-DROP", "PASS", "zz", "🚀 节点"]
)
_PROXY = st.fixed_dictionaries(
    {
        "name": _NAMES,
        "type": st.sampled_from(["ss", "socks5", "http", "vmess", "direct", "reject", "ssr"]),
        "server": st.sampled_from(["127.0.0.1", "", "h.example"]),
        "port": st.sampled_from([1, "2", 0, 70000, True, "0x50"]),
        "cipher": st.sampled_from(["aes-128-gcm", "chacha20-ietf-poly1305", "rc4-md5"]),
        "password": st.sampled_from(["p", "", 123]),
    },
    optional={
        "dialer-proxy": _MEMBERS,
        "plugin": st.just("obfs"),
        "udp": st.sampled_from([True, "true", 0]),
        "username": st.sampled_from(["u", ""]),
    },
)
_GROUP = st.fixed_dictionaries(
    {
        "name": _NAMES,
        "type": st.sampled_from(["select", "url-test", "fallback", "load-balance", "relay", "x"]),
    },
    optional={
        "proxies": st.lists(_MEMBERS, max_size=5),
        "use": st.lists(st.sampled_from(["p", "q"]), max_size=2),
        "filter": st.sampled_from(["a", "(?<n>x)", "b`c"]),
        "exclude-filter": st.sampled_from(["a", "^b$"]),
        "exclude-type": st.sampled_from(["Socks5", "Http|Selector"]),
        "include-all": st.booleans(),
        "include-all-proxies": st.booleans(),
        "tolerance": st.sampled_from([50, "50", -1]),
        "interval": st.sampled_from([0, 60, "x"]),
        "strategy": st.sampled_from(["round-robin", "sticky-sessions", "nope"]),
    },
)
_RULE = st.sampled_from(
    [
        "MATCH,g",
        "MATCH,GLOBAL",
        "DOMAIN,x.example,a",
        "DOMAIN-SUFFIX,y.example,PASS",
        "IP-CIDR,10.0.0.0/8,h,no-resolve",
        "AND,((DOMAIN,a.example),(NETWORK,UDP)),b",
        "RULE-SET,p,a",
        "IN-PORT,7890,g",
        "GEOIP,CN,DIRECT",
        "SRC-IP-SUFFIX,1.2.3.4/24,REJECT",
        "nonsense",
    ]
)
_DOC = st.fixed_dictionaries(
    {},
    optional={
        "mixed-port": st.sampled_from([7890, 0, "7891", -1]),
        "allow-lan": st.booleans(),
        "mode": st.sampled_from(["rule", "Global", "DIRECT", "script"]),
        "proxies": st.lists(_PROXY, max_size=6),
        "proxy-groups": st.lists(_GROUP, max_size=6),
        "rules": st.lists(_RULE, max_size=8),
        "proxy-providers": st.dictionaries(
            st.sampled_from(["p", "q"]),
            st.sampled_from(
                [
                    {"type": "http", "url": "https://s.example/x"},
                    {"type": "file", "path": "p.yaml"},
                    {},
                ]
            ),
            max_size=2,
        ),
        "rule-providers": st.dictionaries(
            st.sampled_from(["p", "r"]),
            st.sampled_from(
                [
                    {"type": "http", "behavior": "domain", "url": "https://r.example/x"},
                    {"type": "x"},
                ]
            ),
            max_size=2,
        ),
        "dns": st.sampled_from(
            [
                {"enable": True, "nameserver": ["1.1.1.1", "https://d.example/dns-query"]},
                {"enable": "yes"},
            ]
        ),
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_DOC)
def test_any_document_validates_or_is_refused(doc: dict[str, Any]) -> None:
    if not doc:
        with pytest.raises(ClashImportError, match="not a Clash configuration"):
            import_document(doc, home="/nonexistent", files_dir="/nonexistent/files")
        return
    if set(doc) == {"proxies"}:
        # A list of proxies alone: a selector over them, or nothing usable at all.
        with contextlib.suppress(ClashImportError):
            parse_config(import_document(doc, home="/x", files_dir="/x").config)
        return
    result = import_document(doc, home="/nonexistent", files_dir="/nonexistent/files")
    parse_config(result.config)
