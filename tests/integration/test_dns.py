"""The engine resolver against a real DNS server on loopback, and outbounds resolving through it."""

from __future__ import annotations

import asyncio
import time

import pytest

from spliceway import ApiError
from spliceway.config import DnsSettings
from spliceway.dns import ResolveError, Resolver, dns_cache_result, dns_lookup_result
from tests.conftest import base_config
from tests.helpers.dnsserver import DnsServer, dead_udp_port, dns_server
from tests.helpers.flows import STATUS_ONLY, completed, socks_curl
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import microsocks, refused_port

ZONE = {
    "both.test": ["10.1.0.1", "fd00::1"],
    "multi.test": ["fd00::3", "10.2.0.1", "10.2.0.2"],
    "v6only.test": ["fd00::2"],
    "nodata.test": [],
    "origin.test": ["127.0.0.1"],
    "proxy.test": ["127.0.0.1"],
}


@pytest.fixture
def server():
    with dns_server(ZONE) as srv:
        yield srv


def resolver(*servers: str, **dns: object) -> Resolver:
    return Resolver(DnsSettings.model_validate({"servers": list(servers), **dns}))


# -- the resolver ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_lookup_and_resolve_over_each_transport(server, transport):
    r = resolver(getattr(server, f"{transport}_url"), cache=None)
    assert r.lookup("both.test") == ["10.1.0.1", "fd00::1"]  # IPv4 first
    assert asyncio.run(r.resolve("Both.Test.")) == ["10.1.0.1", "fd00::1"]
    assert r.lookup("v6only.test") == ["fd00::2"]
    multi = r.lookup("multi.test")
    assert sorted(multi[:2]) == ["10.2.0.1", "10.2.0.2"]  # an RRset has no order
    assert multi[2:] == ["fd00::3"]
    assert {q[2] for q in server.queries} == {transport}
    assert {q[1] for q in server.queries} == {"A", "AAAA"}


@pytest.mark.parametrize("name", ["nx.test", "nodata.test"])
def test_negative_answers_are_empty_and_not_cached(server, name):
    r = resolver(server.udp_url)
    assert r.lookup(name) == []
    asked = server.count(name)
    assert asked >= 1
    assert asyncio.run(r.resolve(name)) == []
    assert server.count(name) == 2 * asked
    assert r.cache_count() == 0


def test_negative_answer_is_final_no_fallback(server):
    with dns_server({"nx.test": ["10.9.9.9"]}) as second:
        r = resolver(server.udp_url, second.udp_url)
        assert r.lookup("nx.test") == []
        assert second.count() == 0


def test_falls_back_when_first_udp_server_never_answers(server):
    r = resolver(f"udp://127.0.0.1:{dead_udp_port()}", server.udp_url)
    started = time.monotonic()
    assert r.lookup("both.test", timeout=2.0) == ["10.1.0.1", "fd00::1"]
    # The dead server got half the budget (1 s), not all of it.
    assert time.monotonic() - started < 1.8
    assert server.count("both.test") == 2


def test_falls_back_when_first_tcp_server_refuses(server):
    r = resolver(f"tcp://127.0.0.1:{refused_port()}", server.tcp_url)
    assert asyncio.run(r.resolve("both.test")) == ["10.1.0.1", "fd00::1"]


def test_falls_back_on_servfail(server):
    with dns_server({"both.test": ["10.7.7.7"]}) as second:
        server.fail = True
        r = resolver(server.udp_url, second.tcp_url)
        assert r.lookup("both.test") == ["10.7.7.7"]
        assert server.count() >= 1


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_one_family_refused_keeps_the_other_familys_addresses(server, transport):
    server.refuse = {"AAAA"}
    url = server.udp_url if transport == "udp" else server.tcp_url
    r = resolver(url)
    assert r.lookup("both.test") == ["10.1.0.1"]
    assert asyncio.run(resolver(url).resolve("both.test")) == ["10.1.0.1"]
    # No address at all, and a family failed: the server failed, not the name.
    with pytest.raises(ResolveError, match="REFUSED"):
        r.lookup("v6only.test")
    # A name that does not exist is final whatever the other family got.
    assert r.lookup("missing.test") == []


def test_every_server_failing_is_a_resolve_error(server):
    server.fail = True
    r = resolver(server.udp_url, f"tcp://127.0.0.1:{refused_port()}")
    with pytest.raises(ResolveError, match=r"cannot resolve both\.test") as info:
        r.lookup("both.test")
    assert server.udp_url in str(info.value)
    result = dns_lookup_result(r, "both.test")
    assert result["resolved_addresses"] == []
    assert result["count"] == 0
    assert "SERVFAIL" in result["error"]
    assert "Connection refused" in result["error"]


def test_cache_hits_do_not_query_again(server):
    r = resolver(server.udp_url)
    assert r.lookup("both.test") == ["10.1.0.1", "fd00::1"]
    asked = server.count()
    assert asked == 2  # A and AAAA
    assert r.lookup("BOTH.test") == ["10.1.0.1", "fd00::1"]
    assert asyncio.run(r.resolve("both.test.")) == ["10.1.0.1", "fd00::1"]
    assert server.count() == asked


def test_without_cache_every_lookup_queries(server):
    r = resolver(server.udp_url, cache=None)
    r.lookup("both.test")
    r.lookup("both.test")
    assert server.count() == 4
    assert dns_cache_result(r) == {"enabled": False, "entries": [], "count": 0}


