"""The shadowsocks outbound end to end: engine → (counting forwarder) → Debian's ss-server → target.

Every AEAD method; the bulk bytes move in the C relay's copy path, so these tests
check what the client and the target see byte for byte, and that the record's
counters equal what crossed the wire to the ss-server.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from spliceway.protocols.shadowsocks import CIPHERS
from tests.conftest import base_config
from tests.helpers.flows import completed, engine_via, proxy_curl
from tests.helpers.servers import CountingPeer, EchoServer
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import CountingForwarder, microsocks, ss_server

PASSWORD = "secret"


@pytest.fixture(params=sorted(CIPHERS))
def ss_forwarded(request: pytest.FixtureRequest) -> Iterator[tuple[str, CountingForwarder]]:
    """An ss-server for one method behind a forwarder that counts what the engine sent it."""
    with ss_server(request.param) as port, CountingForwarder(("127.0.0.1", port)) as fwd:
        yield request.param, fwd


def _ss_outbound(method: str, port: int, tag: str = "ss") -> dict[str, Any]:
    return {
        "tag": tag,
        "protocol": "shadowsocks",
        "server": "127.0.0.1",
        "port": port,
        "method": method,
        "password": PASSWORD,
    }


def _recv_all(sock: socket.socket, expect: int) -> bytes:
    chunks = []
    got = 0
    while got < expect:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _echo_through(engine: Any, echo: EchoServer, payload: bytes) -> bytes:
    """Send ``payload`` to ``echo`` through the engine's socks-in while reading it back."""
    sock = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
    with sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        echoed = _recv_all(sock, len(payload))
        sender.join(10)
    return echoed


def test_echo_through_ss_server_is_byte_exact(make_engine, ss_forwarded) -> None:
    method, fwd = ss_forwarded
    engine = engine_via(make_engine, _ss_outbound(method, fwd.port))
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with EchoServer() as echo:
        echoed = _echo_through(engine, echo, payload)
    assert echoed == payload
    (done,) = completed(engine)
    record = done["payload"]["record"]
    traffic = record["traffic"]
    assert record["path"]["outbound"] == {"tag": "ss", "protocol": "shadowsocks"}
    assert record["path"]["relay_chain"] == []
    assert record["route"]["selection_chain"] == ["ss"]
    assert record["result"]["outcome"] == "chained_relayed"
    # User bytes are plaintext, counted once each way.
    assert traffic["bytes_up"] == traffic["bytes_down"] == len(payload)
    # The outbound boundary counters are the ciphertext the ss-server really exchanged.
    assert traffic["outbound_tx_bytes"] == fwd.bytes_up
    assert traffic["outbound_rx_bytes"] == fwd.bytes_down
    key = CIPHERS[method].key_size
    chunks = -(-len(payload) // 0x3FFF)  # at least this many sealed chunks each way
    assert fwd.bytes_down >= key + len(payload) + chunks * 34


def test_upload_then_half_close_delivers_every_byte(make_engine, ss_forwarded) -> None:
    # shadowsocks-libev's ss-server closes both directions when the client's half
    # ends (ss-local -> ss-server behaves the same), so no reply can follow the
    # half-close here; the relay's own half-close is tested against the codec in
    # tests/csrc/test_relay_aead.py.
    method, fwd = ss_forwarded
    engine = engine_via(make_engine, _ss_outbound(method, fwd.port))
    upload = os.urandom(1_000_003)
    with CountingPeer() as peer:
        sock = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", peer.port)
        with sock:
            sock.sendall(upload)
            sock.shutdown(socket.SHUT_WR)
            assert _recv_all(sock, 1) == b""
        (received,) = peer.wait_for(1)
    assert received == (len(upload), hashlib.sha256(upload).hexdigest())
    (done,) = completed(engine)
    traffic = done["payload"]["record"]["traffic"]
    assert traffic["bytes_up"] == len(upload)
    assert traffic["bytes_down"] == 0
    assert traffic["outbound_tx_bytes"] == fwd.bytes_up


def test_http_forward_request_is_sealed_before_the_hand_off(
    make_engine, ss_forwarded, origin
) -> None:
    # An absolute-URI request arrives with the handshake: the engine seals it itself.
    method, fwd = ss_forwarded
    engine = engine_via(make_engine, _ss_outbound(method, fwd.port))
    url = f"http://{origin[0]}:{origin[1]}/bytes/200000"
    result = proxy_curl(engine, url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "x" * 200000
    (done,) = completed(engine)
    traffic = done["payload"]["record"]["traffic"]
    assert traffic["bytes_up"] > 0
    assert traffic["bytes_down"] > 200000


def test_wrong_password_is_seen_by_probe_outbound(make_engine, origin) -> None:
    method = "chacha20-ietf-poly1305"
    with ss_server(method, password="not-the-engine's") as port:
        engine = engine_via(make_engine, _ss_outbound(method, port))
        result = engine.execute(
            "diagnostics.probe_outbound",
            {"target_tag": "ss", "url": f"http://{origin[0]}:{origin[1]}/generate_204"},
        )
    assert result["reachable"] is False
    assert result["latency_ms"] is None
    assert result["via"] == "through_proxy"
    assert result["error"]


def test_probe_outbound_through_ss_reaches_the_origin(make_engine, ss_forwarded, origin) -> None:
    method, fwd = ss_forwarded
    engine = engine_via(make_engine, _ss_outbound(method, fwd.port))
    url = f"http://{origin[0]}:{origin[1]}/generate_204"
    result = engine.execute("diagnostics.probe_outbound", {"target_tag": "ss", "url": url})
    assert result["reachable"] is True, result
    assert result["url"] == url
    assert result["latency_ms"] > 0
    assert fwd.connections == 1


def test_relay_chain_ending_in_shadowsocks(make_engine) -> None:
    method = "aes-256-gcm"
    payload = os.urandom(500_000)
    with (
        microsocks() as socks_port,
        CountingForwarder(("127.0.0.1", socks_port)) as hop_fwd,
        ss_server(method) as ss_port,
        EchoServer() as echo,
    ):
        cfg = base_config()
        cfg["outbounds"] += [
            {"tag": "hop-a", "protocol": "socks5", "server": "127.0.0.1", "port": hop_fwd.port},
            _ss_outbound(method, ss_port),
        ]
        cfg["outbound_groups"] = [{"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "ss"]}]
        cfg["route"] = {"final": "chain"}
        engine = make_engine(cfg)
        assert _echo_through(engine, echo, payload) == payload
        (done,) = completed(engine)
    record = done["payload"]["record"]
    assert record["path"]["outbound"] == {"tag": "chain", "protocol": "relay"}
    assert record["path"]["relay_chain"] == ["hop-a", "ss"]
    assert record["route"]["selection_chain"] == ["chain"]
    traffic = record["traffic"]
    assert traffic["bytes_up"] == traffic["bytes_down"] == len(payload)
    # Everything the engine exchanged went through the first hop (the socks5 one).
    assert traffic["outbound_tx_bytes"] == hop_fwd.bytes_up
    assert traffic["outbound_rx_bytes"] == hop_fwd.bytes_down
    assert hop_fwd.bytes_down > len(payload)  # ciphertext: framing on top of the payload
