"""The C route tables with rule sets, GEOIP/GEOSITE, logical rules, ``invert`` and
``no_resolve`` (csrc/route.c, csrc/route_set.c, spliceway.native.route) against
spliceway.routing.rules.decide: the part of tests/csrc/test_route_diff.py for what issue 29
added.

On random configurations (rule sets of every behaviour parsed from generated bodies, a
.mmdb and a geosite.dat written here, rules mixing every condition, logical rules nested
and inverted) x random flows, C must give exactly routing.decide's RouteDecision, or defer
exactly where a three-valued reading of the rules says C cannot know (:class:`Oracle3`):

- what C leaves to Python is *unknown*: ``domain_regex`` (a rule's, or a set's regex
  entries when the flow has a name), ``process_name`` for a client on this host, domain
  conditions when a host is not plain ASCII or holds a ``%`` (unless another host
  matches), address conditions when the target is such a host, and the negation of an
  ``inbound_tag`` / ``principal_key`` inside a logical or multi-part rule (no id
  expresses "none of these, or none at all");
- unknown combines as Kleene's logic (and, or, not);
- the first rule that is not false decides: true gives routing's decision, unknown a
  deferral naming that rule; before that, a domain target without an address defers at
  the first resolving rule when it ranks at or before the answer (routing.needs_address).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import re
from collections import Counter
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway._relay import lib
from spliceway.config import Rule, SubRule
from spliceway.native import route_sets
from spliceway.native.route import (
    OUT_BLOCK,
    OUT_DEFER,
    OUT_DIRECT,
    OUT_SOCKS5,
    CompiledRoutes,
    TargetSpec,
    _RuleCompiler,
    compile_route_table,
)
from spliceway.routing import geodata
from spliceway.routing import rules as routing
from spliceway.routing.ruleset import RuleSetData, parse_rule_set
from tests.helpers.examples import examples

F, T, U = 0, 1, 2
TARGETS = {
    "direct": TargetSpec(OUT_DIRECT),
    "p1": TargetSpec(OUT_SOCKS5, "127.0.0.1", 1080),
    "blk": TargetSpec(OUT_BLOCK),
    "ss": TargetSpec(OUT_DEFER),
}
INBOUNDS = {"in0": 0, "in1": 1}
PRINCIPALS = {"alice": 10, "bob": 11}

# ---------------------------------------------------------------------------
# Kleene's three values
# ---------------------------------------------------------------------------


def k_and(values: list[int]) -> int:
    if F in values:
        return F
    return U if U in values else T


def k_or(values: list[int]) -> int:
    if T in values:
        return T
    return U if U in values else F


def k_not(value: int) -> int:
    return {F: T, T: F, U: U}[value]


# ---------------------------------------------------------------------------
# the universe: names, networks, geodata
# ---------------------------------------------------------------------------

LABELS = ["a", "b", "ex", "cdn", "ads", "com", "org", "x1"]
V4 = ["10.0.0.0", "10.0.0.64", "10.0.0.128", "10.0.0.200", "192.0.2.0"]
V6 = ["2001:db8::", "2001:db8::80"]


def _name(rnd: random.Random) -> str:
    return ".".join(rnd.choice(LABELS) for _ in range(rnd.randint(1, 3)))


def _addr(rnd: random.Random) -> str:
    pick = rnd.random()
    if pick < 0.6:
        return str(ipaddress.ip_address(rnd.choice(V4)) + rnd.randrange(64))
    if pick < 0.85:
        return str(ipaddress.ip_address(rnd.choice(V6)) + rnd.randrange(128))
    return f"::ffff:{ipaddress.ip_address(rnd.choice(V4)) + rnd.randrange(64)}"


def _net(rnd: random.Random) -> str:
    if rnd.random() < 0.7:
        base = ipaddress.ip_address(rnd.choice(V4)) + rnd.randrange(64)
        return f"{base}/{rnd.randint(24, 32)}"
    if rnd.random() < 0.5:
        base6 = ipaddress.ip_address(rnd.choice(V6)) + rnd.randrange(128)
        return f"{base6}/{rnd.randint(118, 128)}"
    base = ipaddress.ip_address(rnd.choice(V4)) + rnd.randrange(64)
    return f"::ffff:{base}/{rnd.randint(120, 128)}"


@pytest.fixture(scope="module")
def geo(tmp_path_factory: pytest.TempPathFactory) -> geodata.GeoDatabases:
    """A country .mmdb, an ASN .mmdb and a geosite.dat over the universe."""
    tmp = tmp_path_factory.mktemp("geo")
    country = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    country.insert_network(
        IPSet(["10.0.0.0/26", "2001:db8::/121"]), {"country": {"iso_code": "CN"}}
    )
    country.insert_network(IPSet(["10.0.0.64/26"]), {"country": {"iso_code": "US"}})
    country.insert_network(IPSet(["10.0.0.192/27"]), {"registered_country": {"iso_code": "JP"}})
    country.to_db_file(str(tmp / "country.mmdb"))
    asn = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-ASN")
    asn.insert_network(IPSet(["10.0.0.128/25"]), {"autonomous_system_number": 13335})
    asn.insert_network(IPSet(["2001:db8::80/121"]), {"autonomous_system_number": 64500})
    asn.to_db_file(str(tmp / "asn.mmdb"))
    site_list = geodata.GeoSiteListMessage()
    lists = {
        "google": [(3, "a.ex", ()), (2, "cdn.com", ()), (0, "ads", ()), (2, "org", ("cn",))],
        "cn": [(2, "org", ("cn",)), (3, "b", ()), (1, "^x1", ())],
        "kw": [(0, "x1", ()), (0, "b.a", ())],
    }
    for code, entries in lists.items():
        site = site_list.entry.add(country_code=code)
        for kind, value, attrs in entries:
            domain = site.domain.add(type=kind, value=value)
            for attr in attrs:
                domain.attribute.add(key=attr, bool_value=True)
    (tmp / "geosite.dat").write_bytes(site_list.SerializeToString())
    return geodata.open_databases(
        str(tmp / "country.mmdb"), str(tmp / "asn.mmdb"), str(tmp / "geosite.dat")
    )


# ---------------------------------------------------------------------------
# random rule sets and rules
# ---------------------------------------------------------------------------


def _domain_entry(rnd: random.Random) -> str:
    name = _name(rnd)
    form = rnd.randrange(8)
    return [
        name, name, "+." + name, "." + name, "*." + name,
        f"{rnd.choice(LABELS)}.*.{name}", ".*." + name, "*",
    ][form]  # fmt: skip


def _classical_line(rnd: random.Random, *, nested: bool = True) -> str:
    name = _name(rnd)

    def inner() -> str:
        return _classical_line(rnd, nested=False)

    choices = [
        lambda: f"DOMAIN,{name}",
        lambda: f"DOMAIN-SUFFIX,{name}",
        lambda: f"DOMAIN-KEYWORD,{rnd.choice(LABELS)}",
        lambda: f"IP-CIDR,{_net(rnd)}",
        lambda: f"IP-CIDR,{_net(rnd)},no-resolve",
        lambda: f"SRC-IP-CIDR,{_net(rnd)}",
        lambda: f"DST-PORT,{rnd.choice(['80', '443', '1000-2000', '80/443'])}",
        lambda: f"SRC-PORT,{rnd.choice(['22', '40000-50000'])}",
        lambda: f"NETWORK,{rnd.choice(['tcp', 'udp'])}",
        lambda: "PROCESS-NAME,curl",
        lambda: f"GEOIP,{rnd.choice(['CN', 'US', 'LAN', 'XX'])}",
        lambda: f"GEOSITE,{rnd.choice(['google', 'cn', 'kw', 'nosuch'])}",
        lambda: f"IP-ASN,{rnd.choice(['13335', '64500'])}",
        lambda: "DOMAIN-REGEX,^cdn",
        lambda: f"SRC-GEOIP,{rnd.choice(['CN', 'US'])}",
    ]
    if nested:
        choices += [
            lambda: f"AND,(({inner()}),({inner()}))",
            lambda: f"OR,(({inner()}),({inner()}))",
            lambda: f"NOT,(({inner()}))",
            lambda: f"AND,((DOMAIN-SUFFIX,{name}),(NOT,((DST-PORT,443))))",
        ]
    return rnd.choice(choices)()


def _body(rnd: random.Random, behavior: str) -> bytes:
    n = rnd.randint(1, 12)
    if behavior == "domain":
        lines = [_domain_entry(rnd) for _ in range(n)]
    elif behavior == "ipcidr":
        lines = [
            _net(rnd).replace("/32", "") if rnd.random() < 0.2 else _net(rnd) for _ in range(n)
        ]
    else:
        lines = [_classical_line(rnd) for _ in range(n)]
    return ("\n".join(lines) + "\n").encode()


def _rule_sets(rnd: random.Random) -> dict[str, RuleSetData]:
    out = {}
    for i, behavior in enumerate(["domain", "ipcidr", "classical", "classical", "domain"]):
        try:
            out[f"s{i}"] = parse_rule_set(_body(rnd, behavior), behavior, "text")  # type: ignore[arg-type]
        except ValueError:
            continue  # every line skipped: the provider is absent
    return out


def _conditions(rnd: random.Random, k: int) -> dict[str, Any]:
    keys = [
        "domain", "domain_suffix", "domain_keyword", "ip_cidr", "source_ip_cidr", "port",
        "network", "inbound_tag", "principal_key", "geoip", "source_geoip", "ip_asn",
        "geosite", "rule_set", "rule_set", "rule_set", "process_name", "domain_regex",
        "source_port",
    ]  # fmt: skip
    doc: dict[str, Any] = {}
    for key in rnd.sample(keys, k):
        n = rnd.randint(1, 2)
        if key in ("domain", "domain_suffix"):
            doc[key] = [_name(rnd) for _ in range(n)]
        elif key == "domain_keyword":
            doc[key] = [rnd.choice(LABELS) for _ in range(n)]
        elif key == "domain_regex":
            doc[key] = ["^a"]
        elif key in ("ip_cidr", "source_ip_cidr"):
            doc[key] = [_net(rnd) for _ in range(n)]
        elif key in ("port", "source_port"):
            doc[key] = [rnd.choice(["80", "443", "1000-2000", "22"]) for _ in range(n)]
        elif key == "network":
            doc[key] = rnd.choice(["tcp", "udp"])
        elif key == "inbound_tag":
            doc[key] = rnd.sample(["in0", "in1", "inX"], n)
        elif key == "principal_key":
            doc[key] = rnd.sample(["alice", "bob"], n)
        elif key in ("geoip", "source_geoip"):
            doc[key] = rnd.sample(["cn", "us", "jp", "private", "xx"], n)
        elif key == "ip_asn":
            doc[key] = rnd.sample(["13335", "64500", "1"], n)
        elif key == "geosite":
            doc[key] = rnd.sample(["google", "cn", "google@cn", "kw", "nosuch"], n)
        elif key == "rule_set":
            doc[key] = rnd.sample(["s0", "s1", "s2", "s3", "s4", "missing"], n)
            if rnd.random() < 0.25:
                doc["rule_set_ip_cidr_match_source"] = True
        else:
            doc[key] = ["curl"]
    if rnd.random() < 0.2:
        doc["no_resolve"] = True
    return doc


def _part(rnd: random.Random, depth: int) -> dict[str, Any]:
    if depth < 2 and rnd.random() < 0.25:
        doc: dict[str, Any] = {
            "type": "logical",
            "mode": rnd.choice(["and", "or"]),
            "rules": [_part(rnd, depth + 1) for _ in range(rnd.randint(1, 3))],
        }
    else:
        doc = _conditions(rnd, rnd.randint(1, 2))
    if rnd.random() < 0.3:
        doc["invert"] = True
    return doc


def _rule(rnd: random.Random) -> Rule:
    if rnd.random() < 0.3:
        doc = _part(rnd, 0)
        if doc.get("type") != "logical":
            doc = {
                "type": "logical",
                "mode": rnd.choice(["and", "or"]),
                "rules": [doc, _part(rnd, 1)],
            }
            doc["invert"] = rnd.random() < 0.3
    else:
        doc = _conditions(rnd, rnd.randint(1, 3))
        if rnd.random() < 0.2:
            doc["invert"] = True
    if rnd.random() < 0.2:
        doc["action"] = "block"
    else:
        doc["outbound"] = rnd.choice(list(TARGETS))
    return Rule.model_validate(doc)


def _config(rnd: random.Random, geo: geodata.GeoDatabases) -> dict[str, Any]:
    rule_sets = _rule_sets(rnd)
    rules = [_rule(rnd) for _ in range(rnd.randint(1, 10))]
    return {
        "rules": rules,
        "rule_sets": rule_sets,
        "geo": geo,
        "ruleset": routing.compile_rules(rules, rule_sets=rule_sets, geo=geo),
        "process_lookup": rnd.choice(["auto", "auto", "off"]),
        "local_addresses": ["10.0.0.7"],
        "final": rnd.choice(list(TARGETS)),
    }


def compile_cfg(cfg: dict[str, Any]) -> CompiledRoutes:
    return compile_route_table(
        cfg["rules"],
        mode_kind="rule",
        mode_outbound=None,
        final=cfg["final"],
        targets=TARGETS,
        inbounds=INBOUNDS,
        principals=PRINCIPALS,
        epoch=1,
        ruleset=cfg["ruleset"],
        process_lookup=cfg["process_lookup"],
        local_addresses=cfg["local_addresses"],
    )


def _flow(rnd: random.Random) -> routing.FlowFacts:
    def host() -> str:
        pick = rnd.random()
        if pick < 0.5:
            name = _name(rnd)
            if rnd.random() < 0.3:
                name = "".join(c.upper() if rnd.random() < 0.5 else c for c in name)
            return name + ("." if rnd.random() < 0.1 else "")
        if pick < 0.85:
            return _addr(rnd)
        return rnd.choice(["ex\u212a.com", "a%b.com", "caf\u00e9.org", "", ".", "a..com", "x1.b.a"])

    source = rnd.choice([None, _addr(rnd), "127.0.0.1", "10.0.0.7", "::1"])
    return routing.FlowFacts(
        network=rnd.choice(["tcp", "tcp", "udp"]),
        host=host(),
        port=rnd.choice([80, 443, 1500, 22, rnd.randrange(65536)]),
        sniffed_host=host() if rnd.random() < 0.3 else None,
        resolved_ip=_addr(rnd) if rnd.random() < 0.4 else None,
        source_ip=source,
        source_port=None if source is None else rnd.choice([22, 45000, 1234]),
        inbound_tag=rnd.choice([None, "in0", "in1"]),
        principal_key=rnd.choice([None, "alice", "bob"]),
    )


# ---------------------------------------------------------------------------
# the three-valued reference
# ---------------------------------------------------------------------------


def _unsure(text: str | None) -> bool:
    return bool(text) and (not text.isascii() or "%" in text)


_DOMAIN_KEYS = ("domain", "domain_suffix", "domain_keyword")
_ADDRESS_KEYS = ("ip_cidr", "geoip", "ip_asn")
#: A classical line of one of these conditions alone is an item of the rule set's C set
#: (Kleene inside the set, even under a negation); any other line is a rule part.
_FOLDED = route_sets._ITEM_KEYS | route_sets._GEO_KEYS


class Oracle3:
    """Each rule three-valued (module docstring), from routing's own two-valued checks."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rules: list[Rule] = cfg["rules"]
        self.ruleset: routing.RuleSet = cfg["ruleset"]
        self.sets: dict[str, RuleSetData] = cfg["rule_sets"]
        self.geo = cfg["geo"]
        self.first_ip = self.ruleset.first_ip_rule
        compiler = _RuleCompiler(self.ruleset)
        # Whether C inverts a whole rule by its flag (else the negation is pushed down).
        self.flag_inverted = [compiler.compile(r)[1] for r in self.rules]
        self.process_on = cfg["process_lookup"] != "off"
        self._two: dict[Any, routing.RuleSet] = {}

    # -- two-valued pieces, through routing itself --

    def _holds(
        self, key: Any, doc: dict[str, Any], sets: dict[str, RuleSetData], facts: routing.FlowFacts
    ) -> bool:
        rs = self._two.get(key)
        if rs is None:
            rule = Rule.model_validate({**doc, "outbound": "direct"})
            rs = self._two[key] = routing.compile_rules([rule], rule_sets=sets, geo=self.geo)
        return routing.decide(rs, "rule", None, "fin", facts).matched_rule is not None

    def _cond(self, key: str, value: Any, facts: routing.FlowFacts) -> bool:
        return self._holds(("c", key, value), {key: value}, {}, facts)

    def _set_part(
        self, data: RuleSetData, what: str, source: bool, facts: routing.FlowFacts
    ) -> bool:
        if what == "names":
            part = dataclasses.replace(data, regex=(), cidr=(), classical=())
        else:
            part = dataclasses.replace(
                data, exact=frozenset(), suffix=frozenset(), subdomain=frozenset(),
                wildcard=(), keyword=(), regex=(), classical=(),
            )  # fmt: skip
        # Resolving, so the probe sees resolved_ip: rule_tv strips it where the
        # configuration's rule does not (before the first resolving rule).
        part = dataclasses.replace(part, resolves=True)
        doc = {"rule_set": ["x"], "rule_set_ip_cidr_match_source": source}
        return self._holds(("s", id(data), what, source), doc, {"x": part}, facts)

    # -- facts as C sees them --

    @staticmethod
    def known_hosts(facts: routing.FlowFacts) -> routing.FlowFacts:
        """Only the hosts C reads (an unsure one is unknown, not absent)."""
        return dataclasses.replace(
            facts,
            host="" if _unsure(facts.host) else facts.host,
            sniffed_host=None if _unsure(facts.sniffed_host) else facts.sniffed_host,
        )

    @staticmethod
    def any_unsure(facts: routing.FlowFacts) -> bool:
        return _unsure(facts.host) or _unsure(facts.sniffed_host)

    @staticmethod
    def has_names(facts: routing.FlowFacts) -> bool:
        def name(h: str | None) -> bool:
            return bool(h) and (_unsure(h) or routing._parse_target(h) is None)

        return name(facts.host) or name(facts.sniffed_host)

    def source_local(self, facts: routing.FlowFacts) -> bool:
        if not self.process_on:
            return False
        src = routing._parse_ip(facts.source_ip)
        if src is None:
            return False
        return (src[0] == 4 and src[1] >> 24 == 127) or src == (6, 1) or src == (4, 0x0A000007)

    # -- atoms --

    def _domain(self, held: bool, facts: routing.FlowFacts) -> int:
        return T if held else U if self.any_unsure(facts) else F

    def _names(self, data: RuleSetData, facts: routing.FlowFacts) -> int:
        """A set's domain entries (names, wildcards, keywords, regexes)."""
        out = F
        if data.exact or data.suffix or data.subdomain or data.wildcard or data.keyword:
            out = self._domain(self._set_part(data, "names", False, self.known_hosts(facts)), facts)
        if out != T and route_sets._compiles(data.regex) and self.has_names(facts):
            out = U
        return out

    def _set(self, data: RuleSetData, source: bool, facts: routing.FlowFacts, *, neg: bool) -> int:
        """A rule set; ``neg``: its negation, as C builds it (Kleene over the set's items,
        the negation pushed into its other lines)."""
        items = [self._names(data, facts)]
        if data.cidr:
            if not source and _unsure(facts.host):
                items.append(U)
            else:
                items.append(T if self._set_part(data, "cidr", source, facts) else F)
        folded, parts = [], []
        for part in data.classical:
            one = not part.is_logical and not part.invert and len(part.conditions()) == 1
            (folded if one and next(iter(part.conditions())) in _FOLDED else parts).append(part)
        items += [self.tv(p, facts) for p in folded]
        if not neg:
            return k_or(items + [self.tv(p, facts) for p in parts])
        return k_and([k_not(k_or(items))] + [self.tv(p, facts, neg=True) for p in parts])

    def _geosite(self, names: tuple[str, ...], facts: routing.FlowFacts) -> int:
        found = []
        for name in names:
            try:
                found.append(self._names(self.geo.geosite.domains(name), facts))
            except KeyError:
                continue
        return k_or(found)

    def atom(
        self, rule: Rule | SubRule, key: str, value: Any, facts: routing.FlowFacts, *, neg: bool
    ) -> int:
        items = (value,) if isinstance(value, str) else value
        if key == "rule_set":
            found = [self.sets[n] for n in items if n in self.sets]
            source = rule.rule_set_ip_cidr_match_source
            if not neg:
                return k_or([self._set(d, source, facts, neg=False) for d in found])
            return k_and([self._set(d, source, facts, neg=True) for d in found])
        if key in ("inbound_tag", "principal_key") and neg:
            return U  # the negation is opaque to C
        if key == "domain_regex" or (key in _DOMAIN_KEYS and any("\0" in v.lower() for v in items)):
            out = U
        elif key in _DOMAIN_KEYS:
            out = self._domain(self._cond(key, value, self.known_hosts(facts)), facts)
        elif key == "geosite":
            out = self._geosite(items, facts)
        elif key in _ADDRESS_KEYS and _unsure(facts.host):
            # routing's check over no network at all is false whatever the address.
            out = U if self._has_networks(key, items) else F
        elif key == "process_name":
            out = U if self.source_local(facts) else F
        else:
            out = T if self._cond(key, value, facts) else F
        return k_not(out) if neg else out

    def _has_networks(self, key: str, items: tuple[str, ...]) -> bool:
        if key == "ip_cidr":
            return True
        if key == "geoip":
            db = self.geo.geoip if self.geo else None
            return any(
                v.lower() in ("private", "lan") or (db is not None and db.networks(v))
                for v in items
            )
        db = self.geo.asn if self.geo else None
        return db is not None and any(db.asn_networks(int(v)) for v in items)

    def tv(self, rule: Rule | SubRule, facts: routing.FlowFacts, *, neg: bool = False) -> int:
        """``rule`` (negated with ``neg``), its negations pushed down to the atoms."""
        flip = neg != rule.invert
        if rule.is_logical:
            parts = list(rule.rules or ())
            if not parts:
                return T if flip else F
            values = [self.tv(p, facts, neg=flip) for p in parts]
            conj = (rule.mode == "and") != flip
            return k_and(values) if conj else k_or(values)
        values = [self.atom(rule, k, v, facts, neg=flip) for k, v in rule.conditions().items()]
        return k_or(values) if flip else k_and(values)

    def rule_tv(self, index: int, facts: routing.FlowFacts) -> int:
        rule = self.rules[index]
        if index < self.first_ip:
            facts = dataclasses.replace(facts, resolved_ip=None)
        if self.flag_inverted[index]:
            plain = rule.model_copy(update={"invert": False})
            return k_not(self.tv(plain, facts))
        return self.tv(rule, facts)

    def first(self, facts: routing.FlowFacts) -> tuple[int | None, int]:
        for i in range(len(self.rules)):
            value = self.rule_tv(i, facts)
            if value != F:
                return i, value
        return None, F


