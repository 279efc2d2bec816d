"""The C route tables (csrc/route.c) against spliceway.routing.rules.decide.

On random configs x random flows, C must give exactly routing.decide's RouteDecision
(mapped back through spliceway.native.route.CompiledRoutes) or defer; and it defers
exactly when the first rule whose checkable conditions all hold has an opaque one
(domain_regex; process_name for a source on this host, which fails for any other source
and under process_lookup off), unless a host is one C leaves to Python (non-ASCII, or a
'%' that may be an IPv6 scope id), where it may defer at or before Python's rule; and it
defers at the first ip_cidr rule when the target is a domain name without a resolved
address and that rule ranks before the match (routing.needs_address).
Plus the table's lifecycle and argument checks, and a C harness for the parts
outside the cdef (target info, mode, concurrent decides, a set shared by tables freed on
several threads). Rule sets, GEOIP/GEOSITE, logical rules, invert and no_resolve:
tests/csrc/test_route_sets_diff.py.
"""

from __future__ import annotations

import ipaddress
import random
import shutil
import subprocess
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spliceway._relay import ffi, lib
from spliceway.config import Rule
from spliceway.native.route import (
    NO_INBOUND,
    NO_PRINCIPAL,
    OUT_BLOCK,
    OUT_DEFER,
    OUT_DIRECT,
    OUT_HTTP,
    OUT_SOCKS5,
    CompiledRoutes,
    TargetSpec,
    compile_route_table,
)
from spliceway.routing import rules as routing
from tests.helpers.examples import examples

EINVAL = 22
ENOSPC = 28
ERANGE = 34
CSRC = Path(__file__).resolve().parents[2] / "csrc"

TARGETS = {
    "direct": TargetSpec(OUT_DIRECT),
    "p1": TargetSpec(OUT_SOCKS5, "127.0.0.1", 1080, "u", "pw", 500),
    "p2": TargetSpec(OUT_HTTP, "proxy.test", 8080),
    "blk": TargetSpec(OUT_BLOCK),
    "ss": TargetSpec(OUT_DEFER),
}
INBOUNDS = {"in0": 0, "in1": 1, "in2": 2}
PRINCIPALS = {"alice": 10, "bob": 11, "carol": 12}
OPAQUE_KEYS = ("domain_regex",)
#: Addresses the random configs call this host's (loopback always is).
LOCAL_CHOICES = ["10.0.0.7", "2001:db8::9", "192.168.1.5", "::ffff:10.1.2.3", "fe80::1"]
DOMAIN_KEYS = ("domain", "domain_suffix", "domain_keyword")

# ---------------------------------------------------------------------------
# strategies: configs
# ---------------------------------------------------------------------------

LABELS = ["a", "b", "ex", "cdn", "api", "ads", "x1", "com", "org", "k", "1", "0"]
_name = st.lists(st.sampled_from(LABELS), min_size=1, max_size=3).map(".".join)


def _cased(strategy: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return strategy.flatmap(
        lambda s: st.lists(st.booleans(), min_size=len(s), max_size=len(s)).map(
            lambda up: "".join(c.upper() if u else c for c, u in zip(s, up, strict=True))
        )
    )


_odd_names = st.sampled_from(
    ["\u212a.com", "ex\u212a.org", "\u0130.org", "caf\u00e9.com", "a\x00b", "1.2.3.4", "10.0.0.1"]
)
_domain_item = st.one_of(
    _cased(_name),
    _cased(_name).map(lambda s: s + "."),
    _odd_names,
)
_keyword_item = st.one_of(
    _cased(st.sampled_from(["a", "ex", "ds", "c", ".co", "-", "1", "x1.", "b.a", "ample", "K"])),
    st.text(alphabet="abcxk.-1", min_size=1, max_size=3),
    st.sampled_from(["\u212a", "\u0130", "\x00", "\u00e9"]),
)
_v4_base = st.sampled_from(
    ["10.0.0.0", "10.1.2.3", "192.168.1.0", "1.2.3.4", "0.0.0.0", "127.0.0.1"]
)
_v6_base = st.sampled_from(["2001:db8::", "fe80::", "::", "::1", "2001:db8:1::5"])
_cidr = st.one_of(
    st.builds("{}/{}".format, _v4_base, st.integers(0, 32)),
    st.builds("{}/{}".format, _v6_base, st.integers(0, 128)),
    st.builds("::ffff:{}/{}".format, _v4_base, st.integers(88, 128)),
    _v4_base,
)
_port_num = st.one_of(
    st.sampled_from([0, 22, 80, 443, 8080, 65535]), st.integers(78, 84), st.integers(0, 65535)
)
_port_item = st.one_of(
    _port_num.map(str),
    st.tuples(_port_num, _port_num).map(lambda p: f"{min(p)}-{max(p)}"),
    st.sampled_from([443, 80]),  # integers are accepted too
)


def _items(strategy: st.SearchStrategy, n: int = 4) -> st.SearchStrategy:
    return st.lists(strategy, min_size=1, max_size=n)


_conditions = st.fixed_dictionaries(
    {},
    optional={
        "domain": _items(_domain_item),
        "domain_suffix": _items(_domain_item),
        "domain_keyword": _items(_keyword_item),
        "domain_regex": _items(st.sampled_from(["^a", "ex", r"\d", "org$", "K"]), 2),
        "ip_cidr": _items(_cidr),
        "source_ip_cidr": _items(_cidr),
        "port": _items(_port_item),
        "source_port": _items(_port_item),
        "network": st.sampled_from(["tcp", "udp"]),
        "inbound_tag": _items(st.sampled_from(["in0", "in1", "in2", "inX"]), 2),
        "principal_key": _items(st.sampled_from(["alice", "bob", "carol", "zed"]), 2),
        "process_name": _items(st.sampled_from(["curl", "wget"]), 2),
    },
)


@st.composite
def _rule(draw: st.DrawFn) -> Rule:
    conditions = draw(_conditions)
    # Few conditions per rule, so that rules match often enough to matter.
    keys = sorted(conditions)
    keep = draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)) if keys else []
    doc = {k: conditions[k] for k in keep}
    if draw(st.integers(0, 5)) == 0:
        doc["action"] = "block"
    else:
        doc["outbound"] = draw(st.sampled_from(list(TARGETS)))
    return Rule.model_validate(doc)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    rules = draw(st.lists(_rule(), max_size=12))
    mode = draw(st.sampled_from(["rule", "rule", "rule", "rule", "global", "direct"]))
    order = draw(st.permutations(list(TARGETS)))
    return {
        "rules": rules,
        "process_lookup": draw(st.sampled_from(["auto", "auto", "always", "off"])),
        "local_addresses": draw(st.lists(st.sampled_from(LOCAL_CHOICES), max_size=3)),
        "mode_kind": mode,
        "mode_outbound": draw(st.sampled_from(list(TARGETS))) if mode == "global" else None,
        "final": draw(st.sampled_from(list(TARGETS))),
        "targets": {tag: TARGETS[tag] for tag in order},
    }


# ---------------------------------------------------------------------------
# strategies: flows
# ---------------------------------------------------------------------------