@pytest.mark.parametrize(
    ("cache", "expected_ttl"),
    [
        ({"max_entries": 8}, 300),
        ({"max_entries": 8, "max_ttl_seconds": 20}, 20),
        ({"max_entries": 8, "min_ttl_seconds": 600}, 600),
    ],
)
def test_cached_ttl_is_the_answer_ttl_clamped(server, cache, expected_ttl):
    r = resolver(server.tcp_url, cache=cache)
    r.lookup("both.test")
    entry = r.cache_entry("both.test")
    assert entry is not None
    assert expected_ttl - 1 <= entry.ttl_seconds <= expected_ttl


def test_lru_bound_applies_to_real_answers(server):
    r = resolver(server.udp_url, cache={"max_entries": 1})
    r.lookup("both.test")
    r.lookup("origin.test")
    assert [e.domain for e in r.cache_entries()] == ["origin.test"]
    r.lookup("both.test")
    assert server.count("both.test") == 4


def test_concurrent_lookups_from_threads(server):
    import concurrent.futures

    r = resolver(server.udp_url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: r.lookup("both.test"), range(32)))
    assert all(res == ["10.1.0.1", "fd00::1"] for res in results)


# -- the diagnostics results ---------------------------------------------------------------


def test_dns_lookup_result_shapes(server):
    r = resolver(server.udp_url)
    assert dns_lookup_result(r, "both.test") == {
        "hostname": "both.test",
        "resolved_addresses": ["10.1.0.1", "fd00::1"],
        "count": 2,
    }
    missing = dns_lookup_result(r, "nx.test")
    assert set(missing) == {"hostname", "resolved_addresses", "count", "error"}
    assert missing["hostname"] == "nx.test"
    assert (missing["resolved_addresses"], missing["count"]) == ([], 0)
    assert isinstance(missing["error"], str) and missing["error"]
    with pytest.raises(ApiError) as info:
        dns_lookup_result(r, "bad..name")
    assert (info.value.code, info.value.field_path) == ("invalid_argument", "params.hostname")


def test_dns_cache_result_after_a_real_lookup(server):
    r = resolver(server.udp_url, cache={"max_entries": 8, "max_ttl_seconds": 120})
    dns_lookup_result(r, "both.test")
    hit = dns_cache_result(r, "both.test")
    assert set(hit) == {"enabled", "domain", "hit", "addresses", "ttl_seconds"}
    assert hit["enabled"] is True and hit["hit"] is True
    assert hit["addresses"] == ["10.1.0.1", "fd00::1"]
    assert 119 <= hit["ttl_seconds"] <= 120
    listing = dns_cache_result(r)
    assert listing["count"] == 1
    assert listing["entries"] == [
        {"domain": "both.test", "addresses": hit["addresses"], "ttl_seconds": hit["ttl_seconds"]}
    ]


# -- outbounds resolve through runtime.dns -------------------------------------------------


def dns_config(server: DnsServer, **overrides: object) -> dict:
    return base_config(
        runtime={"stats_interval_ms": 200, "dns": {"servers": [server.udp_url]}}, **overrides
    )


def fetch(engine, url: str) -> None:
    result = socks_curl(engine, url, *STATUS_ONLY)
    assert (result.returncode, result.stdout) == (0, "200"), result.stderr


def only_record(engine) -> dict:
    (done,) = completed(engine)
    return done["payload"]["record"]


def test_direct_target_resolves_through_runtime_dns(make_engine, server, origin):
    engine = make_engine(dns_config(server))
    fetch(engine, f"http://origin.test:{origin[1]}/bytes/100")
    record = only_record(engine)
    assert record["target"]["host"] == "origin.test"
    assert record["target"]["resolved_ip"] == "127.0.0.1"
    assert record["result"]["outcome"] == "direct_relayed"
    assert server.count("origin.test") == 2
    cached = dns_cache_result(engine.core.resolver, "origin.test")
    assert cached["hit"] is True
    assert cached["addresses"] == ["127.0.0.1"]


def test_socks5_outbound_server_resolves_through_runtime_dns(make_engine, server, origin):
    with microsocks() as port:
        cfg = dns_config(
            server,
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "up", "protocol": "socks5", "server": "proxy.test", "port": port},
            ],
            route={"final": "up"},
        )
        engine = make_engine(cfg)
        fetch(engine, f"http://127.0.0.1:{origin[1]}/bytes/100")
        fetch(engine, f"http://127.0.0.1:{origin[1]}/bytes/100")
    records = [e["payload"]["record"] for e in completed(engine, 2)]
    assert [r["result"]["outcome"] for r in records] == ["chained_relayed"] * 2
    assert records[0]["path"]["remote"] == {"host": "proxy.test", "port": port}
    # The second flow found proxy.test in the resolver cache.
    assert server.count("proxy.test") == 2


def test_unknown_name_fails_the_flow_with_dns_failed(make_engine, server):
    cfg = dns_config(
        server,
        inbounds=[{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}, "sniff": False}],
    )
    engine = make_engine(cfg)
    with pytest.raises(ConnectionError, match="socks reply 4"):
        socks5_connect(engine.listen_address("socks-in"), "nx.test", 80)
    failure = only_record(engine)["result"]["failure"]
    assert (failure["code"], failure["stage"]) == ("dns_failed", "resolve")
    assert server.count("nx.test") >= 1
