"""The C connection path (csrc/conn.c) end to end: real sockets on loopback, the real engine.

Every flow here is run twice when it can be: once on an engine whose route table is
installed (C accepts, routes, dials and hands off; ``conn.stats()`` counts it as
``routed``/``ended``), and once on an engine that never installs a table (C does the
handshake, then defers every flow to the Python path; ``conn.stats()`` counts it as
``deferred``). The flow events of the two runs must be identical field by field except
the flow id, the timestamps and the client's source port: the Python path is the
reference for what the docs/events.md record contract says.
"""

from __future__ import annotations

import contextlib
import copy
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spliceway import ApiError, Engine
from tests.conftest import base_config, engines_started, wait_until
from tests.helpers.dnsserver import dns_server
from tests.helpers.flows import completed, flow_events
from tests.helpers.servers import EchoServer, LoopbackServer, SilentPeer, read_head
from tests.helpers.socks import recv_exact, recv_to_eof
from tests.helpers.upstreams import black_hole, microsocks, refused_port, tinyproxy

#: No stats sampling during a test: throughput stays 0 and no flow.updated interleaves,
#: so the two paths' events can be compared whole.
QUIET = {"stats_interval_ms": 60_000}
PAYLOAD = bytes(range(256)) * 12  # 3072 bytes, neither TLS nor HTTP: sniffing finds nothing
S5_OK = b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"
HTTP_OK = b"HTTP/1.1 200 Connection established\r\n\r\n"
NEVER = {"domain_regex": ["^never\\.invalid$"], "outbound": "direct"}


def config(**overrides: Any) -> dict[str, Any]:
    """base_config without stats sampling (``runtime`` merged, not replaced), whose inbounds
    wait up to 10 s to sniff: a slow client's first bytes are still sniffed, and every
    client here sends first (or its flow is never dialled)."""
    runtime = {**QUIET, **overrides.pop("runtime", {})}
    cfg = base_config(runtime=runtime, **overrides)
    if "inbounds" not in overrides:
        cfg["inbounds"] = [ib | {"sniff_timeout_ms": 10_000} for ib in cfg["inbounds"]]
    return cfg


# -- engines ---------------------------------------------------------------------------


@pytest.fixture
def python_engine() -> Iterator[Callable[[dict[str, Any]], Engine]]:
    """Engines that never install a C route table: C defers every flow after its handshake
    (route_publish: "Until a table is installed C defers every flow to Python")."""

    def never_publish(engine: Engine) -> None:
        engine._core.routes.publish = lambda: None  # type: ignore[method-assign]

    yield from engines_started(never_publish)


def cstats(engine: Engine) -> dict[str, int]:
    """The C connection path's counters."""
    return engine._core.bridge.conn.stats()


def expect_stats(engine: Engine, **expected: int) -> None:
    """Wait until the named C counters have exactly these values (others must be 0)."""
    keys = ("accepted", "deferred", "started", "routed", "ended", "handshake_failed")
    want = {k: expected.get(k, 0) for k in keys}
    want.update(expected)
    wait_until(
        lambda: {k: cstats(engine)[k] for k in want} == want,
        timeout=5,
        what=f"C stats {want}, have {cstats(engine)}",
    )
    assert cstats(engine)["accept_errors"] == 0


def c_routed(n: int = 1, **more: int) -> dict[str, int]:
    """The C counters after ``n`` flows C routed and handed to the relay."""
    return {"accepted": n, "started": n, "routed": n, **more}


def c_ended(n: int = 1, **more: int) -> dict[str, int]:
    """The C counters after ``n`` flows C started and ended itself (blocked, failed, closed)."""
    return {"accepted": n, "started": n, "ended": n, **more}


def py_deferred(n: int = 1, **more: int) -> dict[str, int]:
    """The C counters after ``n`` flows C deferred to Python."""
    return {"accepted": n, "deferred": n, **more}


# -- clients ---------------------------------------------------------------------------


def s5_request(host: str, port: int) -> bytes:
    """A SOCKS5 CONNECT request: IPv4 literals as ATYP 1, names as ATYP 3."""
    try:
        addr = b"\x01" + socket.inet_aton(host)
    except OSError:
        addr = b"\x03" + bytes([len(host)]) + host.encode()
    return b"\x05\x01\x00" + addr + struct.pack("!H", port)


class Tunnel:
    """A raw client connection through an inbound, counting every byte both ways."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        ip, port = self.sock.getsockname()[:2]
        #: The client's end, as the flow record's ``source`` must name it.
        self.source = {"ip": ip, "port": port}
        self.sent = 0
        self.received = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def recv(self, n: int) -> bytes:
        data = recv_exact(self.sock, n)
        self.received += len(data)
        return data

    def recv_head(self) -> bytes:
        """An HTTP response head, byte by byte (nothing past it is consumed)."""
        data = b""
        while not data.endswith(b"\r\n\r\n"):
            data += self.recv(1)
        return data

    def rest(self) -> bytes:
        data = recv_to_eof(self.sock)
        self.received += len(data)
        return data

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def socks5_open(
    address: tuple[str, int], host: str, port: int, auth: tuple[str, str] | None = None
) -> tuple[Tunnel, bytes]:
    """A SOCKS5 CONNECT; returns the tunnel and the 10-byte reply (whatever its code)."""
    t = Tunnel(address)
    if auth:
        t.send(b"\x05\x01\x02")
        assert t.recv(2) == b"\x05\x02"
        user, password = (x.encode() for x in auth)
        t.send(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
        assert t.recv(2) == b"\x01\x00"
    else:
        t.send(b"\x05\x01\x00")
        assert t.recv(2) == b"\x05\x00"
    t.send(s5_request(host, port))
    return t, t.recv(10)


def http_open(address: tuple[str, int], host: str, port: int) -> tuple[Tunnel, bytes]:
    """An HTTP CONNECT; returns the tunnel and the response head."""
    t = Tunnel(address)
    t.send(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return t, t.recv_head()


#: How each case opens its tunnel: (inbound tag, opener, success reply).
OPENERS: dict[str, tuple[str, Callable[..., tuple[Tunnel, bytes]], bytes]] = {
    "socks5": ("socks-in", socks5_open, S5_OK),
    "http": ("http-in", http_open, HTTP_OK),
    "mixed-socks5": ("mixed-in", socks5_open, S5_OK),
    "mixed-http": ("mixed-in", http_open, HTTP_OK),
}


def open_via(engine: Engine, kind: str, host: str, port: int) -> tuple[Tunnel, bytes]:
    tag, opener, _ = OPENERS[kind]
    return opener(engine.listen_address(tag), host, port)


def echo_through(tunnel: Tunnel, payload: bytes = PAYLOAD) -> None:
    """Send ``payload``, read it back, half-close, read the end."""
    tunnel.send(payload)
    assert tunnel.recv(len(payload)) == payload
    tunnel.sock.shutdown(socket.SHUT_WR)
    assert tunnel.rest() == b""


# -- records and events -------------------------------------------------------------------


def lifecycle(engine: Engine, flow_id: str) -> list[dict[str, Any]]:
    """The flow's events in ring order, checked (:func:`checked_lifecycle`)."""
    return checked_lifecycle(flow_events(engine, flow_id))


