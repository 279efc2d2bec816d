"""Rule model of issue 29: rule_set, geo conditions, no_resolve, logical rules, invert,
and their cross-checks (unknown rule sets, geodata without a database, empty logical
rules)."""

from __future__ import annotations

from typing import Any

import pytest

from spliceway.config import Rule, SubRule, parse_config, validate_document


def _doc(rules: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"rules": rules, **extra}


def _problems(doc: dict[str, Any]) -> list[tuple[str | None, str]]:
    return [(d.field_path, d.message) for d in validate_document(doc)]


PROVIDERS = {"rules": {"ads": {"path": "/nonexistent/ads.txt", "behavior": "domain"}}}
GEODATA = {"geodata": {"geoip_path": "/x/country.mmdb", "geosite_path": "/x/geosite.dat"}}


def test_new_conditions_validate_and_dump_as_written() -> None:
    rule = Rule.model_validate(
        {
            "rule_set": "ads",
            "geoip": ["CN", "private"],
            "ip_asn": [13335, "15169"],
            "source_geoip": "us",
            "source_ip_asn": 1,
            "geosite": ["google@cn", "geolocation-!cn", "category-ads-all"],
            "no_resolve": True,
            "rule_set_ip_cidr_match_source": True,
            "outbound": "direct",
        }
    )
    assert rule.ip_asn == ("13335", "15169")
    assert rule.source_ip_asn == ("1",)
    assert rule.conditions() == {
        "geosite": ("google@cn", "geolocation-!cn", "category-ads-all"),
        "geoip": ("CN", "private"),
        "ip_asn": ("13335", "15169"),
        "source_geoip": ("us",),
        "source_ip_asn": ("1",),
        "rule_set": ("ads",),
    }
    dumped = rule.model_dump(mode="json")
    assert dumped["no_resolve"] is True
    assert "invert" not in dumped and "type" not in dumped and "rules" not in dumped


def test_plain_rule_keeps_its_old_shape() -> None:
    dumped = Rule.model_validate({"domain": "a.com", "outbound": "direct"}).model_dump()
    assert dumped == {"domain": ("a.com",), "action": "route", "outbound": "direct"}


def test_logical_rule_nested() -> None:
    rule = Rule.model_validate(
        {
            "type": "logical",
            "mode": "and",
            "rules": [
                {"domain_suffix": "a.com"},
                {"type": "logical", "mode": "or", "rules": [{"network": "udp"}, {"port": 53}]},
            ],
            "invert": True,
            "outbound": "direct",
        }
    )
    assert rule.is_logical and rule.conditions() == {}
    assert rule.rules is not None and isinstance(rule.rules[1], SubRule)
    assert rule.rules[1].rules is not None and rule.rules[1].rules[1].port == ("53",)
    again = Rule.model_validate(rule.model_dump(mode="json"))
    assert again == rule


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"type": "logical", "rules": [{"domain": "a"}]}, "needs `mode`"),
        (
            {"type": "logical", "mode": "and", "rules": [{"domain": "a"}], "domain": "b"},
            "no conditions",
        ),
        ({"mode": "and", "domain": "a"}, "need `type: logical`"),
        ({"rules": [{"domain": "a"}], "domain": "a"}, "need `type: logical`"),
        ({"domain": "a", "rule_set_ip_cidr_match_source": True}, "needs `rule_set`"),
        (
            {"type": "logical", "mode": "or", "rules": [{"domain": "a"}], "no_resolve": True},
            "parts",
        ),
        ({"geosite": "!cn"}, "negated"),
        ({"geosite": "a b"}, "geosite list name"),
        ({"geoip": "c n"}, "country code"),
        ({"ip_asn": "AS13335"}, "AS number"),
        ({"type": "logical", "mode": "xor", "rules": [{"domain": "a"}]}, "'and' or 'or'"),
    ],
)
def test_bad_shapes_are_refused(rule: dict[str, Any], message: str) -> None:
    problems = _problems(_doc([{**rule, "outbound": "direct"}]))
    assert any(message in text for _, text in problems), problems


def test_logical_part_takes_no_action() -> None:
    doc = _doc(
        [
            {
                "type": "logical",
                "mode": "or",
                "rules": [{"domain": "a", "outbound": "x"}],
                "outbound": "direct",
            }
        ]
    )
    assert any(path and path.startswith("rules[0].rules[0]") for path, _ in _problems(doc))


def test_cross_checks() -> None:
    doc = _doc(
        [
            {"rule_set": ["ads", "nope"], "outbound": "direct"},
            {"geoip": "cn", "outbound": "direct"},
            {"geoip": ["private", "LAN"], "outbound": "direct"},
            {"geosite": "google", "outbound": "direct"},
            {"ip_asn": 1, "outbound": "direct"},
            {"type": "logical", "mode": "or", "rules": [], "outbound": "direct"},
            {
                "type": "logical",
                "mode": "or",
                "rules": [
                    {"network": "udp"},
                    {"type": "logical", "mode": "and", "rules": [{"rule_set": "zz"}]},
                ],
                "outbound": "direct",
            },
            {"type": "logical", "mode": "and", "rules": [{"invert": True}], "outbound": "direct"},
        ],
        providers=PROVIDERS,
    )
    assert _problems(doc) == [
        ("rules[0].rule_set[1]", "unknown rule provider 'nope' (see providers.rules)"),
        ("rules[1].geoip", "needs runtime.geodata.geoip_path (a database for 'cn')"),
        ("rules[3].geosite", "needs runtime.geodata.geosite_path (a geosite.dat)"),
        ("rules[4].ip_asn", "needs runtime.geodata.asn_path or geoip_path (an ASN database)"),
        ("rules[5].rules", "a logical rule needs at least one rule in `rules`"),
        (
            "rules[6].rules[1].rules[0].rule_set",
            "unknown rule provider 'zz' (see providers.rules)",
        ),
        ("rules[7].rules[0]", "a rule needs at least one condition"),
    ]


def test_geo_rules_with_databases_validate() -> None:
    config = parse_config(
        _doc(
            [
                {"geoip": "cn", "geosite": "google", "ip_asn": 4134, "outbound": "direct"},
                {"rule_set": "ads", "action": "block"},
            ],
            providers=PROVIDERS,
            runtime=GEODATA,
        )
    )
    assert config.rules[1].rule_set == ("ads",)
