"""Rules, modes and inbound authentication through a real engine."""

from __future__ import annotations

import contextlib
import socket

import pytest

from spliceway import ApiError
from tests.conftest import base_config
from tests.helpers.flows import (
    STATUS_ONLY,
    completed,
    curl,
    flow_events,
    in_start_order,
    proxy_curl,
    socks_curl,
)
from tests.helpers.socks import socks5_connect


def test_block_rule_refuses_with_socks_not_allowed_and_emits_no_routed(make_engine, origin):
    cfg = base_config(rules=[{"domain_suffix": ["blocked.test"], "action": "block"}])
    engine = make_engine(cfg)
    with pytest.raises(ConnectionError, match="socks reply 2"):
        socks5_connect(engine.listen_address("socks-in"), "www.blocked.test", 80)
    (done,) = completed(engine)
    record = done["payload"]["record"]
    assert record["result"]["outcome"] == "blocked"
    assert record["route"]["action"] == "block"
    assert record["route"]["matched_rule"] == {
        "index": 0,
        "condition": "domain_suffix=blocked.test",
    }
    types = [e["event_type"] for e in flow_events(engine, record["flow_id"])]
    assert types == ["flow.started", "flow.completed"]
    assert engine.query("stats")["blocked_sessions"] == 1
    # A host outside the suffix is not blocked.
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
    assert result.returncode == 0, result.stderr


def test_block_rule_through_http_inbound_answers_403(make_engine):
    cfg = base_config(rules=[{"domain": ["deny.test"], "action": "block"}])
    engine = make_engine(cfg)
    result = proxy_curl(engine, "http://deny.test/", *STATUS_ONLY)
    assert result.stdout == "403"


def test_rule_routes_to_named_outbound_and_records_the_match(make_engine, origin):
    cfg = base_config(
        rules=[
            {"port": [str(origin[1])], "network": "tcp", "outbound": "direct"},
        ],
        route={"final": "block"},
    )
    engine = make_engine(cfg)
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
    assert result.returncode == 0, result.stderr
    with pytest.raises(ConnectionError, match="socks reply 2"):
        socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", 9)
    first, second = in_start_order(engine, completed(engine, 2))
    assert first["payload"]["record"]["route"]["matched_rule"] == {
        "index": 0,
        "condition": f"port={origin[1]},network=tcp",
    }
    assert first["payload"]["record"]["result"]["outcome"] == "direct_relayed"
    assert second["payload"]["record"]["route"]["matched_rule"] is None
    assert second["payload"]["record"]["route"]["target"] == "block"
    assert second["payload"]["record"]["result"]["outcome"] == "blocked"


def test_modes_switch_routing_for_new_flows(make_engine, origin):
    cfg = base_config(rules=[{"domain": ["localhost"], "action": "block"}])
    engine = make_engine(cfg)
    address = engine.listen_address("socks-in")
    url = f"http://localhost:{origin[1]}/"

    def blocked() -> None:
        with pytest.raises(ConnectionError, match="socks reply 2"):
            socks5_connect(address, "localhost", origin[1])

    def relayed() -> None:
        result = socks_curl(engine, url)
        assert result.returncode == 0, result.stderr

    blocked()
    assert engine.execute("mode.set", {"mode": "direct"}) == {"accepted": True}
    relayed()
    assert engine.execute("mode.set", {"mode": "global", "outbound": "block"}) == {"accepted": True}
    blocked()
    assert engine.execute("mode.set", {"mode": "global", "outbound": "direct"}) == {
        "accepted": True
    }
    relayed()
    assert engine.execute("mode.set", {"mode": "rule"}) == {"accepted": True}
    blocked()

    done = in_start_order(engine, completed(engine, 5))
    modes = [e["payload"]["record"]["route"]["mode"] for e in done]
    assert modes == ["rule", "direct", "global", "global", "rule"]
    outcomes = [e["payload"]["record"]["result"]["outcome"] for e in done]
    assert outcomes == ["blocked", "direct_relayed", "blocked", "direct_relayed", "blocked"]