def checked_lifecycle(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flow's events, checked against the contract: flow.started first, at most one
    flow.routed, exactly one flow.completed, last; sequences and revisions increasing."""
    types = [e["event_type"] for e in events]
    assert types[0] == "flow.started", types
    assert types[-1] == "flow.completed", types
    assert types.count("flow.completed") == 1, types
    assert types.count("flow.started") == 1, types
    assert types.count("flow.routed") <= 1, types
    if "flow.routed" in types:
        assert types.index("flow.routed") < types.index("flow.completed")
    seqs = [e["sequence"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    revisions = [e["payload"]["record"]["revision"] for e in events]
    assert revisions == list(range(1, len(events) + 1)), revisions
    states = {"flow.started": "opening", "flow.routed": "active", "flow.completed": "completed"}
    for e in events:
        payload, record = e["payload"], e["payload"]["record"]
        assert record["state"] == states[e["event_type"]]
        assert payload["flow_id"] == record["flow_id"]
        assert ("result" in record) == (e["event_type"] == "flow.completed")
        if e["event_type"] == "flow.completed":
            assert payload["outcome"] == record["result"]["outcome"]
            assert payload.get("close_reason") == record["result"].get("close_reason")
            assert e["occurred_at_unix_ms"] == record["timing"]["ended_at_unix_ms"]
            for key, value in record["traffic"].items():
                assert payload["traffic"][key] == value, key
        else:
            assert payload["outcome"] is None
            assert payload["timing"]["ended_at_unix_ms"] is None
        if e["event_type"] == "flow.started":
            # When the flow started (C's clock for a C flow), not when Python emitted it.
            assert e["occurred_at_unix_ms"] == record["timing"]["started_at_unix_ms"]
    return events


def _strip(record: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(record)
    record.pop("flow_id")
    record.pop("timing")
    record["source"].pop("port")
    return record


def comparable(event: dict[str, Any], ignore: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
    """An event without flow id, timestamps and source port (and the ``ignore``d traffic
    counters), for comparing two paths."""
    payload = copy.deepcopy(event["payload"])
    payload.pop("flow_id")
    payload.pop("timing")
    payload["record"] = _strip(payload["record"])
    for key in ignore:
        payload["traffic"].pop(key, None)
        payload["record"]["traffic"].pop(key)
    return event["event_type"], payload


def only_flow(engine: Engine) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine's single completed flow: its final record and its checked events."""
    (done,) = completed(engine)
    record = done["payload"]["record"]
    stats = engine.query("stats")
    assert (stats["total_started"], stats["completed_sessions"]) == (1, 1)
    return record, lifecycle(engine, record["flow_id"])


def same_events(
    c_events: list[dict[str, Any]], py_events: list[dict[str, Any]], ignore: tuple[str, ...] = ()
) -> None:
    """The C path's events equal the Python path's, field by field (except the traffic
    counters in ``ignore``, where a known divergence is pinned by an xfail test)."""
    c_side = [comparable(e, ignore) for e in c_events]
    py_side = [comparable(e, ignore) for e in py_events]
    assert [t for t, _ in c_side] == [t for t, _ in py_side]
    for (kind, c_payload), (_, py_payload) in zip(c_side, py_side, strict=True):
        assert c_payload == py_payload, kind


def check_timing(record: dict[str, Any]) -> None:
    timing = record["timing"]
    assert timing["duration_ms"] == timing["ended_at_unix_ms"] - timing["started_at_unix_ms"]
    assert 0 <= timing["duration_ms"] < 10_000


# -- 1 and 2: relayed flows ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socks5", "http", "mixed-socks5", "mixed-http"])
def test_relayed_flow_in_c_equals_the_python_path(make_engine, python_engine, kind):
    inbound_tag, _, success = OPENERS[kind]
    with EchoServer() as server:
        host, port = server.address
        records = {}
        events = {}
        for path, engine in (
            ("c", make_engine(config())),
            ("py", python_engine(config())),
            ("regex", make_engine(config(rules=[NEVER]))),
        ):
            tunnel, _ = open_via(engine, kind, host, port)
            with tunnel:
                echo_through(tunnel)
            records[path], events[path] = only_flow(engine)
            record = records[path]
            assert record["source"] == tunnel.source
            # Exact counters: what the client and the server sent and received, plus
            # the handshake (request and reply) on the inbound side only.
            assert record["traffic"] == {
                "bytes_up": len(PAYLOAD),
                "bytes_down": len(PAYLOAD),
                "inbound_rx_bytes": tunnel.sent,
                "inbound_tx_bytes": tunnel.received,
                "outbound_rx_bytes": len(PAYLOAD),
                "outbound_tx_bytes": len(PAYLOAD),
                "packets_up": None,
                "packets_down": None,
            }
            assert tunnel.received == len(success) + len(PAYLOAD) + (2 if "socks5" in kind else 0)
            check_timing(record)
            if path == "c":
                expect_stats(engine, **c_routed())
            else:
                expect_stats(engine, **py_deferred())
        c = records["c"]
        assert c["state"] == "completed"
        assert c["inbound"] == {
            "tag": inbound_tag,
            "protocol": {"socks-in": "socks5", "http-in": "http", "mixed-in": "mixed"}[inbound_tag],
            # What the client spoke, on a mixed inbound too.
            "client_protocol": "http_connect" if "http" in kind else "socks5",
        }
        assert c["target"] == {"host": host, "port": port, "resolved_ip": "127.0.0.1"}
        assert c["route"] == {
            "mode": "rule",
            "action": "route",
            "target": "direct",
            "matched_rule": None,
            "selection_chain": ["direct"],
        }
        assert c["path"] == {
            "outbound": {"tag": "direct", "protocol": "direct"},
            "remote": {"host": host, "port": port},
            "relay_chain": [],
        }
        assert c["result"] == {"outcome": "direct_relayed"}
        assert [e["event_type"] for e in events["c"]] == [
            "flow.started",
            "flow.routed",
            "flow.completed",
        ]
        same_events(events["c"], events["py"])
        same_events(events["c"], events["regex"])


def test_socks5_inbound_users_in_c_equal_the_python_path(make_engine, python_engine):
    users = [{"username": "alice", "password": "s3cret", "principal_key": "p-alice"}]
    cfg = config(
        inbounds=[{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}, "users": users}]
    )
    with EchoServer() as server:
        events = {}
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = socks5_open(
                engine.listen_address("socks-in"), *server.address, auth=("alice", "s3cret")
            )
            with tunnel:
                assert reply == S5_OK
                echo_through(tunnel)
            record, events[path] = only_flow(engine)
            assert record["traffic"]["inbound_rx_bytes"] == tunnel.sent
            assert record["traffic"]["inbound_tx_bytes"] == tunnel.received
            done = events[path][-1]
            assert done["principal_key"] == "p-alice"
            assert done["payload"]["auth"] == {
                "scheme": "userpass",
                "principal_key": "p-alice",
                "attributes": {},
            }
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
        same_events(events["c"], events["py"])


def client_hello(server_name: str) -> bytes:
    """A real TLS ClientHello naming ``server_name`` (nothing answers it)."""
    ctx = ssl.create_default_context()
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


#: First client bytes and the host sniffing must find in them.
SNIFFED = {
    "tls": (client_hello("www.sniffed.test"), "www.sniffed.test"),
    "http": (b"GET / HTTP/1.1\r\nHost: web.sniffed.test\r\n\r\n", "web.sniffed.test"),
}