_ip_texts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.ip_addresses(v=6).map(lambda a: a.exploded.upper()),
    st.ip_addresses(v=4).map(lambda a: f"::ffff:{a}"),
    st.ip_addresses(v=4).map(lambda a: f"::FFFF:{int(a) >> 16:x}:{int(a) & 0xFFFF:x}"),
    st.ip_addresses().map(lambda a: f"[{a}]"),
    st.sampled_from(
        [
            "01.2.3.4",
            "1.2.3",
            "1.2.3.4.",
            "1.2.3.04",
            "256.1.1.1",
            "0x1.2.3.4",
            "[::1]",
            "[1.2.3.4]",
            "[]",
            "[",
            "::",
            ":::",
            "1::2::3",
            "1:2:3:4:5:6:7:8:9",
            "1:2:3:4:5:6:7:8",
            "::1.2.3.4",
            "1:2:3:4:5:6:1.2.3.4",
            "1:2:3:4:5:6:7:1.2.3.4",
            "::ffff:1.2.3.4%eth0",
            "fe80::1%eth0",
            "[fe80::1%1]",
            "a%b.com",
            "12345::",
            "1:2",
            ":1:2:3:4:5:6:7",
            "1:2:3:4:5:6:7:",
            "10.0.0.1/8",
        ]
    ),
)
_fuzz_text = st.one_of(
    st.text(alphabet="0123456789abcdefABCDEF.:[]%/x-", max_size=24),
    # IPv6-ish part lists: empty parts make '::' anywhere, any number of them.
    st.lists(
        st.sampled_from(["0", "1", "ab", "FFFF", "ffff", "12345", "", "1.2.3.4", "01.2.3.4", "g"]),
        min_size=1,
        max_size=11,
    ).map(":".join),
    # '::' anywhere among 0-8 groups (standing for none is an error), maybe an IPv4 tail.
    st.tuples(
        st.lists(st.sampled_from(["0", "1", "ab", "ffff"]), max_size=8),
        st.integers(0, 8),
        st.sampled_from(["", ":1.2.3.4"]),
    ).map(lambda t: ":".join(t[0][: t[1]]) + "::" + ":".join(t[0][t[1] :]) + t[2]),
)


def _hosts(rules: list[Rule]) -> st.SearchStrategy[str]:
    names = sorted(
        {
            v
            for r in rules
            for key in (*DOMAIN_KEYS, "domain_regex")
            for v in (getattr(r, key) or ())
        }
    )
    nets = sorted({v for r in rules for v in (*(r.ip_cidr or ()), *(r.source_ip_cidr or ()))})
    parts: list[st.SearchStrategy[str]] = [
        _cased(_name),
        _name.map(lambda s: s + "."),
        _ip_texts,
        _fuzz_text,
        st.sampled_from(["", ".", "a..", "..", "ex\u212a.com", "caf\u00e9.com", "\u0130.org"]),
        st.text(max_size=6),
    ]
    if names:
        item = st.sampled_from(names)
        parts += [
            _cased(item),
            st.builds("{}.{}".format, st.sampled_from(LABELS), item),
            st.builds("bad{}".format, item),
            _cased(st.builds("x{}y".format, item)),
            item.map(lambda s: s.rstrip(".") + "."),
        ]
    if nets:
        parts.append(st.builds(_inside, st.sampled_from(nets), st.integers(0, 2**128)))
    return st.one_of(*parts)


def _inside(cidr: str, offset: int) -> str:
    net = ipaddress.ip_network(cidr, strict=False)
    addr = net.network_address + offset % net.num_addresses
    if addr.version == 6 and offset % 3 == 0 and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


@st.composite
def flows(draw: st.DrawFn, rules: list[Rule]) -> routing.FlowFacts:
    hosts = _hosts(rules)
    nets = sorted({v for r in rules for v in (r.source_ip_cidr or ())})
    source = st.one_of(st.ip_addresses().map(str), st.ip_addresses(v=4).map("::ffff:{}".format))
    if nets:
        source |= st.builds(_inside, st.sampled_from(nets), st.integers(0, 2**128))
    src_ip = draw(st.none() | source)
    dst_nets = sorted({v for r in rules for v in (r.ip_cidr or ())})
    resolved = st.ip_addresses().map(str)
    if dst_nets:
        resolved |= st.builds(_inside, st.sampled_from(dst_nets), st.integers(0, 2**128))
    return routing.FlowFacts(
        network=draw(st.sampled_from(["tcp", "tcp", "udp", "quic"])),
        host=draw(hosts),
        port=draw(_port_num),
        sniffed_host=draw(st.none() | hosts),
        resolved_ip=draw(st.none() | resolved),
        source_ip=src_ip,
        source_port=None if src_ip is None else draw(_port_num),
        inbound_tag=draw(st.sampled_from([None, "in0", "in1", "in2"])),
        principal_key=draw(st.sampled_from([None, "alice", "bob", "carol"])),
    )


# ---------------------------------------------------------------------------
# the reference for deferrals
# ---------------------------------------------------------------------------


def _is_opaque(rule: Rule) -> bool:
    """What route_tables compiles as opaque."""
    if any(getattr(rule, k) is not None for k in OPAQUE_KEYS):
        return True
    return any("\0" in v.lower() for k in DOMAIN_KEYS for v in (getattr(rule, k) or ()))


def _checkable(rule: Rule, *, local: bool) -> Rule:
    """``rule`` without what C leaves to Python (for a source on this host, or not)."""
    drop = dict.fromkeys((*OPAQUE_KEYS, "process_name") if local else OPAQUE_KEYS)
    for k in DOMAIN_KEYS:
        if any("\0" in v.lower() for v in (getattr(rule, k) or ())):
            drop[k] = None
    return rule.model_copy(update=drop)


def _unsure(text: str | None) -> bool:
    return bool(text) and (not text.isascii() or "%" in text)


class Oracle:
    """routing.decide, plus the first rule whose checkable conditions all hold."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.rules = cfg["rules"]
        self.ruleset = routing.compile_rules(self.rules)
        # A process_name condition is unknown to C for a source on this host (so it is
        # dropped like an opaque one), and false for any other (kept: a flow without a
        # process_name never matches it), as under process_lookup off.
        self.checkable = routing.compile_rules([_checkable(r, local=True) for r in self.rules])
        self.checkable_remote = routing.compile_rules(
            [_checkable(r, local=False) for r in self.rules]
        )
        self.opaque = [_is_opaque(r) for r in self.rules]
        self.process = [r.process_name is not None for r in self.rules]
        self.process_mode = cfg.get("process_lookup", "auto")
        self.local = {routing._parse_ip(a) for a in cfg.get("local_addresses", ())}

    def source_local(self, facts: routing.FlowFacts) -> bool:
        """Whether C counts the flow's client on this host (process conditions unknown)."""
        if self.process_mode == "off":
            return False
        src = routing._parse_ip(facts.source_ip)
        if src is None:
            return False
        loopback = (src[0] == 4 and src[1] >> 24 == 127) or src == (6, 1)
        return loopback or src in self.local

    def defers_at(self, index: int, facts: routing.FlowFacts) -> bool:
        """Whether rule ``index`` is unknown to C when its checkable conditions hold."""
        return self.opaque[index] or (self.process[index] and self.source_local(facts))

    def decide(self, facts: routing.FlowFacts) -> routing.RouteDecision:
        c = self.cfg
        return routing.decide(self.ruleset, c["mode_kind"], c["mode_outbound"], c["final"], facts)

    def first_checkable(self, facts: routing.FlowFacts) -> int | None:
        ruleset = self.checkable if self.source_local(facts) else self.checkable_remote
        decision = routing.decide(ruleset, "rule", None, "final", facts)
        return None if decision.matched_rule is None else decision.matched_rule.index


def compile_cfg(cfg: dict, epoch: int = 1) -> CompiledRoutes:
    return compile_route_table(
        cfg["rules"],
        mode_kind=cfg["mode_kind"],
        mode_outbound=cfg["mode_outbound"],
        final=cfg["final"],
        targets=cfg["targets"],
        inbounds=INBOUNDS,
        principals=PRINCIPALS,
        epoch=epoch,
        deferred_cidrs=cfg.get("deferred_cidrs", ()),
        process_lookup=cfg.get("process_lookup", "auto"),
        local_addresses=cfg.get("local_addresses", ()),
    )


