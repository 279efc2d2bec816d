"""The C UDP datagram relay (csrc/udp.c) through spliceway.native.udp, with real UDP
sockets on loopback: a SOCKS5 UDP client, the association socket C relays for, upstream
sockets Python hands over, and echo servers behind them."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from spliceway.events.catalogue import UDP_COUNTERS
from spliceway.native.relay import RelayError
from spliceway.native.udp import (
    UDP_UPSTREAM_FIELDS,
    Action,
    AssocEnded,
    Datagram,
    DestEnded,
    End,
    NewDest,
    UdpCounters,
    UdpRecord,
    UdpRelay,
    UpstreamEnded,
)
from spliceway.protocols import socks5
from tests.conftest import wait_until

LOOP = "127.0.0.1"


def open_fds() -> set[str]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(f"{name}:{os.readlink(f'/proc/self/fd/{name}')}")
    return out


class Echo:
    """UDP echo servers on one thread (select over all of them)."""

    def __init__(self, count: int = 1, family: int = socket.AF_INET) -> None:
        host = LOOP if family == socket.AF_INET else "::1"
        self.socks = []
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_DGRAM)
            s.bind((host, 0))
            self.socks.append(s)
        self.received = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def addrs(self) -> list[tuple[str, int]]:
        return [s.getsockname()[:2] for s in self.socks]

    def _run(self) -> None:
        while not self._stop:
            ready, _, _ = select.select(self.socks, [], [], 0.05)
            for s in ready:
                with contextlib.suppress(OSError):
                    data, addr = s.recvfrom(65535)
                    self.received += 1
                    s.sendto(data, addr)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        for s in self.socks:
            s.close()


@dataclass
class Env:
    """A relay, its records so far, and everything a test opened."""

    relay: UdpRelay
    records: list[UdpRecord] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)

    def pump(self) -> None:
        self.records.extend(self.relay.drain())

    def wait_for(self, pred: Callable[[UdpRecord], bool], count: int = 1, timeout: float = 3):
        """The first ``count`` records matching ``pred`` (drained while waiting)."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            found = [r for r in self.records if pred(r)]
            if len(found) >= count:
                return found[:count]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"wanted {count}, have {found}; all: {self.records}")
            select.select([self.relay.fileno()], [], [], min(left, 0.05))

    def of(self, kind: type) -> list:
        self.pump()
        return [r for r in self.records if isinstance(r, kind)]

    def udp(self, family: int = socket.AF_INET, host: str = LOOP) -> socket.socket:
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.bind((host, 0))
        s.settimeout(3)
        self.sockets.append(s)
        return s

    def association(
        self,
        client: socket.socket,
        *,
        client_ip: str | None = LOOP,
        client_port: int | None = None,
        idle: float | None = 5,
        bind: str = LOOP,
    ) -> tuple[int, tuple[str, int]]:
        """An association for ``client`` (its port declared unless told otherwise)."""
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        srv = socket.socket(family, socket.SOCK_DGRAM)
        srv.bind((bind, 0))
        addr = srv.getsockname()[:2]
        port = client.getsockname()[1] if client_port is None else client_port
        assoc = self.relay.add_association(srv.detach(), client_ip, port, idle)
        return assoc, addr

    def upstream(
        self, assoc: int, family: int = socket.AF_INET, idle: float | None = None
    ) -> tuple[int, tuple[str, int]]:
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.bind((LOOP if family == socket.AF_INET else "::", 0))
        addr = s.getsockname()[:2]
        return self.relay.add_upstream(assoc, s.detach(), idle), addr


@pytest.fixture
def env() -> Iterator[Env]:
    before = open_fds()
    e = Env(UdpRelay())
    yield e
    e.relay.close()
    for s in e.sockets:
        s.close()
    del e
    after = open_fds()
    # Only what this test opened and C was given: every socket must be closed.
    assert {f for f in after - before if "socket:" in f} == set()


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.close()


def dgram(host: str, port: int, payload: bytes, frag: int = 0) -> bytes:
    return socks5.build_udp_datagram(host, port, payload, frag)


def new_dest(e: Env, n: int = 1) -> list[NewDest]:
    return e.wait_for(lambda r: isinstance(r, NewDest), n)


def recv(sock: socket.socket) -> socks5.UdpDatagram:
    return socks5.parse_udp_datagram(sock.recv(65535))


