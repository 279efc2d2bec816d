"""Rule providers, GEOIP and GEOSITE through a real engine.

A ``path`` rule provider (a domain text list of 10,000 lines), a ``.mmdb`` and a
``geosite.dat`` built here, names resolved by a DNS server of the test: real SOCKS5 flows
to a local origin, the chosen outbound read from each flow's record; then the list file
changes and an apply routes by the new one; a rule naming a missing database is refused
with the running engine untouched.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway import ApiError
from spliceway.routing import geodata
from tests.conftest import base_config, wait_until
from tests.helpers.dnsserver import DnsServer, dns_server
from tests.helpers.socks import socks5_connect

#: Every name of the test resolves to the origin's address.
ZONE = {
    name: ["127.0.0.1"]
    for name in ("www.set-hit.test", "new-hit.test", "site-hit.test", "plain.test", "d7777.test")
}


def _domain_list(first: str) -> str:
    lines = [f"+.{first}", "# a comment", ""]
    lines += [f"+.d{i}.test" if i % 2 else f"d{i}.test" for i in range(10_000)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rules = tmp_path / "big.txt"
    rules.write_text(_domain_list("set-hit.test"))
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["127.0.0.0/8"]), {"country": {"iso_code": "ZZ"}})
    writer.insert_network(IPSet(["192.0.2.0/24"]), {"country": {"iso_code": "YY"}})
    writer.to_db_file(str(tmp_path / "country.mmdb"))
    sites = geodata.GeoSiteListMessage()
    sites.entry.add(country_code="TESTSITE").domain.add(type=3, value="site-hit.test")
    (tmp_path / "geosite.dat").write_bytes(sites.SerializeToString())
    return {
        "rules": rules,
        "mmdb": tmp_path / "country.mmdb",
        "geosite": tmp_path / "geosite.dat",
    }


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with dns_server(ZONE) as server:
        yield server


def _config(files: dict[str, Path], dns: DnsServer) -> dict[str, Any]:
    return base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "block", "protocol": "block"},
            {"tag": "via-set", "protocol": "direct"},
            {"tag": "via-geosite", "protocol": "direct"},
            {"tag": "via-geoip", "protocol": "direct"},
        ],
        providers={
            "rules": {"big": {"path": str(files["rules"]), "behavior": "domain", "format": "text"}}
        },
        rules=[
            {"rule_set": "big", "outbound": "via-set"},
            {"geosite": "testsite", "outbound": "via-geosite"},
            {"geoip": "zz", "outbound": "via-geoip"},
        ],
        route={"final": "block"},
        runtime={
            "stats_interval_ms": 200,
            "dns": {"servers": [dns.udp_url]},
            "geodata": {
                "geoip_path": str(files["mmdb"]),
                "geosite_path": str(files["geosite"]),
            },
        },
    )


def _route(engine: Any, origin: tuple[str, int], host: str) -> tuple[str, Any]:
    """One SOCKS5 flow to ``host`` at the origin's port (a GET when it connects); the
    target and matched rule its record names."""
    before = {e["payload"]["record"]["flow_id"] for e in _completed(engine)}
    try:
        with socks5_connect(engine.listen_address("socks-in"), host, origin[1]) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            while sock.recv(65536):
                pass
    except ConnectionError:
        pass  # blocked (a SOCKS error or a reset): recorded all the same

    def new_record() -> dict[str, Any] | None:
        for event in _completed(engine):
            record = event["payload"]["record"]
            if record["flow_id"] not in before:
                return record
        return None

    record = wait_until(new_record, what=f"the flow to {host} completed")
    return record["route"]["target"], record["route"]["matched_rule"]


def _completed(engine: Any) -> list[dict[str, Any]]:
    return [e for e in engine.query("events")["events"] if e["event_type"] == "flow.completed"]


def test_rule_set_geosite_geoip_route_real_flows_and_follow_a_changed_file(
    make_engine: Any, origin: tuple[str, int], files: dict[str, Path], dns: DnsServer
) -> None:
    config = _config(files, dns)
    engine = make_engine(config)
    table = {
        "www.set-hit.test": ("via-set", {"index": 0, "condition": "rule_set=big"}),
        "d7777.test": ("via-set", {"index": 0, "condition": "rule_set=big"}),
        "site-hit.test": ("via-geosite", {"index": 1, "condition": "geosite=testsite"}),
        "127.0.0.1": ("via-geoip", {"index": 2, "condition": "geoip=zz"}),
        # Not in a list: resolved (geoip wants the address), 127.0.0.1 is ZZ.
        "plain.test": ("via-geoip", {"index": 2, "condition": "geoip=zz"}),
        # Does not resolve: no rule matches, final.
        "nx.test": ("block", None),
        "192.0.2.1": ("block", None),
    }
    for host, want in table.items():
        assert _route(engine, origin, host) == want, host

    # The list changes on disk; an apply of the same document reads it again.
    files["rules"].write_text(_domain_list("new-hit.test"))
    stat = files["rules"].stat()
    os.utime(files["rules"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    result = engine.execute("config.apply", {"config": copy.deepcopy(config)})
    assert result["applied"] is True
    assert _route(engine, origin, "new-hit.test") == (
        "via-set",
        {"index": 0, "condition": "rule_set=big"},
    )
    assert _route(engine, origin, "www.set-hit.test") == (
        "via-geoip",
        {"index": 2, "condition": "geoip=zz"},
    )


def test_missing_database_refuses_the_config_and_keeps_the_engine(
    make_engine: Any, origin: tuple[str, int], files: dict[str, Path], dns: DnsServer
) -> None:
    config = _config(files, dns)
    engine = make_engine(config)
    broken = copy.deepcopy(config)
    broken["runtime"]["geodata"]["geoip_path"] = str(files["mmdb"].with_name("gone.mmdb"))
    with pytest.raises(ApiError, match=r"gone\.mmdb"):
        engine.execute("config.apply", {"config": broken})
    corrupt = files["mmdb"].with_name("corrupt.mmdb")
    corrupt.write_bytes(b"not a database" * 100)
    broken["runtime"]["geodata"]["geoip_path"] = str(corrupt)
    with pytest.raises(ApiError, match=r"corrupt\.mmdb"):
        engine.execute("config.apply", {"config": broken})
    assert _route(engine, origin, "127.0.0.1") == (
        "via-geoip",
        {"index": 2, "condition": "geoip=zz"},
    )


def test_unreadable_rule_set_is_empty_and_the_engine_runs(
    make_engine: Any, origin: tuple[str, int], files: dict[str, Path], dns: DnsServer
) -> None:
    files["rules"].write_bytes(b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>")
    engine = make_engine(_config(files, dns))
    # The set is empty: the name falls through to geoip (it resolves to 127.0.0.1).
    assert _route(engine, origin, "www.set-hit.test") == (
        "via-geoip",
        {"index": 2, "condition": "geoip=zz"},
    )