def check_flow(oracle: Oracle, routes: CompiledRoutes, facts: routing.FlowFacts) -> str:
    """Asserts the contract for one flow; returns what happened (for statistics)."""
    expected = oracle.decide(facts)
    raw = routes.query(facts)
    assert raw is not None, facts  # the strategies only make expressible flows
    action, rule, _ = raw
    got = routes.decision(*raw)
    if oracle.cfg["mode_kind"] != "rule":
        assert got == expected, facts
        return "mode"
    unsure = _unsure(facts.host) or _unsure(facts.sniffed_host)
    first = oracle.first_checkable(facts)
    opaque_first = first is not None and oracle.defers_at(first, facts)
    # A domain target without an address, an ip_cidr rule before C's answer: C defers.
    bound = len(oracle.rules) if expected.matched_rule is None else expected.matched_rule.index
    if opaque_first:
        bound = min(bound, first)
    first_ip = oracle.ruleset.first_ip_rule
    needs_address = (
        facts.resolved_ip is None
        and bool(facts.host)
        and routing._parse_target(facts.host) is None
        and first_ip < bound
    )
    if action == lib.SW_ROUTE_DEFER:
        if unsure:
            matched = expected.matched_rule
            limit = len(oracle.rules) if matched is None else matched.index
            assert 0 <= rule <= limit, (facts, rule, expected)
            return "defer-unsure"
        if needs_address:
            assert rule == first_ip, (facts, rule, first_ip, expected)
            assert routing.needs_address(oracle.ruleset, "rule", facts, expected)
            return "defer-address"
        assert opaque_first and rule == first, (facts, rule, first, expected)
        return "defer-opaque" if oracle.opaque[first] else "defer-process"
    assert got == expected, (facts, raw, got, expected)
    assert unsure or not opaque_first, (facts, first)
    assert unsure or not needs_address, (facts, first_ip)
    return "match" if expected.matched_rule else "final"


# ---------------------------------------------------------------------------
# the differential tests
# ---------------------------------------------------------------------------


def _quick_flows(rnd: random.Random, rules: list[Rule], n: int) -> list[routing.FlowFacts]:
    """Many more flows per config than Hypothesis draws cheaply, from the same pools."""
    names = sorted({v for r in rules for k in DOMAIN_KEYS for v in (getattr(r, k) or ())})
    nets = sorted({v for r in rules for v in (*(r.ip_cidr or ()), *(r.source_ip_cidr or ()))})
    odd = ["", ".", "a..", "1.2.3.4.", "[1.2.3.4]", "::ffff:10.1.2.3", "[::1]", "01.2.3.4"]
    odd += ["ex\u212a.com", "fe80::1%eth0", "1::2::3", "::1.2.3.4", "10.0.0.1"]
    # Other spellings of addresses (spliceway.routing.hostnorm), the fullwidth one left to Python.
    odd += ["167772161", "0xa.1", "012.0.0.1", "10.1 x", "0", "::", "\uff11\uff10.0.0.1"]

    def case(s: str) -> str:
        return "".join(c.upper() if rnd.random() < 0.3 else c for c in s)

    def host() -> str:
        pick = rnd.random()
        if names and pick < 0.45:
            name = rnd.choice(names)
            form = rnd.randrange(5)
            if form == 1:
                name = f"{rnd.choice(LABELS)}.{name}"
            elif form == 2:
                name = "bad" + name
            elif form == 3:
                name = f"x{name}y"
            elif form == 4:
                name = name.rstrip(".") + "."
            return case(name)
        if nets and pick < 0.65:
            return _inside(rnd.choice(nets), rnd.getrandbits(128))
        if pick < 0.85:
            return case(".".join(rnd.choice(LABELS) for _ in range(rnd.randint(1, 3))))
        return rnd.choice(odd)

    out = []
    for _ in range(n):
        src = None
        if rnd.random() < 0.7:
            src = _inside(rnd.choice(nets), rnd.getrandbits(128)) if nets else "127.0.0.1"
            if rnd.random() < 0.4:
                # Sources on this host (loopback) make process conditions unknown to C.
                src = rnd.choice(
                    ["10.0.0.7", "127.0.0.1", "::1", "::ffff:127.0.0.1", "2001:db8::9", "fe80::1"]
                )
        dst_nets = [n for r in rules for n in (r.ip_cidr or ())]
        resolved = None
        if dst_nets and rnd.random() < 0.3:
            resolved = _inside(rnd.choice(dst_nets), rnd.getrandbits(128))
        out.append(
            routing.FlowFacts(
                network=rnd.choice(["tcp", "tcp", "udp"]),
                host=host(),
                resolved_ip=resolved,
                port=rnd.choice(
                    [0, 22, 80, 443, 8080, 65535, rnd.randint(78, 84), rnd.randrange(65536)]
                ),
                sniffed_host=host() if rnd.random() < 0.3 else None,
                source_ip=src,
                source_port=None if src is None else rnd.choice([22, 443, rnd.randrange(65536)]),
                inbound_tag=rnd.choice([None, "in0", "in1", "in2"]),
                principal_key=rnd.choice([None, "alice", "bob", "carol"]),
            )
        )
    return out


def _facts(host: str, source: str | None) -> routing.FlowFacts:
    port = None if source is None else 40000
    return routing.FlowFacts("tcp", host, 443, source_ip=source, source_port=port)


def test_c_decide_matches_routing_or_defers():
    seen: Counter[str] = Counter()

    @settings(
        max_examples=examples(130),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cfg=configs(), data=st.data())
    def run(cfg, data):
        oracle = Oracle(cfg)
        routes = compile_cfg(cfg)
        assert lib.sw_table_epoch(routes.table) == 1
        c_first = lib.sw_table_first_domain_rule(routes.table)
        opaque = [i for i, o in enumerate(oracle.opaque) if o]
        assert c_first == min([oracle.ruleset.first_domain_rule, *opaque])
        drawn = data.draw(st.lists(flows(cfg["rules"]), min_size=1, max_size=4))
        rnd = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
        for facts in [*drawn, *_quick_flows(rnd, cfg["rules"], 250)]:
            seen[check_flow(oracle, routes, facts)] += 1
        routes.close()

    run()
    # Deferrals are rare in random configs, so one fixed config makes sure each kind is
    # checked against the oracle in every run, not only in lucky ones.
    fixed = {
        "rules": [
            Rule.model_validate({"process_name": ["curl"], "outbound": "p1"}),
            Rule.model_validate({"domain_regex": ["^a"], "outbound": "p1"}),
            Rule.model_validate({"domain_suffix": ["ex"], "action": "block"}),
        ],
        "process_lookup": "auto",
        "local_addresses": ["10.0.0.7"],
        "mode_kind": "rule",
        "mode_outbound": None,
        "final": "direct",
        "targets": TARGETS,
    }
    oracle, routes = Oracle(fixed), compile_cfg(fixed)
    for source in ("127.0.0.1", "::1", "10.0.0.7", "192.0.2.1", None):
        # The last two are names C cannot be sure of (non-ASCII, a percent escape).
        for host in ("a.ex", "b.ex", "zz.org", "\u00e9.ex", "a%41.org"):
            seen[check_flow(oracle, routes, _facts(host, source))] += 1
    routes.close()
    # A domain target meets an ip_cidr rule: C defers unless it is given the address.
    rule = {"ip_cidr": "10.0.0.0/8", "port": "1", "action": "block"}
    fixed_ip = {**fixed, "rules": [Rule.model_validate(rule)]}
    oracle, routes = Oracle(fixed_ip), compile_cfg(fixed_ip)
    for host in ("zz.org", "10.1.2.3", "0xa.1", "zz.org."):
        for resolved in (None, "10.9.9.9", "::ffff:10.0.0.1", "192.0.2.1"):
            for port in (1, 2):
                facts = routing.FlowFacts("tcp", host, port, resolved_ip=resolved)
                seen[check_flow(oracle, routes, facts)] += 1
    routes.close()
    # Together they produce matches, finals and both kinds of deferral.
    kinds = {"match", "final", "defer-opaque", "defer-process", "defer-unsure", "mode"}
    assert kinds | {"defer-address"} <= set(seen), seen