def check_flow(oracle: Oracle3, routes: CompiledRoutes, facts: routing.FlowFacts) -> str:
    """The contract for one flow (module docstring); returns what happened."""
    cfg = oracle.cfg
    expected = routing.decide(oracle.ruleset, "rule", None, cfg["final"], facts)
    raw = routes.query(facts)
    assert raw is not None, facts
    action, c_rule, _ = raw
    index, value = oracle.first(facts)
    n = len(oracle.rules)
    bound = n if index is None else index
    name_target = (
        bool(facts.host)
        and not _unsure(facts.host)
        and routing._parse_target(facts.host) is None
        and facts.resolved_ip is None
    )
    where = (facts, raw, index, value, expected)
    if name_target and oracle.first_ip <= bound and oracle.first_ip < n:
        assert action == lib.SW_ROUTE_DEFER and routes.rule_of[c_rule] == oracle.first_ip, where
        assert c_rule == routes.rule_of.index(oracle.first_ip), where
        assert routing.needs_address(oracle.ruleset, "rule", facts, expected), where
        return "defer-address"
    if value == U:
        assert action == lib.SW_ROUTE_DEFER, where
        assert routes.rule_of[c_rule] == index, where
        return "defer"
    got = routes.decision(*raw)
    assert got == expected, where
    if index is None:
        assert expected.matched_rule is None, where
        return "final"
    assert expected.matched_rule is not None and expected.matched_rule.index == index, where
    return "match"


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------


