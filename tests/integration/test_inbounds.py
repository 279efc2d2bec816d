"""Real clients (curl, sockets) through each inbound of a real engine to a local origin."""

from __future__ import annotations

import hashlib
import socket

import pytest

from tests.conftest import base_config, wait_until
from tests.helpers.flows import completed, flow_events, proxy_curl, socks_curl, socks_fetch
from tests.helpers.servers import CountingPeer
from tests.helpers.socks import recv_all, socks5_connect
from tests.helpers.upstreams import refused_port


def test_curl_socks5_hostname_counts_every_byte(make_engine, origin):
    engine = make_engine()
    size_header, size_download, size_request = socks_fetch(engine, origin, 12345)
    (done,) = completed(engine)
    record = done["payload"]["record"]
    assert record["state"] == "completed"
    assert record["result"]["outcome"] == "direct_relayed"
    assert "close_reason" not in record["result"]
    assert record["inbound"] == {
        "tag": "socks-in",
        "protocol": "socks5",
        "client_protocol": "socks5",
    }
    assert record["target"]["host"] == "127.0.0.1"
    assert record["target"]["port"] == origin[1]
    assert record["traffic"]["bytes_up"] == size_request
    assert record["traffic"]["bytes_down"] == size_header + size_download
    assert record["path"]["outbound"] == {"tag": "direct", "protocol": "direct"}
    assert record["route"]["selection_chain"] == ["direct"]
    assert done["occurred_at_unix_ms"] == record["timing"]["ended_at_unix_ms"]
    assert done["payload"]["outcome"] == "direct_relayed"
    assert done["payload"]["traffic"]["bytes_up"] == size_request


def test_flow_lifecycle_events_in_order_with_growing_revisions(make_engine, origin):
    engine = make_engine()
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/", inbound="mixed-in")
    assert result.returncode == 0, result.stderr
    completed(engine)
    wanted = flow_events(engine)
    types = [e["event_type"] for e in wanted]
    assert types[0] == "flow.started"
    assert types[1] == "flow.routed"
    assert types[-1] == "flow.completed"
    revisions = [e["payload"]["record"]["revision"] for e in wanted]
    assert revisions == sorted(revisions)
    assert len(set(revisions)) == len(revisions)
    states = [e["payload"]["record"]["state"] for e in wanted]
    assert states[0] == "opening"
    assert states[1] == "active"
    assert states[-1] == "completed"
    sequences = [e["sequence"] for e in wanted]
    assert sequences == sorted(sequences)
    assert len({e["payload"]["record"]["flow_id"] for e in wanted}) == 1


@pytest.mark.parametrize("inbound", ["http-in", "mixed-in"])
def test_curl_http_forward_proxy(make_engine, origin, inbound):
    engine = make_engine()
    result = proxy_curl(
        engine,
        f"http://127.0.0.1:{origin[1]}/host",
        "-w",
        "\n%{http_code} %{size_header} %{size_download}",
        inbound=inbound,
    )
    assert result.returncode == 0, result.stderr
    body, status = result.stdout.rsplit("\n", 1)
    code, size_header, size_download = map(int, status.split())
    assert code == 200
    assert body == f"127.0.0.1:{origin[1]}"
    (done,) = completed(engine)
    record = done["payload"]["record"]
    # A forwarded request is `http` on a mixed inbound too (a CONNECT is `http_connect`).
    assert record["inbound"] == {
        "tag": inbound,
        "protocol": inbound.removesuffix("-in"),
        "client_protocol": "http",
    }
    assert record["result"]["outcome"] == "direct_relayed"
    assert record["traffic"]["bytes_down"] == size_header + size_download


@pytest.mark.parametrize("inbound", ["http-in", "mixed-in"])
def test_curl_http_connect_tunnel(make_engine, origin, inbound):
    engine = make_engine()
    result = proxy_curl(
        engine,
        f"http://127.0.0.1:{origin[1]}/bytes/777",
        "-p",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{size_download}",
        inbound=inbound,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["200", "777"]
    (done,) = completed(engine)
    assert done["payload"]["record"]["result"]["outcome"] == "direct_relayed"


def test_exact_byte_counts_for_ten_million_bytes(make_engine):
    with CountingPeer(reply_bytes=3_000_001) as peer:
        engine = make_engine()
        payload = hashlib.sha256(b"seed").digest() * (10_000_000 // 32) + b"z" * (10_000_000 % 32)
        assert len(payload) == 10_000_000
        sock = socks5_connect(engine.listen_address("socks-in"), *peer.address)
        with sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            received = 0
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        assert received == 3_000_001
        ((count, digest),) = peer.wait_for(1)
        assert count == 10_000_000
        assert digest == hashlib.sha256(payload).hexdigest()
        (done,) = completed(engine)
        traffic = done["payload"]["record"]["traffic"]
        assert traffic["bytes_up"] == 10_000_000
        assert traffic["bytes_down"] == 3_000_001
        assert traffic["outbound_tx_bytes"] == 10_000_000
        assert traffic["outbound_rx_bytes"] == 3_000_001
        # The inbound boundary also carries the SOCKS5 handshake: greeting 3, request 7+len.
        request_len = 4 + 1 + len(peer.address[0]) + 2
        assert traffic["inbound_rx_bytes"] == 10_000_000 + 3 + request_len
        assert traffic["inbound_tx_bytes"] == 3_000_001 + 2 + 10
        stats = engine.query("stats")
        assert stats["bytes_up"] == 10_000_000
        assert stats["bytes_down"] == 3_000_001


def test_malformed_socks5_gets_error_and_close_then_engine_still_serves(make_engine, origin):
    engine = make_engine()
    address = engine.listen_address("socks-in")
    # Wrong version byte in the request: the reply is "general failure", then close.
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(b"\x05\x01\x00")
        assert sock.recv(2) == b"\x05\x00"
        sock.sendall(b"\x04\x01\x00\x01\x7f\x00\x00\x01\x00\x50")
        reply = sock.recv(64)
        assert reply[:2] == b"\x05\x01"
        assert sock.recv(64) == b""
    # Garbage greeting: closed without a reply.
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert sock.recv(64) == b""
    # BIND is answered "command not supported" (UDP ASSOCIATE: tests/integration/test_udp.py).
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(b"\x05\x01\x00")
        assert sock.recv(2) == b"\x05\x00"
        sock.sendall(b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00")
        assert sock.recv(64)[:2] == b"\x05\x07"
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
    assert result.returncode == 0, result.stderr
    assert engine.query("stats")["total_started"] == 1


def test_malformed_http_head_gets_400(make_engine):
    engine = make_engine()
    with socket.create_connection(engine.listen_address("http-in"), timeout=5) as sock:
        sock.sendall(b"GET\x00 nonsense\r\n\r\n")
        data = recv_all(sock)
    assert data.startswith(b"HTTP/1.1 400 ")
    assert engine.query("stats")["total_started"] == 0


def test_connect_refused_is_a_failed_flow_with_socks_reply(make_engine):
    engine = make_engine(
        base_config(
            inbounds=[
                {"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}, "sniff": False},
            ]
        )
    )
    with pytest.raises(ConnectionError, match="socks reply 5"):
        socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", refused_port())
    (done,) = completed(engine)
    result = done["payload"]["record"]["result"]
    assert result["outcome"] == "failed"
    assert result["close_reason"] == "upstream_error"
    assert result["failure"]["code"] == "connection_refused"
    assert result["failure"]["stage"] == "connect"
    assert wait_until(lambda: engine.query("stats")["failed_sessions"] == 1)