@pytest.mark.parametrize("pipelined", [False, True], ids=["after-reply", "pipelined"])
@pytest.mark.parametrize("kind", ["socks5", "http"])
@pytest.mark.parametrize("sniffed", list(SNIFFED))
def test_sniffed_flow_in_c_equals_the_python_path(
    make_engine, python_engine, sniffed, kind, pipelined
):
    """The client's first bytes carry a TLS SNI or an HTTP Host: recorded as sniffed_host.
    Pipelined: the handshake and those bytes come in one write (C forwards them itself)."""
    first, host_name = SNIFFED[sniffed]
    events = {}
    with EchoServer() as server:
        host, port = server.address
        for path, engine in (("c", make_engine(config())), ("py", python_engine(config()))):
            address = engine.listen_address(OPENERS[kind][0])
            if kind == "socks5":
                head = b"\x05\x01\x00" + s5_request(host, port)
                answer = b"\x05\x00" + S5_OK
            else:
                head = f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
                answer = HTTP_OK
            tunnel = Tunnel(address)
            with tunnel:
                if pipelined:
                    tunnel.send(head + first)
                    assert tunnel.recv(len(answer)) == answer
                else:
                    tunnel.send(head)
                    assert tunnel.recv(len(answer)) == answer
                    tunnel.send(first)
                assert tunnel.recv(len(first)) == first
                tunnel.sock.shutdown(socket.SHUT_WR)
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["target"] == {
                "host": host,
                "port": port,
                "resolved_ip": "127.0.0.1",
                "sniffed_host": host_name,
            }
            assert record["traffic"] == {
                "bytes_up": len(first),
                "bytes_down": len(first),
                "inbound_rx_bytes": tunnel.sent,
                "inbound_tx_bytes": tunnel.received,
                "outbound_rx_bytes": len(first),
                "outbound_tx_bytes": len(first),
                "packets_up": None,
                "packets_down": None,
            }
            assert record["result"] == {"outcome": "direct_relayed"}
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


@pytest.mark.parametrize("sniffed", list(SNIFFED))
def test_sniff_before_routing_in_c_blocks_by_the_sniffed_host(make_engine, python_engine, sniffed):
    """A domain rule ranks before the match: C answers success first, sniffs, then routes
    by the sniffed host (here into a block rule), as the Python path does."""
    first, host_name = SNIFFED[sniffed]
    cfg = config(rules=[{"domain_suffix": ["sniffed.test"], "action": "block"}])
    events = {}
    with SilentPeer() as target:
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *target.address)
            with tunnel:
                assert reply == S5_OK  # told success before routing, to sniff
                tunnel.send(first)
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["target"]["sniffed_host"] == host_name
            assert record["result"] == {"outcome": "blocked"}
            assert record["route"]["matched_rule"] == {
                "index": 0,
                "condition": "domain_suffix=sniffed.test",
            }
            # The sniffed bytes were only peeked at, never read or relayed.
            assert record["traffic"] == {
                "bytes_up": 0,
                "bytes_down": 0,
                "inbound_rx_bytes": 3 + 10,
                "inbound_tx_bytes": 2 + 10,
                "outbound_rx_bytes": 0,
                "outbound_tx_bytes": 0,
                "packets_up": None,
                "packets_down": None,
            }
            assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
        assert target.conns == []
    same_events(events["c"], events["py"])


def test_sniffed_then_routed_where_c_cannot_go_is_taken_over_by_the_flow(
    make_engine, python_engine
):
    """C answers, sniffs, and the sniffed host routes to a load_balance group, which picks
    per flow (a table cannot hold it): the flow C started (flow.started already out) carries
    on in Python, to the same record as the Python path's."""
    request = b"GET / HTTP/1.1\r\nHost: web.via-lb.test\r\n\r\n"
    events = {}
    with EchoServer() as server:
        cfg = config(
            outbound_groups=[
                {
                    "tag": "lb",
                    "kind": "load_balance",
                    "outbounds": ["direct"],
                    "strategy": "round_robin",
                }
            ],
            rules=[{"domain_suffix": ["via-lb.test"], "action": "route", "outbound": "lb"}],
        )
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *server.address)
            with tunnel:
                assert reply == S5_OK  # told success before routing, to sniff
                tunnel.send(request)
                assert tunnel.recv(len(request)) == request
                tunnel.sock.shutdown(socket.SHUT_WR)
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["target"]["sniffed_host"] == "web.via-lb.test"
            assert record["route"]["target"] == "lb"
            assert record["route"]["selection_chain"] == ["lb", "direct"]
            assert record["result"] == {"outcome": "direct_relayed"}
            assert record["traffic"]["bytes_up"] == record["traffic"]["bytes_down"] == len(request)
            assert [e["event_type"] for e in events[path]] == [
                "flow.started",
                "flow.routed",
                "flow.completed",
            ]
            # C started the flow, then handed the connection to it (counted as deferred).
            want = {"accepted": 1, "started": 1, "deferred": 1} if path == "c" else py_deferred()
            expect_stats(engine, **want)
    same_events(events["c"], events["py"])


def test_rule_matched_route_in_c_records_the_rule(make_engine, python_engine):
    events = {}
    with EchoServer() as server:
        host, port = server.address
        cfg = config(
            rules=[
                {"port": ["1-10"], "action": "block"},
                {"ip_cidr": ["127.0.0.0/8"], "port": [str(port)], "outbound": "direct"},
            ],
            route={"final": "block"},
        )
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), host, port)
            with tunnel:
                assert reply == S5_OK
                echo_through(tunnel)
            record, events[path] = only_flow(engine)
            assert record["route"] == {
                "mode": "rule",
                "action": "route",
                "target": "direct",
                "matched_rule": {"index": 1, "condition": f"ip_cidr=127.0.0.0/8,port={port}"},
                "selection_chain": ["direct"],
            }
            assert record["result"] == {"outcome": "direct_relayed"}
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


# -- 3: blocked by a rule -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socks5", "http", "mixed-socks5", "mixed-http"])
@pytest.mark.parametrize("rule", ["ip_cidr", "port"])
def test_rule_block_in_c_answers_refusal_and_never_dials(make_engine, python_engine, kind, rule):
    with SilentPeer() as target:
        host, port = target.address
        condition = {"ip_cidr": {"ip_cidr": ["127.0.0.0/8"]}, "port": {"port": [str(port)]}}
        cfg = config(rules=[{**condition[rule], "action": "block"}])
        events = {}
        answers = {}
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = open_via(engine, kind, host, port)
            with tunnel:
                answers[path] = reply + tunnel.rest()
            record, events[path] = only_flow(engine)
            assert record["result"] == {"outcome": "blocked"}
            assert record["route"] == {
                "mode": "rule",
                "action": "block",
                "target": None,
                "matched_rule": {
                    "index": 0,
                    "condition": "ip_cidr=127.0.0.0/8" if rule == "ip_cidr" else f"port={port}",
                },
                "selection_chain": [],
            }
            assert record["path"] == {"outbound": None, "remote": None, "relay_chain": []}
            assert "resolved_ip" not in record["target"]
            assert record["traffic"] == {
                "bytes_up": 0,
                "bytes_down": 0,
                "inbound_rx_bytes": tunnel.sent,
                "inbound_tx_bytes": tunnel.received,
                "outbound_rx_bytes": 0,
                "outbound_tx_bytes": 0,
                "packets_up": None,
                "packets_down": None,
            }
            assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
            assert engine.query("stats")["blocked_sessions"] == 1
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
        if "socks5" in kind:
            assert answers["c"] == b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"
        else:
            assert answers["c"] == (
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 16\r\nConnection: close\r\n\r\n"
                b"blocked by rule\n"
            )
        assert answers["c"] == answers["py"]
        same_events(events["c"], events["py"])
        assert target.conns == []  # neither path dialled