def test_random_configs_match_routing_or_defer_exactly(geo: geodata.GeoDatabases) -> None:
    seen: Counter[str] = Counter()

    # The seed is the whole example: shrinking it teaches nothing (a failure prints it).
    @settings(
        max_examples=examples(120),
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(seed=st.integers(0, 2**32))
    def run(seed: int) -> None:
        rnd = random.Random(seed)
        cfg = _config(rnd, geo)
        oracle = Oracle3(cfg)
        routes = compile_cfg(cfg)
        for _ in range(150):
            seen[check_flow(oracle, routes, _flow(rnd))] += 1
        routes.close()

    run()
    assert {"match", "final", "defer", "defer-address"} <= set(seen), seen


def _one(
    doc: dict[str, Any], sets: dict[str, RuleSetData] | None = None, geo: Any = None
) -> tuple[CompiledRoutes, dict[str, Any]]:
    rules = [Rule.model_validate({**doc, "outbound": "p1"})]
    cfg = {
        "rules": rules, "rule_sets": sets or {}, "geo": geo, "final": "direct",
        "ruleset": routing.compile_rules(rules, rule_sets=sets or {}, geo=geo),
        "process_lookup": "auto", "local_addresses": ["10.0.0.7"],
    }  # fmt: skip
    return compile_cfg(cfg), cfg


def _route(routes: CompiledRoutes, host: str, **kw: Any) -> Any:
    facts = routing.FlowFacts(**{"network": "tcp", "host": host, "port": 443, **kw})
    raw = routes.query(facts)
    assert raw is not None
    if raw[0] == lib.SW_ROUTE_DEFER:
        return "defer"
    got = routes.decision(*raw)
    assert got is not None
    return got.target


def test_domain_set_entries() -> None:
    body = b"+.plus.com\n.dot.com\nfull.com\n*.one.com\na.*.mid.com\n.*.deep.com\n*\n"
    data = parse_rule_set(body, "domain", "text")
    routes, _ = _one({"rule_set": "s"}, {"s": data})
    cases = {
        "plus.com": "p1", "a.plus.com": "p1", "xplus.com": "direct",
        "dot.com": "direct", "a.dot.com": "p1", "a.b.dot.com": "p1",
        "full.com": "p1", "a.full.com": "direct",
        "x.one.com": "p1", "one.com": "direct", "y.x.one.com": "direct",
        "a.b.mid.com": "p1", "a.b.c.mid.com": "direct", "b.a.mid.com": "direct",
        "x.y.deep.com": "p1", "w.x.y.deep.com": "p1", "y.deep.com": "direct",
        "localhost": "p1", "FULL.COM.": "p1", "a..one.com": "direct",
    }  # fmt: skip
    for host, target in cases.items():
        assert _route(routes, host) == target, host


def test_cidr_sets_match_target_or_source() -> None:
    data = parse_rule_set(b"10.0.0.0/24\n2001:db8::/32\n::ffff:192.0.2.0/120\n", "ipcidr", "text")
    target, _ = _one({"rule_set": "s"}, {"s": data})
    source, _ = _one({"rule_set": "s", "rule_set_ip_cidr_match_source": True}, {"s": data})
    assert _route(target, "10.0.0.9") == "p1"
    assert _route(target, "192.0.2.9") == "p1"  # the mapped network covers IPv4
    assert _route(target, "10.0.1.9") == "direct"
    assert _route(target, "example.com") == "defer"  # the set resolves: Python looks it up
    assert _route(target, "example.com", resolved_ip="2001:db8::1") == "p1"
    assert _route(source, "10.0.0.9") == "direct"
    assert _route(source, "1.1.1.1", source_ip="10.0.0.3", source_port=1) == "p1"
    assert _route(source, "example.com") == "direct"  # the source's networks never resolve


def test_no_resolve_and_the_first_resolving_rule() -> None:
    """Rules before the first resolving one see only an address the client sent."""
    rules = [
        Rule.model_validate({"ip_cidr": "10.0.0.0/8", "no_resolve": True, "outbound": "p1"}),
        Rule.model_validate({"domain": "x.com", "outbound": "blk"}),
        Rule.model_validate({"ip_cidr": "192.0.2.0/24", "outbound": "ss"}),
        Rule.model_validate({"ip_cidr": "10.0.0.0/8", "no_resolve": True, "outbound": "p1"}),
    ]
    cfg = {
        "rules": rules, "rule_sets": {}, "geo": None, "final": "direct",
        "ruleset": routing.compile_rules(rules), "process_lookup": "auto", "local_addresses": [],
    }  # fmt: skip
    routes = compile_cfg(cfg)
    assert lib.sw_table_first_ip_rule(routes.table) == 2
    assert _route(routes, "10.1.1.1") == "p1"
    assert _route(routes, "x.com") == "blk"
    assert _route(routes, "y.com") == "defer"  # reaches rule 2 without an address
    # Resolved: rule 0 does not see it, rule 3 does.
    assert _route(routes, "y.com", resolved_ip="10.1.1.1") == "p1"
    got = routes.decide(routing.FlowFacts("tcp", "y.com", 1, resolved_ip="10.1.1.1"))
    assert got is not None and got.matched_rule is not None and got.matched_rule.index == 3
    oracle = Oracle3(cfg)
    for host in ("y.com", "10.1.1.1", "192.0.2.1", "x.com"):
        for resolved in (None, "10.1.1.1", "192.0.2.5", "1.1.1.1"):
            check_flow(oracle, routes, routing.FlowFacts("tcp", host, 1, resolved_ip=resolved))


def test_invert_and_logical_rules() -> None:
    cases: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({"domain_suffix": "a.com", "invert": True}, {"x.a.com": "direct", "b.com": "p1"}),
        (
            {"type": "logical", "mode": "or", "rules": [{"domain": "a.com"}, {"port": "80"}]},
            {"a.com": "p1", "b.com": "direct"},
        ),
        (
            {"type": "logical", "mode": "and", "rules": [{"domain_suffix": "com"}, {"port": 443}]},
            {"a.com": "p1", "a.org": "direct"},
        ),
        (
            {
                "type": "logical", "mode": "and", "invert": True,
                "rules": [{"domain_suffix": "com"}, {"domain_keyword": "ads"}],
            },
            {"ads.com": "direct", "a.com": "p1", "ads.org": "p1"},
        ),
        (
            {"type": "logical", "mode": "and", "rules": [{"inbound_tag": "in0"}, {"port": "9"}]},
            {"a.com": "direct"},
        ),
    ]  # fmt: skip
    for doc, want in cases:
        routes, cfg = _one(doc)
        oracle = Oracle3(cfg)
        for host, target in want.items():
            assert _route(routes, host, inbound_tag="in0") == target, (doc, host)
            check_flow(oracle, routes, routing.FlowFacts("tcp", host, 443, inbound_tag="in0"))