def direct_round_trip(e: Env, echo: Echo) -> tuple[socket.socket, int, int, int]:
    """Client -> NEW_DEST -> DIRECT to the echo server; returns (client, assoc, dest, up)."""
    client = e.udp()
    assoc, relay_addr = e.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"first"), relay_addr)
    (nd,) = new_dest(e)
    up, _ = e.upstream(assoc)
    assert e.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client) == (0, host, port, b"first")
    client.connect(relay_addr)
    return client, assoc, nd.dest, up


# -- round trips ---------------------------------------------------------------------


def test_echo_round_trip_direct(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"ping"), relay_addr)
    (nd,) = new_dest(env)
    assert (nd.assoc, nd.dest, nd.host, nd.port, nd.atyp) == (assoc, 1, host, port, 1)
    assert (nd.client_ip, nd.client_port) == client.getsockname()
    up, _ = env.upstream(assoc)
    assert env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client) == (0, host, port, b"ping")  # the held datagram went on
    for i in range(20):
        client.sendto(dgram(host, port, b"x" * i), relay_addr)
        assert recv(client) == (0, host, port, b"x" * i)
    c = env.relay.dest_counters(assoc, nd.dest)
    assert c is not None
    assert c.client_rx_packets == c.upstream_tx_packets == 21
    assert c.upstream_rx_packets == c.client_tx_packets == 21
    assert c.bytes_up == c.bytes_down == 4 + sum(range(20))


def test_domain_destination_keeps_its_name(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram("echo.example", port, b"q"), relay_addr)
    (nd,) = new_dest(env)
    assert (nd.host, nd.atyp) == ("echo.example", 3)
    up, _ = env.upstream(assoc)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    # The reply says it came from the name the client sent to.
    assert recv(client) == (0, "echo.example", port, b"q")


def test_many_destinations_one_association(env: Env) -> None:
    servers = Echo(24)
    try:
        client = env.udp()
        assoc, relay_addr = env.association(client)
        up, _ = env.upstream(assoc)
        for i, (host, port) in enumerate(servers.addrs):
            client.sendto(dgram(host, port, b"d%d" % i), relay_addr)
        news = new_dest(env, len(servers.addrs))
        assert sorted(n.dest for n in news) == list(range(1, 25))
        for n in news:
            env.relay.set_direct(assoc, n.dest, up, n.host, n.port)
        got = {recv(client) for _ in servers.addrs}
        want = {(0, h, p, b"d%d" % i) for i, (h, p) in enumerate(servers.addrs)}
        assert got == want
        live = env.relay.association_dests(assoc)
        assert live is not None and sorted(live) == list(range(1, 25))
        assert all(c.client_tx_packets == 1 for c in live.values())
        # Again: the destinations are known now, no new records.
        for i, (host, port) in enumerate(servers.addrs):
            client.sendto(dgram(host, port, b"again%d" % i), relay_addr)
        got = {recv(client) for _ in servers.addrs}
        assert got == {(0, h, p, b"again%d" % i) for i, (h, p) in enumerate(servers.addrs)}
        assert len(env.of(NewDest)) == 24
        st = env.relay.stats()
        assert (st.created_associations, st.reused_associations) == (1, 23)
        assert st.packets_sent == st.packets_received == 48
    finally:
        servers.close()


def test_ipv6_client_and_upstream(env: Env) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    servers = Echo(1, socket.AF_INET6)
    try:
        client = env.udp(socket.AF_INET6, "::1")
        assoc, relay_addr = env.association(client, client_ip="::1", bind="::1")
        host, port = servers.addrs[0]
        client.sendto(dgram(host, port, b"six"), relay_addr)
        (nd,) = new_dest(env)
        assert (nd.host, nd.atyp, nd.client_ip) == ("::1", 4, "::1")
        up, _ = env.upstream(assoc, socket.AF_INET6)
        env.relay.set_direct(assoc, nd.dest, up, host, port)
        assert recv(client) == (0, "::1", port, b"six")
    finally:
        servers.close()


def test_ipv4_destination_over_a_dual_stack_upstream(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"mapped"), relay_addr)
    (nd,) = new_dest(env)
    up, _ = env.upstream(assoc, socket.AF_INET6)  # bound to ::, v6only off
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client) == (0, host, port, b"mapped")


# -- what is refused -----------------------------------------------------------------


