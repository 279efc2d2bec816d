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
