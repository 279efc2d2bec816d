"""spliceway.clash.rule_lines: Clash rule lines read as mihomo reads them.

Three layers: a table of lines and what they become; mihomo's own parser on a corpus of
lines (``mihomo -t`` accepts exactly the lines spliceway does not call "mihomo refuses it
too"); and routing: the same rule list loaded into a running mihomo and into
spliceway's reference (``routing.rules.decide``, resolving names through the same DNS
server when a rule asks), each destination sent through mihomo's SOCKS5 port, the rule
mihomo logs against the one spliceway picks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.clash.rule_lines import (
    InboundContext,
    ParsedRule,
    Unsupported,
    parse_rule_line,
    single_item,
)
from spliceway.config import Rule
from spliceway.routing.rules import FlowFacts, compile_rules, decide, needs_address
from spliceway.routing.ruleset import parse_rule_set
from tests.helpers.dnsserver import dns_server
from tests.helpers.mihomo import require_mihomo, running_mihomo

# ---------------------------------------------------------------------------
# What lines become
# ---------------------------------------------------------------------------

TABLE: list[tuple[str, dict[str, Any] | str]] = [
    ("DOMAIN,Example.COM,P", {"domain": ["example.com"]}),
    ("domain-suffix , google.com , P", {"domain_suffix": ["google.com"]}),
    ("DOMAIN-KEYWORD,ADS,P", {"domain_keyword": ["ads"]}),
    ("DOMAIN-REGEX,^a{1,3}\\.com$,P", {"domain_regex": ["^a{1,3}\\.com$"]}),
    ("DOMAIN-WILDCARD,*.goo?le.com,P", {"domain_regex": ["^.*\\.goo.le\\.com$"]}),
    ("DOMAIN,例子.测试,P", {"domain": ["xn--fsqu00a.xn--0zwm56d"]}),
    ("GEOSITE,Google@CN,P", {"geosite": ["google@cn"]}),
    ("GEOSITE,!cn,P", {"geosite": ["cn"], "invert": True}),
    ("GEOIP,CN,P", {"geoip": ["cn"]}),
    ("GEOIP,CN,P,no-resolve", {"geoip": ["cn"], "no_resolve": True}),
    ("GEOIP,CN,P,src", {"source_geoip": ["cn"]}),
    ("SRC-GEOIP,lan,P", {"source_geoip": ["lan"]}),
    ("IP-ASN,13335,P", {"ip_asn": ["13335"]}),
    ("SRC-IP-ASN,13335,P", {"source_ip_asn": ["13335"]}),
    ("IP-CIDR,10.0.0.0/8,P", {"ip_cidr": ["10.0.0.0/8"]}),
    ("IP-CIDR6,2001:db8::/32,P,no-resolve", {"ip_cidr": ["2001:db8::/32"], "no_resolve": True}),
    ("IP-CIDR,10.0.0.0/8,P,src", {"source_ip_cidr": ["10.0.0.0/8"]}),
    ("SRC-IP-CIDR,192.168.1.1/32,P", {"source_ip_cidr": ["192.168.1.1/32"]}),
    ("DST-PORT,80/443/1000-2000,P", {"port": ["80", "443", "1000-2000"]}),
    ("DST-PORT,2000-1000,P", {"port": ["1000-2000"]}),
    ("SRC-PORT,5000,P", {"source_port": ["5000"]}),
    ("NETWORK,Udp,P", {"network": "udp"}),
    ("PROCESS-NAME,curl,P", {"process_name": ["curl"]}),
    ("RULE-SET,ads,P", {"rule_set": ["ads"]}),
    ("RULE-SET,ads,P,no-resolve", {"rule_set": ["ads"], "no_resolve": True}),
    ("RULE-SET,ads,P,src", {"rule_set": ["ads"], "rule_set_ip_cidr_match_source": True}),
    ("MATCH,P", {}),
    ("AND,((DOMAIN,a.com),(NETWORK,UDP)),P", {"domain": ["a.com"], "network": "udp"}),
    (
        "AND,((DOMAIN,a.com),(DOMAIN,b.com)),P",
        {"type": "logical", "mode": "and", "rules": [{"domain": ["a.com"]}, {"domain": ["b.com"]}]},
    ),
    (
        "AND,((IP-CIDR,1.0.0.0/8,no-resolve),(GEOIP,cn)),P",
        {
            "type": "logical",
            "mode": "and",
            "rules": [{"ip_cidr": ["1.0.0.0/8"], "no_resolve": True}, {"geoip": ["cn"]}],
        },
    ),
    (
        "OR,((DOMAIN,a.com),(DST-PORT,53)),P",
        {"type": "logical", "mode": "or", "rules": [{"domain": ["a.com"]}, {"port": ["53"]}]},
    ),
    ("NOT,((DOMAIN,a.com)),P", {"domain": ["a.com"], "invert": True}),
    ("NOT,((NOT,((DOMAIN,a.com)))),P", {"domain": ["a.com"]}),
    (
        "NOT,((OR,((DOMAIN,a),(NETWORK,tcp)))),P",
        {
            "type": "logical",
            "mode": "or",
            "rules": [{"domain": ["a"]}, {"network": "tcp"}],
            "invert": True,
        },
    ),
    ("and,((domain,a)),P", {"domain": ["a"]}),
    # Not evaluated by spliceway
    ("IP-SUFFIX,8.8.8.8/24,P", "IP-SUFFIX: no spliceway condition matches the low bits"),
    ("DSCP,4,P", "DSCP: spliceway does not read"),
    ("UID,1000,P", "UID: spliceway does not match"),
    ("PROCESS-PATH,/usr/bin/curl,P", "PROCESS-PATH: spliceway matches a process by name"),
    ("PROCESS-NAME-REGEX,^cu,P", "PROCESS-NAME-REGEX: spliceway matches process names exactly"),
    ("SUB-RULE,(NETWORK,tcp),sub", "SUB-RULE: spliceway has no sub-rule"),
    ("IN-PORT,7890,P", "IN-PORT: needs the imported inbounds"),
    ("DOMAIN-REGEX,(?<n>a),P", "DOMAIN-REGEX: regular expression '(?<n>a)' does not compile"),
    ("DST-PORT,70000,P", "DST-PORT: '70000': ports are 0..65535"),
    # mihomo refuses these too
    ("FOO,bar,P", "FOO: unsupported rule type 'FOO' (mihomo refuses it too)"),
    ("DOMAIN,a.com", "DOMAIN: format invalid: no target (mihomo refuses it too)"),
    ("IP-CIDR,1.2.3.4,P", "IP-CIDR: '1.2.3.4' is not a network (mihomo refuses it too)"),
    ("NETWORK,icmp,P", "NETWORK: 'icmp': only TCP or UDP (mihomo refuses it too)"),
    ("AND,((DOMAIN,a),(MATCH,x)),P", "MATCH: MATCH is not allowed in a logic rule"),
    ("DST-PORT,*,P", "DST-PORT: '*' names no port (mihomo refuses it too)"),
    ("NOT,((DOMAIN,a),(DOMAIN,b)),P", "NOT: not rule must contain one rule"),
    ("AND,(DOMAIN,a,P", "AND: payload format error"),
    ("AND,((DOMAIN,a),P", "AND: format error is missing )"),
    ("AND,((DOMAIN,a)(,P", "AND: payload format error"),
    ("AND,DOMAIN,a,P", "AND: payload format error"),
]


@pytest.mark.parametrize(("line", "want"), TABLE)
def test_line(line: str, want: dict[str, Any] | str) -> None:
    parsed = parse_rule_line(line)
    if isinstance(want, str):
        assert isinstance(parsed, Unsupported), parsed
        assert f"{parsed.type}: {parsed.reason}".startswith(want), parsed
        return
    assert isinstance(parsed, ParsedRule), parsed
    assert parsed.rule == want
    if parsed.type != "MATCH":
        # Every rule a line gives is a valid spliceway rule.
        Rule.model_validate({**parsed.rule, "outbound": "direct"})


def test_target_and_notes() -> None:
    parsed = parse_rule_line("DOMAIN-WILDCARD,*.a.com, 🚀 Proxy ")
    assert isinstance(parsed, ParsedRule)
    assert parsed.target == "🚀 Proxy"
    assert parsed.notes == (
        "DOMAIN-WILDCARD: the sniffed host is tried too (mihomo: the target only)",
    )


def test_rule_set_lines() -> None:
    parsed = parse_rule_line("DOMAIN-SUFFIX,google.com", with_target=False)
    assert isinstance(parsed, ParsedRule) and parsed.target is None
    assert single_item(parsed) == ("domain_suffix", "google.com", False)
    cidr = parse_rule_line("IP-CIDR,10.0.0.0/8,no-resolve", with_target=False)
    assert isinstance(cidr, ParsedRule) and single_item(cidr) == ("ip_cidr", "10.0.0.0/8", True)
    for line in ("MATCH", "RULE-SET,x", "SUB-RULE,(NETWORK,tcp)"):
        assert isinstance(parse_rule_line(line, with_target=False), Unsupported), line


def test_inbound_context() -> None:
    ctx = InboundContext(
        by_port={7890: ["mixed"], 1080: ["socks"]},
        by_type={"SOCKS5": ["socks", "mixed"], "HTTP": ["mixed"]},
        by_name={"in-a": "a"},
        users={"alice": "alice-key"},
    )
    assert parse_rule_line("IN-PORT,1000-8000,P", context=ctx).rule == {  # type: ignore[union-attr]
        "inbound_tag": ["mixed", "socks"]
    }
    assert parse_rule_line("IN-TYPE,socks/HTTP,P", context=ctx).rule == {  # type: ignore[union-attr]
        "inbound_tag": ["socks", "mixed"]
    }
    assert parse_rule_line("IN-NAME,in-a,P", context=ctx).rule == {"inbound_tag": ["a"]}  # type: ignore[union-attr]
    assert parse_rule_line("IN-USER,alice/bob,P", context=ctx).rule == {  # type: ignore[union-attr]
        "principal_key": ["alice-key"]
    }
    assert isinstance(parse_rule_line("IN-PORT,9999,P", context=ctx), Unsupported)
    assert isinstance(parse_rule_line("IN-TYPE,FOO,P", context=ctx), Unsupported)


# ---------------------------------------------------------------------------
# mihomo's parser: the same lines accepted and refused
# ---------------------------------------------------------------------------

#: Lines mihomo parses without geodata (GEOIP other than lan, GEOSITE and IP-ASN would
#: make it load or download a database).
ACCEPTANCE_CORPUS = [
    line for line, _ in TABLE if not re.search(r"(GEOIP|GEOSITE|IP-ASN),(?!lan)", line)
] + [
    "GEOIP,lan,P",
    "DOMAIN-SUFFIX,,P",
    "NOT,((DOMAIN,a)),P",
    "OR,((NETWORK,tcp),(AND,((DST-PORT,80),(DOMAIN,x.com)))),P",
    "IN-TYPE,SOCKS/HTTP,P",
    "IN-USER,alice,P",
    "IN-NAME,mixed-in,P",
    "SRC-PORT,1-65535,P",
    "DST-PORT,80,P,no-resolve",
    "MATCH",
    "RULE-SET,ads,P",
]


def _mihomo_accepts(exe: Path, home: Path, line: str) -> tuple[bool, str]:
    config = {
        "mode": "rule",
        "geo-auto-update": False,
        "find-process-mode": "off",
        "dns": {"enable": False},
        "proxies": [{"name": "P", "type": "socks5", "server": "127.0.0.1", "port": 1}],
        "rule-providers": {
            "ads": {"type": "inline", "behavior": "domain", "payload": ["+.ads.test"]}
        },
        "sub-rules": {"sub": ["MATCH,P"]},
        "rules": [line, "MATCH,P"],
    }
    (home / "config.yaml").write_text(json.dumps(config))
    proc = subprocess.run(
        [str(exe), "-t", "-d", str(home), "-f", str(home / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return proc.returncode == 0, proc.stdout + proc.stderr


def test_mihomo_accepts_what_spliceway_does_not_call_refused(tmp_path: Path) -> None:
    exe = require_mihomo()
    disagreements = []
    for line in ACCEPTANCE_CORPUS:
        accepted, log = _mihomo_accepts(exe, tmp_path, line)
        parsed = parse_rule_line(line)
        refused = isinstance(parsed, Unsupported) and "mihomo refuses it too" in parsed.reason
        if accepted == refused:
            disagreements.append((line, parsed, log.strip().splitlines()[-2:]))
    assert not disagreements


# ---------------------------------------------------------------------------
# Routing: mihomo and spliceway on the same rules and destinations
# ---------------------------------------------------------------------------

ZONE = {
    "in10.test": ["10.1.2.3"],
    "lan.test": ["192.168.7.7"],
    "ads.example.com": ["203.0.113.5"],
    "plain.test": ["198.51.100.9"],
}

ROUTING_LINES = [
    "DOMAIN,exact.test,{t}",
    "DOMAIN-SUFFIX,suffix.test,{t}",
    "DOMAIN-KEYWORD,kw,{t}",
    "DOMAIN-REGEX,^re[0-9]+\\.test$,{t}",
    "IP-CIDR,10.0.0.0/8,{t},no-resolve",
    "AND,((NETWORK,TCP),(DST-PORT,8443)),{t}",
    "OR,((DOMAIN,or-a.test),(DST-PORT,9443)),{t}",
    "NOT,((DOMAIN-SUFFIX,test)),{t}",
    "RULE-SET,names,{t}",
    "GEOIP,lan,{t}",
    "IP-CIDR,203.0.113.0/24,{t}",
    "RULE-SET,nets,{t},no-resolve",
    "RULE-SET,classic,{t}",
    "DST-PORT,7000-7100,{t}",
    "IP-CIDR6,2001:db8::/32,{t}",
]

PROBES = [
    ("exact.test", 443),
    ("www.exact.test", 443),
    ("a.suffix.test", 443),
    ("mykwsite.org", 443),
    ("re12.test", 443),
    ("in10.test", 443),
    ("10.9.9.9", 443),
    ("x.test", 8443),
    ("or-a.test", 443),
    ("y.test", 9443),
    ("example.org", 443),
    ("tracker.names.test", 443),
    ("lan.test", 443),
    ("192.168.1.1", 443),
    ("ads.example.com", 443),
    ("plain.test", 443),
    ("172.20.0.1", 443),
    ("nx.test", 7050),
    ("cls.test", 443),
    ("2001:db8::1", 443),
    ("198.51.100.1", 443),
]

RULE_SETS = {
    "names": ("domain", "+.names.test\n.only-sub.test\n"),
    "nets": ("ipcidr", "172.16.0.0/12\n"),
    "classic": ("classical", "DOMAIN,cls.test\nIP-CIDR,198.51.0.0/16\n"),
}


def _socks_connect(port: int, host: str, dport: int) -> int:
    """One SOCKS5 CONNECT through mihomo; the client's source port."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        sport = s.getsockname()[1]
        s.sendall(b"\x05\x01\x00")
        assert s.recv(2) == b"\x05\x00"
        try:
            packed = socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            atyp = b"\x04" if len(packed) == 16 else b"\x01"
            addr = atyp + packed
        except OSError:
            addr = b"\x03" + bytes([len(host)]) + host.encode()
        s.sendall(b"\x05\x01\x00" + addr + struct.pack("!H", dport))
        s.settimeout(10)
        with contextlib.suppress(OSError):
            s.recv(10)  # the reply (a failure: the proxies are closed ports)
        return sport