def test_foreign_source_dropped(env: Env, echo: Echo) -> None:
    client, assoc, dest, _ = direct_round_trip(env, echo)
    relay_addr = client.getpeername()
    stranger = env.udp()
    host, port = echo.addrs[0]
    for _ in range(3):
        stranger.sendto(dgram(host, port, b"intruder"), relay_addr)
    client.send(dgram(host, port, b"mine"))
    assert recv(client).payload == b"mine"
    assert env.relay.association_counters(assoc)[1].dropped_foreign == 3
    assert env.relay.stats().dropped_foreign == 3
    stranger.settimeout(0.2)
    with pytest.raises(TimeoutError):
        stranger.recv(100)
    assert env.relay.dest_counters(assoc, dest).client_rx_packets == 2


def test_learns_the_port_from_the_first_datagram(env: Env, echo: Echo) -> None:
    first, second = env.udp(), env.udp()
    assoc, relay_addr = env.association(first, client_port=0)
    host, port = echo.addrs[0]
    first.sendto(dgram(host, port, b"1"), relay_addr)
    (nd,) = new_dest(env)
    assert nd.client_port == first.getsockname()[1]
    second.sendto(dgram(host, port, b"2"), relay_addr)  # same IP, another port
    up, _ = env.upstream(assoc)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(first).payload == b"1"
    first.sendto(dgram(host, port, b"3"), relay_addr)
    assert recv(first).payload == b"3"
    assert env.relay.association_counters(assoc)[1].dropped_foreign == 1


def test_any_address_learned(env: Env, echo: Echo) -> None:
    client = env.udp()
    _, relay_addr = env.association(client, client_ip=None, client_port=0)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"hi"), relay_addr)
    (nd,) = new_dest(env)
    assert (nd.client_ip, nd.client_port) == client.getsockname()


def test_declared_port_other_than_the_sender_is_foreign(env: Env, echo: Echo) -> None:
    client, other = env.udp(), env.udp()
    assoc, relay_addr = env.association(client, client_port=other.getsockname()[1])
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"wrong port"), relay_addr)
    other.sendto(dgram(host, port, b"right port"), relay_addr)
    (nd,) = new_dest(env)
    assert nd.client_port == other.getsockname()[1]
    assert env.relay.association_counters(assoc)[1].dropped_foreign == 1


def test_fragments_and_malformed_headers_dropped(env: Env, echo: Echo) -> None:
    client, assoc, _, _ = direct_round_trip(env, echo)
    host, port = echo.addrs[0]
    for frag in (1, 0x80, 0xFF):
        client.send(dgram(host, port, b"part", frag))
    for bad in (b"", b"\0\0", b"\0\0\0\x05", b"\0\0\0\x03\x00\0\0", b"\0\0\0\x01\x7f\0"):
        client.send(bad)
    client.send(dgram(host, port, b"whole"))
    assert recv(client).payload == b"whole"
    drops = env.relay.association_counters(assoc)[1]
    assert (drops.dropped_fragment, drops.dropped_malformed) == (3, 5)
    assert len(env.of(NewDest)) == 1
    assert echo.received == 2


def test_unsolicited_upstream_datagram_dropped(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"a"), relay_addr)
    (nd,) = new_dest(env)
    up, up_addr = env.upstream(assoc)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client).payload == b"a"
    peer = env.udp()
    peer.sendto(b"let me in", up_addr)
    time.sleep(0.1)
    client.settimeout(0.2)
    with pytest.raises(TimeoutError):
        client.recv(100)
    st = env.relay.stats()
    assert (st.dropped_unsolicited, st.packets_received, st.packets_sent) == (1, 1, 1)
    env.relay.close_association(assoc)
    (ended,) = env.wait_for(lambda r: isinstance(r, UpstreamEnded))
    assert ended.drops.dropped_unsolicited == 1
    assert ended.counters.upstream_rx_packets == 2  # the reply and the stranger


# -- verdicts ------------------------------------------------------------------------


