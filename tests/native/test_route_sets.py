"""spliceway.native.route_sets: the bulk set API (``sw_set_*``) and its caches.

The sets' lookups against routing's own matching of the same RuleSetData (random domain
and ipcidr bodies x random hosts and addresses), a 300,000-name set built in one call per
kind (time and bytes per name), names C cannot carry, and the weak caches that share one
C set between the tables compiled from the same provider content.
"""

from __future__ import annotations

import gc
import ipaddress
import random
import threading
import time
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway._relay import ffi, lib
from spliceway.config import Rule
from spliceway.native import route_sets
from spliceway.routing import rules as routing
from spliceway.routing.ruleset import RuleSetData, parse_cidr, parse_rule_set
from tests.helpers.examples import examples

LABELS = ["a", "b", "ab", "x", "com", "org"]


def _python_matches(data: RuleSetData, host: str) -> bool:
    rule = Rule.model_validate({"rule_set": "s", "outbound": "p"})
    ruleset = routing.compile_rules([rule], rule_sets={"s": data})
    facts = routing.FlowFacts("tcp", host, 1, resolved_ip=None)
    return routing.decide(ruleset, "rule", None, "f", facts).matched_rule is not None


_label = st.sampled_from(LABELS)
_name = st.lists(_label, min_size=1, max_size=3).map(".".join)
_entry = st.one_of(
    _name,
    _name.map("+.{}".format),
    _name.map(".{}".format),
    _name.map("*.{}".format),
    st.tuples(_label, _name).map(lambda t: f"{t[0]}.*.{t[1]}"),
    _name.map(".*.{}".format),
    st.just("*"),
)
_host = st.one_of(
    _name,
    st.text(alphabet="abxcomrg.", max_size=12),
    _name.map(lambda n: n.upper() + "."),
)


@settings(max_examples=examples(300), deadline=None)
@given(entries=st.lists(_entry, min_size=1, max_size=12), hosts=st.lists(_host, max_size=20))
def test_domain_sets_match_like_routing(entries: list[str], hosts: list[str]) -> None:
    body = ("\n".join(entries) + "\n").encode()
    data = parse_rule_set(body, "domain", "text")
    built = route_sets.rule_set_parts(data, match_source=False, geo=None).main
    for host in hosts:
        if routing._parse_target(host) is not None:
            continue  # an address is never a name
        assert built.has_name(host) == _python_matches(data, host), (entries, host)


@settings(max_examples=examples(200), deadline=None)
@given(
    nets=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 255), st.integers(22, 32)).map(
                lambda t: f"10.0.{t[0]}.0/{t[1]}"
            ),
            st.tuples(st.integers(0, 255), st.integers(112, 128)).map(
                lambda t: f"2001:db8::{t[0]:x}00/{t[1]}"
            ),
            st.tuples(st.integers(0, 255), st.integers(118, 128)).map(
                lambda t: f"::ffff:10.0.{t[0]}.0/{t[1]}"
            ),
        ),
        min_size=1,
        max_size=10,
    ),
    seed=st.integers(0, 2**32),
)
def test_cidr_sets_match_like_routing(nets: list[str], seed: int) -> None:
    data = parse_rule_set(("\n".join(nets) + "\n").encode(), "ipcidr", "text")
    built = route_sets.build_set(cidr=data.cidr)
    rule = Rule.model_validate({"rule_set": "s", "outbound": "p"})
    ruleset = routing.compile_rules([rule], rule_sets={"s": data})
    rnd = random.Random(seed)
    for _ in range(60):
        if rnd.random() < 0.5:
            address = f"10.0.{rnd.randrange(256)}.{rnd.randrange(256)}"
        elif rnd.random() < 0.5:
            address = f"2001:db8::{rnd.randrange(0x10000):x}"
        else:
            address = f"::ffff:10.0.{rnd.randrange(256)}.{rnd.randrange(256)}"
        facts = routing.FlowFacts("tcp", address, 1)
        wanted = routing.decide(ruleset, "rule", None, "f", facts).matched_rule is not None
        assert built.has_address(address) == wanted, (nets, address)
        assert not built.has_address(address, source=True)


def test_items_of_every_kind() -> None:
    built = route_sets.build_set(
        exact=["full.com"],
        suffix=["suf.com"],
        subdomain=["sub.com"],
        wildcard=["*.one.com", "a.*.mid.com", ".*.deep.com"],
        keyword=["ads"],
        cidr=[parse_cidr("10.0.0.0/8")],
        source_cidr=[parse_cidr("192.0.2.0/24")],
        ports=["443", "8000-8100"],
        networks=["udp"],
    )
    info = built.info()
    assert (info.names, info.keywords, info.wildcards) == (4, 1, 2), info
    assert (info.nets4, info.nets6, info.ports) == (2, 0, 2), info
    for host, hit in {
        "full.com": True, "x.full.com": False, "suf.com": True, "a.suf.com": True,
        "sub.com": False, "a.sub.com": True, "x.one.com": True, ".one.com": False,
        "a.b.mid.com": True, "x.y.deep.com": True, "y.deep.com": False, "my-ads.org": True,
        "FULL.COM.": True, "nothing.org": False,
    }.items():  # fmt: skip
        assert built.has_name(host) == hit, host
    assert built.has_address("10.1.2.3") and built.has_address("::ffff:10.1.2.3")
    assert not built.has_address("192.0.2.1") and built.has_address("192.0.2.1", source=True)