_ab = st.text(alphabet="ab.", min_size=1, max_size=5)
_ab_name = _ab.filter(lambda v: not v.startswith(".") and ".." not in v)
_ab_rule = st.fixed_dictionaries(
    {},
    optional={
        "domain": _items(_cased(_ab_name), 3),
        "domain_suffix": _items(_cased(_ab_name), 3),
        "domain_keyword": _items(_cased(_ab), 3),
    },
).filter(bool)


@settings(max_examples=examples(300), deadline=None)
@given(docs=st.lists(_ab_rule, min_size=1, max_size=8), seed=st.integers(0, 2**32))
def test_domain_matching_on_a_small_alphabet(docs, seed):
    """Names, suffixes and keywords that overlap every way (keywords inside keywords,
    suffixes of suffixes, empty labels): C must equal Python exactly (nothing opaque)."""
    rules = [Rule.model_validate({**d, "outbound": "p1"}) for d in docs]
    cfg = {**_PROBE, "rules": rules}
    oracle, routes = Oracle(cfg), compile_cfg(cfg)
    rnd = random.Random(seed)
    for _ in range(40):
        host = "".join(rnd.choice("abAB.") for _ in range(rnd.randrange(9)))
        sniffed = None
        if rnd.random() < 0.3:
            sniffed = "".join(rnd.choice("ab.") for _ in range(rnd.randrange(6)))
        facts = routing.FlowFacts(network="tcp", host=host, port=1, sniffed_host=sniffed)
        assert routes.decide(facts) == oracle.decide(facts), facts
    routes.close()


def test_slow_path_facts_with_no_value():
    """A non-ASCII host sends decide down the three-valued scan: inbound, principal and
    source conditions must still be false when the flow has none."""
    rules = [
        Rule.model_validate(d)
        for d in (
            {"inbound_tag": "inX", "outbound": "p1"},
            {"principal_key": ["zed"], "outbound": "p1"},
            {"source_port": "0-65535", "outbound": "p1"},
            {"source_ip_cidr": ["0.0.0.0/0", "::/0"], "outbound": "p1"},
            {"network": "udp", "outbound": "p1"},
            {"domain_suffix": "com", "outbound": "p2"},
        )
    ]
    cfg = {**_PROBE, "rules": rules}
    routes = compile_cfg(cfg)
    for host in ("caf\u00e9.com", "fe80::1%eth0", "plain.com"):
        raw = routes.query(routing.FlowFacts(network="tcp", host=host, port=1))
        if host == "plain.com":
            assert raw == (lib.SW_ROUTE_ROUTE, 5, routes.targets.index("p2"))
        else:
            assert raw == (lib.SW_ROUTE_DEFER, 5, -1)


_small_port = st.integers(0, 15)
_small_net = st.tuples(st.integers(0, 15), st.integers(28, 32))


_port_rule = _items(st.one_of(_small_port.map(str), st.tuples(_small_port, _small_port))).map(
    lambda items: {
        "port": [f"{min(i)}-{max(i)}" if isinstance(i, tuple) else i for i in items],
        "outbound": "p2",
    }
)
_net_rule = _items(_small_net).map(
    lambda items: {
        "ip_cidr": [f"10.0.0.{a}/{p}" for a, p in items]
        + [f"::ffff:10.0.0.{a}/{p + 96}" for a, p in items[:1]],
        "outbound": "p1",
    }
)


@settings(max_examples=examples(200), deadline=None)
@given(docs=st.lists(_port_rule | _net_rule, min_size=1, max_size=4))
def test_ranges_and_networks_in_a_small_universe(docs):
    """Every port 0..16 and every address of 10.0.0.0/27 (also IPv4-mapped) against
    port ranges and networks that touch, overlap and nest."""
    cfg = {**_PROBE, "rules": [Rule.model_validate(d) for d in docs]}
    oracle, routes = Oracle(cfg), compile_cfg(cfg)
    hosts = [f"10.0.0.{a}" for a in range(32)] + [f"::ffff:10.0.0.{a}" for a in range(0, 32, 3)]
    for port in range(17):
        for host in hosts if port % 4 == 0 else hosts[:1]:
            facts = routing.FlowFacts(network="tcp", host=host, port=port)
            assert routes.decide(facts) == oracle.decide(facts), facts
    routes.close()


_PROBE_KEYWORDS = [*"0123456789abcdefxABCDEF.:[]/-%", "\u212a"]
_PROBE = {
    "rules": [
        Rule.model_validate({"ip_cidr": "0.0.0.0/0", "outbound": "p1"}),
        Rule.model_validate({"ip_cidr": "::/0", "outbound": "p2"}),
        Rule.model_validate({"domain_keyword": _PROBE_KEYWORDS, "outbound": "ss"}),
    ],
    "mode_kind": "rule",
    "mode_outbound": None,
    "final": "direct",
    "targets": TARGETS,
}
_PROBE_ROUTES = compile_cfg(_PROBE)
_PROBE_ORACLE = Oracle(_PROBE)


@settings(max_examples=examples(800), deadline=None)
@given(host=st.one_of(_ip_texts, _fuzz_text, st.text(max_size=8)))
def test_ip_literals_parse_like_python(host):
    """IPv4 vs IPv6 vs name (vs nothing), as routing._parse_target tells them apart (an
    address in any spelling spliceway.routing.hostnorm knows)."""
    facts = routing.FlowFacts(network="tcp", host=host, port=1)
    check_flow(_PROBE_ORACLE, _PROBE_ROUTES, facts)
    if _unsure(host):
        return
    got = _PROBE_ROUTES.decide(facts)
    if host and routing._parse_target(host) is None:
        assert got is None  # a name meets the ip_cidr rules first: its address decides
    else:
        assert got == _PROBE_ORACLE.decide(facts)


def test_examples():
    rules = [
        Rule.model_validate(d)
        for d in (
            {"domain_suffix": ["Example.COM."], "port": "443", "outbound": "p1"},
            {"domain": "foo.org", "outbound": "direct"},
            {"domain_keyword": ["ads", "\u212a"], "action": "block"},
            {"ip_cidr": ["10.0.0.0/8", "::ffff:192.168.0.0/112"], "outbound": "p2"},
            {"source_ip_cidr": "127.0.0.0/8", "inbound_tag": "in1", "outbound": "direct"},
            {"principal_key": ["bob", "zed"], "outbound": "p1"},
            {"inbound_tag": "inX", "outbound": "p1"},
            {"domain_regex": "^x", "outbound": "p1"},
        )
    ]
    cfg = {**_PROBE, "rules": rules}
    routes, oracle = compile_cfg(cfg), Oracle(cfg)

    def go(host, **kw):
        facts = routing.FlowFacts(**{"network": "tcp", "host": host, "port": 1, **kw})
        check_flow(oracle, routes, facts)
        got = routes.decide(facts)
        return None if got is None else (got.matched_rule.index if got.matched_rule else "final")

    assert go("www.EXAMPLE.com.", port=443) == 0
    assert go("badexample.com", port=443) is None  # reaches the regex rule
    assert go("1.1.1.1", sniffed_host="a.example.com", port=443) == 0
    assert go("FOO.org.") == 1
    assert go("my-ads.net") == 2
    assert go("k.com") == 2  # the Kelvin sign lowercases to 'k'
    assert go("10.9.9.9") == 3
    assert go("[::ffff:10.9.9.9]") == 3
    assert go("192.168.7.7") == 3
    assert go("192.169.7.7") is None
    assert go("1.1.1.1", source_ip="127.0.0.2", source_port=9, inbound_tag="in1") == 4
    assert go("1.1.1.1", source_ip="::ffff:127.0.0.2", source_port=9, inbound_tag="in1") == 4
    assert go("1.1.1.1", principal_key="bob") == 5
    assert go("xyz.com") is None
    assert go("ex\u212a.com") is None  # not ASCII: Python decides
    assert go("fe80::1%eth0") is None  # a scope id: Python decides
    # Unexpressible facts.
    assert routes.query(routing.FlowFacts("tcp", "a", 1, inbound_tag="inX")) is None
    assert routes.query(routing.FlowFacts("tcp", "a", 1, principal_key="zed")) is None
    assert routes.query(routing.FlowFacts("tcp", "a", 1, resolved_ip="a.b")) is None
    assert routes.query(routing.FlowFacts("tcp", "a", 70000)) is None
    assert routes.query(routing.FlowFacts("tcp", "a", 1, source_ip="1.1.1.1")) is None