# -- 4: connection refused ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socks5", "http"])
def test_connection_refused_in_c_fails_as_the_python_path(make_engine, python_engine, kind):
    port = refused_port()
    events = {}
    answers = {}
    for path, engine in (("c", make_engine(config())), ("py", python_engine(config()))):
        tunnel, reply = open_via(engine, kind, "127.0.0.1", port)
        with tunnel:
            answers[path] = reply + tunnel.rest()
        record, events[path] = only_flow(engine)
        assert record["result"] == {
            "outcome": "failed",
            "close_reason": "upstream_error",
            "failure": {
                "stage": "connect",
                "code": "connection_refused",
                "message": f"connect to 127.0.0.1:{port} failed: Connection refused",
                "remote": {"host": "127.0.0.1"},
            },
        }
        assert record["path"] == {
            "outbound": {"tag": "direct", "protocol": "direct"},
            "remote": None,
            "relay_chain": [],
        }
        assert record["traffic"]["inbound_rx_bytes"] == tunnel.sent
        assert record["traffic"]["inbound_tx_bytes"] == tunnel.received
        assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
        assert engine.query("stats")["failed_sessions"] == 1
        expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
    if kind == "socks5":
        assert answers["c"] == b"\x05\x05\x00\x01\x00\x00\x00\x00\x00\x00"
    else:
        body = f"connect to 127.0.0.1:{port} failed: Connection refused\n".encode()
        assert answers["c"] == (
            f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: {len(body)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + body
        )
    assert answers["c"] == answers["py"]
    same_events(events["c"], events["py"])


# -- 5: an upstream socks5 outbound ---------------------------------------------------------------


def echoed_on_both(
    make_engine: Callable[..., Engine],
    python_engine: Callable[..., Engine],
    cfg: dict[str, Any],
    kind: str,
    host: str,
    port: int,
    events: dict[str, list[dict[str, Any]]],
) -> Iterator[tuple[str, Engine, dict[str, Any], Tunnel]]:
    """One echoed flow through a C engine, then a Python-path engine, on ``cfg``: yields
    (path, engine, the flow's record, its closed tunnel); ``events[path]`` gets its events."""
    for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
        tunnel, reply = open_via(engine, kind, host, port)
        with tunnel:
            assert reply == OPENERS[kind][2]
            echo_through(tunnel)
        record, events[path] = only_flow(engine)
        yield path, engine, record, tunnel


def upstream_config(port: int, auth: tuple[str, str] | None) -> dict[str, Any]:
    up: dict[str, Any] = {"tag": "up", "protocol": "socks5", "server": "127.0.0.1", "port": port}
    if auth:
        up |= {"username": auth[0], "password": auth[1]}
    return config(outbounds=[{"tag": "direct", "protocol": "direct"}, up], route={"final": "up"})


@pytest.mark.parametrize("kind", ["socks5", "http"])
@pytest.mark.parametrize("auth", [None, ("u1", "p1")], ids=["noauth", "userpass"])
def test_socks5_upstream_in_c_equals_the_python_path(make_engine, python_engine, kind, auth):
    with EchoServer() as server, microsocks(auth) as proxy:
        host, port = server.address
        events = {}
        for path, engine, record, tunnel in echoed_on_both(
            make_engine, python_engine, upstream_config(proxy, auth), kind, host, port, events
        ):
            greeting = 3
            userpass = 3 + len("u1p1") if auth else 0
            request = 10
            method_reply, auth_reply = 2, (2 if auth else 0)
            connect_reply = 10  # microsocks answers with an IPv4 bound address
            assert record["traffic"] == {
                "bytes_up": len(PAYLOAD),
                "bytes_down": len(PAYLOAD),
                "inbound_rx_bytes": tunnel.sent,
                "inbound_tx_bytes": tunnel.received,
                "outbound_rx_bytes": method_reply + auth_reply + connect_reply + len(PAYLOAD),
                "outbound_tx_bytes": greeting + userpass + request + len(PAYLOAD),
                "packets_up": None,
                "packets_down": None,
            }
            assert record["result"] == {"outcome": "chained_relayed"}
            assert record["route"]["selection_chain"] == ["up"]
            assert record["path"] == {
                "outbound": {"tag": "up", "protocol": "socks5"},
                "remote": {"host": "127.0.0.1", "port": proxy},
                "relay_chain": [],
            }
            assert record["target"] == {"host": host, "port": port}
            assert engine.query("stats")["chained_sessions"] == 1
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
        same_events(events["c"], events["py"])


#: Upstream SOCKS5 failures: (microsocks credentials, outbound credentials, target port
#: or None for a refused one, whether the proxy itself refuses connections).
UPSTREAM_FAILURES = {
    "wrong-password": (("u1", "p1"), ("u1", "bad"), "auth_failed"),
    "credentials-required": (("u1", "p1"), None, "auth_failed"),
    "target-refused": (None, None, "connection_refused"),
    "proxy-refused": (None, None, "connection_refused"),
}


@contextlib.contextmanager
def failing_upstream(case: str) -> Iterator[tuple[dict[str, Any], int, dict[str, Any]]]:
    """A config whose socks5 outbound fails as ``case`` says, the target port to ask for,
    and the ``result`` both paths must record."""
    server_auth, our_auth, code = UPSTREAM_FAILURES[case]
    dead = refused_port()
    if case == "proxy-refused":
        message = f"connect to 127.0.0.1:{dead} failed: Connection refused"
        result = {"stage": "connect", "code": code, "message": message}
        yield upstream_config(dead, None), 9, result | {"remote": {"host": "127.0.0.1"}}
        return
    with microsocks(server_auth) as proxy:
        if case == "target-refused":
            message = f"proxy up answered SOCKS5 reply 5 for 127.0.0.1:{dead}"
            remote = {"host": f"127.0.0.1:{proxy}"}
            port = dead
        else:
            what = "rejected the credentials" if our_auth else "requires authentication"
            message = f"proxy up {what}"
            remote = {"host": "127.0.0.1", "port": 9}
            port = 9
        failure = {"stage": "connect", "code": code, "message": message, "remote": remote}
        yield upstream_config(proxy, our_auth), port, failure


def upstream_failure_runs(make_engine, python_engine, kind: str, case: str):
    """Run the failing flow on both paths; the clients' answers and the flows' events."""
    answers: dict[str, bytes] = {}
    events: dict[str, list[dict[str, Any]]] = {}
    with failing_upstream(case) as (cfg, port, failure):
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            tunnel, reply = open_via(engine, kind, "127.0.0.1", port)
            with tunnel:
                answers[path] = reply + tunnel.rest()
            record, events[path] = only_flow(engine)
            assert record["result"] == {
                "outcome": "failed",
                "close_reason": "upstream_error",
                "failure": failure,
            }
            assert record["path"]["outbound"] == {"tag": "up", "protocol": "socks5"}
            assert record["traffic"]["inbound_rx_bytes"] == tunnel.sent
            assert record["traffic"]["inbound_tx_bytes"] == tunnel.received
            assert record["traffic"]["bytes_up"] == record["traffic"]["bytes_down"] == 0
            assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
            assert engine.query("stats")["failed_sessions"] == 1
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
    return answers, events


@pytest.mark.parametrize("kind", ["socks5", "http"])
@pytest.mark.parametrize("case", list(UPSTREAM_FAILURES))
def test_socks5_upstream_failure_in_c_fails_as_the_python_path(
    make_engine, python_engine, kind, case
):
    """The client's answer and every event field equal the Python path's."""
    answers, events = upstream_failure_runs(make_engine, python_engine, kind, case)
    if kind == "socks5":
        code = 5 if case.endswith("refused") else 1
        assert answers["c"] == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]) == answers["py"]
    else:
        message = events["py"][-1]["payload"]["record"]["result"]["failure"]["message"]
        body = f"{message}\n".encode()
        head = f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: {len(body)}\r\n"
        assert answers["py"] == head.encode() + b"Connection: close\r\n\r\n" + body
        assert answers["c"] == answers["py"]
    same_events(events["c"], events["py"])