@pytest.mark.parametrize(
    ("params", "field_path"),
    [
        ({"mode": "sideways"}, "params.mode"),
        ({"mode": "global"}, "params.outbound"),
        ({"mode": "global", "outbound": "nowhere"}, "params.outbound"),
        ({"mode": "rule", "extra": 1}, "params.extra"),
        ({}, "params.mode"),
    ],
)
def test_mode_set_rejects_bad_arguments(make_engine, params, field_path):
    engine = make_engine()
    with pytest.raises(ApiError) as info:
        engine.execute("mode.set", params)
    assert info.value.code == "invalid_argument"
    assert info.value.field_path == field_path


def auth_config():
    users = [
        {"username": "alice", "password": "s3cret", "principal_key": "p-alice"},
        {"username": "bob", "password": "hunter2"},
    ]
    return base_config(
        inbounds=[
            {"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}, "users": users},
            {"tag": "http-in", "protocol": "http", "listen": {"port": 0}, "users": users},
        ]
    )


def test_socks5_auth_accepted_sets_principal_and_rejected_fails(make_engine, origin):
    engine = make_engine(auth_config())
    host, port = engine.listen_address("socks-in")
    url = f"http://127.0.0.1:{origin[1]}/"
    ok = curl("--socks5-hostname", f"alice:s3cret@{host}:{port}", url)
    assert ok.returncode == 0, ok.stderr
    bad = curl("--socks5-hostname", f"alice:wrong@{host}:{port}", url)
    assert bad.returncode != 0
    with pytest.raises(ConnectionError, match="method 255"):
        socks5_connect((host, port), "127.0.0.1", origin[1])
    bob = socks5_connect((host, port), "127.0.0.1", origin[1], auth=("bob", "hunter2"))
    bob.close()
    alice_done, bob_done = completed(engine, 2)
    assert alice_done["principal_key"] == "p-alice"
    assert alice_done["payload"]["auth"] == {
        "scheme": "userpass",
        "principal_key": "p-alice",
        "attributes": {},
    }
    assert bob_done["principal_key"] == "bob"
    assert engine.query("stats")["total_started"] == 2


def test_http_auth_accepted_and_rejected_with_407(make_engine, origin):
    engine = make_engine(auth_config())
    host, port = engine.listen_address("http-in")
    url = f"http://127.0.0.1:{origin[1]}/"
    ok = curl("-x", f"http://alice:s3cret@{host}:{port}", url)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "hello from origin\n"
    for proxy in (f"http://alice:nope@{host}:{port}", f"http://{host}:{port}"):
        bad = curl("-x", proxy, "-o", "/dev/null", "-D", "-", url)
        assert bad.stdout.startswith("HTTP/1.1 407")
        assert 'Proxy-Authenticate: Basic realm="spliceway"' in bad.stdout
    tunnel = curl("-p", "-x", f"http://bob:hunter2@{host}:{port}", url)
    assert tunnel.stdout == "hello from origin\n"
    first, second = completed(engine, 2)
    assert first["principal_key"] == "p-alice"
    assert second["principal_key"] == "bob"
    flows = engine.query("flows", {"principal_key": "nobody"})
    assert flows == {"active_flows": []}


def test_sniffed_tls_sni_feeds_domain_rules(make_engine):
    import ssl

    cfg = base_config(rules=[{"domain_suffix": ["sni-blocked.test"], "action": "block"}])
    engine = make_engine(cfg)
    # The ClientHello is made before the tunnel opens: loading the CA store can take
    # longer than the inbound's sniff window on a loaded machine, and the hello must
    # arrive within it, as a real client's does.
    ctx = ssl.create_default_context()
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="www.sni-blocked.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        sock = socks5_connect(engine.listen_address("socks-in"), *listener.getsockname()[:2])
        with sock:
            sock.sendall(hello)
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(100) == b""
    finally:
        listener.close()
    (done,) = completed(engine)
    record = done["payload"]["record"]
    assert record["target"]["sniffed_host"] == "www.sni-blocked.test"
    assert record["result"]["outcome"] == "blocked"