def test_drop_verdict_counts(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    for _ in range(3):
        client.sendto(dgram(host, port, b"blocked"), relay_addr)
    (nd,) = new_dest(env)
    time.sleep(0.05)
    assert env.relay.set_drop(assoc, nd.dest)
    client.sendto(dgram(host, port, b"blocked"), relay_addr)
    wait_until(lambda: env.relay.dest_counters(assoc, nd.dest).client_rx_packets == 4)
    env.relay.close_association(assoc)
    (ended,) = env.wait_for(lambda r: isinstance(r, DestEnded))
    assert ended.action == Action.DROP
    assert ended.counters.client_rx_packets == ended.counters.dropped_blocked == 4
    assert ended.counters.upstream_tx_packets == 0
    assert echo.received == 0


def test_python_verdict(env: Env) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    client.sendto(dgram("peer.example", 9999, b"held"), relay_addr)
    (nd,) = new_dest(env)
    assert env.relay.set_python(assoc, nd.dest)
    client.sendto(dgram("peer.example", 9999, b"\x00live" * 100), relay_addr)
    grams = env.wait_for(lambda r: isinstance(r, Datagram), 2)
    assert [g.payload for g in grams] == [b"held", b"\x00live" * 100]
    assert {g.dest for g in grams} == {nd.dest}
    n = env.relay.send_to_client(assoc, nd.dest, b"reply")
    assert n == len(dgram("peer.example", 9999, b"reply"))
    assert recv(client) == (0, "peer.example", 9999, b"reply")
    env.relay.send_to_client(assoc, nd.dest, b"from elsewhere", ("198.51.100.7", 53))
    assert recv(client) == (0, "198.51.100.7", 53, b"from elsewhere")
    env.relay.send_to_client(assoc, nd.dest, b"v6", ("2001:db8::1", 5353))
    assert recv(client) == (0, "2001:db8::1", 5353, b"v6")
    c = env.relay.dest_counters(assoc, nd.dest)
    assert (c.python_packets, c.python_bytes) == (2, 4 + 500)
    assert (c.client_tx_packets, c.bytes_down) == (3, 5 + 14 + 2)


def test_bounded_pending_queue(env: Env, echo: Echo) -> None:
    relay = UdpRelay(pending_max=4)
    try:
        client = env.udp()
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        srv.bind((LOOP, 0))
        relay_addr = srv.getsockname()
        assoc = relay.add_association(srv.detach(), LOOP, client.getsockname()[1], 5)
        host, port = echo.addrs[0]
        for i in range(10):
            client.sendto(dgram(host, port, b"p%d" % i), relay_addr)
        deadline = time.monotonic() + 3
        nd = None
        while nd is None and time.monotonic() < deadline:
            nd = next((r for r in relay.drain() if isinstance(r, NewDest)), None)
        assert nd is not None
        wait_until(lambda: relay.dest_counters(assoc, nd.dest).client_rx_packets == 10)
        assert relay.dest_counters(assoc, nd.dest).dropped_pending == 6
        up_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        up = relay.add_upstream(assoc, up_sock.detach())
        relay.set_direct(assoc, nd.dest, up, host, port)
        assert [recv(client).payload for _ in range(4)] == [b"p0", b"p1", b"p2", b"p3"]
        assert relay.stats().dropped_pending == 6
    finally:
        relay.close()


def test_verdict_for_an_unknown_upstream_or_family(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"x"), relay_addr)
    (nd,) = new_dest(env)
    with pytest.raises(RelayError) as exc:
        env.relay.set_direct(assoc, nd.dest, 7, host, port)
    assert exc.value.errno == errno.ENXIO
    up, _ = env.upstream(assoc)  # AF_INET
    with pytest.raises(RelayError) as exc:
        env.relay.set_direct(assoc, nd.dest, up, "::1", port)
    assert exc.value.errno == errno.EAFNOSUPPORT
    assert not env.relay.set_drop(assoc, 999)
    assert not env.relay.close_association(assoc + 1)
    assert env.relay.dest_counters(assoc, 999) is None


# -- endings and exact counters -------------------------------------------------------


def test_idle_timeout_record(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client, idle=0.2)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"once"), relay_addr)
    (nd,) = new_dest(env)
    up, _ = env.upstream(assoc)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client).payload == b"once"
    t0 = time.monotonic()
    (ended,) = env.wait_for(lambda r: isinstance(r, DestEnded))
    assert 0.1 < time.monotonic() - t0 < 1.5
    assert (ended.reason, ended.dest, ended.upstream) == (End.IDLE, nd.dest, up)
    assert ended.counters.client_tx_packets == 1
    assert env.relay.stats().dest_idle_timeouts == 1
    # The next datagram to it is a new destination (a new flow).
    client.sendto(dgram(host, port, b"again"), relay_addr)
    (nd2,) = env.wait_for(lambda r: isinstance(r, NewDest) and r.dest != nd.dest)
    assert (nd2.host, nd2.port, nd2.dest) == (host, port, 2)


