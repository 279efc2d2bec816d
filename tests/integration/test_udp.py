"""SOCKS5 UDP ASSOCIATE through the engine: real UDP sockets on loopback."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from spliceway.protocols import socks5
from tests.conftest import base_config, wait_until
from tests.helpers.socks import recv_exact
from tests.helpers.udp import Association, UdpEcho


def completed(engine: Any, n: int) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        events = engine.query("events", {"types": "flow.completed"})["events"]
        return events if len(events) >= n else None

    return [e["payload"]["record"] for e in wait_until(done, what=f"{n} flow.completed")]


@pytest.mark.parametrize("inbound", ["socks-in", "mixed-in"])
def test_round_trips_are_counted_exactly(make_engine, inbound: str) -> None:
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address(inbound)) as assoc:
        wire_up = wire_down = 0
        for n in range(5):
            payload = b"x" * (10 + n)
            wire_up += assoc.send("127.0.0.1", echo.port, payload)
            host, port, back, size = assoc.recv()
            assert (host, port, back) == ("127.0.0.1", echo.port, payload)
            wire_down += size
        (flow,) = engine.query("flows")["active_flows"]
        assert flow["network"] == "udp" and flow["state"] == "active"
        assert flow["inbound"]["tag"] == inbound
    (record,) = completed(engine, 1)  # the association ended with its TCP connection
    payload_bytes = sum(10 + n for n in range(5))
    assert record["network"] == "udp"
    assert (record["target"]["host"], record["target"]["port"]) == ("127.0.0.1", echo.port)
    assert record["result"]["outcome"] == "direct_relayed"
    assert record["traffic"] == {
        "bytes_up": payload_bytes,
        "bytes_down": payload_bytes,
        "inbound_rx_bytes": wire_up,
        "inbound_tx_bytes": wire_down,
        "outbound_rx_bytes": payload_bytes,
        "outbound_tx_bytes": payload_bytes,
        "packets_up": 5,
        "packets_down": 5,
    }
    udp = engine.query("stats")["udp_upstream"]
    assert udp["packets_sent"] == 5 and udp["packets_received"] == 5
    assert udp["created_associations"] == 1 and udp["closed_associations"] == 1
    assert udp["active_associations"] == 0


def test_many_destinations_share_one_association(make_engine) -> None:
    engine = make_engine()
    echoes = [UdpEcho() for _ in range(4)]
    try:
        with Association(engine.listen_address("socks-in")) as assoc:
            for echo in echoes:
                assoc.send("127.0.0.1", echo.port, b"hi")
                assert assoc.recv()[1] == echo.port
            assoc.send("localhost", echoes[0].port, b"by name")
            assert assoc.recv()[:3] == ("localhost", echoes[0].port, b"by name")
            assert len(engine.query("flows")["active_flows"]) == 5
        records = completed(engine, 5)
    finally:
        for echo in echoes:
            echo.close()
    assert {r["target"]["host"] for r in records} == {"127.0.0.1", "localhost"}
    udp = engine.query("stats")["udp_upstream"]
    assert (udp["created_associations"], udp["reused_associations"]) == (1, 4)


def test_a_datagram_from_another_address_is_dropped(make_engine) -> None:
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            stranger.sendto(socks5.build_udp_datagram("127.0.0.1", echo.port, b"x"), assoc.relay)
        assoc.send("127.0.0.1", echo.port, b"mine")
        assert assoc.recv()[2] == b"mine"
        assert echo.received == 1  # the stranger's datagram never left the engine


def test_a_fragment_and_garbage_are_dropped(make_engine) -> None:
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        assoc.udp.sendto(socks5.build_udp_datagram("127.0.0.1", echo.port, b"f", 1), assoc.relay)
        assoc.udp.sendto(b"\x00\x00", assoc.relay)
        assoc.send("127.0.0.1", echo.port, b"ok")
        assert assoc.recv()[2] == b"ok"
        assert echo.received == 1


def test_rules_route_udp_by_network(make_engine) -> None:
    engine = make_engine(base_config(rules=[{"network": "udp", "port": ["9"], "action": "block"}]))
    with Association(engine.listen_address("socks-in")) as assoc:
        assoc.send("127.0.0.1", 9, b"discard")
        (record,) = completed(engine, 1)
    assert record["result"]["outcome"] == "blocked"
    assert record["route"]["matched_rule"]["index"] == 0


def test_an_idle_destination_completes(make_engine) -> None:
    cfg = base_config()
    cfg["runtime"]["udp_upstream_idle_timeout_seconds"] = 1
    engine = make_engine(cfg)
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        assoc.send("127.0.0.1", echo.port, b"once")
        assoc.recv()
        (record,) = completed(engine, 1)
        assert record["result"] == {"outcome": "direct_relayed", "close_reason": "idle_timeout"}
        assert engine.query("stats")["udp_upstream"]["idle_timeouts"] == 1
        # The association itself lives on: a new datagram opens a new flow.
        assoc.send("127.0.0.1", echo.port, b"again")
        assert assoc.recv()[2] == b"again"


def test_flows_close_ends_one_udp_flow(make_engine) -> None:
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        assoc.send("127.0.0.1", echo.port, b"x")
        assoc.recv()
        (flow,) = engine.query("flows")["active_flows"]
        assert engine.execute("flows.close", {"flow_id": flow["flow_id"]})["closed"] is True
        (record,) = completed(engine, 1)
        assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}


def test_socks5_outbound_relays_udp_through_dante(make_engine, tmp_path) -> None:
    from tests.helpers.upstreams import dante

    with dante(tmp_path) as port, UdpEcho() as echo:
        cfg = base_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "hop", "protocol": "socks5", "server": "127.0.0.1", "port": port},
            ],
            route={"final": "hop"},
        )
        engine = make_engine(cfg)
        with Association(engine.listen_address("socks-in")) as assoc:
            for n in range(3):
                assoc.send("127.0.0.1", echo.port, b"via dante %d" % n)
                assert assoc.recv()[:3] == ("127.0.0.1", echo.port, b"via dante %d" % n)
            # The same server by name: dante names its replies by the address, so the
            # name has an upstream association of its own and its replies stay its own.
            assoc.send("localhost", echo.port, b"by name")
            assert assoc.recv()[:3] == ("localhost", echo.port, b"by name")
            assoc.send("127.0.0.1", echo.port, b"by address")
            assert assoc.recv()[:3] == ("127.0.0.1", echo.port, b"by address")
            udp = engine.query("stats")["udp_upstream"]
            assert (udp["active_associations"], udp["created_associations"]) == (2, 2)
            assert (udp["packets_sent"], udp["packets_received"]) == (5, 5)
        records = {r["target"]["host"]: r for r in completed(engine, 2)}
    udp = engine.query("stats")["udp_upstream"]
    assert (udp["active_associations"], udp["closed_associations"]) == (0, 2)
    assert engine.core.udp_datagram_drops()["unmatched_reply"] == 0
    assert records["localhost"]["traffic"]["packets_down"] == 1
    record = records["127.0.0.1"]
    assert record["result"]["outcome"] == "chained_relayed"
    assert record["path"]["outbound"]["tag"] == "hop"
    t = record["traffic"]
    assert (t["packets_up"], t["packets_down"]) == (4, 4)
    assert t["bytes_up"] == t["bytes_down"] == 3 * len(b"via dante 0") + len(b"by address")
    # Each way, the hop's datagrams carry the SOCKS5 header (10 bytes for IPv4).
    assert t["outbound_tx_bytes"] == t["bytes_up"] + 4 * 10
    assert t["outbound_rx_bytes"] == t["bytes_down"] + 4 * 10


@pytest.mark.parametrize("method", ["chacha20-ietf-poly1305", "aes-256-gcm"])
def test_shadowsocks_outbound_relays_udp_through_ss_server(make_engine, method: str) -> None:
    from tests.helpers.upstreams import ss_server

    with ss_server(method, "pw", udp=True) as port, UdpEcho() as echo:
        cfg = base_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {
                    "tag": "ss",
                    "protocol": "shadowsocks",
                    "server": "127.0.0.1",
                    "port": port,
                    "method": method,
                    "password": "pw",
                },
            ],
            route={"final": "ss"},
        )
        engine = make_engine(cfg)
        with Association(engine.listen_address("socks-in")) as assoc:
            for n in range(3):
                assoc.send("127.0.0.1", echo.port, b"sealed %d" % n)
                assert assoc.recv()[:3] == ("127.0.0.1", echo.port, b"sealed %d" % n)
        (record,) = completed(engine, 1)
    assert record["result"]["outcome"] == "chained_relayed"
    t = record["traffic"]
    assert (t["packets_up"], t["packets_down"]) == (3, 3)
    # salt (32) + sealed IPv4 address (7) + payload + tag (16) per packet
    assert t["outbound_tx_bytes"] == t["bytes_up"] + 3 * (32 + 7 + 16)
    assert t["outbound_rx_bytes"] == t["bytes_down"] + 3 * (32 + 7 + 16)


def test_a_datagram_to_a_fake_ip_goes_by_its_domain(make_engine) -> None:
    cfg = base_config(rules=[{"domain": ["echo.test"], "network": "udp", "action": "block"}])
    cfg["runtime"]["dns"] = {"answer": {"type": "fake_ip"}}
    engine = make_engine(cfg)
    fake = engine.core.dns.pool.lookup("echo.test")  # what the engine's DNS server answers
    with Association(engine.listen_address("socks-in")) as assoc:
        assoc.send(fake, 7, b"x")
        (record,) = completed(engine, 1)
    assert record["target"] == {"host": "echo.test", "port": 7, "fake_ip": fake}
    assert record["inbound"] == {
        "tag": "socks-in",
        "protocol": "socks5",
        "client_protocol": "socks5",
    }
    assert record["result"]["outcome"] == "blocked"


def test_an_open_udp_flow_is_sampled_with_live_counts(make_engine) -> None:
    engine = make_engine()  # stats every 200 ms
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        for _ in range(4):
            assoc.send("127.0.0.1", echo.port, b"12345678")
            assoc.recv()

        def updated() -> dict[str, Any] | None:
            events = engine.query("events", {"types": "flow.updated"})["events"]
            return events[-1]["payload"] if events else None

        payload = wait_until(updated, what="a flow.updated of the UDP flow")
        assert payload["network"] == "udp"
        assert (payload["bytes_up"], payload["bytes_down"]) == (32, 32)
        assert payload["record"]["traffic"]["packets_up"] == 4
        (flow,) = engine.query("flows")["active_flows"]
        assert flow["traffic"]["bytes_up"] == 32
        assert engine.query("stats")["bytes_up"] >= 32


def test_an_inbound_without_udp_refuses_udp_associate(make_engine) -> None:
    cfg = base_config()
    for inbound in cfg["inbounds"]:
        inbound["udp"] = False
    engine = make_engine(cfg)
    for tag in ("socks-in", "mixed-in"):
        with pytest.raises(ConnectionError, match="socks reply 7"):
            Association(engine.listen_address(tag))
    assert engine.query("stats")["udp_upstream"]["created_associations"] == 0


def test_a_client_that_declares_port_zero_is_learned_from_its_first_datagram(make_engine):
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address("socks-in"), declare_port=False) as a:
        a.send("127.0.0.1", echo.port, b"first")
        assert a.recv()[2] == b"first"
        # Learned: the same address from another port is a stranger now.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            other.sendto(socks5.build_udp_datagram("127.0.0.1", echo.port, b"x"), a.relay)
        a.send("127.0.0.1", echo.port, b"second")
        assert a.recv()[2] == b"second"
        assert echo.received == 2
        assert engine.core.udp_datagram_drops()["foreign"] == 1


def test_dropped_datagrams_are_counted_by_reason(make_engine) -> None:
    engine = make_engine()
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        assoc.udp.sendto(socks5.build_udp_datagram("127.0.0.1", echo.port, b"f", 1), assoc.relay)
        assoc.udp.sendto(b"\x00\x00", assoc.relay)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            stranger.sendto(socks5.build_udp_datagram("127.0.0.1", echo.port, b"x"), assoc.relay)
        assoc.send("127.0.0.1", echo.port, b"ok")  # after the three, on one socket: in order
        assert assoc.recv()[2] == b"ok"
        drops = engine.core.udp_datagram_drops()
    assert (drops["fragment"], drops["malformed"], drops["foreign"]) == (1, 1, 1)
    assert sum(drops.values()) == 3


def test_a_refused_destination_is_routed_again_after_the_hold(make_engine) -> None:
    cfg = base_config(rules=[{"network": "udp", "action": "block"}])
    cfg["runtime"]["udp_upstream_idle_timeout_seconds"] = 1  # the hold is at most this
    engine = make_engine(cfg)
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        size = assoc.send("127.0.0.1", echo.port, b"blocked")
        (blocked,) = completed(engine, 1)
        assert blocked["result"]["outcome"] == "blocked"
        # What the client sent is counted; nothing left the engine.
        t = blocked["traffic"]
        assert (t["inbound_rx_bytes"], t["packets_up"], t["bytes_up"]) == (size, 0, 0)
        # The rule goes; the destination's datagrams are dropped until the hold ends,
        # then the next one is a new flow, routed by the rules of that moment.
        cfg["rules"] = []
        engine.execute("config.apply_runtime", {"config": cfg})
        assoc.udp.settimeout(0.1)

        def echoed() -> bool:
            assoc.send("127.0.0.1", echo.port, b"again")
            try:
                return assoc.recv()[2] == b"again"
            except TimeoutError:
                return False

        wait_until(echoed, timeout=10, what="the destination routed again")
    records = completed(engine, 2)
    assert [r["result"]["outcome"] for r in records] == ["blocked", "direct_relayed"]
    assert engine.core.udp_datagram_drops()["blocked"] >= 1


def test_a_udp_flow_to_a_fake_ip_is_relayed_to_the_real_address(make_engine) -> None:
    cfg = base_config(rules=[{"domain": ["localhost"], "network": "udp", "outbound": "direct"}])
    cfg["runtime"]["dns"] = {"answer": {"type": "fake_ip"}}
    engine = make_engine(cfg)
    fake = engine.core.dns.pool.lookup("localhost")
    with UdpEcho() as echo, Association(engine.listen_address("socks-in")) as assoc:
        assoc.send(fake, echo.port, b"by name")
        # The reply names the address the client sent to.
        assert assoc.recv()[:3] == (fake, echo.port, b"by name")
    (record,) = completed(engine, 1)
    assert record["target"]["host"] == "localhost"
    assert record["route"]["matched_rule"]["index"] == 0
    assert record["result"]["outcome"] == "direct_relayed"
    assert record["traffic"]["packets_down"] == 1


def test_udp_upstream_failures_are_counted(make_engine) -> None:
    from tests.helpers.upstreams import refused_port

    cfg = base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "hop", "protocol": "socks5", "server": "127.0.0.1", "port": refused_port()},
        ],
        rules=[{"network": "udp", "port": ["7"], "outbound": "hop"}],
    )
    engine = make_engine(cfg)
    with Association(engine.listen_address("socks-in")) as assoc:
        assoc.send("127.0.0.1", 7, b"nobody")
        (record,) = completed(engine, 1)
        assert record["result"]["outcome"] == "failed"
        assert record["result"]["failure"]["code"] == "connect_failed"
        # A broadcast address without SO_BROADCAST: the kernel refuses the send.
        assoc.send("255.255.255.255", 9, b"nowhere")

        def send_failed() -> dict[str, Any] | None:
            udp = engine.query("stats")["udp_upstream"]
            return udp if udp["send_failures"] >= 1 else None

        udp = wait_until(send_failed, what="a counted send failure")
    assert udp["failed_association_attempts"] == 1
    assert udp["created_associations"] == 1  # the C upstream the broadcast went to


def test_a_proxy_upstream_is_reused_then_closed_when_idle(make_engine, tmp_path) -> None:
    from tests.helpers.upstreams import dante

    with dante(tmp_path) as port, UdpEcho() as one, UdpEcho() as two:
        cfg = base_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "hop", "protocol": "socks5", "server": "127.0.0.1", "port": port},
            ],
            route={"final": "hop"},
        )
        cfg["runtime"]["udp_upstream_idle_timeout_seconds"] = 1
        engine = make_engine(cfg)
        with Association(engine.listen_address("socks-in")) as assoc:
            for echo in (one, two):
                assoc.send("127.0.0.1", echo.port, b"x")
                assert assoc.recv()[1] == echo.port
            records = completed(engine, 2)  # both idle: the upstream goes with the last
            assert {r["result"]["close_reason"] for r in records} == {"idle_timeout"}

            def closed() -> dict[str, Any] | None:
                udp = engine.query("stats")["udp_upstream"]
                return udp if udp["closed_associations"] == 1 else None

            udp = wait_until(closed, what="the idle upstream association closed")
    assert (udp["created_associations"], udp["reused_associations"]) == (1, 1)
    assert (udp["idle_timeouts"], udp["active_associations"]) == (1, 0)


def test_an_ipv6_client_relays_to_ipv6_and_ipv4_destinations(make_engine) -> None:
    """A client on ::1 (declared address and port as ATYP 4): told an IPv6 relay address,
    it reaches an IPv6 and an IPv4 echo server through one association, and the
    dual-stack inbound still tells an IPv4 client an IPv4 address (ATYP 1)."""
    cfg = base_config()
    cfg["inbounds"][0]["listen"] = {"address": "::", "port": 0}
    engine = make_engine(cfg)
    port = engine.listen_address("socks-in")[1]
    echo6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    echo6.bind(("::1", 0))
    with echo6, UdpEcho() as echo4:
        udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        udp.bind(("::1", 0))
        udp.settimeout(5)
        with udp, socket.create_connection(("::1", port), timeout=5) as control:
            control.sendall(b"\x05\x01\x00")
            assert recv_exact(control, 2) == b"\x05\x00"
            control.sendall(
                b"\x05\x03\x00\x04"
                + socket.inet_pton(socket.AF_INET6, "::1")
                + udp.getsockname()[1].to_bytes(2, "big")
            )
            head = recv_exact(control, 4)
            assert (head[1], head[3]) == (0, 4)
            relay = (
                socket.inet_ntop(socket.AF_INET6, recv_exact(control, 16)),
                int.from_bytes(recv_exact(control, 2), "big"),
            )
            assert relay[0] == "::1"
            udp.sendto(socks5.build_udp_datagram("::1", echo6.getsockname()[1], b"six"), relay)
            data, peer = echo6.recvfrom(100)
            echo6.sendto(data, peer)
            back = socks5.parse_udp_datagram(udp.recvfrom(100)[0])
            assert (back.host, back.port, back.payload) == ("::1", echo6.getsockname()[1], b"six")
            udp.sendto(socks5.build_udp_datagram("127.0.0.1", echo4.port, b"four"), relay)
            back = socks5.parse_udp_datagram(udp.recvfrom(100)[0])
            assert (back.host, back.port, back.payload) == ("127.0.0.1", echo4.port, b"four")
            # An IPv4 client of the same dual-stack inbound: an IPv4 relay address.
            with Association(("127.0.0.1", port)) as assoc:
                assert assoc.relay[0] == "127.0.0.1"
                assoc.send("127.0.0.1", echo4.port, b"v4 client")
                assert assoc.recv()[2] == b"v4 client"
    records = completed(engine, 3)
    assert sorted(r["source"]["ip"] for r in records) == ["127.0.0.1", "::1", "::1"]
    assert sorted(r["traffic"]["bytes_up"] for r in records) == [3, 4, 9]
