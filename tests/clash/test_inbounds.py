"""spliceway.clash.inbounds: mihomo's ports, authentication and listeners as inbounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spliceway.clash.inbounds import convert_inbounds
from spliceway.clash.state import ImportState
from spliceway.config import parse_config


def _convert(doc: dict[str, Any], tmp_path: Path) -> tuple[Any, ...]:
    state = ImportState(home=str(tmp_path), files_dir=str(tmp_path))
    inbounds, index, routes = convert_inbounds(doc, state)
    parse_config({"inbounds": inbounds})
    return inbounds, index, routes, state.report


def test_ports_default_to_loopback(tmp_path: Path) -> None:
    inbounds, index, routes, report = _convert(
        {"port": 7890, "socks-port": "7891", "mixed-port": 7892}, tmp_path
    )
    assert inbounds == [
        {
            "tag": "DEFAULT-HTTP",
            "protocol": "http",
            "listen": {"address": "127.0.0.1", "port": 7890},
        },
        {
            "tag": "DEFAULT-SOCKS",
            "protocol": "socks5",
            "listen": {"address": "127.0.0.1", "port": 7891},
        },
        {
            "tag": "DEFAULT-MIXED",
            "protocol": "mixed",
            "listen": {"address": "127.0.0.1", "port": 7892},
        },
    ]
    assert index.by_port == {
        7890: ["DEFAULT-HTTP"],
        7891: ["DEFAULT-SOCKS"],
        7892: ["DEFAULT-MIXED"],
    }
    assert index.by_type["HTTP"] == ["DEFAULT-HTTP", "DEFAULT-MIXED"]
    assert index.by_type["SOCKS5"] == ["DEFAULT-SOCKS", "DEFAULT-MIXED"]
    assert index.by_name["DEFAULT-MIXED"] == "DEFAULT-MIXED"
    assert index.has_mixed and routes == []
    assert len(report.converted) == 3


@pytest.mark.parametrize(
    ("allow_lan", "bind", "address"),
    [
        (False, "0.0.0.0", "127.0.0.1"),
        (True, "*", "0.0.0.0"),
        (True, None, "0.0.0.0"),
        (True, "::1", "::1"),
        (True, "eth0", "0.0.0.0"),
        ("yes", "*", "127.0.0.1"),
    ],
)
def test_allow_lan_and_bind_address(
    allow_lan: Any, bind: Any, address: str, tmp_path: Path
) -> None:
    doc: dict[str, Any] = {"mixed-port": 7890, "allow-lan": allow_lan}
    if bind is not None:
        doc["bind-address"] = bind
    inbounds, *_ = _convert(doc, tmp_path)
    assert inbounds[0]["listen"]["address"] == address


def test_port_zero_is_off_and_bad_ports_reported(tmp_path: Path) -> None:
    inbounds, _, _, report = _convert({"port": 0, "socks-port": 65536, "mixed-port": "x"}, tmp_path)
    assert inbounds == []
    assert {i.path for i in report.skipped} == {"socks-port", "mixed-port"}


def test_users_checked(tmp_path: Path) -> None:
    doc = {
        "mixed-port": 1,
        "authentication": ["a:b", "a:c", "x" * 256 + ":p", "u:" + "p" * 256, "emoji🙂:pässword"],
    }
    inbounds, index, _, report = _convert(doc, tmp_path)
    assert inbounds[0]["users"] == [
        {"username": "a", "password": "b"},
        {"username": "emoji🙂", "password": "pässword"},
    ]
    assert index.users == {"a": "a", "emoji🙂": "emoji🙂"}
    assert [i.path for i in report.skipped] == [
        "authentication[1]",
        "authentication[2]",
        "authentication[3]",
    ]


def test_listener_proxy_route_and_port_zero(tmp_path: Path) -> None:
    doc = {
        "listeners": [
            {"name": "in", "type": "mixed", "port": 0, "proxy": "HK", "listen": "127.0.0.1"},
            {"name": "in", "type": "http", "port": 8081},
            {"type": "socks", "port": 1},
            {"name": "r", "type": "redir", "port": 2},
            "junk",
        ]
    }
    inbounds, index, routes, report = _convert(doc, tmp_path)
    assert [(i["tag"], i["listen"]["port"]) for i in inbounds] == [("in", 0), ("in (2)", 8081)]
    assert routes[0].tag == "in" and routes[0].target == "HK"
    assert index.by_name == {"in": "in (2)"}
    assert {i.path for i in report.skipped} == {"listeners[2]", "listeners[3]", "listeners[4]"}
