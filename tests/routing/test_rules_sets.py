"""spliceway.routing.rules on the conditions of issue 29: rule sets, geoip / ip_asn /
geosite, logical rules, invert, no_resolve and the resolve-once order of mihomo.

Differential parts: a domain set against a port of mihomo's ``DomainTrie`` search, and
whole rule lists against mihomo's match loop (resolve at the first rule that wants an
address, every later rule sees it) run over single rules.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway.config import Rule
from spliceway.routing import geodata
from spliceway.routing.rules import (
    FlowFacts,
    compile_rules,
    condition_text,
    decide,
    needs_address,
    rule_resolves,
)
from spliceway.routing.ruleset import RuleSetData, parse_rule_set


def _rule(target: str = "hit", **kw: Any) -> Rule:
    return Rule.model_validate({**kw, "outbound": target})


def _facts(host: str, **kw: Any) -> FlowFacts:
    return FlowFacts(**{"network": "tcp", "host": host, "port": 443, **kw})


def _target(rules: list[Rule], facts: FlowFacts, **compile_kw: Any) -> str | None:
    return decide(compile_rules(rules, **compile_kw), "rule", None, "final", facts).target


# ---------------------------------------------------------------------------
# Domain sets: mihomo's trie semantics
# ---------------------------------------------------------------------------


class _Trie:
    """mihomo's component/trie/domain.go, insert and search, for a set (no values)."""

    def __init__(self) -> None:
        self.root: dict[str, Any] = {}

    def insert(self, domain: str) -> bool:
        if not domain or domain.endswith(".") or domain[0].isspace() or domain[-1].isspace():
            return False
        parts = domain.lower().split(".")
        if len(parts) == 1 and parts[0] == "":
            return False
        if any(p == "" for p in parts[1:]):
            return False
        if parts[0] == "+":
            self._insert(parts[1:])
            parts[0] = ""
        self._insert(parts)
        return True

    def _insert(self, parts: list[str]) -> None:
        node = self.root
        for part in reversed(parts):
            node = node.setdefault(part, {})
        node["\0"] = True

    def has(self, domain: str) -> bool:
        parts = domain.lower().split(".")
        if any(p == "" for p in parts):
            return False
        return self._search(self.root, parts)

    def _search(self, node: dict[str, Any], parts: list[str]) -> bool:
        if not parts:
            return bool(node.get("\0"))
        child = node.get(parts[-1])
        if child is not None and self._search(child, parts[:-1]):
            return True
        child = node.get("*")
        if child is not None and self._search(child, parts[:-1]):
            return True
        dot = node.get("")
        return bool(dot is not None and dot.get("\0"))


_LABELS = ["a", "b", "example", "com", "x"]
_entry = st.builds(
    lambda prefix, labels: prefix + ".".join(labels),
    st.sampled_from(["", "+.", ".", "*.", ""]),
    st.lists(st.sampled_from([*_LABELS, "*"]), min_size=1, max_size=3),
)
_host = st.lists(st.sampled_from(_LABELS), min_size=1, max_size=4).map(".".join)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(_entry, min_size=1, max_size=8), hosts=st.lists(_host, max_size=8))
def test_domain_set_matches_mihomo_trie(entries: list[str], hosts: list[str]) -> None:
    trie = _Trie()
    kept = [e for e in entries if trie.insert(e)]
    data = parse_rule_set("\n".join(entries).encode(), "domain", "text") if kept else None
    rules = [_rule(rule_set="s")]
    for host in hosts:
        want = trie.has(host)
        got = data is not None and _target(rules, _facts(host), rule_sets={"s": data}) == "hit"
        assert got == want, (entries, host)


def test_domain_entry_kinds() -> None:
    data = parse_rule_set(
        b"+.plus.com\n.dot.com\n*.star.com\nexact.com\nmid.*.org\n*\n", "domain", "text"
    )
    rules = [_rule(rule_set="s")]
    table = {
        "plus.com": True,
        "a.b.plus.com": True,
        "dot.com": False,
        "a.dot.com": True,
        "a.b.dot.com": True,
        "star.com": False,
        "a.star.com": True,
        "a.b.star.com": False,
        "exact.com": True,
        "www.exact.com": False,
        "mid.x.org": True,
        "mid.x.y.org": False,
        "localhost": True,  # "*" alone: any one-label name
        "EXACT.COM.": True,
    }
    for host, want in table.items():
        assert (_target(rules, _facts(host), rule_sets={"s": data}) == "hit") == want, host


