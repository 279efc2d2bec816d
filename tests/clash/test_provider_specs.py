"""spliceway.clash.provider_specs: proxy and rule providers as spliceway providers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spliceway.clash.provider_specs import (
    convert_proxy_providers,
    convert_rule_providers,
    finish_providers,
)
from spliceway.clash.state import ImportState
from spliceway.config import parse_config


def _state(tmp_path: Path) -> ImportState:
    return ImportState(home=str(tmp_path), files_dir=str(tmp_path / "files"))


def _validate(state: ImportState) -> None:
    parse_config(
        {
            "outbounds": [{"tag": "hop", "protocol": "socks5", "server": "127.0.0.1", "port": 1}],
            "providers": {"proxies": state.proxy_providers, "rules": state.rule_providers},
        }
    )


def test_proxy_providers(tmp_path: Path) -> None:
    state = _state(tmp_path)
    state.names.add("hop", "proxy", "socks5", protocol="socks5")
    convert_proxy_providers(
        {
            "sub": {
                "type": "http",
                "url": "https://sub.example/api?token=x",
                "interval": 3600,
                "proxy": "hop",
                "size-limit": 1048576,
                "filter": "(?i)hk`jp",
                "exclude-filter": "expire",
                "exclude-type": "vmess",
                "health-check": {
                    "enable": True,
                    "url": "https://cp.cloudflare.com",
                    "interval": 300,
                    "lazy": True,
                },
                "override": {"additional-prefix": "A|", "additional-suffix": "|Z", "tfo": True},
            },
            "local": {"type": "file", "path": "./p/local.yaml"},
            "inline": {
                "type": "inline",
                "payload": [{"name": "x", "type": "socks5", "server": "h", "port": 1}],
            },
            "bad-regex": {"type": "file", "path": "x.yaml", "filter": "(?<name>hk)"},
            "outside": {"type": "file", "path": "/etc/passwd"},
            "escaping": {"type": "file", "path": "../../up.yaml"},
            "nowhere": {"type": "http", "url": "ftp://x"},
            "odd": {"type": "carrier-pigeon"},
            "via-unknown": {"type": "http", "url": "http://h/s", "proxy": "ghost"},
        },
        state,
    )
    finish_providers(state)
    _validate(state)
    sub = state.proxy_providers["sub"]
    assert sub == {
        "url": "https://sub.example/api?token=x",
        "interval_seconds": 3600,
        "via": "hop",
        "size_limit_bytes": 1048576,
        "filter": ["(?i)hk", "jp"],
        "exclude_filter": ["expire"],
        "health_check": {
            "enabled": True,
            "url": "https://cp.cloudflare.com",
            "interval_seconds": 300,
        },
        "override": {"name_prefix": "A|", "name_suffix": "|Z"},
    }
    assert state.proxy_providers["local"] == {"path": str(tmp_path / "p" / "local.yaml")}
    inline = state.proxy_providers["inline"]["path"]
    assert json.loads(state.files[inline]) == {
        "proxies": [{"name": "x", "type": "socks5", "server": "h", "port": 1}]
    }
    assert "filter" not in state.proxy_providers["bad-regex"]
    assert "via" not in state.proxy_providers["via-unknown"]
    skipped = {i.path for i in state.report.skipped}
    assert {
        "proxy-providers.sub.exclude-type",
        "proxy-providers.sub.health-check.lazy",
        "proxy-providers.sub.override.tfo",
        "proxy-providers.nowhere",
        "proxy-providers.odd",
        "proxy-providers.outside.path",
        "proxy-providers.escaping.path",
    } <= skipped
    assert "outside" not in state.proxy_providers and "escaping" not in state.proxy_providers


def test_rule_providers(tmp_path: Path) -> None:
    state = _state(tmp_path)
    doc: dict[str, Any] = {
        "cn": {
            "type": "http",
            "behavior": "domain",
            "format": "mrs",
            "url": "https://r/cn.mrs",
            "interval": 0,
        },
        "lan": {"type": "file", "behavior": "ipcidr", "format": "text", "path": "lan.txt"},
        "apps": {"type": "inline", "behavior": "classical", "payload": ["DOMAIN,a.example"]},
        "bad": {"type": "http", "behavior": "regex", "url": "https://r/x"},
        "worse": {"type": "http", "behavior": "classical", "format": "mrs", "url": "https://r/x"},
        "fmt": {"type": "http", "behavior": "domain", "format": "json", "url": "https://r/x"},
    }
    convert_rule_providers(doc, state)
    finish_providers(state)
    _validate(state)
    assert state.rule_providers["cn"] == {
        "url": "https://r/cn.mrs",
        "behavior": "domain",
        "format": "mrs",
    }
    assert state.rule_providers["lan"] == {
        "path": str(tmp_path / "lan.txt"),
        "behavior": "ipcidr",
        "format": "text",
    }
    apps = state.rule_providers["apps"]
    assert apps["format"] == "yaml" and json.loads(state.files[apps["path"]]) == {
        "payload": ["DOMAIN,a.example"]
    }
    assert {"rule-providers.bad", "rule-providers.worse", "rule-providers.fmt"} <= {
        i.path for i in state.report.skipped
    }
    assert "rule-providers.cn.interval" in {i.path for i in state.report.changed}


def test_not_mappings(tmp_path: Path) -> None:
    state = _state(tmp_path)
    convert_proxy_providers(["x"], state)
    convert_rule_providers("x", state)
    assert {i.path for i in state.report.skipped} == {"proxy-providers", "rule-providers"}
