"""socks5 and http outbounds against real upstream proxies (microsocks, tinyproxy)."""

from __future__ import annotations

import pytest

from tests.helpers.flows import (
    STATUS_ONLY,
    completed,
    engine_via,
    proxy_curl,
    socks_curl,
    socks_fetch,
)
from tests.helpers.upstreams import CountingForwarder, black_hole, microsocks, tinyproxy


def fetch_through(engine, origin, size: int = 50_000):
    header, body, request = socks_fetch(engine, origin, size)
    (done,) = completed(engine)
    record = done["payload"]["record"]
    assert record["traffic"]["bytes_down"] == header + body
    assert record["traffic"]["bytes_up"] == request
    return record


def fetch_via_upstream(make_engine, origin, protocol: str, port: int, auth):
    """An engine whose outbound reaches the upstream on ``port`` through a CountingForwarder.

    Returns the engine, the record of one fetch through it, and the forwarder.
    """
    with CountingForwarder(("127.0.0.1", port)) as fwd:
        outbound = {"tag": "up", "protocol": protocol, "server": "127.0.0.1", "port": fwd.port}
        if auth:
            outbound |= {"username": auth[0], "password": auth[1]}
        engine = engine_via(make_engine, outbound)
        return engine, fetch_through(engine, origin), fwd


@pytest.mark.parametrize("auth", [None, ("u1", "p1")])
def test_socks5_outbound_through_microsocks(make_engine, origin, auth):
    with microsocks(auth) as port:
        _, record, fwd = fetch_via_upstream(make_engine, origin, "socks5", port, auth)
    assert record["result"]["outcome"] == "chained_relayed"
    assert record["path"]["outbound"] == {"tag": "up", "protocol": "socks5"}
    assert record["path"]["remote"] == {"host": "127.0.0.1", "port": fwd.port}
    assert record["path"]["relay_chain"] == []  # a plain outbound is no relay
    assert fwd.connections == 1
    # Every relayed byte crossed the upstream; the rest was its SOCKS5 handshake.
    assert fwd.bytes_down == record["traffic"]["outbound_rx_bytes"]
    assert fwd.bytes_up == record["traffic"]["outbound_tx_bytes"]
    assert record["traffic"]["outbound_rx_bytes"] > record["traffic"]["bytes_down"]


@pytest.mark.parametrize("auth", [None, ("user", "pass")])
def test_http_outbound_through_tinyproxy(make_engine, origin, tmp_path, auth):
    with tinyproxy(tmp_path, auth) as port:
        engine, record, fwd = fetch_via_upstream(make_engine, origin, "http", port, auth)
    assert record["result"]["outcome"] == "chained_relayed"
    assert record["path"]["outbound"] == {"tag": "up", "protocol": "http"}
    assert fwd.connections == 1
    assert fwd.bytes_up == record["traffic"]["outbound_tx_bytes"]
    assert fwd.bytes_down == record["traffic"]["outbound_rx_bytes"]
    assert engine.query("stats")["chained_sessions"] == 1


def _failed_via_socks5(make_engine, origin, port: int, **outbound) -> dict:
    """The completed event of a request to ``origin`` through a socks5 outbound at
    ``port`` (with ``outbound``'s settings) that fails."""
    engine = engine_via(
        make_engine,
        {"tag": "up", "protocol": "socks5", "server": "127.0.0.1", "port": port, **outbound},
    )
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
    assert result.returncode != 0
    (done,) = completed(engine)
    return done


def test_socks5_outbound_with_wrong_password_fails_the_flow(make_engine, origin):
    with microsocks(("u1", "p1")) as port:
        done = _failed_via_socks5(make_engine, origin, port, username="u1", password="bad")
    failure = done["payload"]["record"]["result"]["failure"]
    assert done["payload"]["record"]["result"]["outcome"] == "failed"
    assert failure["code"] == "auth_failed"


def test_http_outbound_rejected_connect_fails_the_flow(make_engine, origin, tmp_path):
    with tinyproxy(tmp_path, ("user", "pass")) as port:
        engine = engine_via(
            make_engine, {"tag": "up", "protocol": "http", "server": "127.0.0.1", "port": port}
        )
        result = proxy_curl(engine, f"http://127.0.0.1:{origin[1]}/", *STATUS_ONLY)
        assert result.stdout == "502"
        (done,) = completed(engine)
    failure = done["payload"]["record"]["result"]["failure"]
    assert failure["code"] == "upstream_rejected"
    assert "407" in failure["message"]


def test_unreachable_upstream_times_out_as_configured(make_engine, origin):
    with black_hole() as port:
        done = _failed_via_socks5(make_engine, origin, port, connect_timeout_ms=300)
    record = done["payload"]["record"]
    assert record["result"]["failure"]["code"] == "connect_timeout"
    assert record["timing"]["duration_ms"] < 3000