def test_sniffed_host_is_tried_for_sets() -> None:
    data = parse_rule_set(b"+.example.com\n", "domain", "text")
    facts = _facts("93.184.216.34", sniffed_host="www.example.com")
    assert _target([_rule(rule_set="s")], facts, rule_sets={"s": data}) == "hit"


# ---------------------------------------------------------------------------
# CIDR sets, classical sets
# ---------------------------------------------------------------------------


def test_ipcidr_set_target_and_source() -> None:
    data = parse_rule_set(b"10.0.0.0/8\n2001:db8::/32\n::ffff:192.0.2.0/120\n", "ipcidr", "text")
    sets = {"s": data}
    assert _target([_rule(rule_set="s")], _facts("10.2.3.4"), rule_sets=sets) == "hit"
    assert _target([_rule(rule_set="s")], _facts("2001:db8::9"), rule_sets=sets) == "hit"
    assert _target([_rule(rule_set="s")], _facts("192.0.2.7"), rule_sets=sets) == "hit"
    assert _target([_rule(rule_set="s")], _facts("11.0.0.1"), rule_sets=sets) == "final"
    src = _rule(rule_set="s", rule_set_ip_cidr_match_source=True)
    assert _target([src], _facts("11.0.0.1", source_ip="10.9.9.9"), rule_sets=sets) == "hit"
    assert _target([src], _facts("10.0.0.1", source_ip="11.9.9.9"), rule_sets=sets) == "final"
    # A domain target meets the set by its resolved address.
    assert (
        _target([_rule(rule_set="s")], _facts("a.test", resolved_ip="10.1.1.1"), rule_sets=sets)
        == "hit"
    )


def test_big_sets_are_fast_in_python() -> None:
    """300,000 domains and 20,000 networks: parsed in seconds, decided by set lookups
    and a bisect (never a scan)."""
    body = "\n".join(f"+.d{i}.example{i % 97}.com" for i in range(300_000)).encode()
    started = time.monotonic()
    domains = parse_rule_set(body, "domain", "text")
    cidrs = parse_rule_set(
        "\n".join(
            f"{10 + i // 65536}.{(i // 256) % 256}.{i % 256}.0/24" for i in range(20_000)
        ).encode(),
        "ipcidr",
        "text",
    )
    parse_seconds = time.monotonic() - started
    ruleset = compile_rules(
        [_rule("d", rule_set="d"), _rule("c", rule_set="c")], rule_sets={"d": domains, "c": cidrs}
    )
    facts = [_facts(f"www.d{i}.example{i % 97}.com") for i in range(0, 300_000, 300)]
    facts += [_facts(f"10.{i % 78}.{i % 256}.1") for i in range(1000)]
    started = time.monotonic()
    targets = [decide(ruleset, "rule", None, "final", f).target for f in facts]
    per_decision = (time.monotonic() - started) / len(facts)
    assert targets.count("d") == 1000 and targets.count("c") == 1000
    assert len(domains.suffix) == 300_000
    assert parse_seconds < 20
    assert per_decision < 200e-6, per_decision


def test_classical_set_lines() -> None:
    body = (
        b"payload:\n"
        b"  - DOMAIN-SUFFIX,foo.com\n"
        b"  - DOMAIN,exact.org\n"
        b"  - DOMAIN-KEYWORD,tracker\n"
        b"  - IP-CIDR,10.0.0.0/8,no-resolve\n"
        b"  - AND,((NETWORK,udp),(DST-PORT,53))\n"
        b"  - SRC-IP-CIDR,192.168.0.0/16\n"
        b"  - PROCESS-PATH,/usr/bin/curl\n"
        b"  - MATCH\n"
    )
    data = parse_rule_set(body, "classical", "yaml")
    assert (data.count, data.skipped) == (6, 2)
    assert not data.resolves  # its only network came with no-resolve
    sets = {"s": data}
    rules = [_rule(rule_set="s")]
    assert _target(rules, _facts("a.foo.com"), rule_sets=sets) == "hit"
    assert _target(rules, _facts("exact.org"), rule_sets=sets) == "hit"
    assert _target(rules, _facts("mytracker.net"), rule_sets=sets) == "hit"
    assert _target(rules, _facts("10.1.1.1"), rule_sets=sets) == "hit"
    assert _target(rules, _facts("q.net", network="udp", port=53), rule_sets=sets) == "hit"
    assert _target(rules, _facts("q.net", network="tcp", port=53), rule_sets=sets) == "final"
    assert (
        _target(rules, _facts("q.net", source_ip="192.168.1.2", source_port=5), rule_sets=sets)
        == "hit"
    )
    assert (
        _target(rules, _facts("q.net", source_ip="10.0.0.1", source_port=5), rule_sets=sets)
        == "final"
    )