@pytest.mark.parametrize(
    ("kind", "case"),
    [
        pytest.param(kind, case, id=f"{case}-{kind}")
        for kind in ("socks5", "http")
        for case in UPSTREAM_FAILURES
    ],
)
def test_socks5_upstream_failure_in_c_records_equal_the_python_path(
    make_engine, python_engine, kind, case
):
    answers, events = upstream_failure_runs(make_engine, python_engine, kind, case)
    assert answers["c"] == answers["py"]
    same_events(events["c"], events["py"])


# -- 6: flows.close on flows C holds ------------------------------------------------------------


def sniffing_config(**overrides: Any) -> dict[str, Any]:
    """One socks5 inbound that sniffs for up to 30 s (the client never sends first)."""
    inbound = {"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}
    return config(inbounds=[inbound | {"sniff": True, "sniff_timeout_ms": 30_000}], **overrides)


def the_active_flow(engine: Engine, state: str) -> dict[str, Any]:
    flows = wait_until(
        lambda: [f for f in engine.query("flows")["active_flows"] if f["state"] == state],
        timeout=3,
        what=f"a flow in state {state}",
    )
    assert len(flows) == 1, flows
    return flows[0]


def close_flow(engine: Engine, flow_id: str) -> None:
    assert engine.execute("flows.close", {"flow_id": flow_id}) == {
        "flow_id": flow_id,
        "closed": True,
    }


def assert_closed_again_is_not_found(engine: Engine, flow_id: str) -> None:
    with pytest.raises(ApiError) as info:
        engine.execute("flows.close", {"flow_id": flow_id})
    assert info.value.code == "not_found"


def test_flows_close_while_c_sniffs_after_the_reply(make_engine, python_engine):
    """C dialled, answered success and waits for the client's first bytes to sniff: the flow
    is C's (started, neither routed nor ended) until flows.close ends it."""
    events = {}
    with SilentPeer() as target:
        for n, (path, engine) in enumerate(
            (("c", make_engine(sniffing_config())), ("py", python_engine(sniffing_config()))),
            start=1,
        ):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *target.address)
            with tunnel:
                assert reply == S5_OK
                wait_until(lambda n=n: len(target.conns) == n, timeout=3, what="the dial")
                flow = the_active_flow(engine, "opening")
                if path == "c":
                    expect_stats(engine, accepted=1, started=1)
                close_flow(engine, flow["flow_id"])
                assert tunnel.rest() == b""
                target.conns[-1].settimeout(5)
                assert target.conns[-1].recv(1) == b""  # the upstream was closed too
            record, events[path] = only_flow(engine)
            assert record["flow_id"] == flow["flow_id"]
            assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
            assert events[path][-1]["payload"]["close_reason"] == "manual"
            assert record["traffic"] == {
                "bytes_up": 0,
                "bytes_down": 0,
                "inbound_rx_bytes": 13,
                "inbound_tx_bytes": 12,
                "outbound_rx_bytes": 0,
                "outbound_tx_bytes": 0,
                "packets_up": None,
                "packets_down": None,
            }
            assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
            assert_closed_again_is_not_found(engine, flow["flow_id"])
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


def test_flows_close_on_a_flow_c_relayed(make_engine, python_engine):
    events = {}
    with EchoServer() as server:
        for path, engine in (("c", make_engine(config())), ("py", python_engine(config()))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *server.address)
            with tunnel:
                assert reply == S5_OK
                tunnel.send(b"ping")
                assert tunnel.recv(4) == b"ping"
                flow = the_active_flow(engine, "active")
                close_flow(engine, flow["flow_id"])
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
            assert record["traffic"] == {
                "bytes_up": 4,
                "bytes_down": 4,
                "inbound_rx_bytes": 13 + 4,
                "inbound_tx_bytes": 12 + 4,
                "outbound_rx_bytes": 4,
                "outbound_tx_bytes": 4,
                "packets_up": None,
                "packets_down": None,
            }
            assert [e["event_type"] for e in events[path]] == [
                "flow.started",
                "flow.routed",
                "flow.completed",
            ]
            assert_closed_again_is_not_found(engine, flow["flow_id"])
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


def test_flows_close_while_c_dials(make_engine, python_engine):
    """C started the flow and its connect() is pending (a black hole): flows.close ends it
    cancelled/manual, never dialled, as on the Python path."""
    events = {}
    with black_hole() as hole:
        for path, engine in (("c", make_engine(config())), ("py", python_engine(config()))):
            tunnel = Tunnel(engine.listen_address("socks-in"))
            with tunnel:
                tunnel.send(b"\x05\x01\x00" + s5_request("127.0.0.1", hole))
                assert tunnel.recv(2) == b"\x05\x00"
                flow = the_active_flow(engine, "opening")
                if path == "c":
                    expect_stats(engine, accepted=1, started=1)
                close_flow(engine, flow["flow_id"])
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
            assert record["route"]["target"] == "direct"
            assert record["path"] == {
                "outbound": {"tag": "direct", "protocol": "direct"},
                "remote": None,
                "relay_chain": [],
            }
            assert record["traffic"]["inbound_rx_bytes"] == 13
            assert record["traffic"]["inbound_tx_bytes"] == 2
            assert [e["event_type"] for e in events[path]] == ["flow.started", "flow.completed"]
            assert_closed_again_is_not_found(engine, flow["flow_id"])
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


def test_closed_in_the_upstream_handshake_counts_as_the_python_path(make_engine, python_engine):
    """flows.close while the upstream SOCKS5 proxy has the greeting and stays silent."""
    events = {}
    with SilentPeer() as silent:
        cfg = upstream_config(silent.port, None)
        for n, (path, engine) in enumerate(
            (("c", make_engine(cfg)), ("py", python_engine(cfg))), start=1
        ):
            tunnel = Tunnel(engine.listen_address("socks-in"))
            with tunnel:
                tunnel.send(b"\x05\x01\x00" + s5_request("127.0.0.1", 9))
                assert tunnel.recv(2) == b"\x05\x00"
                wait_until(lambda n=n: len(silent.conns) == n, timeout=3, what="the proxy dial")
                silent.conns[-1].settimeout(5)
                assert recv_exact(silent.conns[-1], 3) == b"\x05\x01\x00"
                flow = the_active_flow(engine, "opening")
                close_flow(engine, flow["flow_id"])
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
            assert record["path"]["outbound"] == {"tag": "up", "protocol": "socks5"}
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])


