"""spliceway.routing.ruleset: rule provider bodies parsed as mihomo reads them."""

from __future__ import annotations

import pytest

from spliceway.routing.ruleset import RuleSetError, parse_cidr, parse_rule_set


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
    with pytest.raises(ValueError):
        parse_cidr("10.1/8")
