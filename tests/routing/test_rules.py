"""spliceway.routing.rules: rule matching table, modes, final, Hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.config import Rule, parse_config
from spliceway.routing import hostnorm
from spliceway.routing import rules as routing
from spliceway.routing.rules import FlowFacts, MatchedRule, RouteDecision, compile_rules, decide
from tests.config.test_config import EXAMPLE
from tests.helpers.examples import examples
from tests.helpers.spellings import LOOPBACK_SPELLINGS


def _rule(**conditions) -> Rule:
    return Rule.model_validate({**conditions, "outbound": "hit"})


def _facts(**kw) -> FlowFacts:
    base = {"network": "tcp", "host": "example.com", "port": 443}
    return FlowFacts(**{**base, **kw})


def _matches(rule: Rule, facts: FlowFacts) -> bool:
    decision = decide(compile_rules([rule]), "rule", None, "final", facts)
    return decision.target == "hit"


MANY_SUFFIXES = [f"s{i}.test" for i in range(40)] + ["example.com"]

# (conditions, facts overrides, expected match)
TABLE = [
    # domain: exact, case-insensitive, trailing dot ignored
    ({"domain": ["example.com"]}, {}, True),
    ({"domain": ["example.com"]}, {"host": "EXAMPLE.com."}, True),
    ({"domain": ["Example.COM."]}, {"host": "example.com"}, True),
    ({"domain": ["example.com"]}, {"host": "a.example.com"}, False),
    ({"domain": ["example.com"]}, {"host": "1.2.3.4", "sniffed_host": "example.com"}, True),
    ({"domain": ["example.com"]}, {"host": "other.org", "sniffed_host": "example.com"}, True),
    ({"domain": ["example.com"]}, {"host": "1.2.3.4"}, False),
    ({"domain": ["1.2.3.4"]}, {"host": "1.2.3.4"}, False),  # an IP literal is not a domain
    # domain_suffix edge cases
    ({"domain_suffix": ["example.com"]}, {}, True),
    ({"domain_suffix": ["example.com"]}, {"host": "a.example.com"}, True),
    ({"domain_suffix": ["example.com"]}, {"host": "a.b.EXAMPLE.com."}, True),
    ({"domain_suffix": ["example.com"]}, {"host": "badexample.com"}, False),
    ({"domain_suffix": ["example.com"]}, {"host": "example.com.evil.org"}, False),
    ({"domain_suffix": ["example.com"]}, {"host": "example.co"}, False),
    ({"domain_suffix": ["example.com"]}, {"host": "com"}, False),
    ({"domain_suffix": ["com"]}, {"host": "example.com"}, True),
    (
        {"domain_suffix": ["example.com"]},
        {"host": "x.org", "sniffed_host": "cdn.example.com"},
        True,
    ),
    ({"domain_suffix": ["example.org", "example.com"]}, {"host": "www.example.org"}, True),
    ({"domain_suffix": MANY_SUFFIXES}, {"host": "a.b.example.com"}, True),
    ({"domain_suffix": MANY_SUFFIXES}, {"host": "example.com"}, True),
    ({"domain_suffix": MANY_SUFFIXES}, {"host": "badexample.com"}, False),
    ({"domain_suffix": MANY_SUFFIXES}, {"host": "x.s39.test"}, True),
    # domain_keyword and domain_regex
    ({"domain_keyword": ["ads"]}, {"host": "my-ADS.example.com"}, True),
    ({"domain_keyword": ["ads"]}, {"host": "example.com"}, False),
    ({"domain_keyword": ["ads"]}, {"host": "1.2.3.4", "sniffed_host": "ads.net"}, True),
    ({"domain_regex": [r"^api\d+\."]}, {"host": "api12.example.com"}, True),
    ({"domain_regex": [r"^API\d+\."]}, {"host": "api12.example.com"}, True),
    ({"domain_regex": [r"\.cn$"]}, {"host": "example.com"}, False),
    ({"domain_regex": ["example"]}, {"host": "www.example.com"}, True),  # search, not match
    # ip_cidr: target literal, resolved_ip, IPv4-mapped IPv6, IPv6
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "10.1.2.3"}, True),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "11.0.0.1"}, False),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "example.com", "resolved_ip": "10.9.9.9"}, True),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "example.com"}, False),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "11.0.0.1", "resolved_ip": "10.0.0.1"}, False),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "::ffff:10.0.0.1"}, True),
    ({"ip_cidr": ["::ffff:10.0.0.0/104"]}, {"host": "10.0.0.1"}, True),
    ({"ip_cidr": ["2001:db8::/32"]}, {"host": "2001:db8::1"}, True),
    ({"ip_cidr": ["2001:db8::/32"]}, {"host": "[2001:db8::1]"}, True),
    ({"ip_cidr": ["2001:db8::/32"]}, {"host": "2001:db9::1"}, False),
    ({"ip_cidr": ["0.0.0.0/0"]}, {"host": "::1"}, False),
    ({"ip_cidr": ["1.2.3.4"]}, {"host": "1.2.3.4"}, True),
    ({"ip_cidr": ["1.2.3.0/24", "1.2.4.0/24", "9.0.0.0/8"]}, {"host": "1.2.4.255"}, True),
    ({"ip_cidr": ["1.2.3.0/24", "1.2.4.0/24", "9.0.0.0/8"]}, {"host": "1.2.5.0"}, False),
    ({"ip_cidr": ["10.0.0.0/8"]}, {"host": "x", "resolved_ip": "not-an-ip"}, False),
    # source_ip_cidr
    ({"source_ip_cidr": ["192.168.0.0/16"]}, {"source_ip": "192.168.1.5"}, True),
    ({"source_ip_cidr": ["192.168.0.0/16"]}, {"source_ip": "10.0.0.1"}, False),
    ({"source_ip_cidr": ["192.168.0.0/16"]}, {}, False),
    ({"source_ip_cidr": ["192.168.0.0/16"]}, {"host": "192.168.1.5"}, False),
    # port and source_port (inclusive ranges)
    ({"port": ["443"]}, {}, True),
    ({"port": ["22", "8000-8100"]}, {"port": 8000}, True),
    ({"port": ["22", "8000-8100"]}, {"port": 8100}, True),
    ({"port": ["22", "8000-8100"]}, {"port": 8101}, False),
    ({"port": ["22", "8000-8100"]}, {"port": 7999}, False),
    ({"port": ["1-5"]}, {"port": 5}, True),
    ({"source_port": ["50000-60000"]}, {"source_port": 55555}, True),
    ({"source_port": ["50000-60000"]}, {"source_port": 1}, False),
    ({"source_port": ["50000-60000"]}, {}, False),
    # network, inbound_tag, principal_key, process_name
    ({"network": "udp"}, {"network": "udp"}, True),
    ({"network": "udp"}, {}, False),
    ({"inbound_tag": ["in-a", "in-b"]}, {"inbound_tag": "in-b"}, True),
    ({"inbound_tag": ["in-a"]}, {"inbound_tag": "in-c"}, False),
    ({"inbound_tag": ["in-a"]}, {}, False),
    ({"principal_key": ["alice"]}, {"principal_key": "alice"}, True),
    ({"principal_key": ["alice"]}, {"principal_key": "Alice"}, False),
    ({"principal_key": ["alice"]}, {}, False),
    ({"process_name": ["curl"]}, {"process_name": "curl"}, True),
    ({"process_name": ["curl"]}, {"process_name": "wget"}, False),
    # AND across conditions
    ({"domain_suffix": ["example.com"], "port": ["443"]}, {}, True),
    ({"domain_suffix": ["example.com"], "port": ["443"]}, {"port": 80}, False),
    (
        {"ip_cidr": ["10.0.0.0/8"], "port": ["22"], "network": "tcp"},
        {"host": "10.0.0.1", "port": 22},
        True,
    ),
    (
        {"ip_cidr": ["10.0.0.0/8"], "port": ["22"], "network": "tcp"},
        {"host": "10.0.0.1", "port": 22, "network": "udp"},
        False,
    ),
]


@pytest.mark.parametrize(("conditions", "facts", "expected"), TABLE)
def test_rule_table(conditions, facts, expected):
    assert _matches(_rule(**conditions), _facts(**facts)) is expected


def test_first_matching_rule_wins_and_reports_its_condition():
    rules = [
        Rule.model_validate({"domain_keyword": "nomatch", "outbound": "a"}),
        Rule.model_validate(
            {
                "port": ["443", "8443"],
                "domain_suffix": ["example.com", "example.org"],
                "outbound": "b",
            }
        ),
        Rule.model_validate({"port": "443", "outbound": "c"}),
    ]
    decision = decide(compile_rules(rules), "rule", None, "final", _facts())
    assert decision == RouteDecision(
        "rule",
        "route",
        "b",
        MatchedRule(1, "domain_suffix=example.com|example.org,port=443|8443"),
    )


def test_block_rule():
    rules = [Rule.model_validate({"domain_keyword": ["ads"], "network": "tcp", "action": "block"})]
    decision = decide(compile_rules(rules), "rule", None, "proxy", _facts(host="ads.example"))
    assert decision == RouteDecision(
        "rule", "block", None, MatchedRule(0, "domain_keyword=ads,network=tcp")
    )


def test_final_when_nothing_matches():
    rules = [_rule(domain=["other.org"])]
    decision = decide(compile_rules(rules), "rule", None, "proxy", _facts())
    assert decision == RouteDecision("rule", "route", "proxy", None)
    assert decide(compile_rules([]), "rule", None, "direct", _facts()).target == "direct"


def test_global_and_direct_modes_ignore_rules():
    rs = compile_rules([_rule(domain=["example.com"])])
    assert decide(rs, "global", "hop-a", "final", _facts()) == RouteDecision(
        "global", "route", "hop-a", None
    )
    assert decide(rs, "direct", None, "final", _facts()) == RouteDecision(
        "direct", "route", "direct", None
    )


def test_bad_mode_arguments_raise():
    rs = compile_rules([])
    with pytest.raises(ValueError, match="global"):
        decide(rs, "global", None, "final", _facts())
    with pytest.raises(ValueError, match="mode"):
        decide(rs, "fast", None, "final", _facts())


def test_condition_text_order_and_every_key():
    rule = Rule.model_validate(
        {
            "process_name": "curl",
            "principal_key": "alice",
            "inbound_tag": "in",
            "network": "tcp",
            "source_port": "1-2",
            "port": ["80", "443"],
            "source_ip_cidr": "10.0.0.0/8",
            "ip_cidr": "1.0.0.0/8",
            "domain_regex": "x",
            "domain_keyword": "k",
            "domain_suffix": "s.com",
            "domain": "d.com",
            "outbound": "o",
        }
    )
    facts = FlowFacts(
        network="tcp",
        host="d.com",
        port=80,
        sniffed_host=None,
        resolved_ip="1.2.3.4",
        source_ip="10.1.1.1",
        source_port=2,
        inbound_tag="in",
        principal_key="alice",
        process_name="curl",
    )
    # d.com matches domain but neither suffix s.com nor keyword k: no match
    assert decide(compile_rules([rule]), "rule", None, "f", facts).matched_rule is None
    facts2 = FlowFacts(
        network="tcp",
        host="d.com",
        port=80,
        sniffed_host="kx.s.com",
        resolved_ip="1.2.3.4",
        source_ip="10.1.1.1",
        source_port=2,
        inbound_tag="in",
        principal_key="alice",
        process_name="curl",
    )
    matched = decide(compile_rules([rule]), "rule", None, "f", facts2).matched_rule
    assert matched == MatchedRule(
        0,
        "domain=d.com,domain_suffix=s.com,domain_keyword=k,domain_regex=x,ip_cidr=1.0.0.0/8,"
        "source_ip_cidr=10.0.0.0/8,port=80|443,source_port=1-2,network=tcp,inbound_tag=in,"
        "principal_key=alice,process_name=curl",
    )


def test_has_domain_conditions():
    assert compile_rules([]).first_domain_rule == 0
    assert compile_rules([_rule(port="1"), _rule(domain_keyword="x")]).first_domain_rule == 1
    assert compile_rules([_rule(port="1"), _rule(port="2")]).first_domain_rule == 2
    assert not compile_rules([]).has_domain_conditions
    assert not compile_rules([_rule(port="1"), _rule(ip_cidr="1.0.0.0/8")]).has_domain_conditions
    for key in ("domain", "domain_suffix", "domain_keyword", "domain_regex"):
        assert compile_rules([_rule(port="1"), _rule(**{key: "x"})]).has_domain_conditions


def test_rules_from_the_config_example():
    cfg = parse_config(
        {
            "outbounds": [{"tag": "proxy", "protocol": "http", "server": "h", "port": 1}],
            "rules": EXAMPLE["rules"],
            "route": {"final": "proxy"},
        }
    )
    rs = compile_rules(cfg.rules)

    def route(**kw):
        d = decide(rs, cfg.mode.kind, cfg.mode.outbound, cfg.route.final, _facts(**kw))
        return d.action, d.target, d.matched_rule.index if d.matched_rule else None

    assert route(host="www.example.com") == ("route", "proxy", 0)
    assert route(host="ads.net") == ("block", None, 1)
    assert route(host="10.0.0.5", port=8050) == ("route", "direct", 2)
    assert route(host="10.0.0.5", port=8050, network="udp") == ("route", "proxy", None)


# ---------------------------------------------------------------------------
# Hypothesis
# ---------------------------------------------------------------------------

EVERY_CONDITION = compile_rules(
    [
        _rule(domain=["example.com"]),
        _rule(domain_suffix=["example.org"]),
        _rule(domain_suffix=MANY_SUFFIXES),
        _rule(domain_keyword=["ads"]),
        _rule(domain_regex=[r"^a+b$"]),
        _rule(ip_cidr=["10.0.0.0/8", "2001:db8::/32", "::ffff:0:0/96"]),
        _rule(source_ip_cidr=["192.168.0.0/16"]),
        _rule(port=["22", "8000-8100"]),
        _rule(source_port=["1-1024"]),
        _rule(network="udp"),
        _rule(inbound_tag=["in"]),
        _rule(principal_key=["alice"]),
        _rule(process_name=["curl"]),
    ]
)

_hosty = st.one_of(
    st.text(),
    st.ip_addresses().map(str),
    st.from_regex(r"[a-zA-Z0-9.\-\[\]:]{0,30}", fullmatch=True),
)
_opt_text = st.none() | _hosty

facts_strategy = st.builds(
    FlowFacts,
    network=st.sampled_from(["tcp", "udp"]) | st.text(),
    host=_hosty,
    port=st.integers(),
    sniffed_host=_opt_text,
    resolved_ip=_opt_text,
    source_ip=_opt_text,
    source_port=st.none() | st.integers(),
    inbound_tag=st.none() | st.text(),
    principal_key=st.none() | st.text(),
    process_name=st.none() | st.text(),
)


@settings(max_examples=examples(300), deadline=None)
@given(facts=facts_strategy, mode=st.sampled_from(["rule", "global", "direct"]))
def test_decide_never_raises(facts, mode):
    decision = decide(EVERY_CONDITION, mode, "hop", "final", facts)
    assert decision.action in ("route", "block")
    assert decision.target is not None


_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True)
_domain = st.lists(_label, min_size=1, max_size=4).map(".".join)


@settings(max_examples=examples(300), deadline=None)
@given(suffix=_domain, host=_domain | st.tuples(_domain, _domain).map(".".join))
def test_domain_suffix_matches_exactly_equal_or_dot_suffix(suffix, host):
    rs = compile_rules([_rule(domain_suffix=[suffix])])
    facts = FlowFacts(network="tcp", host=host, port=443)
    matched = decide(rs, "rule", None, "final", facts).matched_rule is not None
    if hostnorm.target_address(host) is not None:
        return  # an address, in any spelling, is not a domain name
    assert matched == (host == suffix or host.endswith("." + suffix))


# -- every spelling of an address; a domain's address for ip_cidr (docs/routing.md) -------


@pytest.mark.parametrize(
    "host",
    [
        *LOOPBACK_SPELLINGS,
        "[::ffff:7f00:1]",
        "127.0.0.1 x",
        "\uff11\uff12\uff17.\uff10.\uff10.\uff11",
    ],
)
def test_ip_cidr_sees_every_spelling_of_an_address(host):
    rs = compile_rules([_rule(ip_cidr=["127.0.0.0/8"]), _rule(domain_keyword=["1"])])
    decision = decide(rs, "rule", None, "final", _facts(host=host))
    assert decision.matched_rule == MatchedRule(0, "ip_cidr=127.0.0.0/8")
    # An address is not a name: no domain condition sees it (the keyword "1" would).
    rs = compile_rules([_rule(domain_keyword=["1", "x", "7"])])
    assert decide(rs, "rule", None, "final", _facts(host=host)).matched_rule is None


def test_names_that_only_look_like_addresses_stay_names():
    rs = compile_rules([_rule(ip_cidr=["0.0.0.0/0", "::/0"])])
    for host in ("4chan.org", "1.2.3.4.5", "256.1.1.1", "09", "1password.com", "a..", "."):
        assert decide(rs, "rule", None, "final", _facts(host=host)).matched_rule is None, host


def test_needs_address_when_an_ip_rule_ranks_before_the_match():
    rules = [
        _rule(domain_suffix=["early.test"]),
        _rule(ip_cidr=["10.0.0.0/8"], port=["1"]),
        _rule(domain_suffix=["late.test"]),
    ]
    rs = compile_rules(rules)
    assert rs.first_ip_rule == 1

    def needs(mode: str = "rule", **kw) -> bool:
        facts = _facts(**kw)
        return routing.needs_address(rs, mode, facts, decide(rs, mode, "hit", "final", facts))

    assert not needs(host="a.early.test")  # decided before any ip_cidr rule
    assert needs(host="a.late.test")  # the ip_cidr rule ranks before the match
    assert needs(host="other.test")  # and before the final
    assert needs(host="other.test.")
    assert not needs(host="other.test", resolved_ip="10.1.1.1")  # resolved already
    assert not needs(host="0xa.1")  # an address
    assert not needs(host="")
    assert not needs("global", host="other.test")
    assert not needs("direct", host="other.test")
    no_ip = compile_rules([_rule(domain=["x"])])
    plain = decide(no_ip, "rule", None, "f", _facts())
    assert not routing.needs_address(no_ip, "rule", _facts(), plain)
    # With the address, the ip_cidr rule decides (its port too), then the later rules.
    resolved = _facts(host="a.late.test", port=1, resolved_ip="10.9.9.9")
    assert decide(rs, "rule", None, "final", resolved).matched_rule.index == 1
    resolved = _facts(host="a.late.test", port=2, resolved_ip="10.9.9.9")
    assert decide(rs, "rule", None, "final", resolved).matched_rule.index == 2
    # An unspecified resolved address is where Linux connects: loopback.
    loop = compile_rules([_rule(ip_cidr=["127.0.0.0/8"])])
    facts = _facts(host="ads.test", resolved_ip="0.0.0.0")
    assert decide(loop, "rule", None, "final", facts).matched_rule is not None