def test_flows_close_while_c_sniffs_before_routing(make_engine, python_engine):
    cfg = sniffing_config(rules=[{"domain_suffix": ["sniffed.test"], "action": "block"}])
    events = {}
    with SilentPeer() as target:
        for path, engine in (("py", python_engine(cfg)), ("c", make_engine(cfg))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *target.address)
            with tunnel:
                assert reply == S5_OK  # answered before routing, to sniff
                flow = the_active_flow(engine, "opening")
                close_flow(engine, flow["flow_id"])
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
            # Closed before routing: nothing was decided or dialled.
            assert record["route"]["action"] == "pending"
            assert record["path"] == {"outbound": None, "remote": None, "relay_chain": []}
            assert record["traffic"]["inbound_tx_bytes"] == 12  # method selection + reply
        assert target.conns == []  # never dialled: closed while sniffing
    same_events(events["c"], events["py"])


# -- 7: mode.set and policies.select republish the table -----------------------------------------


def run_step(engine: Engine, server: EchoServer, blocked: bool) -> dict[str, Any]:
    """One flow to ``server``: relayed (echo) or refused; returns its record."""
    before = len(engine.query("events", {"types": "flow.completed"})["events"])
    tunnel, reply = socks5_open(engine.listen_address("socks-in"), *server.address)
    with tunnel:
        if blocked:
            assert reply == b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"
            assert tunnel.rest() == b""
        else:
            assert reply == S5_OK
            echo_through(tunnel, b"step")
    done = wait_until(
        lambda: engine.query("events", {"types": "flow.completed"})["events"][before:],
        timeout=5,
        what="the step's flow.completed",
    )
    assert len(done) == 1
    return done[0]["payload"]["record"]


def test_mode_set_and_policies_select_change_the_next_c_flow(make_engine, python_engine):
    with EchoServer() as server, microsocks() as proxy:
        cfg = config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "block", "protocol": "block"},
                {"tag": "up", "protocol": "socks5", "server": "127.0.0.1", "port": proxy},
            ],
            outbound_groups=[{"tag": "pick", "kind": "selector", "outbounds": ["direct", "up"]}],
            route={"final": "pick"},
        )
        direct = {"tag": "direct", "protocol": "direct"}
        up = {"tag": "up", "protocol": "socks5"}
        block = {"tag": "block", "protocol": "block"}
        # (command before the flow, then the flow's route mode, target, chain, outbound, outcome)
        steps: list[tuple[Any, tuple[Any, ...]]] = [
            (None, ("rule", "pick", ["pick", "direct"], direct, "direct_relayed")),
            (
                ("policies.select", {"policy_tag": "pick", "target_tag": "up"}),
                ("rule", "pick", ["pick", "up"], up, "chained_relayed"),
            ),
            (
                ("mode.set", {"mode": "global", "outbound": "direct"}),
                ("global", "direct", ["direct"], direct, "direct_relayed"),
            ),
            (
                ("mode.set", {"mode": "global", "outbound": "block"}),
                ("global", "block", ["block"], block, "blocked"),
            ),
            (
                ("mode.set", {"mode": "direct"}),
                ("direct", "direct", ["direct"], direct, "direct_relayed"),
            ),
            (
                ("mode.set", {"mode": "rule"}),
                ("rule", "pick", ["pick", "up"], up, "chained_relayed"),
            ),
            (
                ("policies.select", {"policy_tag": "pick", "target_tag": "direct"}),
                ("rule", "pick", ["pick", "direct"], direct, "direct_relayed"),
            ),
        ]
        records: dict[str, list[dict[str, Any]]] = {"c": [], "py": []}
        for path, engine in (("c", make_engine(cfg)), ("py", python_engine(cfg))):
            routed = ended = 0
            for command, (mode, target, chain, outbound, outcome) in steps:
                if command is not None:
                    engine.execute(*command)
                record = run_step(engine, server, outcome == "blocked")
                assert record["route"]["mode"] == mode
                assert record["route"]["target"] == target
                assert record["route"]["selection_chain"] == chain
                assert record["route"]["matched_rule"] is None
                assert record["path"]["outbound"] == outbound
                assert record["result"] == {"outcome": outcome}
                records[path].append(record)
                if path == "c":
                    routed += outcome != "blocked"
                    ended += outcome == "blocked"
                    n = routed + ended
                    expect_stats(engine, accepted=n, started=n, routed=routed, ended=ended)
            if path == "py":
                expect_stats(engine, **py_deferred(len(steps)))
        for c_record, py_record in zip(records["c"], records["py"], strict=True):
            assert _strip(c_record) == _strip(py_record)


# -- 8: a name target: deferred on a DNS miss, then routed in C ------------------------------------


def test_a_name_defers_on_a_dns_miss_then_c_routes_it(make_engine):
    with EchoServer() as server, dns_server({"echo.test": ["127.0.0.1"]}) as dns:
        host, port = "echo.test", server.port
        engine = make_engine(config(runtime={"dns": {"servers": [dns.udp_url]}}))
        events = []
        for n in (1, 2):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), host, port)
            with tunnel:
                assert reply == S5_OK
                echo_through(tunnel)
            done = completed(engine, n)[-1]
            record = done["payload"]["record"]
            events.append(lifecycle(engine, record["flow_id"]))
            assert record["target"] == {"host": host, "port": port, "resolved_ip": "127.0.0.1"}
            assert record["path"]["remote"] == {"host": host, "port": port}
            assert record["result"] == {"outcome": "direct_relayed"}
            assert record["traffic"]["inbound_rx_bytes"] == tunnel.sent
            assert record["traffic"]["inbound_tx_bytes"] == tunnel.received
            if n == 1:
                # C had no address for the name: Python resolved it (and told C).
                expect_stats(engine, **py_deferred())
                asked = dns.count(host)
                assert asked >= 1
            else:
                expect_stats(engine, accepted=2, deferred=1, started=1, routed=1)
                assert dns.count(host) == asked  # C dialled from its own cache
        same_events(events[1], events[0])


@pytest.mark.parametrize(
    "case", ["second-answers", "none-answers"], ids=["second-answers", "none-answers"]
)
def test_a_name_with_several_addresses_is_tried_in_order_as_python_does(make_engine, case):
    """C keeps every address of an answer and tries them in order within one deadline, as
    open_tcp does: the first refuses; the second accepts, or refuses too (the last error)."""
    with EchoServer() as server:
        port = server.port if case == "second-answers" else refused_port()
        # The echo server listens on 127.0.0.1 only: 127.0.0.2 and 127.0.0.3 refuse.
        second = "127.0.0.1" if case == "second-answers" else "127.0.0.3"
        with dns_server({"two.test": ["127.0.0.2", second]}) as dns:
            engine = make_engine(config(runtime={"dns": {"servers": [dns.udp_url]}}))
            events = []
            for n in (1, 2):
                tunnel, reply = socks5_open(engine.listen_address("socks-in"), "two.test", port)
                with tunnel:
                    if case == "second-answers":
                        assert reply == S5_OK
                        echo_through(tunnel)
                    else:
                        assert reply == b"\x05\x05\x00\x01\x00\x00\x00\x00\x00\x00"
                        assert tunnel.rest() == b""
                record = completed(engine, n)[-1]["payload"]["record"]
                events.append(lifecycle(engine, record["flow_id"]))
                if case == "second-answers":
                    assert record["target"]["resolved_ip"] == "127.0.0.1"
                    assert record["result"] == {"outcome": "direct_relayed"}
                else:
                    assert record["result"]["failure"] == {
                        "stage": "connect",
                        "code": "connection_refused",
                        "message": f"connect to two.test:{port} failed: Connection refused",
                        "remote": {"host": "two.test"},
                    }
                if n == 1:
                    expect_stats(engine, **py_deferred())  # the DNS miss: Python resolved it
                elif case == "second-answers":
                    expect_stats(engine, accepted=2, deferred=1, started=1, routed=1)
                else:
                    expect_stats(engine, accepted=2, deferred=1, started=1, ended=1)
            same_events(events[1], events[0])


