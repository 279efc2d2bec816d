"""spliceway.clash.rule_lines: Clash rule lines read as mihomo reads them."""

from __future__ import annotations

from spliceway.clash.rule_lines import ParsedRule, Unsupported, parse_rule_line


def test_plain_line() -> None:
    parsed = parse_rule_line("DOMAIN-SUFFIX,google.com,Proxy")
    assert parsed == ParsedRule(
        "DOMAIN-SUFFIX",
        {"domain_suffix": ["google.com"]},
        "Proxy",
        "DOMAIN-SUFFIX,google.com,Proxy",
    )


def test_unsupported_says_why() -> None:
    parsed = parse_rule_line("IP-SUFFIX,8.8.8.8/24,X")
    assert isinstance(parsed, Unsupported)
    assert "low bits" in parsed.reason