def test_missing_set_matches_nothing_and_is_listed() -> None:
    ruleset = compile_rules([_rule(rule_set="gone")])
    assert ruleset.missing == ("rule set 'gone'",)
    assert decide(ruleset, "rule", None, "final", _facts("a.com")).target == "final"


# ---------------------------------------------------------------------------
# GeoIP, ASN, GeoSite
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def geo(tmp_path_factory: pytest.TempPathFactory) -> geodata.GeoDatabases:
    home = tmp_path_factory.mktemp("geo")
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(
        IPSet(["1.0.0.0/24", "1.0.1.0/24", "240e::/20"]),
        {"country": {"iso_code": "CN"}, "autonomous_system_number": 4134},
    )
    writer.insert_network(
        IPSet(["8.8.8.0/24"]), {"country": {"iso_code": "US"}, "autonomous_system_number": 15169}
    )
    writer.insert_network(IPSet(["9.9.9.0/24"]), {"registered_country": {"iso_code": "CH"}})
    writer.to_db_file(str(home / "country.mmdb"))
    sites = geodata.GeoSiteListMessage()
    google = sites.entry.add(country_code="GOOGLE")
    cn = google.domain.add(type=2, value="google.cn")
    cn.attribute.add(key="cn", bool_value=True)
    google.domain.add(type=2, value="google.com")
    google.domain.add(type=3, value="www.youtube.com")
    google.domain.add(type=0, value="gstatic")
    google.domain.add(type=1, value=r"^ads\d+\.goog$")
    google.domain.add(type=1, value=r"(?<name>x)")  # Go RE2 syntax Python refuses
    sites.entry.add(country_code="GEOLOCATION-!CN").domain.add(type=2, value="example.org")
    (home / "geosite.dat").write_bytes(sites.SerializeToString())
    return geodata.open_databases(str(home / "country.mmdb"), None, str(home / "geosite.dat"))


def test_geoip_private_asn(geo: geodata.GeoDatabases) -> None:
    rules = [
        _rule("cn", geoip="CN"),
        _rule("lan", geoip="private"),
        _rule("as", ip_asn=15169),
        _rule("ch", geoip="ch"),
        _rule("src", source_geoip="us"),
    ]
    for host, want in [
        ("1.0.1.200", "cn"),
        ("240e:1::1", "cn"),
        ("192.168.3.4", "lan"),
        ("127.0.0.1", "lan"),
        ("fe80::1", "lan"),
        ("8.8.8.8", "as"),
        ("9.9.9.9", "ch"),  # registered_country when country is absent
        ("7.7.7.7", "final"),
    ]:
        assert _target(rules, _facts(host), geo=geo) == want, host
    assert _target(rules, _facts("7.7.7.7", source_ip="8.8.8.1"), geo=geo) == "src"
    # A domain target: by its resolved address.
    assert _target(rules, _facts("a.test", resolved_ip="1.0.0.9"), geo=geo) == "cn"


def test_geosite_lists_and_attributes(geo: geodata.GeoDatabases) -> None:
    rules = [
        _rule("cn", geosite="google@cn"),
        _rule("g", geosite="google"),
        _rule("o", geosite="geolocation-!cn"),
    ]
    for host, want in [
        ("google.cn", "cn"),
        ("www.google.cn", "cn"),
        ("google.com", "g"),
        ("www.youtube.com", "g"),
        ("m.youtube.com", "final"),
        ("fonts.gstatic.com", "g"),
        ("ads12.goog", "g"),
        ("a.example.org", "o"),
    ]:
        assert _target(rules, _facts(host), geo=geo) == want, host
    google = geo.geosite.domains("google") if geo.geosite else None
    assert google is not None and (google.count, google.skipped) == (5, 1)