# -- 9: engine stop with flows in every state C holds -------------------------------------------


def test_engine_stop_completes_every_flow_c_holds_exactly_once(make_engine, python_engine):
    """Dialling, in the upstream SOCKS5 handshake, sniffing after the reply, relayed (and
    one still in its handshake, which has no flow): each started flow completes once."""
    summaries: dict[str, dict[int, tuple[str, dict[str, Any]]]] = {}
    events: dict[str, dict[int, list[dict[str, Any]]]] = {}
    # A target port only a rule uses: it sends the flow to "silent", a socks5 "proxy"
    # that accepts and never answers.
    via_silent = refused_port()
    with black_hole() as hole, EchoServer() as echo, SilentPeer() as quiet, SilentPeer() as silent:
        cfg = sniffing_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "silent", "protocol": "socks5", "server": "127.0.0.1", "port": silent.port},
            ],
            rules=[{"port": [str(via_silent)], "outbound": "silent"}],
        )
        for n, (path, engine) in enumerate(
            (("c", make_engine(cfg)), ("py", python_engine(cfg))), start=1
        ):
            address = engine.listen_address("socks-in")
            clients = []
            # Dialling: the connect to the black hole never completes.
            t = Tunnel(address)
            t.send(b"\x05\x01\x00" + s5_request("127.0.0.1", hole))
            clients.append(t)
            # In the upstream handshake: the proxy took the greeting and stays silent.
            t = Tunnel(address)
            t.send(b"\x05\x01\x00" + s5_request("127.0.0.1", via_silent))
            clients.append(t)
            wait_until(lambda n=n: len(silent.conns) == n, timeout=3, what="the proxy dial")
            silent.conns[-1].settimeout(5)
            assert recv_exact(silent.conns[-1], 3) == b"\x05\x01\x00"
            # Sniffing after the reply: the client never sends a byte.
            t, reply = socks5_open(address, *quiet.address)
            assert reply == S5_OK
            clients.append(t)
            wait_until(lambda n=n: len(quiet.conns) == n, timeout=3, what="the quiet dial")
            # Relayed.
            t, reply = socks5_open(address, *echo.address)
            assert reply == S5_OK
            t.send(b"ping")
            assert t.recv(4) == b"ping"
            clients.append(t)
            # Still in the handshake: half a greeting, no flow.
            t = Tunnel(address)
            t.send(b"\x05\x01")
            clients.append(t)
            wait_until(
                lambda engine=engine: (
                    len(engine.query("flows")["active_flows"]) == 4
                    and sum(f["state"] == "active" for f in engine.query("flows")["active_flows"])
                    == 1
                ),
                timeout=3,
                what="four open flows, one relayed",
            )
            if path == "c":
                expect_stats(engine, accepted=5, started=4, routed=1)
            else:
                expect_stats(engine, accepted=5, deferred=4)
            types = ["flow.started", "flow.routed", "flow.completed", "engine.stopped"]
            sub = engine.subscribe(types, since=0, timeout=10)
            engine.stop()
            seen = list(sub)
            assert seen[-1]["event_type"] == "engine.stopped"
            done = [e for e in seen if e["event_type"] == "flow.completed"]
            assert len(done) == 4
            assert len({e["payload"]["flow_id"] for e in done}) == 4
            summaries[path] = {}
            events[path] = {}
            for e in done:
                record = e["payload"]["record"]
                port = record["target"]["port"]
                summaries[path][port] = (record["result"]["outcome"], record["traffic"])
                events[path][port] = checked_lifecycle(
                    [x for x in seen[:-1] if x["payload"]["flow_id"] == record["flow_id"]]
                )
            if path == "c":
                assert cstats(engine)["ended"] == 3
            # Every client is closed; the two flows stopped before the reply got none.
            rests = []
            for t in clients:
                rests.append(t.rest())
                t.close()
            assert rests == [b"\x05\x00", b"\x05\x00", b"", b"", b""]

    def traffic(rx: int, tx: int, up: int = 0) -> dict[str, Any]:
        return {
            "bytes_up": up,
            "bytes_down": up,
            "inbound_rx_bytes": rx + up,
            "inbound_tx_bytes": tx + up,
            "outbound_rx_bytes": up,
            "outbound_tx_bytes": up,
            "packets_up": None,
            "packets_down": None,
        }

    for path in ("c", "py"):
        got = summaries[path]
        # Stopped before the upstream connection existed: cancelled; dialled (sniffing
        # after the reply) or relayed: relayed (docs/events.md, outcome cancelled).
        assert got[hole] == ("cancelled", traffic(13, 2))
        assert got[quiet.port] == ("direct_relayed", traffic(13, 12))
        assert got[echo.port] == ("direct_relayed", traffic(13, 12, up=4))
        # In the upstream handshake: cancelled too. Its outbound_tx_bytes (the greeting C
        # sent) is the divergence test_closed_in_the_upstream_handshake_... pins down.
        outcome, proxy_traffic = got[via_silent]
        assert outcome == "cancelled"
        if path == "py":
            assert proxy_traffic == traffic(13, 2)
        else:
            assert proxy_traffic | {"outbound_tx_bytes": 0} == traffic(13, 2)
        for port, flow_events_ in events[path].items():
            types = [e["event_type"] for e in flow_events_]
            relayed = port == echo.port
            assert types == ["flow.started"] + ["flow.routed"] * relayed + ["flow.completed"]
    for port in (hole, quiet.port, echo.port):
        same_events(events["c"][port], events["py"][port])
    same_events(events["c"][via_silent], events["py"][via_silent], ("outbound_tx_bytes",))


def test_engine_stop_while_c_sniffs_before_routing_completes_the_flow(make_engine, python_engine):
    cfg = sniffing_config(rules=[{"domain_suffix": ["sniffed.test"], "action": "block"}])
    with SilentPeer() as target:
        for path, engine in (("py", python_engine(cfg)), ("c", make_engine(cfg))):
            tunnel, reply = socks5_open(engine.listen_address("socks-in"), *target.address)
            with tunnel:
                assert reply == S5_OK
                # C started the flow before sniffing: it is the flow's owner while it sniffs.
                expect_stats(
                    engine, accepted=1, deferred=int(path == "py"), started=int(path == "c")
                )
                sub = engine.subscribe(["flow.completed", "engine.stopped"], since=0, timeout=10)
                engine.stop()
                seen = list(sub)
                assert tunnel.rest() == b""
            assert [e["event_type"] for e in seen] == ["flow.completed", "engine.stopped"], path
            record = seen[0]["payload"]["record"]
            assert record["result"] == {"outcome": "cancelled"}
            assert record["route"]["action"] == "pending"