def test_upstream_idle_timeout(env: Env, echo: Echo) -> None:
    client = env.udp()
    assoc, relay_addr = env.association(client, idle=None)
    host, port = echo.addrs[0]
    client.sendto(dgram(host, port, b"once"), relay_addr)
    (nd,) = new_dest(env)
    up, _ = env.upstream(assoc, idle=0.2)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client).payload == b"once"
    dest_end, up_end = env.wait_for(lambda r: isinstance(r, DestEnded | UpstreamEnded), 2)
    assert isinstance(dest_end, DestEnded) and dest_end.reason == End.IDLE
    assert isinstance(up_end, UpstreamEnded) and up_end.reason == End.IDLE
    st = env.relay.stats()
    assert (st.idle_timeouts, st.closed_associations, st.active_associations) == (1, 1, 0)
    assert not env.relay.set_direct(assoc, 1, up, host, port)  # the destination ended
    client.sendto(dgram(host, port, b"later"), relay_addr)
    (nd2,) = env.wait_for(lambda r: isinstance(r, NewDest) and r.dest == 2)
    with pytest.raises(RelayError) as exc:  # its upstream is gone: Python makes another
        env.relay.set_direct(assoc, nd2.dest, up, host, port)
    assert exc.value.errno == errno.ENXIO


def test_close_records_with_exact_counters(env: Env) -> None:
    servers = Echo(3)
    try:
        client = env.udp()
        assoc, relay_addr = env.association(client)
        up, _ = env.upstream(assoc)
        sizes = [0, 1, 100, 1400, 8000]
        expect = {}
        for host, port in servers.addrs:
            hdr = len(dgram(host, port, b""))
            for i, n in enumerate(sizes):
                client.sendto(dgram(host, port, bytes([i]) * n), relay_addr)
                if i == 0:
                    (nd,) = env.wait_for(lambda r, p=port: isinstance(r, NewDest) and r.port == p)
                    env.relay.set_direct(assoc, nd.dest, up, host, port)
                assert recv(client).payload == bytes([i]) * n
            total = sum(sizes)
            expect[port] = UdpCounters(
                client_rx_packets=5, client_rx_bytes=5 * hdr + total,
                upstream_tx_packets=5, upstream_tx_bytes=total, bytes_up=total,
                upstream_rx_packets=5, upstream_rx_bytes=total,
                client_tx_packets=5, client_tx_bytes=5 * hdr + total, bytes_down=total,
                python_packets=0, python_bytes=0, dropped_pending=0, dropped_blocked=0,
                dropped_python=0, send_failures=0, client_send_failures=0,
                last_activity_unix_ms=0,
            )  # fmt: skip
        assert env.relay.close_association(assoc)
        assert not env.relay.close_association(assoc)
        last = env.wait_for(lambda r: isinstance(r, AssocEnded))[0]
        mine = [r for r in env.records if not isinstance(r, NewDest)]
        assert [type(r) for r in mine] == [DestEnded] * 3 + [UpstreamEnded, AssocEnded]
        ports = {r.dest: r.port for r in env.of(NewDest)}
        for r in mine[:3]:
            assert r.reason == End.ASSOC
            assert r.counters._replace(last_activity_unix_ms=0) == expect[ports[r.dest]]
            assert abs(r.counters.last_activity_unix_ms - time.time() * 1000) < 5000
        up_end = mine[3]
        assert (up_end.upstream, up_end.reason) == (up, End.ASSOC)
        assert up_end.counters.upstream_tx_packets == up_end.counters.upstream_rx_packets == 15
        assert last.reason == End.CLOSED and last.drops.destinations == 3
        summed = [sum(c) for c in zip(*(r.counters for r in mine[:3]), strict=True)]
        assert list(last.counters)[:-1] == summed[:-1]
        st = env.relay.stats()
        assert (st.assocs_active, st.assocs_ended, st.dests_active, st.dests_ended) == (0, 1, 0, 3)
        assert (st.packets_sent, st.packets_received) == (15, 15)
        assert (st.client_packets_received, st.client_packets_sent) == (15, 15)
    finally:
        servers.close()