def test_geo_without_database_matches_nothing() -> None:
    ruleset = compile_rules([_rule(geoip="cn"), _rule(geosite="google"), _rule("lan", geoip="lan")])
    assert set(ruleset.missing) == {
        "GeoIP database (for 'cn')",
        "geosite database (for 'google')",
    }
    assert decide(ruleset, "rule", None, "final", _facts("10.0.0.1")).target == "lan"


# ---------------------------------------------------------------------------
# Logical rules, invert, condition text
# ---------------------------------------------------------------------------


def test_logical_and_or_invert() -> None:
    both = _rule(type="logical", mode="and", rules=[{"domain_suffix": "a.com"}, {"network": "udp"}])
    either = _rule(type="logical", mode="or", rules=[{"domain": "b.com"}, {"port": 53}])
    nested = _rule(
        type="logical",
        mode="or",
        rules=[
            {
                "type": "logical",
                "mode": "and",
                "rules": [{"port": 1}, {"network": "udp"}],
                "invert": True,
            }
        ],
    )
    assert _target([both], _facts("x.a.com", network="udp")) == "hit"
    assert _target([both], _facts("x.a.com")) == "final"
    assert _target([either], _facts("b.com")) == "hit"
    assert _target([either], _facts("c.com", port=53)) == "hit"
    assert _target([either], _facts("c.com")) == "final"
    assert _target([nested], _facts("c.com", port=1, network="udp")) == "final"
    assert _target([nested], _facts("c.com", port=1)) == "hit"
    assert _target([_rule(domain="a.com", invert=True)], _facts("b.com")) == "hit"
    assert _target([_rule(domain="a.com", invert=True)], _facts("a.com")) == "final"


def test_condition_text() -> None:
    rule = _rule(
        type="logical",
        mode="and",
        rules=[
            {"rule_set": ["ads", "trackers"], "no_resolve": True},
            {"geoip": "cn", "invert": True},
            {
                "type": "logical",
                "mode": "or",
                "rules": [{"network": "udp"}, {"port": [53, "80-90"]}],
            },
        ],
        invert=True,
    )
    assert condition_text(rule) == (
        "not(logical(and: rule_set=ads|trackers,no_resolve; not(geoip=cn); "
        "logical(or: network=udp; port=53|80-90)))"
    )
    matched = decide(compile_rules([rule]), "rule", None, "final", _facts("a.com")).matched_rule
    assert matched is not None and matched.condition == condition_text(rule)


def test_process_and_domain_flags_see_parts() -> None:
    part = _rule(type="logical", mode="or", rules=[{"process_name": "curl"}, {"geosite": "x"}])
    ruleset = compile_rules([_rule(port=1), part])
    assert ruleset.has_process_conditions
    assert ruleset.first_domain_rule == 1
    data = parse_rule_set(b"PROCESS-NAME,curl\n", "classical", "text")
    assert compile_rules([_rule(rule_set="s")], rule_sets={"s": data}).has_process_conditions


# ---------------------------------------------------------------------------
# Resolving: no_resolve, first_ip_rule, needs_address, against mihomo's loop
# ---------------------------------------------------------------------------

ZONE = {"in10.test": "10.0.0.7", "in8.test": "8.8.8.8", "lan.test": "192.168.1.1"}


def _engine_route(rules: list[Rule], host: str, sets: dict[str, RuleSetData]) -> str | None:
    """What the engine does: decide; when needs_address, resolve and decide again."""
    ruleset = compile_rules(rules, rule_sets=sets)
    facts = _facts(host)
    decision = decide(ruleset, "rule", None, "final", facts)
    if needs_address(ruleset, "rule", facts, decision) and host in ZONE:
        decision = decide(ruleset, "rule", None, "final", _facts(host, resolved_ip=ZONE[host]))
    return decision.target


_RESOLVER = _rule("never", ip_cidr="255.255.255.255/32")  # resolves, never matches


