"""IP rules see every spelling of an IP address, and the address a domain resolves to
(issue 26 point 5), end to end on a real engine, on the C path and on the Python path.

With ``ip_cidr: 127.0.0.0/8`` -> block, a client naming 127.0.0.1 as ``2130706433``,
``0x7f.0.0.1``, ``0x7f000001``, ``127.1``, ``0177.0.0.1``, ``127.0.0.1.``, ``0`` or
``::ffff:127.0.0.1`` (a SOCKS5 domain-type address, an HTTP CONNECT authority, an
absolute-URI request) is refused by that rule, never dialled, and its record names the
rule and the canonical target 127.0.0.1. A domain that resolves into 127.0.0.0/8 (through
the engine's resolver: a test DNS server, or ``localhost``) is blocked by the same rule,
and a flow to ``::1`` (by address or by name) still relays byte for byte.

Each case runs on an engine whose route table is installed (C routes what it can) and on
one that never installs it (C defers every flow to the Python path).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spliceway import Engine
from tests.conftest import base_config, wait_until
from tests.helpers.dnsserver import dns_server
from tests.helpers.flows import completed
from tests.helpers.servers import LoopbackServer
from tests.helpers.socks import recv_exact, recv_to_eof
from tests.helpers.spellings import LOOPBACK_SPELLINGS

RULE = {"ip_cidr": ["127.0.0.0/8"], "action": "block"}
MATCHED = {"index": 0, "condition": "ip_cidr=127.0.0.0/8"}
SPELLINGS = LOOPBACK_SPELLINGS
PAYLOAD = bytes(range(256)) * 8  # 2048 bytes, neither TLS nor HTTP
#: How many of SPELLINGS the C path blocks itself, per client kind.
C_BLOCKS = {"socks5": len(SPELLINGS), "connect": len(SPELLINGS) - 1, "forward": 0}


def config(**overrides: Any) -> dict[str, Any]:
    runtime = {"stats_interval_ms": 60_000, **overrides.pop("runtime", {})}
    return base_config(rules=[RULE], runtime=runtime, **overrides)


@pytest.fixture
def engines() -> Iterator[Callable[[dict[str, Any]], dict[str, Engine]]]:
    """Per config: {"c": an engine whose C route table is installed, "py": one whose C
    path defers every flow to Python (its table is never published)}."""
    started: list[Engine] = []

    def _make(cfg: dict[str, Any]) -> dict[str, Engine]:
        out = {}
        for path in ("c", "py"):
            engine = Engine(cfg)
            if path == "py":
                engine._core.routes.publish = lambda: None  # type: ignore[method-assign]
            engine.start()
            started.append(engine)
            out[path] = engine
        return out

    yield _make
    for engine in started:
        engine.stop()
    for engine in started:
        assert not engine._core.flow_actors


class Watch(LoopbackServer):
    """A listener that must never be dialled: it counts what it accepts."""

    def __init__(self, family: int = socket.AF_INET, echo: bool = False) -> None:
        self.accepted = 0
        self.echo = echo
        self._conns: list[socket.socket] = []
        super().__init__(family)

    def handle(self, conn: socket.socket) -> None:
        self.accepted += 1
        self._conns.append(conn)
        if self.echo:
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        super().close()
        self.accepting.join(5)
        for c in self._conns:
            c.close()


@contextlib.contextmanager
def watching(**kw: Any) -> Iterator[Watch]:
    w = Watch(**kw)
    try:
        yield w
    finally:
        w.close()


def socks5(engine: Engine, host: str, port: int) -> tuple[socket.socket, bytes]:
    """A SOCKS5 CONNECT naming ``host`` as a domain (ATYP 3); the socket and the reply."""
    sock = socket.create_connection(engine.listen_address("socks-in"), timeout=10)
    sock.sendall(b"\x05\x01\x00")
    assert recv_exact(sock, 2) == b"\x05\x00"
    name = host.encode()
    sock.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
    return sock, recv_exact(sock, 10)


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(engine: Engine, host: str, port: int) -> tuple[socket.socket, bytes]:
    """An HTTP CONNECT; the socket and the response head."""
    sock = socket.create_connection(engine.listen_address("http-in"), timeout=10)
    where = _authority(host, port)
    sock.sendall(f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += recv_exact(sock, 1)
    return sock, head


def forward(engine: Engine, host: str, port: int) -> bytes:
    """An absolute-URI GET; everything the engine answers."""
    with socket.create_connection(engine.listen_address("http-in"), timeout=10) as sock:
        where = _authority(host, port)
        sock.sendall(
            f"GET http://{where}/x HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode()
        )
        return recv_to_eof(sock)


def blocked_via(kind: str, engine: Engine, host: str, port: int) -> None:
    """One flow to ``host`` through ``kind``, refused as a block rule refuses."""
    if kind == "socks5":
        sock, reply = socks5(engine, host, port)
        with sock:
            assert reply == b"\x05\x02\x00\x01" + bytes(6), (host, reply)  # not allowed
            assert recv_to_eof(sock) == b""
    elif kind == "connect":
        sock, head = connect(engine, host, port)
        with sock:
            assert head.startswith(b"HTTP/1.1 403 "), (host, head)
    else:
        answer = forward(engine, host, port)
        assert answer.startswith(b"HTTP/1.1 403 "), (host, answer[:80])


def _completed_after(engine: Engine, n: int) -> dict[str, Any]:
    """The record of the engine's n-th completed flow (1-based), once it completed."""
    wait_until(lambda: engine.query("stats")["completed_sessions"] >= n, 10, f"{n} flows")
    return completed(engine, n)[-1]["payload"]["record"]