# -- 10: a handshake that never completes ----------------------------------------------------------


def test_unfinished_handshakes_are_dropped_after_the_timeout_without_a_record(
    make_engine, monkeypatch
):
    """HANDSHAKE_TIMEOUT (10 s) is no configuration setting: the listener hands C the
    module constant, lowered here so the test stays short."""
    import spliceway.actors.listener as listener

    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 0.5)
    engine = make_engine(config())
    cases = [
        ("socks-in", b"", b""),  # connected, silent
        ("socks-in", b"\x05\x01", b""),  # half a greeting
        ("socks-in", b"\x05\x01\x00\x05\x01\x00\x01\x7f", b"\x05\x00"),  # half a request
        ("http-in", b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n", b""),
        ("mixed-in", b"CONN", b""),
    ]
    started = time.monotonic()
    clients = []
    for tag, data, _ in cases:
        sock = socket.create_connection(engine.listen_address(tag), timeout=10)
        sock.sendall(data)
        clients.append(sock)
    expect_stats(engine, accepted=len(cases))
    for sock, (tag, _, answer) in zip(clients, cases, strict=True):
        with sock:
            assert recv_to_eof(sock) == answer, tag
    elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 5, elapsed
    expect_stats(engine, accepted=len(cases), handshake_failed=len(cases))
    assert flow_events(engine) == []
    assert engine.query("flows") == {"active_flows": []}
    assert engine.query("stats")["total_started"] == 0


# -- upstream http proxies ------------------------------------------------------------------------


def http_upstream_config(port: int, auth: tuple[str, str] | None = None) -> dict[str, Any]:
    up: dict[str, Any] = {"tag": "hp", "protocol": "http", "server": "127.0.0.1", "port": port}
    if auth:
        up |= {"username": auth[0], "password": auth[1]}
    return config(outbounds=[{"tag": "direct", "protocol": "direct"}, up], route={"final": "hp"})


class ScriptedProxy(LoopbackServer):
    """An HTTP proxy that reads a CONNECT head, sends ``answer`` as is, then echoes what the
    client sends (``echo``) or closes."""

    def __init__(self, answer: bytes, echo: bool = False) -> None:
        self.answer = answer
        self.echo = echo
        self.requests: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(10)
            head = read_head(conn)
            if b"\r\n\r\n" not in head:
                return
            self.requests.append(head)
            conn.sendall(self.answer)
            while self.echo and (data := conn.recv(65536)):
                conn.sendall(data)


@pytest.mark.parametrize("kind", ["socks5", "http"])
@pytest.mark.parametrize("auth", [None, ("u1", "p1")], ids=["noauth", "basic"])
def test_http_upstream_in_c_equals_the_python_path(
    make_engine, python_engine, tmp_path, kind, auth
):
    """CONNECT through tinyproxy (with and without Basic auth), routed and dialled in C."""
    with EchoServer() as server, tinyproxy(tmp_path, auth) as proxy:
        host, port = server.address
        events = {}
        cfg = http_upstream_config(proxy, auth)
        for path, engine, record, _ in echoed_on_both(
            make_engine, python_engine, cfg, kind, host, port, events
        ):
            assert record["result"] == {"outcome": "chained_relayed"}
            assert record["path"]["outbound"] == {"tag": "hp", "protocol": "http"}
            assert record["path"]["remote"] == {"host": "127.0.0.1", "port": proxy}
            assert record["traffic"]["bytes_up"] == record["traffic"]["bytes_down"] == len(PAYLOAD)
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
        same_events(events["c"], events["py"])


HTTP_ANSWERS = {
    # answer, expected failure code, message after "proxy hp", member of the record's remote
    "rejected-407": (
        b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n",
        "upstream_rejected",
        " answered 407 to CONNECT 127.0.0.1:{port}",
    ),
    "not-http": (b"SSH-2.0-OpenSSH\r\n\r\n", "protocol_error", ": not an HTTP response"),
    "bad-version": (b"HTTP/2.0 200 OK\r\n\r\n", "protocol_error", None),
    "bad-header": (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", "protocol_error", None),
    "bare-cr": (b"HTTP/1.1 200 OK\r\nX: a\rb\r\n\r\n", "protocol_error", None),
    "closed": (b"HTTP/1.1 200", "protocol_error", None),
    # A message longer than any fixed buffer: the version is quoted in it.
    "long-version": (b"HTTP/1." + b"\x01" * 3000 + b" 200 OK\r\n\r\n", "protocol_error", None),
}


@pytest.mark.parametrize("kind", ["socks5", "http"])
@pytest.mark.parametrize("case", list(HTTP_ANSWERS))
def test_http_upstream_failure_in_c_equals_the_python_path(make_engine, python_engine, kind, case):
    """A refusing or broken http proxy: C fails the flow with the Python outbound's failure
    (code, exact message, the client's reply bytes, member health aside)."""
    answer, code, tail = HTTP_ANSWERS[case]
    answers: dict[str, bytes] = {}
    events: dict[str, list[dict[str, Any]]] = {}
    with EchoServer() as server, ScriptedProxy(answer) as proxy:
        host, port = server.address
        for path, engine in (
            ("c", make_engine(http_upstream_config(proxy.port))),
            ("py", python_engine(http_upstream_config(proxy.port))),
        ):
            tunnel, reply = open_via(engine, kind, host, port)
            with tunnel:
                answers[path] = reply + tunnel.rest()
            record, events[path] = only_flow(engine)
            failure = record["result"]["failure"]
            assert record["result"]["outcome"] == "failed"
            assert failure["code"] == code
            if tail is not None:
                assert failure["message"] == "proxy hp" + tail.format(port=port)
            expect_stats(engine, **(c_ended() if path == "c" else py_deferred()))
        assert answers["c"] == answers["py"]
        assert len(proxy.requests) == 2 and proxy.requests[0] == proxy.requests[1]
    same_events(events["c"], events["py"])


def test_http_upstream_bytes_past_the_head_reach_the_client(make_engine, python_engine):
    """The proxy's first target bytes come with its 200: C hands them to the client before
    relaying (bytes_down, inbound_tx_bytes), as the Python path sends its dial's leftover."""
    answer = b"HTTP/1.1 200 Connection established\r\n\r\nHELLO"
    events = {}
    with ScriptedProxy(answer, echo=True) as proxy:
        for path, engine in (
            ("c", make_engine(http_upstream_config(proxy.port))),
            ("py", python_engine(http_upstream_config(proxy.port))),
        ):
            tunnel, reply = open_via(engine, "socks5", "127.0.0.1", 9)
            with tunnel:
                assert reply == S5_OK
                # First bytes from the client: the engine sniffs before the hand-off.
                tunnel.send(PAYLOAD)
                assert tunnel.recv(5 + len(PAYLOAD)) == b"HELLO" + PAYLOAD
                tunnel.sock.shutdown(socket.SHUT_WR)
                assert tunnel.rest() == b""
            record, events[path] = only_flow(engine)
            assert record["traffic"]["bytes_down"] == 5 + len(PAYLOAD)
            assert record["traffic"]["outbound_rx_bytes"] == len(answer) + len(PAYLOAD)
            expect_stats(engine, **(c_routed() if path == "c" else py_deferred()))
    same_events(events["c"], events["py"])
