"""spliceway.clash.groups: proxies and proxy groups as outbounds and outbound groups."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from spliceway.clash.groups import (
    build_dialer_chains,
    convert_groups,
    convert_proxies,
    ensure_global,
    python_regex,
    split_filter,
)
from spliceway.clash.state import ImportState
from spliceway.config import parse_config


def _run(proxies: list[Any], groups: list[Any], tmp_path: Path) -> ImportState:
    state = ImportState(home=str(tmp_path), files_dir=str(tmp_path))
    carried = convert_proxies(proxies, state)
    names = {g.get("name") for g in groups if isinstance(g, dict)}
    build_dialer_chains(carried, {n for n in names if isinstance(n, str)}, state)
    convert_groups(groups, state, set())
    outbounds = list(state.outbounds)
    if state.names.block_used:
        outbounds.append({"tag": "REJECT", "protocol": "block"})
    parse_config({"outbounds": outbounds, "outbound_groups": state.groups})
    return state


P = [
    {"name": "s1", "type": "socks5", "server": "127.0.0.1", "port": 1},
    {"name": "s2", "type": "socks5", "server": "127.0.0.1", "port": 2},
    {"name": "h1", "type": "http", "server": "127.0.0.1", "port": 3},
    {
        "name": "ss1",
        "type": "ss",
        "server": "127.0.0.1",
        "port": 4,
        "cipher": "aes-128-gcm",
        "password": "p",
    },
    {"name": "vm", "type": "vmess", "server": "h", "port": 5, "uuid": "u"},
]


def _groups(state: ImportState) -> dict[str, dict[str, Any]]:
    return {g["tag"]: g for g in state.groups}


def test_selector_keeps_order_and_drops_skipped(tmp_path: Path) -> None:
    state = _run(
        P,
        [{"name": "g", "type": "select", "proxies": ["vm", "s2", "s1", "DIRECT", "s1"]}],
        tmp_path,
    )
    assert _groups(state)["g"] == {
        "tag": "g",
        "kind": "selector",
        "outbounds": ["s2", "s1", "direct"],
    }


def test_group_losing_every_proxy_refuses(tmp_path: Path) -> None:
    state = _run(P, [{"name": "g", "type": "select", "proxies": ["vm", "DIRECT"]}], tmp_path)
    assert _groups(state)["g"]["outbounds"] == ["REJECT", "direct"]
    assert any("lost every proxy" in i.why for i in state.report.changed)


def test_relay_groups(tmp_path: Path) -> None:
    groups = [
        {"name": "ok", "type": "relay", "proxies": ["s1", "h1", "ss1"]},
        {"name": "ss-first", "type": "relay", "proxies": ["ss1", "s1"]},
        {"name": "inner", "type": "select", "proxies": ["s1"]},
        {"name": "with-group", "type": "relay", "proxies": ["inner", "s2"]},
    ]
    state = _run(P, groups, tmp_path)
    got = _groups(state)
    assert got["ok"] == {"tag": "ok", "kind": "relay", "outbounds": ["s1", "h1", "ss1"]}
    assert got["ss-first"]["kind"] == "selector" and got["ss-first"]["outbounds"][0] == "REJECT"
    assert got["with-group"]["kind"] == "selector"


def test_dialer_chains_nest(tmp_path: Path) -> None:
    proxies = [
        {"name": "a", "type": "socks5", "server": "127.0.0.1", "port": 1},
        {"name": "b", "type": "http", "server": "127.0.0.1", "port": 2, "dialer-proxy": "a"},
        {
            "name": "c",
            "type": "ss",
            "server": "127.0.0.1",
            "port": 3,
            "cipher": "aes-128-gcm",
            "password": "p",
            "dialer-proxy": "b",
        },
        {
            "name": "loop1",
            "type": "socks5",
            "server": "127.0.0.1",
            "port": 4,
            "dialer-proxy": "loop2",
        },
        {
            "name": "loop2",
            "type": "socks5",
            "server": "127.0.0.1",
            "port": 5,
            "dialer-proxy": "loop1",
        },
        {"name": "to-vm", "type": "socks5", "server": "127.0.0.1", "port": 6, "dialer-proxy": "vm"},
        {"name": "vm", "type": "vmess", "server": "h", "port": 5, "uuid": "u"},
    ]
    state = _run(proxies, [], tmp_path)
    got = _groups(state)
    assert got["b"]["outbounds"] == ["a", "b (last hop)"]
    assert got["c"]["outbounds"] == ["a", "b (last hop)", "c (last hop)"]
    assert "loop1" not in got and "to-vm" not in got
    whys = {i.name: i.why for i in state.report.changed if i.path.endswith("dialer-proxy")}
    assert "loops" in whys["loop1"]
    assert "not a carried proxy" in whys["to-vm"]


def test_global_made_on_demand(tmp_path: Path) -> None:
    state = _run(P[:2], [{"name": "g", "type": "select", "proxies": ["s1"]}], tmp_path)
    assert ensure_global(state) == "GLOBAL"
    assert _groups(state)["GLOBAL"]["outbounds"] == ["direct", "REJECT", "s1", "s2", "g"]
    assert ensure_global(state) == "GLOBAL"
    assert sum(g["tag"] == "GLOBAL" for g in state.groups) == 1


@pytest.mark.parametrize(
    ("text", "parts"),
    [("a", ["a"]), ("a`b", ["a", "b"]), ("", []), ("a``b`", ["a", "b"])],
)
def test_split_filter(text: str, parts: list[str]) -> None:
    assert split_filter(text) == parts


def test_python_regex() -> None:
    assert python_regex("(?i)港|hk") == "(?i)港|hk"
    assert python_regex("(?<n>x)") is None
    assert python_regex("a(?i)b") is None
    assert re.search(python_regex(r"^\d+") or "", "12")