def test_an_unknown_alternative_is_overruled_by_one_that_holds() -> None:
    """OR(regex, suffix): the regex is Python's, but the suffix holding decides in C."""
    doc = {
        "type": "logical", "mode": "or",
        "rules": [{"domain_regex": "^z"}, {"domain_suffix": "a.com"}],
    }  # fmt: skip
    routes, _ = _one(doc)
    assert len(routes.rule_of) == 2
    assert _route(routes, "x.a.com") == "p1"
    assert _route(routes, "x.b.com") == "defer"
    assert _route(routes, "1.2.3.4") == "defer"  # a rule's own regex is opaque to C


def test_geoip_geosite_and_asn(geo: geodata.GeoDatabases) -> None:
    routes, _ = _one({"geoip": ["cn", "jp"], "no_resolve": True}, geo=geo)
    assert _route(routes, "10.0.0.5") == "p1"
    assert _route(routes, "10.0.0.200") == "p1"  # registered_country
    assert _route(routes, "10.0.0.70") == "direct"
    assert _route(routes, "2001:db8::7") == "p1"
    assert _route(routes, "example.com") == "direct"  # no_resolve: never resolved
    routes, _ = _one({"geoip": "private"}, geo=geo)
    assert _route(routes, "192.168.1.1") == "p1" and _route(routes, "8.8.8.8") == "direct"
    routes, _ = _one({"ip_asn": "13335"}, geo=geo)
    assert _route(routes, "10.0.0.130") == "p1" and _route(routes, "10.0.0.1") == "direct"
    routes, _ = _one({"source_geoip": "us"}, geo=geo)
    assert _route(routes, "1.1.1.1", source_ip="10.0.0.70", source_port=1) == "p1"
    routes, _ = _one({"geosite": ["google"]}, geo=geo)
    assert _route(routes, "a.ex") == "p1" and _route(routes, "x.cdn.com") == "p1"
    assert _route(routes, "my-ads.net") == "p1" and _route(routes, "b.ex") == "direct"
    routes, _ = _one({"geosite": ["google@cn"]}, geo=geo)
    assert _route(routes, "x.org") == "p1" and _route(routes, "a.ex") == "direct"
    routes, _ = _one({"geosite": ["cn"]}, geo=geo)
    assert _route(routes, "b") == "p1"
    assert _route(routes, "x1.com") == "defer"  # the list's regex is Python's
    assert _route(routes, "10.0.0.1") == "direct"  # an address has no name for a regex
    routes, _ = _one({"geosite": ["nosuch"]}, geo=geo)
    assert _route(routes, "b") == "direct"