_MATCH_LOG = re.compile(
    r"dial (\S+) \(match .*?\) 127\.0\.0\.1:(\d+)"
    r"|127\.0\.0\.1:(\d+)\S* --> \S+ match .* using (\S+)"
)


def _mihomo_choices(mihomo_log: list[str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in mihomo_log:
        m = _MATCH_LOG.search(line)
        if m:
            proxy, sport = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            out[int(sport)] = proxy.split("[")[0]
    return out


@pytest.fixture
def dns_zone() -> Iterator[Any]:
    with dns_server(ZONE) as server:
        yield server


def test_routes_like_mihomo(tmp_path: Path, dns_zone: Any) -> None:
    require_mihomo()
    lines = [line.format(t=f"P{i}") for i, line in enumerate(ROUTING_LINES)]
    parsed = [parse_rule_line(line) for line in lines]
    assert all(isinstance(p, ParsedRule) for p in parsed), parsed
    names = [f"P{i}" for i in range(len(ROUTING_LINES))] + ["FINAL"]
    home = tmp_path / "mihomo"
    home.mkdir()
    providers = {}
    sets = {}
    for name, (behavior, text) in RULE_SETS.items():
        (home / f"{name}.txt").write_text(text)
        providers[name] = {
            "type": "file",
            "behavior": behavior,
            "format": "text",
            "path": f"./{name}.txt",
        }
        sets[name] = parse_rule_set(text.encode(), behavior, "text")  # type: ignore[arg-type]
    config = {
        "mode": "rule",
        "log-level": "info",
        "ipv6": True,
        "geo-auto-update": False,
        "find-process-mode": "off",
        "profile": {"store-selected": False},
        "external-controller": "127.0.0.1:0",
        "listeners": [{"name": "mixed-in", "type": "mixed", "listen": "127.0.0.1", "port": 0}],
        "dns": {
            "enable": True,
            "ipv6": False,
            "enhanced-mode": "normal",
            "default-nameserver": [dns_zone.udp_url],
            "nameserver": [dns_zone.udp_url],
        },
        "proxies": [{"name": n, "type": "socks5", "server": "127.0.0.1", "port": 1} for n in names],
        "rule-providers": providers,
        "rules": [*lines, "MATCH,FINAL"],
    }
    rules = [
        Rule.model_validate({**p.rule, "outbound": p.target})
        for p in parsed
        if isinstance(p, ParsedRule)
    ]
    ruleset = compile_rules(rules, rule_sets=sets)
    wanted: dict[int, tuple[str, str | None]] = {}
    with running_mihomo(config, home) as mihomo:
        # mihomo drops connections that arrive while it still applies its config (the
        # tunnel is suspended until then): wait until one is routed.
        deadline = time.monotonic() + 10
        while True:
            warm = _socks_connect(mihomo.mixed_port, "warm-up.invalid", 1)
            if warm in _mihomo_choices(mihomo.lines) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for host, dport in PROBES:
            sport = _socks_connect(mihomo.mixed_port, host, dport)
            facts = FlowFacts(
                network="tcp", host=host, port=dport, source_ip="127.0.0.1", source_port=sport
            )
            decision = decide(ruleset, "rule", None, "FINAL", facts)
            if needs_address(ruleset, "rule", facts, decision) and host in ZONE:
                again = dataclasses.replace(facts, resolved_ip=ZONE[host][0])
                decision = decide(ruleset, "rule", None, "FINAL", again)
            wanted[sport] = (host, decision.target)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = _mihomo_choices(mihomo.lines)
            if all(s in seen for s in wanted):
                break
            time.sleep(0.05)
        seen = _mihomo_choices(mihomo.lines)
        log = mihomo.log_tail(60)
    got = {host: seen.get(sport) for sport, (host, _) in wanted.items()}
    want = dict(wanted.values())
    assert got == want, (
        log
        + "\n"
        + "\n".join(f"{h}: mihomo {got[h]}, spliceway {want[h]}" for h in want if got[h] != want[h])
    )
