"""``providers`` and ``runtime.geodata``: what the schema accepts and refuses."""

from __future__ import annotations

import pytest

from spliceway.config import parse_config
from spliceway.errors import ApiError


def test_a_provider_takes_exactly_one_source() -> None:
    config = parse_config(
        {
            "providers": {
                "proxies": {"sub": {"url": "https://sub.example/clash"}},
                "rules": {"ads": {"path": "/srv/ads.txt", "behavior": "domain", "format": "text"}},
            }
        }
    )
    assert config.providers.proxies["sub"].interval_seconds == 3600
    assert config.providers.rules["ads"].behavior == "domain"
    for bad in ({}, {"url": "https://a.example/", "path": "/x"}):
        with pytest.raises(ApiError):
            parse_config({"providers": {"proxies": {"sub": bad}}})


def test_urls_must_be_http() -> None:
    with pytest.raises(ApiError):
        parse_config({"providers": {"proxies": {"sub": {"url": "ftp://a.example/x"}}}})
    with pytest.raises(ApiError):
        parse_config({"runtime": {"geodata": {"geoip_url": "file:///etc/passwd"}}})
    config = parse_config({"runtime": {"geodata": {"geoip_path": "/srv/Country.mmdb"}}})
    assert config.runtime.geodata.geoip_path == "/srv/Country.mmdb"


def _group_doc(**group: object) -> dict[str, object]:
    return {
        "outbounds": [
            {"tag": "hk", "protocol": "socks5", "server": "127.0.0.1", "port": 9},
            {"tag": "jp", "protocol": "socks5", "server": "127.0.0.1", "port": 10},
        ],
        "providers": {"proxies": {"sub": {"path": "/srv/sub.yaml"}}},
        "outbound_groups": [{"tag": "g", "kind": "selector", **group}],
    }


@pytest.mark.parametrize("kind", ["selector", "url_test", "fallback", "relay", "load_balance"])
def test_every_group_kind_takes_filter_and_exclude_filter(kind: str) -> None:
    doc = _group_doc(kind=kind, providers=["sub"], filter=["HK", "JP"], exclude_filter="x")
    group = parse_config(doc).find_group("g")
    assert group.filter == ("HK", "JP")
    assert group.exclude_filter == ("x",)


def test_group_filters_must_compile() -> None:
    with pytest.raises(ApiError) as info:
        parse_config(_group_doc(providers=["sub"], filter=["(unclosed"]))
    assert [d.field_path for d in info.value.details] == ["outbound_groups[0].filter[0]"]


def test_a_group_without_providers_keeps_a_member_through_its_exclude_filter() -> None:
    # A filter without providers is allowed (it changes nothing).
    assert parse_config(_group_doc(outbounds=["hk"], filter=["nothing"])).find_group("g")
    with pytest.raises(ApiError) as info:
        parse_config(_group_doc(outbounds=["hk", "jp"], exclude_filter=["^(hk|jp)$"]))
    assert [d.field_path for d in info.value.details] == ["outbound_groups[0].exclude_filter"]
    with pytest.raises(ApiError) as info:
        parse_config(_group_doc(outbounds=["hk", "jp"], exclude_filter=["hk"], default="hk"))
    assert [d.field_path for d in info.value.details] == ["outbound_groups[0].default"]
    # With providers both are decided when the content is merged (no member: no_member).
    ok = _group_doc(outbounds=["hk"], providers=["sub"], exclude_filter=["hk"], default="hk")
    assert parse_config(ok).find_group("g").default == "hk"
