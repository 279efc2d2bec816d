"""Diagnostics commands over HTTP: probe_target, dns_lookup and dns_cache."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import falcon.testing
import orjson
import pytest

from spliceway.api.app import create_app
from spliceway.api.auth import KeyTable
from tests.api.conftest import JSON_BODY, RELAXED, local_client
from tests.api.test_openapi import validate_response
from tests.conftest import base_config
from tests.helpers.dnsserver import dns_server
from tests.helpers.upstreams import black_hole, refused_port


def call(client: falcon.testing.TestClient, method: str, params: dict[str, Any]) -> Any:
    return client.simulate_post(
        "/api/v1/commands",
        body=orjson.dumps({"method": method, "params": params}),
        headers=JSON_BODY,
    )


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


@pytest.fixture
def zone_engine(
    make_engine: Callable[..., Any], listener: socket.socket
) -> Iterator[falcon.testing.TestClient]:
    port = listener.getsockname()[1]
    closed = refused_port()
    zone = {"proxy.test": ["127.0.0.1"], "multi.test": ["127.0.0.2", "127.0.0.3"]}
    with black_hole() as hole, dns_server(zone) as dns:
        cfg = base_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "up", "protocol": "socks5", "server": "proxy.test", "port": port},
                {"tag": "refused", "protocol": "socks5", "server": "127.0.0.1", "port": closed},
                {"tag": "hole", "protocol": "http", "server": "127.0.0.1", "port": hole},
                {"tag": "unknown-name", "protocol": "http", "server": "nx.test", "port": 80},
            ],
            runtime={"dns": {"servers": [dns.udp_url], "cache": {"max_entries": 16}}},
        )
        engine = make_engine(cfg)
        yield local_client(create_app(engine.control_plane, keys=KeyTable([]), limits=RELAXED))


def test_probe_target_reachable_through_the_engine_resolver(
    zone_engine: falcon.testing.TestClient, listener: socket.socket
) -> None:
    result = call(zone_engine, "diagnostics.probe_target", {"target_tag": "up"})
    assert result.status_code == 200, result.text
    body = result.json["result"]
    assert body["reachable"] is True
    assert (body["server"], body["port"]) == ("proxy.test", listener.getsockname()[1])
    assert isinstance(body["latency_ms"], float) and 0 <= body["latency_ms"] < 2000
    assert "error" not in body
    validate_response("POST", "/api/v1/commands", 200, result.json)


def test_probe_target_failures_are_results(zone_engine: falcon.testing.TestClient) -> None:
    refused = call(zone_engine, "diagnostics.probe_target", {"target_tag": "refused"}).json
    assert refused["ok"] is True
    assert refused["result"]["reachable"] is False and refused["result"]["latency_ms"] is None
    assert "refused" in refused["result"]["error"].lower()
    unknown = call(zone_engine, "diagnostics.probe_target", {"target_tag": "unknown-name"}).json
    assert unknown["result"]["reachable"] is False and "nx.test" in unknown["result"]["error"]
    direct = call(zone_engine, "diagnostics.probe_target", {"target_tag": "direct"}).json["result"]
    assert direct == {
        "target_tag": "direct",
        "server": None,
        "port": None,
        "reachable": False,
        "latency_ms": None,
        "error": "outbound has no probeable fixed server",
    }
    missing = call(zone_engine, "diagnostics.probe_target", {"target_tag": "nope"})
    assert missing.status_code == 404 and missing.json["error"]["code"] == "not_found"


def test_probe_target_times_out_in_two_seconds(zone_engine: falcon.testing.TestClient) -> None:
    started = time.monotonic()
    result = call(zone_engine, "diagnostics.probe_target", {"target_tag": "hole"}).json["result"]
    elapsed = time.monotonic() - started
    assert result["reachable"] is False and "timed out" in result["error"]
    assert 1.5 < elapsed < 4.0


def test_dns_lookup_and_cache(zone_engine: falcon.testing.TestClient) -> None:
    found = call(zone_engine, "diagnostics.dns_lookup", {"hostname": "multi.test"}).json["result"]
    # DNS answers are sets: the server may rotate their order.
    assert sorted(found["resolved_addresses"]) == ["127.0.0.2", "127.0.0.3"]
    assert found == {
        "hostname": "multi.test",
        "resolved_addresses": found["resolved_addresses"],
        "count": 2,
    }
    missing = call(zone_engine, "diagnostics.dns_lookup", {"hostname": "nx.test"}).json["result"]
    assert missing["resolved_addresses"] == [] and missing["count"] == 0 and missing["error"]
    bad = call(zone_engine, "diagnostics.dns_lookup", {"hostname": "a..b"})
    assert bad.status_code == 400
    assert bad.json["error"]["field_path"] == "params.hostname"
    hit = call(zone_engine, "diagnostics.dns_cache", {"domain": "multi.test"}).json["result"]
    assert hit["enabled"] is True and hit["hit"] is True
    assert sorted(hit["addresses"]) == ["127.0.0.2", "127.0.0.3"] and 0 < hit["ttl_seconds"] <= 300
    listing = call(zone_engine, "diagnostics.dns_cache", {}).json["result"]
    assert listing["enabled"] is True
    assert "multi.test" in {e["domain"] for e in listing["entries"]}
