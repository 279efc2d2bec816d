"""The DNS commands a Clash dashboard drives: ``dns.cache_flush`` (mihomo's
``POST /cache/dns/flush``) and ``diagnostics.dns_query`` (``GET /dns/query``), through
the engine's ``runtime.dns`` servers, against the repo's test DNS server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from spliceway.errors import ApiError
from tests.conftest import base_config
from tests.helpers.dnsserver import DnsServer, dead_udp_port, dns_server

ZONE = {"www.example.test": ["192.0.2.10", "2001:db8::10"], "one.example.test": ["192.0.2.1"]}


@pytest.fixture
def server() -> Iterator[DnsServer]:
    with dns_server(ZONE, ttl=300) as srv:
        yield srv


def _engine(make_engine: Any, *servers: str, cache: bool = True) -> Any:
    dns: dict[str, Any] = {"servers": list(servers)}
    if cache:
        dns["cache"] = {"max_entries": 64}
    return make_engine(base_config(runtime={"dns": dns}))


def test_cache_flush_empties_the_cache_and_counts(make_engine, server) -> None:
    engine = _engine(make_engine, server.udp_url)
    for name in ("www.example.test", "one.example.test"):
        engine.execute("diagnostics.dns_lookup", {"hostname": name})
    assert engine.execute("diagnostics.dns_cache", {})["count"] == 2
    asked = server.count()

    assert engine.execute("dns.cache_flush", {}) == {"flushed": 2}
    assert engine.execute("diagnostics.dns_cache", {})["count"] == 0
    assert engine.execute("dns.cache_flush", {}) == {"flushed": 0}
    # The next lookup asks the server again.
    engine.execute("diagnostics.dns_lookup", {"hostname": "one.example.test"})
    assert server.count() > asked
    with pytest.raises(ApiError) as info:
        engine.execute("dns.cache_flush", {"all": True})
    assert info.value.code == "invalid_argument"


def test_cache_flush_without_a_cache_is_zero(make_engine, server) -> None:
    engine = _engine(make_engine, server.udp_url, cache=False)
    assert engine.execute("dns.cache_flush", {}) == {"flushed": 0}


def test_dns_query_answers_each_type(make_engine, server) -> None:
    engine = _engine(make_engine, server.udp_url)
    a = engine.execute("diagnostics.dns_query", {"name": "www.example.test"})
    assert a["rcode"] == 0
    assert a["question"] == {"name": "www.example.test.", "type": 1, "class": 1}
    assert a["answer"] == [
        {"name": "www.example.test.", "type": 1, "ttl": 300, "data": "192.0.2.10"}
    ]
    assert a["flags"] == {"tc": False, "rd": True, "ra": False, "ad": False, "cd": False}
    assert (a["authority"], a["additional"]) == ([], [])

    aaaa = engine.execute("diagnostics.dns_query", {"name": "WWW.example.test.", "type": "aaaa"})
    assert aaaa["question"]["type"] == 28
    assert [r["data"] for r in aaaa["answer"]] == ["2001:db8::10"]

    # A type the server holds nothing of: NOERROR with the zone's SOA as authority.
    mx = engine.execute("diagnostics.dns_query", {"name": "www.example.test", "type": "MX"})
    assert (mx["rcode"], mx["answer"]) == (0, [])
    assert [(r["name"], r["type"]) for r in mx["authority"]] == [("test.", 6)]

    nx = engine.execute("diagnostics.dns_query", {"name": "nx.example.test"})
    assert (nx["rcode"], nx["answer"]) == (3, [])
    assert [(q[0], q[1], q[2]) for q in server.queries[-1:]] == [("nx.example.test", "A", "udp")]
    # Queries bypass the cache and leave it as it was.
    assert engine.execute("diagnostics.dns_cache", {})["count"] == 0

    for params, field in (
        ({"name": "www.example.test", "type": "BOGUS"}, "params.type"),
        ({"name": "www.example.test", "type": "ANY"}, "params.type"),
        ({"name": ""}, "params.name"),
        ({"name": "a..b"}, "params.name"),
        ({"name": "x", "type": 1}, "params.type"),
    ):
        with pytest.raises(ApiError) as info:
            engine.execute("diagnostics.dns_query", params)
        assert (info.value.code, info.value.field_path) == ("invalid_argument", field), params


def test_dns_query_moves_on_and_reports_when_every_server_fails(make_engine, server) -> None:
    dead = f"udp://127.0.0.1:{dead_udp_port()}"
    engine = _engine(make_engine, dead, server.udp_url)
    ok = engine.execute("diagnostics.dns_query", {"name": "one.example.test"})
    assert [r["data"] for r in ok["answer"]] == ["192.0.2.1"]

    server.fail = True  # SERVFAIL: a server failure, not an answer
    failed = engine.execute("diagnostics.dns_query", {"name": "one.example.test"})
    assert failed["rcode"] == 2 and failed["answer"] == []
    assert "cannot resolve one.example.test" in failed["error"]
    assert server.udp_url in failed["error"]