def cstats(engine: Engine) -> dict[str, int]:
    return engine._core.bridge.conn.stats()


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socks5", "connect", "forward"])
def test_every_spelling_of_127_0_0_1_is_blocked_by_its_ip_rule(engines, kind):
    with watching() as target:
        pair = engines(config())
        for path, engine in pair.items():
            for n, spelling in enumerate(SPELLINGS, 1):
                blocked_via(kind, engine, spelling, target.port)
                record = _completed_after(engine, n)
                assert record["result"] == {"outcome": "blocked"}, (path, spelling)
                assert record["route"]["matched_rule"] == MATCHED, (path, spelling)
                assert record["route"]["action"] == "block"
                # Routed, and recorded, as the address it spells.
                assert record["target"]["host"] == "127.0.0.1", (path, spelling)
                assert record["target"]["port"] == target.port
                assert "resolved_ip" not in record["target"]
            assert engine.query("stats")["blocked_sessions"] == len(SPELLINGS)
        # The C engine blocked them itself, but for what its parsers leave to Python (a
        # bracketed IPv4-mapped CONNECT authority; an absolute-URI request it would not
        # forward); the Python engine's C deferred every one.
        c, py = cstats(pair["c"]), cstats(pair["py"])
        assert c["ended"] == C_BLOCKS[kind] and c["deferred"] == len(SPELLINGS) - c["ended"], c
        assert py["deferred"] == len(SPELLINGS) and py["started"] == 0, py
        assert target.accepted == 0