def test_dest_close_and_upstream_close(env: Env, echo: Echo) -> None:
    client, assoc, dest, up = direct_round_trip(env, echo)
    assert env.relay.close_dest(assoc, dest)
    assert not env.relay.close_dest(assoc, dest)
    (ended,) = env.wait_for(lambda r: isinstance(r, DestEnded))
    assert ended.reason == End.CLOSED
    host, port = echo.addrs[0]
    client.send(dgram(host, port, b"next"))
    (nd,) = env.wait_for(lambda r: isinstance(r, NewDest) and r.dest == 2)
    env.relay.set_direct(assoc, nd.dest, up, host, port)
    assert recv(client).payload == b"next"
    assert env.relay.close_upstream(assoc, up)
    dest_end, up_end = env.wait_for(lambda r: isinstance(r, UpstreamEnded) or (
        isinstance(r, DestEnded) and r.dest == 2), 2)  # fmt: skip
    assert (dest_end.reason, up_end.reason) == (End.UPSTREAM, End.CLOSED)


def test_shutdown_ends_everything(echo: Echo) -> None:
    relay = UdpRelay(loops=2)
    e = Env(relay)
    try:
        client = e.udp()
        assocs = [e.association(client)[0] for _ in range(4)]
        relay.close()
        relay.close()
        ends = e.wait_for(lambda r: isinstance(r, AssocEnded), 4)
        assert {r.assoc for r in ends} == set(assocs)
        assert all(r.reason == End.SHUTDOWN for r in ends)
        with pytest.raises(RelayError):
            e.association(client)
        assert not relay.close_association(assocs[0])
    finally:
        for s in e.sockets:
            s.close()


# -- limits and the record ring ----------------------------------------------------------


def test_max_dests_and_record_overflow(echo: Echo) -> None:
    relay = UdpRelay(ring_records=4, max_dests=6)
    e = Env(relay)
    try:
        client = e.udp()
        assoc, relay_addr = e.association(client)
        # Nobody drains: 4 NEW_DEST fill the ring, the rest are dropped for room.
        for i in range(8):
            client.sendto(dgram("10.0.0.1", 1000 + i, b"x"), relay_addr)
        wait_until(lambda: relay.stats().client_packets_received == 8)
        st = relay.stats()
        assert (st.dests_created, st.dropped_no_dest) == (4, 4)
        news = [r for r in relay.drain() if isinstance(r, NewDest)]
        assert [r.port for r in news] == [1000, 1001, 1002, 1003]
        for i in range(8, 12):
            client.sendto(dgram("10.0.0.1", 1000 + i, b"x"), relay_addr)
        wait_until(lambda: relay.stats().client_packets_received == 12)
        # 6 live destinations at most: two more were made, two refused.
        st = relay.stats()
        assert (st.dests_created, st.dropped_no_dest) == (6, 6)
        # Ending 6 destinations and the association with 2 ring slots taken:
        # the endings wait outside the ring, in order, and none is lost.
        relay.close_association(assoc)
        e.records.clear()
        for _ in range(20):
            e.pump()
        kinds = [type(r).__name__ for r in e.records]
        assert kinds == ["NewDest"] * 2 + ["DestEnded"] * 6 + ["AssocEnded"]
        assert relay.stats().records_overflowed >= 5
    finally:
        relay.close()
        for s in e.sockets:
            s.close()


def test_udp_upstream_fields_match_the_catalogue() -> None:
    assert UDP_UPSTREAM_FIELDS == UDP_COUNTERS


def test_assoc_add_refuses_non_udp_sockets(env: Env) -> None:
    tcp = socket.socket()
    env.sockets.append(tcp)
    with pytest.raises(RelayError) as exc:
        env.relay.add_association(tcp.fileno(), LOOP, 0)
    assert exc.value.errno == errno.EINVAL


def test_assoc_capacity() -> None:
    relay = UdpRelay(max_assocs=2)
    socks = []
    try:
        ids = []
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            ids.append(relay.add_association(s.detach(), LOOP, 0))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        socks.append(s)
        with pytest.raises(RelayError) as exc:
            relay.add_association(s.fileno(), LOOP, 0)
        assert exc.value.errno == errno.ENOSPC
        relay.close_association(ids[0])
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        new_id = relay.add_association(s.detach(), LOOP, 0)
        assert new_id not in ids  # a reused slot gets a new id
        assert not relay.close_association(ids[0])
    finally:
        relay.close()
        for s in socks:
            s.close()