# ---------------------------------------------------------------------------
# lifecycle and argument checks
# ---------------------------------------------------------------------------


def _new(nrules=2, ntargets=2, epoch=7):
    out = ffi.new("sw_table **")
    assert lib.sw_table_new(nrules, ntargets, epoch, out) == 0
    return ffi.gc(out[0], lib.sw_table_free)


def _query(host=b"example.com"):
    q = ffi.new("sw_route_query *")
    buf = ffi.from_buffer(host)
    q.host, q.host_len = buf, len(host)
    q.inbound, q.principal = NO_INBOUND, NO_PRINCIPAL
    return q, buf


def test_table_lifecycle_and_bad_arguments():
    t = _new()
    out = ffi.new("sw_route_result *")
    q, _buf = _query()
    assert lib.sw_table_epoch(t) == 7
    assert lib.sw_table_decide(t, q, out) == -EINVAL  # not sealed
    assert lib.sw_table_seal(t) == -EINVAL  # no mode yet
    assert lib.sw_table_set_mode(t, 9, -1, 0) == -EINVAL
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 2) == -EINVAL  # final out of range
    assert lib.sw_table_set_mode(t, lib.SW_MODE_GLOBAL, -1, 0) == -EINVAL  # no mode target
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 1) == 0
    assert lib.sw_table_seal(t) == -EINVAL  # rules without an action
    assert lib.sw_table_rule(t, 2, lib.SW_ROUTE_ROUTE, 0) == -EINVAL  # rule out of range
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_ROUTE, 2) == -EINVAL  # target out of range
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_BLOCK, 0) == -EINVAL  # block takes -1
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_DEFER, -1) == -EINVAL
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_ROUTE, 0) == 0
    assert lib.sw_table_rule(t, 1, lib.SW_ROUTE_BLOCK, -1) == 0
    assert lib.sw_table_cond_domain(t, 2, lib.SW_DOMAIN_EXACT, b"a") == -EINVAL
    assert lib.sw_table_cond_domain(t, 0, 4, b"a") == -EINVAL
    assert lib.sw_table_cond_domain(t, 0, lib.SW_DOMAIN_EXACT, ffi.NULL) == -EINVAL
    addr = ffi.new("uint8_t[16]")
    assert lib.sw_table_cond_cidr(t, 0, 2, 4, addr, 8) == -EINVAL  # field
    assert lib.sw_table_cond_cidr(t, 0, 0, 5, addr, 8) == -EINVAL  # family
    assert lib.sw_table_cond_cidr(t, 0, 0, 4, addr, 33) == -EINVAL
    assert lib.sw_table_cond_cidr(t, 0, 0, 6, addr, 129) == -EINVAL
    assert lib.sw_table_cond_cidr(t, 0, 0, 4, ffi.NULL, 8) == -EINVAL
    assert lib.sw_table_cond_port(t, 0, 0, 10, 9) == -EINVAL
    assert lib.sw_table_cond_port(t, 0, 3, 1, 9) == -EINVAL
    assert lib.sw_table_cond_network(t, 0, 3) == -EINVAL
    assert lib.sw_table_cond_inbound(t, 5, 0) == -EINVAL
    assert lib.sw_table_cond_principal(t, 5, 0) == -EINVAL
    assert lib.sw_table_cond_opaque(t, 5) == -EINVAL
    assert lib.sw_table_target(t, 2, OUT_DIRECT, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0) == -EINVAL
    assert lib.sw_table_target(t, 0, 9, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0) == -EINVAL
    assert lib.sw_table_target(t, 0, OUT_SOCKS5, ffi.NULL, 1, ffi.NULL, ffi.NULL, 0) == -EINVAL
    assert lib.sw_table_target(t, 0, OUT_SOCKS5, b"h", 1, b"u", ffi.NULL, 0) == 0
    assert lib.sw_table_target(t, 0, OUT_SOCKS5, b"h", 1, b"u", b"p", 0) == 0  # replaces
    assert lib.sw_table_cond_domain(t, 0, lib.SW_DOMAIN_SUFFIX, b"Example.COM.") == 0
    assert lib.sw_table_first_domain_rule(t) == 0
    assert lib.sw_table_seal(t) == 0
    # Sealed: read-only.
    assert lib.sw_table_seal(t) == -EINVAL
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 0) == -EINVAL
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_ROUTE, 0) == -EINVAL
    assert lib.sw_table_cond_domain(t, 0, lib.SW_DOMAIN_EXACT, b"a") == -EINVAL
    assert lib.sw_table_cond_opaque(t, 0) == -EINVAL
    assert lib.sw_table_target(t, 0, OUT_DIRECT, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0) == -EINVAL
    assert lib.sw_table_decide(t, q, out) == 0
    assert (out.action, out.rule, out.target) == (lib.SW_ROUTE_ROUTE, 0, 0)
    q2, _b2 = _query(b"other.org")
    assert lib.sw_table_decide(t, q2, out) == 0
    assert (out.action, out.rule, out.target) == (lib.SW_ROUTE_BLOCK, 1, -1)
    # Bad queries.
    q2.host = ffi.NULL
    assert lib.sw_table_decide(t, q2, out) == -EINVAL  # NULL host with a length
    q2.host_len = 0
    assert lib.sw_table_decide(t, q2, out) == 0
    q2.source_family = 5
    assert lib.sw_table_decide(t, q2, out) == -EINVAL
    assert lib.sw_table_decide(ffi.NULL, q, out) == -EINVAL
    assert lib.sw_table_new(0, 0, 0, ffi.NULL) == -EINVAL


def test_empty_table_and_modes():
    t = _new(nrules=0, ntargets=3)
    out = ffi.new("sw_route_result *")
    q, _buf = _query()
    assert lib.sw_table_set_mode(t, lib.SW_MODE_DIRECT, 2, -1) == 0
    assert lib.sw_table_seal(t) == 0
    assert lib.sw_table_first_domain_rule(t) == 0
    assert lib.sw_table_decide(t, q, out) == 0
    assert (out.action, out.rule, out.target) == (lib.SW_ROUTE_ROUTE, -1, 2)


def test_compiled_routes_ownership():
    cfg = {**_PROBE}
    routes = compile_cfg(cfg, epoch=42)
    raw = routes.detach()
    assert lib.sw_table_epoch(raw) == 42
    with pytest.raises(RuntimeError):
        routes.query(routing.FlowFacts("tcp", "a", 1))
    routes.close()  # nothing to free any more
    lib.sw_table_free(raw)
    routes = compile_cfg(cfg)
    routes.close()
    routes.close()
    with pytest.raises(ValueError, match="no route target"):
        compile_route_table(
            _PROBE["rules"],
            mode_kind="rule",
            mode_outbound=None,
            final="nowhere",
            targets=TARGETS,
            inbounds={},
            principals={},
            epoch=1,
        )
    kw = {"mode_kind": "rule", "mode_outbound": None, "final": "direct", "epoch": 1}
    as_list = compile_route_table(
        [], targets=list(TARGETS.items()), inbounds={}, principals={}, **kw
    )
    assert as_list.targets == tuple(TARGETS)
    as_list.close()
    with pytest.raises(ValueError, match="twice"):
        compile_route_table(
            [], targets=[("direct", (OUT_DIRECT,))] * 2, inbounds={}, principals={}, **kw
        )
    with pytest.raises(ValueError, match="principal ids out of range"):
        compile_route_table([], targets=TARGETS, inbounds={}, principals={"x": NO_PRINCIPAL}, **kw)
    with pytest.raises(ValueError, match="global"):
        compile_route_table(
            [],
            mode_kind="global",
            mode_outbound=None,
            final="direct",
            targets=TARGETS,
            inbounds={},
            principals={},
            epoch=1,
        )