def _mihomo_route(rules: list[Rule], host: str, sets: dict[str, RuleSetData]) -> str | None:
    """mihomo's tunnel.match: resolve once, at the first rule that wants an address;
    each rule then matched on its own (after a resolving rule, so it sees the address)."""
    resolved: str | None = None
    done = ipaddress_literal(host)
    for rule in rules:
        if not done and rule_resolves(rule, sets):
            done = True
            resolved = ZONE.get(host)
        alone = compile_rules([_RESOLVER, rule], rule_sets=sets)
        facts = _facts(host, resolved_ip=resolved)
        if decide(alone, "rule", None, "final", facts).target not in ("final", "never"):
            return rule.outbound
    return "final"


def ipaddress_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


_SETS = {
    "nets": parse_rule_set(b"10.0.0.0/8\n", "ipcidr", "text"),
    "names": parse_rule_set(b"+.in8.test\n", "domain", "text"),
    "mixed": parse_rule_set(b"IP-CIDR,8.0.0.0/8\nDOMAIN,lan.test\n", "classical", "text"),
}
_TEMPLATES: list[dict[str, Any]] = [
    {"ip_cidr": "10.0.0.0/8"},
    {"ip_cidr": "10.0.0.0/8", "no_resolve": True},
    {"ip_cidr": "8.0.0.0/8", "no_resolve": True},
    {"geoip": "private"},
    {"geoip": "lan", "no_resolve": True},
    {"geoip": "private", "invert": True},
    {"ip_cidr": "8.0.0.0/8", "invert": True, "no_resolve": True},
    {"rule_set": "nets"},
    {"rule_set": "nets", "no_resolve": True},
    {"rule_set": "names"},
    {"rule_set": "mixed"},
    {"rule_set": "mixed", "no_resolve": True},
    {"domain_suffix": "in10.test"},
    {
        "type": "logical",
        "mode": "or",
        "rules": [{"ip_cidr": "192.168.0.0/16"}, {"domain": "nowhere.test"}],
    },
    {
        "type": "logical",
        "mode": "and",
        "rules": [{"ip_cidr": "8.0.0.0/8", "no_resolve": True}, {"port": 443}],
    },
]
_HOSTS = [*ZONE, "nx.test", "10.1.1.1", "8.8.4.4", "192.168.9.9", "1.1.1.1"]


@settings(max_examples=400, deadline=None)
@given(
    picks=st.lists(st.integers(0, len(_TEMPLATES) - 1), min_size=1, max_size=6),
    host=st.sampled_from(_HOSTS),
)
def test_resolving_order_matches_mihomo(picks: list[int], host: str) -> None:
    rules = [_rule(f"r{i}", **_TEMPLATES[t]) for i, t in enumerate(picks)]
    assert _engine_route(rules, host, _SETS) == _mihomo_route(rules, host, _SETS)


def test_no_resolve_before_the_first_resolving_rule() -> None:
    rules = [
        _rule("early", ip_cidr="10.0.0.0/8", no_resolve=True),
        _rule("late", ip_cidr="8.0.0.0/8"),
    ]
    ruleset = compile_rules(rules)
    assert ruleset.first_ip_rule == 1
    # in10.test resolves to 10.0.0.7, but only when matching reaches rule 1: rule 0
    # never sees it (mihomo: the address is looked up at rule 1).
    assert _engine_route(rules, "in10.test", {}) == "final"
    rules.reverse()
    assert _engine_route(rules, "in10.test", {}) == "early"


def test_needs_address_counts_a_resolving_rule_that_matched() -> None:
    ruleset = compile_rules([_rule("x", geoip="private", invert=True)])
    facts = _facts("lan.test")
    decision = decide(ruleset, "rule", None, "final", facts)
    assert decision.target == "x"  # no address yet: "not private" holds
    assert needs_address(ruleset, "rule", facts, decision)
    assert (
        decide(ruleset, "rule", None, "final", _facts("lan.test", resolved_ip="192.168.1.1")).target
        == "final"
    )
    domain_only = compile_rules([_rule("x", geoip="private", invert=True, no_resolve=True)])
    assert not needs_address(
        domain_only, "rule", facts, decide(domain_only, "rule", None, "final", facts)
    )