def test_classical_lines_become_items_or_rules() -> None:
    body = b"\n".join([
        b"DOMAIN-SUFFIX,plain.com", b"DST-PORT,8443", b"NETWORK,udp",
        b"AND,((DOMAIN-SUFFIX,both.com),(DST-PORT,80))", b"SRC-IP-CIDR,192.0.2.0/24",
        b"IN-PORT,7890",
    ])  # fmt: skip
    data = parse_rule_set(body, "classical", "text")
    routes, _ = _one({"rule_set": "s", "domain_keyword": "o"}, {"s": data})
    assert len(routes.rule_of) == 2  # the set's items, and the AND line
    assert _route(routes, "a.plain.com") == "p1"
    assert _route(routes, "a.org", port=8443) == "p1"
    assert _route(routes, "a.org", network="udp") == "p1"
    assert _route(routes, "both.com", port=80) == "p1"
    assert _route(routes, "both.com") == "direct"
    assert _route(routes, "o.net", source_ip="192.0.2.5", source_port=1) == "p1"
    assert _route(routes, "nothing.net") == "direct"


def test_sets_are_shared_and_memory_is_stated() -> None:
    names = frozenset(f"n{i}.zone{i % 7}.test" for i in range(20000))
    data = RuleSetData(behavior="domain", suffix=names)
    first = route_sets.rule_set_parts(data, match_source=False, geo=None).main
    again = route_sets.rule_set_parts(data, match_source=False, geo=None).main
    assert first is again
    info = first.info()
    assert info.names == 20000
    assert info.bytes < 20000 * 64, info  # slots + arena: ~35 bytes a name
    rules = [Rule.model_validate({"rule_set": "s", "outbound": "p1"})]
    ruleset = routing.compile_rules(rules, rule_sets={"s": data})
    tables = [
        compile_route_table(
            rules,
            mode_kind="rule",
            mode_outbound=None,
            final="direct",
            targets=TARGETS,
            inbounds={},
            principals={},
            epoch=e,
            ruleset=ruleset,
        )
        for e in range(3)
    ]
    for t in tables:
        assert _route(t, "www.n19999.zone0.test") == "p1"
        assert _route(t, "www.n19999.zone1.test") == "direct"
    del first, again
    # The tables hold the set now; each frees its reference.
    for t in tables:
        t.close()