def test_deferred_inbounds_leave_decisions_alone():
    """The flow hook's inbounds: a table flags their slots for the connection path
    (``sw_table_inbound_deferred``) and decides every flow exactly as without them."""
    t = _new(nrules=0, ntargets=1)
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 0) == 0
    assert lib.sw_table_defer_inbound(t, 0) == 0
    assert lib.sw_table_defer_inbound(t, 63) == 0
    assert lib.sw_table_defer_inbound(t, 64) == 0
    assert lib.sw_table_defer_inbound(t, lib.SW_TABLE_INBOUND_SLOTS) == -ERANGE
    assert lib.sw_table_defer_inbound(ffi.NULL, 0) == -EINVAL
    assert lib.sw_table_seal(t) == 0
    assert lib.sw_table_defer_inbound(t, 1) == -EINVAL  # sealed
    deferred = [i for i in range(lib.SW_TABLE_INBOUND_SLOTS) if lib.sw_table_inbound_deferred(t, i)]
    assert deferred == [0, 63, 64]
    assert lib.sw_table_inbound_deferred(t, NO_INBOUND) == 0
    assert lib.sw_table_inbound_deferred(ffi.NULL, 0) == 0
    out = ffi.new("sw_route_result *")
    q, _buf = _query()
    q.inbound = 0
    assert lib.sw_table_decide(t, q, out) == 0
    assert (out.action, out.rule, out.target) == (lib.SW_ROUTE_ROUTE, -1, 0)
    # Through the compiler: only the slots named, and none by default.
    kw = {"mode_kind": "rule", "mode_outbound": None, "final": "direct", "epoch": 1}
    routes = compile_route_table(
        [], targets=TARGETS, inbounds={}, principals={}, deferred_inbounds=(2, 5), **kw
    )
    assert [i for i in range(8) if lib.sw_table_inbound_deferred(routes.table, i)] == [2, 5]
    routes.close()
    routes = compile_route_table([], targets=TARGETS, inbounds={}, principals={}, **kw)
    assert not any(lib.sw_table_inbound_deferred(routes.table, i) for i in range(256))
    routes.close()


