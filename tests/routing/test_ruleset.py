"""spliceway.routing.ruleset: rule provider bodies parsed as mihomo reads them."""

from __future__ import annotations

import pytest

from spliceway.routing.ruleset import MAX_REASONS, RuleSetError, parse_cidr, parse_rule_set


def test_domain_text_entries_by_kind() -> None:
    body = b"# comment\n\n+.example.com\n.sub.org\n*.wild.net\nExact.IO.\n// premium comment\n"
    data = parse_rule_set(body, "domain", "text")
    assert data.exact == {"exact.io"}
    assert data.suffix == {"example.com"}
    assert data.subdomain == {"sub.org"}
    assert data.wildcard == ("*.wild.net",)
    assert (data.count, data.skipped) == (4, 0)


def test_ipcidr_yaml_and_bare_addresses() -> None:
    body = b"payload:\n  - '10.1.2.3/8'\n  - 192.168.1.1\n  - '2001:db8::/32'\n  - nonsense\n"
    data = parse_rule_set(body, "ipcidr", "yaml")
    assert list(data.cidr_text()) == ["10.0.0.0/8", "192.168.1.1/32", "2001:db8::/32"]
    assert data.resolves
    assert (data.count, data.skipped) == (3, 1)


def test_garbage_is_an_error() -> None:
    with pytest.raises(RuleSetError, match="HTML"):
        parse_rule_set(b"<!DOCTYPE html><html>502</html>", "domain", "text")
    with pytest.raises(RuleSetError, match="payload"):
        parse_rule_set(b"proxies: []\n", "domain", "yaml")
    with pytest.raises(RuleSetError, match="binary"):
        parse_rule_set(bytes(range(256)) * 4, "domain", "text")


def test_parse_cidr() -> None:
    assert parse_cidr("10.1.2.3/8") == (4, 0x0A000000, 8)
    with pytest.raises(ValueError, match="not a network"):
        parse_cidr("10.1/8")


def test_yaml_is_read_as_mihomo_reads_it() -> None:
    body = b"payload:\n  - no\n  - on.example\n  - 'yes'\n  - +.example.com\n  - 0x10.test\n"
    data = parse_rule_set(body, "domain", "yaml")
    assert data.exact == {"no", "on.example", "yes", "0x10.test"}
    assert data.suffix == {"example.com"}
    with pytest.raises(RuleSetError, match="not a YAML document: line 3"):
        parse_rule_set(b"payload:\n  - [a\n", "domain", "yaml")
    with pytest.raises(RuleSetError, match="`payload` must be a list"):
        parse_rule_set(b"payload: example.com\n", "domain", "yaml")


def test_bad_entries_are_counted_with_their_first_reasons() -> None:
    lines = ["good.example"] + [f"bad entry {i}" for i in range(9)] + ["a*.example", "x..y"]
    data = parse_rule_set("\n".join(lines).encode(), "domain", "text")
    assert (data.count, data.skipped) == (1, 11)
    assert len(data.skip_reasons) == MAX_REASONS
    assert data.skip_reasons[0] == "'bad entry 0' is not a domain (space or '/')"
    with pytest.raises(RuleSetError, match=r"no valid domain entry in the rule set \(2 skipped: "):
        parse_rule_set(b"bad one\nbad two\n", "domain", "text")
    with pytest.raises(RuleSetError, match="no valid ipcidr entry"):
        parse_rule_set(b"# only comments\n\n", "ipcidr", "text")


def test_domain_normalisation() -> None:
    data = parse_rule_set(
        "\ufeffEXAMPLE.com.\n+.Example.ORG\n.例子.测试\n".encode(), "domain", "text"
    )
    assert data.exact == {"example.com"}
    assert data.suffix == {"example.org"}
    assert data.subdomain == {"xn--fsqu00a.xn--0zwm56d"}
    # "x" and ".x" together are "+.x".
    both = parse_rule_set(b"a.test\n.a.test\n", "domain", "text")
    assert (both.exact, both.suffix, both.subdomain) == (frozenset(), {"a.test"}, frozenset())
    wild = parse_rule_set(b"+.*.w.test\n.*.v.test\n", "domain", "text")
    assert wild.wildcard == ("*.w.test", ".*.w.test", ".*.v.test")


def test_cidr_forms() -> None:
    data = parse_rule_set(
        b"10.0.0.0/8\n10.0.0.0/8\n192.168.1.7/24\n::1\n2001:db8::/32\n", "ipcidr", "text"
    )
    assert list(data.cidr_text()) == ["10.0.0.0/8", "192.168.1.0/24", "::1/128", "2001:db8::/32"]
    for bad in ("10.1/8", "1.2.3.4/33", "01.2.3.4/8", "fe80::1%eth0/64", "1.2.3.4/-1", "::/129"):
        with pytest.raises(ValueError, match=r"network|prefix"):
            parse_cidr(bad)


def test_classical_folding_and_parts() -> None:
    body = b"\n".join(
        [
            b"DOMAIN,a.test",
            b"DOMAIN-SUFFIX,b.test",
            b"DOMAIN-KEYWORD,kw",
            b"DOMAIN-REGEX,^r\\d\\.test$",
            b"IP-CIDR,10.0.0.0/8",
            b"IP-CIDR6,2001:db8::/32,no-resolve",
            b"SRC-IP-CIDR,192.168.0.0/16",
            b"DST-PORT,53",
            b"GEOIP,cn",
            b"RULE-SET,other",
            b"MATCH",
            b"UID,1000",
        ]
    )
    data = parse_rule_set(body, "classical", "text")
    assert data.exact == {"a.test"} and data.suffix == {"b.test"}
    assert data.keyword == ("kw",) and data.regex == ("^r\\d\\.test$",)
    assert list(data.cidr_text()) == ["10.0.0.0/8", "2001:db8::/32"]
    assert [p.conditions() for p in data.classical] == [
        {"source_ip_cidr": ("192.168.0.0/16",)},
        {"port": ("53",)},
        {"geoip": ("cn",)},
    ]
    assert data.resolves  # 10.0.0.0/8 came without no-resolve (and GEOIP,cn resolves)
    assert (data.count, data.skipped) == (9, 3)


def test_mrs_garbage_is_refused() -> None:
    with pytest.raises(RuleSetError, match="mrs: not zstd-compressed"):
        parse_rule_set(b"\x00binary", "domain", "mrs")