@cache
def _wild_re(pattern: str) -> re.Pattern[str]:
    return routing._wildcard_regex([pattern])  # type: ignore[return-value]


@settings(max_examples=examples(400), deadline=None)
@given(
    pattern=st.lists(st.sampled_from(["*", "a", "b", "ab"]), min_size=1, max_size=4).map(".".join)
    | st.lists(st.sampled_from(["*", "a", "b"]), min_size=1, max_size=3).map(
        lambda p: "." + ".".join(p)
    ),
    host=st.text(alphabet="ab.", max_size=9),
)
def test_wildcards_match_routing(pattern: str, host: str) -> None:
    """Wildcard entries against routing's regex on a two-letter alphabet (empty labels,
    leading and trailing dots)."""
    if "*" not in pattern:
        pattern = "*." + pattern.lstrip(".")
    wanted = _wild_re(pattern).match(host[:-1] if host.endswith(".") else host) is not None
    built = route_sets.build_set(wildcard=[pattern])
    assert built.has_name(host) == wanted, (pattern, host)


def test_bad_set_arguments() -> None:
    from spliceway._relay import ffi

    out = ffi.new("sw_set **")
    assert lib.sw_set_new(out) == 0
    s = out[0]
    assert lib.sw_set_domains(s, lib.SW_SET_EXACT, b"no-terminator", 13) == -22
    assert lib.sw_set_domains(s, 9, b"a\0", 2) == -22
    assert lib.sw_set_cidrs(s, 5, 4, b"\0" * 4, b"\x20", 1) == -22
    assert lib.sw_set_cidrs(s, lib.SW_COND_DST, 4, b"\0" * 4, b"\x21", 1) == -22
    assert lib.sw_set_port(s, lib.SW_COND_DST, 9, 1) == -22
    assert lib.sw_set_flags(s, 64) == -22
    assert lib.sw_set_has_name(s, b"a", 1) == -22  # not sealed yet
    t = ffi.new("sw_table **")
    assert lib.sw_table_new(1, 1, 1, t) == 0
    sets = ffi.new("sw_set *[]", [s])
    assert lib.sw_table_cond_sets(t[0], 0, 0, sets, 1) == -22  # an unsealed set
    assert lib.sw_set_seal(s) == 0
    assert lib.sw_set_seal(s) == -22
    assert lib.sw_set_domains(s, lib.SW_SET_EXACT, b"a\0", 2) == -22  # sealed
    assert lib.sw_table_cond_sets(t[0], 0, 4, sets, 1) == -22  # unknown flag
    assert lib.sw_table_cond_sets(t[0], 1, 0, sets, 1) == -22  # no such rule
    assert lib.sw_table_rule_flags(t[0], 0, lib.SW_RULE_GROUPED) == -22  # nothing before it
    assert lib.sw_table_cond_sets(t[0], 0, 0, sets, 1) == 0
    lib.sw_set_free(s)  # the table still holds it
    assert lib.sw_table_set_mode(t[0], lib.SW_MODE_RULE, -1, 0) == 0
    assert lib.sw_table_rule(t[0], 0, lib.SW_ROUTE_BLOCK, -1) == 0
    assert lib.sw_table_seal(t[0]) == 0
    lib.sw_table_free(t[0])