_HARNESS = r"""
#include "route.h"
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c) \
    do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
enum { NRULES = 3000, NQ = 64, ROUNDS = 2000 };
static sw_table *T;
static sw_route_query Q[NQ];
static char H[NQ][64];
static sw_route_result R[NQ];

/* Shared sets: tables built on one set, decided and freed on several threads. */
static sw_table *ST[4];
static sw_route_query SQ[2];

static void *set_worker(void *arg)
{
    long i = (long)arg, bad = 0;
    for (int round = 0; round < ROUNDS; round++) {
        sw_route_result r;
        if (sw_table_decide(ST[i], &SQ[0], &r) || r.action != SW_ROUTE_BLOCK || r.rule != 0)
            bad++;
        if (sw_table_decide(ST[i], &SQ[1], &r) || r.action != SW_ROUTE_ROUTE || r.rule != -1)
            bad++;
    }
    sw_table_free(ST[i]); /* the last table freed frees the set */
    return (void *)bad;
}

static void *worker(void *arg)
{
    long bad = 0;
    (void)arg;
    for (int round = 0; round < ROUNDS; round++)
        for (int i = 0; i < NQ; i++) {
            sw_route_result r;
            if (sw_table_decide(T, &Q[i], &r) || memcmp(&r, &R[i], sizeof r))
                bad++;
        }
    return (void *)bad;
}

int main(void)
{
    char name[64];
    CHECK(sw_table_new(NRULES, 3, 5, &T) == 0);
    CHECK(sw_table_target(T, 0, SW_OUT_DIRECT, NULL, 0, NULL, NULL, 0) == 0);
    CHECK(sw_table_target(T, 1, SW_OUT_SOCKS5, "10.0.0.1", 1080, "u", NULL, 250) == 0);
    CHECK(sw_table_target(T, 2, SW_OUT_HTTP, "proxy", 3128, NULL, "ignored", 0) == 0);
    CHECK(sw_table_set_mode(T, SW_MODE_RULE, -1, 0) == 0);
    CHECK(sw_table_mode(T) == SW_MODE_RULE);
    for (int r = 0; r < NRULES; r++) {
        snprintf(name, sizeof name, "s%d.test", r);
        CHECK(sw_table_rule(T, (uint32_t)r, SW_ROUTE_ROUTE, 1 + r % 2) == 0);
        CHECK(sw_table_cond_domain(T, (uint32_t)r, SW_DOMAIN_SUFFIX, name) == 0);
        if (r % 7 == 0)
            CHECK(sw_table_cond_port(T, (uint32_t)r, SW_COND_DST, 443, 443) == 0);
    }
    /* Deferred inbounds (the flow hook's) are read by the connection path only. */
    CHECK(sw_table_defer_inbound(T, 255) == 0);
    CHECK(sw_table_defer_inbound(T, SW_TABLE_INBOUND_SLOTS) == -ERANGE);
    /* So are deferred networks (fake-ip ranges). */
    const uint8_t fake[4] = {198, 18, 0, 0};
    CHECK(sw_table_defer_cidr(T, 4, fake, 15) == 0);
    CHECK(sw_table_seal(T) == 0);
    CHECK(sw_table_host_deferred(T, "198.19.1.2", 10) == 1);
    CHECK(sw_table_host_deferred(T, "[::ffff:198.18.0.9]", 19) == 1);
    CHECK(sw_table_host_deferred(T, "198.20.1.2", 10) == 0);
    CHECK(sw_table_host_deferred(T, "198.19.1.2x", 11) == 0);
    /* Random IP-ish texts, not NUL-terminated, under the sanitizers. */
    unsigned seed = 1;
    char rnd[48];
    for (int i = 0; i < 200000; i++) {
        int n = rand_r(&seed) % 48;
        for (int j = 0; j < n; j++)
            rnd[j] = "0123456789abcdef.:[]%/x"[rand_r(&seed) % 23];
        CHECK(sw_table_host_deferred(T, rnd, (uint32_t)n) <= 1);
    }
    CHECK(sw_table_inbound_deferred(T, 255) == 1 && sw_table_inbound_deferred(T, 0) == 0);
    CHECK(sw_table_inbound_deferred(T, UINT32_MAX) == 0);
    /* A process_name rule and many local addresses, repeated (sorted, deduplicated,
     * bisected): 10.0.0.0-250 and 2001:db8::0-252 are on this host. */
    sw_table *P;
    CHECK(sw_table_new(2, 1, 1, &P) == 0);
    CHECK(sw_table_target(P, 0, SW_OUT_DIRECT, NULL, 0, NULL, NULL, 0) == 0);
    CHECK(sw_table_set_mode(P, SW_MODE_RULE, -1, 0) == 0);
    CHECK(sw_table_rule(P, 0, SW_ROUTE_BLOCK, -1) == 0);
    CHECK(sw_table_cond_process(P, 0) == 0);
    CHECK(sw_table_rule(P, 1, SW_ROUTE_ROUTE, 0) == 0);
    CHECK(sw_table_set_process(P, SW_PROCESS_ALL) == 0);
    uint8_t a4[4] = {10, 0, 0, 0}, a6[16] = {0x20, 0x01, 0x0d, 0xb8};
    for (int i = 0; i < 1000; i++) {
        a4[3] = (uint8_t)(i * 7 % 251);
        a6[15] = (uint8_t)(i * 13 % 253);
        CHECK(sw_table_local_addr(P, 4, a4) == 0);
        CHECK(sw_table_local_addr(P, 6, a6) == 0);
    }
    CHECK(sw_table_seal(P) == 0);
    for (int i = 0; i < 256; i++) {
        for (int family = 4; family <= 6; family += 2) {
            sw_route_query q;
            sw_route_result r;
            memset(&q, 0, sizeof q);
            q.host = "h";
            q.host_len = 1;
            q.inbound = UINT32_MAX;
            q.principal = SW_NO_PRINCIPAL;
            q.source_family = (uint8_t)family;
            memcpy(q.source_ip, family == 4 ? a4 : a6, family == 4 ? 4 : 16);
            q.source_ip[family == 4 ? 3 : 15] = (uint8_t)i;
            CHECK(sw_table_decide(P, &q, &r) == 0);
            int local = i <= (family == 4 ? 250 : 252);
            CHECK(local ? r.action == SW_ROUTE_DEFER && r.rule == 0
                        : r.action == SW_ROUTE_ROUTE && r.rule == 1);
            CHECK(sw_table_source_deferred(P, family, q.source_ip) == local);
        }
    }
    const uint8_t lo[4] = {127, 0, 0, 1};
    CHECK(sw_table_source_deferred(P, 4, lo) == 1);
    sw_table_free(P);
    for (int i = 0; i < NQ; i++) {
        snprintf(H[i], sizeof H[i], "www.S%d.test.", i * 40);
        Q[i].host = H[i];
        Q[i].host_len = (uint32_t)strlen(H[i]);
        Q[i].port = i % 2 ? 443 : 80;
        Q[i].inbound = UINT32_MAX;
        Q[i].principal = SW_NO_PRINCIPAL;
        CHECK(sw_table_decide(T, &Q[i], &R[i]) == 0);
        int rule = i * 40;
        if (rule >= NRULES || (rule % 7 == 0 && Q[i].port != 443))
            CHECK(R[i].action == SW_ROUTE_ROUTE && R[i].rule == -1 && R[i].target == 0);
        else
            CHECK(R[i].action == SW_ROUTE_ROUTE && R[i].rule == rule &&
                  R[i].target == 1 + rule % 2);
    }
    const sw_target_info *ti = sw_table_target_info(T, 1);
    CHECK(ti && ti->kind == SW_OUT_SOCKS5 && !strcmp(ti->server, "10.0.0.1") && ti->port == 1080);
    CHECK(!strcmp(ti->user, "u") && !strcmp(ti->pass, "") && ti->connect_timeout_ms == 250);
    ti = sw_table_target_info(T, 2);
    CHECK(ti && ti->kind == SW_OUT_HTTP && ti->user == NULL && ti->pass == NULL);
    ti = sw_table_target_info(T, 0);
    CHECK(ti && ti->kind == SW_OUT_DIRECT && ti->server == NULL);
    CHECK(sw_table_target_info(T, 3) == NULL);
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        CHECK(pthread_create(&th[i], NULL, worker, NULL) == 0);
    long bad = 0;
    for (int i = 0; i < 4; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        bad += (long)ret;
    }
    CHECK(bad == 0);
    sw_table_free(T);
    sw_set *S;
    CHECK(sw_set_new(&S) == 0);
    char names[2000 * 16];
    size_t len = 0;
    for (int i = 0; i < 2000; i++)
        len += (size_t)snprintf(names + len, sizeof names - len, "n%d.test", i) + 1;
    CHECK(sw_set_domains(S, SW_SET_SUFFIX, names, len) == 0);
    CHECK(sw_set_seal(S) == 0);
    for (int i = 0; i < 4; i++) {
        CHECK(sw_table_new(1, 1, (uint64_t)i, &ST[i]) == 0);
        CHECK(sw_table_target(ST[i], 0, SW_OUT_DIRECT, NULL, 0, NULL, NULL, 0) == 0);
        CHECK(sw_table_set_mode(ST[i], SW_MODE_RULE, -1, 0) == 0);
        CHECK(sw_table_rule(ST[i], 0, SW_ROUTE_BLOCK, -1) == 0);
        CHECK(sw_table_cond_sets(ST[i], 0, 0, &S, 1) == 0);
        CHECK(sw_table_seal(ST[i]) == 0);
    }
    sw_set_free(S); /* the tables hold it now */
    SQ[0].host = "www.n1999.test";
    SQ[1].host = "www.m1999.test";
    for (int i = 0; i < 2; i++) {
        SQ[i].host_len = 14;
        SQ[i].inbound = UINT32_MAX;
        SQ[i].principal = SW_NO_PRINCIPAL;
    }
    for (long i = 0; i < 4; i++)
        CHECK(pthread_create(&th[i], NULL, set_worker, (void *)i) == 0);
    for (int i = 0; i < 4; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        bad += (long)ret;
    }
    CHECK(bad == 0);
    puts("ok");
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("sanitize", ["address,undefined", "thread"])
def test_c_harness(tmp_path, sanitize):
    """Target info and mode (outside the cdef), and concurrent decides on one table."""
    src = tmp_path / "harness.c"
    src.write_text(textwrap.dedent(_HARNESS))
    exe = tmp_path / "harness"
    flags = ["-O1", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror"]
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    cmd = [
        "gcc",
        *flags,
        f"-I{CSRC}",
        str(src),
        str(CSRC / "route.c"),
        str(CSRC / "route_set.c"),
        str(CSRC / "iplit.c"),
        "-o",
        str(exe),
        "-lpthread",
    ]
    built = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if built.returncode and sanitize and "sanitize" in built.stderr:
        pytest.skip(f"no {sanitize} runtime: {built.stderr[:200]}")
    assert built.returncode == 0, built.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# ---------------------------------------------------------------------------
# fake-ip ranges: targets C hands to Python before routing
# ---------------------------------------------------------------------------

_DEFER_NETS = ["198.18.0.0/15", "10.0.0.0/29", "fc00::/64", "::ffff:0:0/120", "0.0.0.0/0"]


def _host_deferred(routes: CompiledRoutes, host: str) -> bool:
    data = host.encode("utf-8", "surrogatepass")
    return bool(lib.sw_table_host_deferred(routes.table, data, len(data)))


def _defer_reference(nets: list[str], host: str) -> bool:
    """What C must answer: an IP literal (as routing._parse_ip reads it) in one of the
    networks, or any text with '%' (a scoped IPv6 literal only Python reads)."""
    if "%" in host:
        return True
    parsed = routing._parse_ip(host)
    if parsed is None:
        return False
    version, value = parsed
    for text in nets:
        net = ipaddress.ip_network(text)
        if net.version == version and int(net.network_address) == value & int(net.netmask):
            return True
    return False


@settings(max_examples=examples(600), deadline=None)
@given(
    nets=st.lists(st.sampled_from(_DEFER_NETS[:4]), min_size=1, max_size=3, unique=True),
    host=st.one_of(
        _ip_texts,
        _fuzz_text,
        st.text(max_size=8),
        st.ip_addresses(network="198.18.0.0/15").map(str),
        st.ip_addresses(network="10.0.0.0/28").map(str),
        st.ip_addresses(network="fc00::/63").map(str),
        st.ip_addresses(network="10.0.0.0/28").map(lambda a: f"::ffff:{a}"),
        st.ip_addresses(network="fc00::/64").map(lambda a: f"[{a}]"),
    ),
)
def test_deferred_cidrs_match_python(nets, host):
    """``sw_table_host_deferred`` against the reference; the decisions stay the oracle's."""
    cfg = {**_PROBE, "deferred_cidrs": nets}
    routes = compile_cfg(cfg)
    try:
        assert _host_deferred(routes, host) == _defer_reference(nets, host), host
        facts = routing.FlowFacts(network="tcp", host=host, port=1)
        check_flow(_PROBE_ORACLE, routes, facts)
    finally:
        routes.close()