@pytest.mark.parametrize("kind", ["socks5", "connect"])
def test_domains_resolving_into_the_network_are_blocked_and_others_relay(engines, kind):
    zone = {"inside.test": ["127.0.0.1"], "outside.test": ["::1"]}
    with (
        dns_server(zone) as dns,
        watching() as target,
        watching(family=socket.AF_INET6, echo=True) as echo,
    ):
        pair = engines(config(runtime={"dns": {"servers": [dns.udp_url]}}))
        for path, engine in pair.items():
            n = 0
            # Twice each: on the C engine the second flow finds the name in C's cache.
            for host in ("inside.test", "inside.test.", "localhost", "inside.test"):
                blocked_via(kind, engine, host, target.port)
                n += 1
                record = _completed_after(engine, n)
                assert record["result"] == {"outcome": "blocked"}, (path, host)
                assert record["route"]["matched_rule"] == MATCHED, (path, host)
                assert record["target"]["host"] == host.rstrip("."), (path, host)
            for host in ("::1", "outside.test", "0:0:0:0:0:0:0:1"):
                opener = socks5 if kind == "socks5" else connect
                sock, reply = opener(engine, host, echo.port)
                with sock:
                    if kind == "socks5":
                        assert reply[:2] == b"\x05\x00", (path, host, reply)
                    else:
                        assert reply.startswith(b"HTTP/1.1 200 "), (path, host, reply)
                    sock.sendall(PAYLOAD)
                    assert recv_exact(sock, len(PAYLOAD)) == PAYLOAD
                    sock.shutdown(socket.SHUT_WR)
                    assert recv_to_eof(sock) == b""
                n += 1
                record = _completed_after(engine, n)
                assert record["result"] == {"outcome": "direct_relayed"}, (path, host)
                assert record["route"]["matched_rule"] is None
                assert record["target"]["resolved_ip"] == "::1", (path, host)
                assert record["traffic"]["bytes_up"] == len(PAYLOAD)
                assert record["traffic"]["bytes_down"] == len(PAYLOAD)
        assert target.accepted == 0
        assert echo.accepted == 6
        # The C engine blocked inside.test itself from the address its DNS cache held once
        # Python had resolved the name (twice: "inside.test." is the same name), and
        # relayed both ::1 spellings itself; a name it had no address for it deferred.
        c = cstats(pair["c"])
        assert (c["ended"], c["routed"], c["deferred"]) == (2, 2, 3), c


def test_udp_destinations_meet_ip_rules_by_any_spelling_and_by_resolved_address(make_engine):
    """SOCKS5 UDP: a destination spelling 127.0.0.1 otherwise, or a domain resolving into
    127.0.0.0/8, is blocked by the ip_cidr rule; a domain resolving to ::1 relays."""
    from tests.helpers.udp import Association

    zone = {"inside.test": ["127.0.0.1"], "outside.test": ["::1"]}
    with dns_server(zone) as dns, contextlib.ExitStack() as stack:
        echo = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        stack.callback(echo.close)
        echo.bind(("::1", 0))
        echo.settimeout(5)
        engine = make_engine(config(runtime={"dns": {"servers": [dns.udp_url]}}))
        assoc = stack.enter_context(Association(engine.listen_address("socks-in")))
        # Each its own destination, so each its own flow (the port 9 is never reached).
        blocked = ["2130706433", "0x7f.1", "127.0.0.1.", "0", "inside.test"]
        for n, host in enumerate(blocked, 1):
            assoc.send(host, 9, b"never")
            record = _completed_after(engine, n)
            assert record["result"] == {"outcome": "blocked"}, host
            assert record["route"]["matched_rule"] == MATCHED, host
            expected = "inside.test" if host == "inside.test" else "127.0.0.1"
            assert record["target"]["host"] == expected, host
        port = echo.getsockname()[1]
        assoc.send("outside.test", port, b"ping")
        data, peer = echo.recvfrom(100)
        assert data == b"ping"
        echo.sendto(b"pong", peer)
        host, rport, payload, _ = assoc.recv()
        assert (host, rport, payload) == ("outside.test", port, b"pong")

        def routed() -> dict[str, Any] | None:
            for f in engine.query("flows")["active_flows"]:
                if f["target"]["host"] == "outside.test" and f["state"] == "active":
                    return f
            return None

        flow = wait_until(routed, 5, "the outside.test flow routed")
        assert flow["route"]["matched_rule"] is None
        assert flow["target"]["resolved_ip"] == "::1", flow