def test_names_with_a_nul_make_the_set_opaque_on_names() -> None:
    built = route_sets.build_set(exact=["a\0b", "ok.com"])
    info = built.info()
    assert info.names == 1 and info.flags == lib.SW_SET_F_DOMAIN_OPAQUE
    assert built.has_name("ok.com") and not built.has_name("a")
    assert route_sets.build_set(keyword=["\0"]).info().keywords == 0


def test_300k_names_in_one_call_per_kind() -> None:
    """The benchmark's size: built in well under a second, ~35 bytes a name."""
    names = [f"s{i}.zone{i % 13}.test" for i in range(300_000)]
    t0 = time.perf_counter()
    built = route_sets.build_set(suffix=names)
    took = time.perf_counter() - t0
    info = built.info()
    assert info.names == 300_000
    assert info.bytes / 300_000 < 48, info
    assert took < 5.0, took  # about 0.2 s here; generous for a loaded machine
    assert built.has_name("www.s299999.zone11.test")
    assert not built.has_name("www.s299999.zone12.test")


def test_the_gil_is_free_while_a_big_set_builds() -> None:
    """cffi releases the GIL around each C call: another thread runs Python meanwhile."""
    names = [f"n{i}.example" for i in range(400_000)]
    buf = ("\0".join(names) + "\0").encode()
    out = ffi.new("sw_set **")
    assert lib.sw_set_new(out) == 0
    ptr = ffi.gc(out[0], lib.sw_set_free)
    spins = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal spins
        while not done.is_set():
            spins += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = spins
        t0 = time.perf_counter()
        assert lib.sw_set_domains(ptr, lib.SW_SET_SUFFIX, buf, len(buf)) == 0
        took = time.perf_counter() - t0
        during = spins - before
    finally:
        done.set()
        spinner.join()
    assert lib.sw_set_seal(ptr) == 0
    # The spinner ran during the C call (with the GIL held it could not have, beyond a
    # switch interval or two).
    assert during > 1000, (during, took)


def test_the_caches_share_and_let_go() -> None:
    data = RuleSetData(behavior="domain", suffix=frozenset({"a.com"}))
    first = route_sets.rule_set_parts(data, match_source=False, geo=None)
    assert route_sets.rule_set_parts(data, match_source=False, geo=None).main is first.main
    other = route_sets.rule_set_parts(data, match_source=True, geo=None)
    assert other.main is not first.main
    assert route_sets.geosite_set(data) is first.main
    assert len(route_sets._RULE_SETS) >= 1
    del data, first, other
    gc.collect()
    assert all(d.suffix != frozenset({"a.com"}) for d in list(route_sets._RULE_SETS))


def test_geoip_sets_without_a_database() -> None:
    sets = route_sets.geoip_sets("geoip", ["private", "LAN", "cn"], None)
    assert len(sets) == 2 and sets[0] is sets[1]
    assert sets[0].has_address("192.168.1.1") and not sets[0].has_address("8.8.8.8")
    src = route_sets.geoip_sets("source_geoip", ["private"], None)[0]
    assert src.has_address("10.0.0.1", source=True) and not src.has_address("10.0.0.1")
    assert route_sets.geoip_sets("ip_asn", ["13335"], None) == []
    assert route_sets.geosite_sets(["google"], None) == []


def test_addresses_of_every_private_range() -> None:
    private = route_sets.geoip_sets("geoip", ["private"], None)[0]
    for cidr in routing.PRIVATE_CIDRS:
        net = ipaddress.ip_network(cidr)
        assert private.has_address(str(net.network_address)), cidr
        assert private.has_address(str(net[-1])), cidr


@pytest.mark.parametrize("bad", [b"x", b"a\0b"])
def test_a_buffer_must_end_in_nul(bad: bytes) -> None:
    out = ffi.new("sw_set **")
    assert lib.sw_set_new(out) == 0
    rc = lib.sw_set_domains(out[0], lib.SW_SET_EXACT, bad, len(bad))
    assert rc == -22
    lib.sw_set_free(out[0])


def test_prepare_sets_builds_ahead() -> None:
    """native.route.prepare_sets fills the cache compile_route_table then reads."""
    from spliceway.native.route import prepare_sets

    data = RuleSetData(behavior="domain", exact=frozenset({"ahead.test"}))
    rules = [Rule.model_validate({"rule_set": "s", "outbound": "p"})]
    ruleset = routing.compile_rules(rules, rule_sets={"s": data})
    assert data not in route_sets._RULE_SETS
    prepare_sets(rules, ruleset)
    folded = route_sets._RULE_SETS[data][False]
    assert route_sets.rule_set_parts(data, match_source=False, geo=None).main is folded.main


def test_a_table_mirror_does_not_keep_its_rule_sets() -> None:
    """The engine keeps many tables' mirrors; a mirror keeps the rule decisions, not the
    rules and sets it was compiled from: a replaced set is freed with its generation."""
    from spliceway.native.route import OUT_DIRECT, TargetSpec, compile_route_table

    data = parse_rule_set(b"+.mirror.test\n", "domain", "text")
    rules = [Rule.model_validate({"rule_set": "s", "outbound": "p"})]
    ruleset = routing.compile_rules(rules, rule_sets={"s": data})
    routes = compile_route_table(
        rules, mode_kind="rule", mode_outbound=None, final="p",
        targets={"p": TargetSpec(OUT_DIRECT)}, inbounds={}, principals={}, epoch=1,
        ruleset=ruleset,
    )  # fmt: skip
    assert routes.ruleset is ruleset
    routes.close()
    gone = weakref.ref(data)
    del data, ruleset
    gc.collect()
    assert gone() is None and routes.ruleset is None
    assert routes.rule_decisions[0].target == "p"  # what a record of this table needs