@pytest.mark.parametrize("busy_poll_us", [0, 200])
def test_burst_through_two_loops(echo: Echo, busy_poll_us: int) -> None:
    """Many associations over two loops, windows of 16 datagrams each, nothing lost."""
    relay = UdpRelay(loops=2, busy_poll_us=busy_poll_us)
    e = Env(relay)
    try:
        host, port = echo.addrs[0]
        clients = []
        for _ in range(8):
            c = e.udp()
            assoc, addr = e.association(c)
            c.connect(addr)
            c.send(dgram(host, port, b"hello"))
            clients.append((c, assoc))
        news = e.wait_for(lambda r: isinstance(r, NewDest), 8)
        for nd in news:
            up, _ = e.upstream(nd.assoc)
            relay.set_direct(nd.assoc, nd.dest, up, host, port)
        for c, _ in clients:
            assert recv(c).payload == b"hello"
        for rnd in range(10):
            for c, _ in clients:
                for k in range(16):
                    c.send(dgram(host, port, b"%d-%d" % (rnd, k)))
            for c, _ in clients:
                got = sorted(recv(c).payload for _ in range(16))
                assert got == sorted(b"%d-%d" % (rnd, k) for k in range(16))
        st = relay.stats()
        assert st.packets_sent == st.packets_received == 8 * 161
        assert st.send_failures == st.client_send_failures == 0
    finally:
        relay.close()
        for s in e.sockets:
            s.close()


def test_concurrent_associations_keep_record_order(echo: Echo) -> None:
    """Eight client threads open associations, talk to five names each (all resolving to
    one echo server, so replies are told apart by which destination sent last) and close
    them, while one thread answers NEW_DEST through a tiny ring: every destination's
    records come in order, each association's AssocEnded after all of its others."""
    relay = UdpRelay(loops=2, ring_records=8)
    host, port = echo.addrs[0]
    records: list[UdpRecord] = []
    stop = threading.Event()
    upstreams: dict[int, int] = {}

    def answer() -> None:
        while not stop.is_set():
            select.select([relay.fileno()], [], [], 0.05)
            for rec in relay.drain():
                records.append(rec)
                if isinstance(rec, NewDest):
                    if rec.assoc not in upstreams:
                        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                        upstreams[rec.assoc] = relay.add_upstream(rec.assoc, s.detach())
                    relay.set_direct(rec.assoc, rec.dest, upstreams[rec.assoc], host, port)

    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
                c.bind((LOOP, 0))
                c.settimeout(0.3)
                srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                srv.bind((LOOP, 0))
                addr = srv.getsockname()
                assoc = relay.add_association(srv.detach(), LOOP, c.getsockname()[1], 30)
                for rnd in range(3):
                    for name in range(5):
                        data = dgram(f"n{name}.c{k}.example", port, b"%d/%d/%d" % (k, rnd, name))
                        for _ in range(30):  # a NEW_DEST may find the ring full: retry
                            c.sendto(data, addr)
                            with contextlib.suppress(TimeoutError):
                                assert socks5.parse_udp_datagram(c.recv(100)) == (
                                    socks5.parse_udp_datagram(data)
                                )
                                break
                        else:
                            raise AssertionError(f"no reply for {data!r}")
                assert relay.close_association(assoc)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    answerer = threading.Thread(target=answer)
    answerer.start()
    workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    wait_until(lambda: sum(isinstance(r, AssocEnded) for r in records) == 8)
    stop.set()
    answerer.join()
    relay.close()
    assert not errors, errors
    by_assoc: dict[int, list[UdpRecord]] = {}
    for r in records:
        by_assoc.setdefault(r.assoc, []).append(r)
    assert len(by_assoc) == 8
    for recs in by_assoc.values():
        assert isinstance(recs[-1], AssocEnded) and recs[-1].reason == End.CLOSED
        news = [r.dest for r in recs if isinstance(r, NewDest)]
        ends = [r.dest for r in recs if isinstance(r, DestEnded)]
        assert sorted(news) == sorted(ends) == list(range(1, 6))
        for d in news:
            kinds = [type(r) for r in recs if getattr(r, "dest", None) == d]
            assert kinds == [NewDest, DestEnded]
        total = recs[-1].counters
        assert total.client_tx_packets == total.upstream_tx_packets >= 15
    st = relay.stats()
    assert st.assocs_ended == 8 and st.dests_ended == 40