def test_deferred_cidrs_and_the_fake_ip_pool():
    """Every address the fake-ip pool maps back is one C defers; none by default;
    bad arguments refused."""
    from spliceway.dns.fakeip import FakeIpPool

    pool = FakeIpPool("198.18.0.0/15")
    ip = pool.lookup("fake.example")
    routes = compile_cfg({**_PROBE, "deferred_cidrs": ["198.18.0.0/15"]})
    for host in (ip, f"::ffff:{ip}", f"[{ip}]", "198.19.255.255", "198.18.0.0"):
        assert _host_deferred(routes, host), host
    for host in ("198.20.0.1", "fake.example", "", "198.018.0.2"):
        assert not _host_deferred(routes, host), host
    assert pool.domain_of(f"::ffff:{ip}") == pool.domain_of(f"[{ip}]") == "fake.example"
    routes.close()
    plain = compile_cfg(_PROBE)
    assert not _host_deferred(plain, ip)
    plain.close()
    t = _new(nrules=0, ntargets=1)
    addr = ffi.new("uint8_t[]", bytes(16))
    assert lib.sw_table_defer_cidr(t, 5, addr, 8) == -EINVAL
    assert lib.sw_table_defer_cidr(t, 4, addr, 33) == -EINVAL
    assert lib.sw_table_defer_cidr(t, 4, ffi.NULL, 8) == -EINVAL
    assert lib.sw_table_defer_cidr(ffi.NULL, 4, addr, 8) == -EINVAL
    for _ in range(lib.SW_TABLE_DEFER_NETS):
        assert lib.sw_table_defer_cidr(t, 6, addr, 128) == 0
    assert lib.sw_table_defer_cidr(t, 4, addr, 0) == -ENOSPC
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 0) == 0
    assert lib.sw_table_seal(t) == 0
    assert lib.sw_table_defer_cidr(t, 4, addr, 8) == -EINVAL  # sealed
    assert lib.sw_table_host_deferred(t, b"::", 2) == 1
    assert lib.sw_table_host_deferred(t, b"::1", 3) == 0
    assert lib.sw_table_host_deferred(ffi.NULL, b"::", 2) == 0


# ---------------------------------------------------------------------------
# process_name conditions and runtime.process_lookup
# ---------------------------------------------------------------------------


def _process_cfg(mode: str, local: tuple[str, ...] = ("192.0.2.2", "2001:db8::2")) -> dict:
    return {
        "rules": [
            Rule.model_validate({"port": "22", "outbound": "p2"}),
            Rule.model_validate({"process_name": ["curl"], "action": "block"}),
            Rule.model_validate({"domain_suffix": "example.com", "outbound": "p1"}),
        ],
        "process_lookup": mode,
        "local_addresses": local,
        "mode_kind": "rule",
        "mode_outbound": None,
        "final": "direct",
        "targets": TARGETS,
    }


def _from(source: str, port: int = 443, host: str = "a.example.com") -> routing.FlowFacts:
    return routing.FlowFacts("tcp", host, port, source_ip=source, source_port=40000)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_process_rules_defer_for_local_sources_only(mode):
    routes = compile_cfg(_process_cfg(mode))
    for local in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "192.0.2.2", "2001:db8::2"):
        assert routes.query(_from(local)) == (lib.SW_ROUTE_DEFER, 1, -1), local
        # A rule before it still decides first.
        assert routes.query(_from(local, port=22))[:2] == (lib.SW_ROUTE_ROUTE, 0)
    for remote in ("192.0.2.3", "10.0.0.1", "2001:db8::3", "::ffff:192.0.2.3"):
        # No process from elsewhere: the rule fails, as routing.decide fails it.
        raw = routes.query(_from(remote))
        assert raw == (lib.SW_ROUTE_ROUTE, 2, routes.targets.index("p1")), remote
        assert routes.decide(_from(remote)) == Oracle(_process_cfg(mode)).decide(_from(remote))
    # Unknown source: nothing to look up either.
    assert routes.query(routing.FlowFacts("tcp", "a.example.com", 443))[:2] == (
        lib.SW_ROUTE_ROUTE,
        2,
    )
    # C never knows a process: facts carrying one are not expressible.
    facts = routing.FlowFacts(
        "tcp", "x", 1, source_ip="127.0.0.1", source_port=1, process_name="curl"
    )
    assert routes.query(facts) is None
    routes.close()


def test_process_rules_never_hold_with_lookups_off():
    routes = compile_cfg(_process_cfg("off"))
    for source in ("127.0.0.1", "192.0.2.2", "10.0.0.1"):
        assert routes.query(_from(source))[:2] == (lib.SW_ROUTE_ROUTE, 2), source
    routes.close()


def _source_deferred(routes: CompiledRoutes, text: str) -> int:
    ip = ipaddress.ip_address(text)
    return lib.sw_table_source_deferred(routes.table, ip.version, ffi.new("uint8_t[]", ip.packed))


def test_source_deferred_only_with_always():
    local = ("127.0.0.1", "::1", "127.0.0.5", "192.0.2.2", "2001:db8::2", "::ffff:192.0.2.2")
    remote = ("192.0.2.3", "2001:db8::3", "::ffff:10.0.0.1", "0.0.0.0")
    for mode in ("auto", "off", "always"):
        # Without any process rule too: `always` looks every local flow up.
        cfg = {**_process_cfg(mode), "rules": []}
        routes = compile_cfg(cfg)
        for text in local:
            assert _source_deferred(routes, text) == (mode == "always"), (mode, text)
        for text in remote:
            assert _source_deferred(routes, text) == 0, (mode, text)
        routes.close()


def test_process_arguments():
    t = _new()
    addr = ffi.new("uint8_t[16]", b"\x20\x01\x0d\xb8" + bytes(11) + b"\x02")
    assert lib.sw_table_set_process(t, 3) == -EINVAL
    assert lib.sw_table_set_process(ffi.NULL, 1) == -EINVAL
    assert lib.sw_table_local_addr(t, 5, addr) == -EINVAL
    assert lib.sw_table_local_addr(t, 4, ffi.NULL) == -EINVAL
    assert lib.sw_table_cond_process(t, 2) == -EINVAL
    for _ in range(3):  # duplicates are fine
        assert lib.sw_table_local_addr(t, 6, addr) == 0
    assert lib.sw_table_set_process(t, lib.SW_PROCESS_ALL) == 0
    # Unsealed: nothing is deferred yet.
    assert lib.sw_table_source_deferred(t, 6, addr) == 0
    assert lib.sw_table_set_mode(t, lib.SW_MODE_RULE, -1, 0) == 0
    assert lib.sw_table_rule(t, 0, lib.SW_ROUTE_ROUTE, 0) == 0
    assert lib.sw_table_rule(t, 1, lib.SW_ROUTE_ROUTE, 1) == 0
    assert lib.sw_table_cond_process(t, 0) == 0
    assert lib.sw_table_seal(t) == 0
    assert lib.sw_table_source_deferred(t, 6, addr) == 1
    assert lib.sw_table_source_deferred(t, 5, addr) == 0
    assert lib.sw_table_source_deferred(t, 6, ffi.NULL) == 0
    assert lib.sw_table_set_process(t, lib.SW_PROCESS_OFF) == -EINVAL  # sealed
    assert lib.sw_table_local_addr(t, 6, addr) == -EINVAL
    assert lib.sw_table_cond_process(t, 1) == -EINVAL
    # A process rule does not make the sniffed host matter (it is no domain rule).
    assert lib.sw_table_first_domain_rule(t) == 2
