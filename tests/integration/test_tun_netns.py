"""The TUN system stack on a real TUN device, in a network namespace the test creates.

Setup (tests/helpers/netns_tun.py): a namespace with a TUN ``swk0`` holding
198.18.0.1/30 and fdfe:dcba:9876::1/126, and the test prefixes 203.0.113.0/24 and
2001:db8:77::/64 routed into it. The C stack (spliceway/native/tun.py) runs on the TUN
with its kernel listeners on A (198.18.0.1 / fdfe:dcba:9876::1). Clients inside the
namespace (Python sockets made there, ``curl`` run there) reach addresses in the
captured prefixes; the listener accepts, the NAT lookup gives the original destination,
and a relay thread connects the accepted socket to a real server in the test's own
namespace (on loopback), byte for byte. UDP goes through the record ring and back;
ICMP echo is answered by C. The same with offloads (``vnet_hdr``: IFF_VNET_HDR, TSO and
checksum offload): the kernel's GSO bursts go through whole (more bytes per read than
the MTU) and still arrive byte-exact. Skipped, with the reason, only where a namespace
or a TUN cannot be made.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import select
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from spliceway.native.tun import TunFlow, TunStack
from spliceway.tun import packet as P
from tests.helpers.netns_tun import TunNetns, unavailable
from tests.helpers.servers import LoopbackServer

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

ADDRS = ["198.18.0.1/30", "fdfe:dcba:9876::1/126"]
ROUTES = ["203.0.113.0/24", "2001:db8:77::/64"]
TARGET = {4: "203.0.113.5", 6: "2001:db8:77::5"}


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class Relay:
    """Accepts on the stack's listeners, looks every connection up, and relays it to
    ``upstream(flow)`` (an address in this namespace)."""

    def __init__(self, stack: TunStack, upstream: Callable[[TunFlow], tuple[str, int]]) -> None:
        self.stack = stack
        self.upstream = upstream
        self.flows: list[TunFlow] = []
        #: TCP_CONGESTION of each accepted socket.
        self.congestion: list[bytes] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        listeners = list(self.stack.listeners.values())
        while not self.stop.is_set():
            ready, _, _ = select.select(listeners, [], [], 0.1)
            for lsock in ready:
                try:
                    conn, _ = lsock.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(True)
                cc = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
                self.congestion.append(cc.rstrip(b"\0"))
                flow = self.stack.lookup_peer(conn)
                assert flow is not None
                self.flows.append(flow)
                up = socket.create_connection(self.upstream(flow), timeout=10)
                up.settimeout(None)
                for a, b in ((conn, up), (up, conn)):
                    t = threading.Thread(target=_pump, args=(a, b), daemon=True)
                    t.start()
                    self.threads.append(t)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for t in self.threads:
            t.join(5)


class Server(LoopbackServer):
    """A TCP server on loopback here: ``echo`` (back what it reads) or ``http``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.received: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            if self.kind == "echo":
                while data := conn.recv(65536):
                    conn.sendall(data)
                return
            head = b""
            while b"\r\n\r\n" not in head and (data := conn.recv(4096)):
                head += data
            self.received.append(head)
            body = b"hello through the tun\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % len(body) + body)  # fmt: skip


@pytest.fixture
def ns() -> Iterator[TunNetns]:
    with TunNetns() as n:
        yield n


def start_stack(ns: TunNetns, mtu: int = 1500, *, vnet_hdr: bool = False, **kw) -> TunStack:
    fd = ns.open_tun("swk0", ADDRS, ROUTES, mtu=mtu, vnet_hdr=vnet_hdr)
    stack = TunStack(fd, ADDRS, mtu, vnet_hdr=vnet_hdr, **kw)
    with ns.entered():
        stack.start()
    return stack


def client(ns: TunNetns, version: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with ns.entered():
        return socket.socket(socket.AF_INET if version == 4 else socket.AF_INET6, kind)


def _echoed(ns: TunNetns, v: int, size: int) -> socket.socket:
    """A client in ``ns`` connected to TARGET[v]:8443 that sent ``size`` random bytes
    while reading them back (both ways at once), the two equal by hash."""
    c = client(ns, v)
    c.settimeout(20)
    c.connect((TARGET[v], 8443))
    data = os.urandom(size)
    got = bytearray()
    sender = threading.Thread(target=c.sendall, args=(data,))
    sender.start()
    while len(got) < len(data):
        chunk = c.recv(1 << 20)
        assert chunk
        got += chunk
    sender.join()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    return c


def _echo_through(ns: TunNetns, stack: TunStack, v: int, size: int) -> Relay:
    """``size`` random bytes to an echo server through the stack and back, both ways at
    once, compared by hash; returns the relay (its flows)."""
    echo = Server("echo")
    relay = Relay(stack, lambda flow: ("127.0.0.1", echo.port))
    try:
        c = _echoed(ns, v, size)
        c.close()
    finally:
        relay.close()
        echo.close()
    return relay


@pytest.mark.parametrize("v", [4, 6])
def test_tcp_through_the_stack_is_byte_exact(ns: TunNetns, v: int) -> None:
    stack = start_stack(ns, mtu=9000)
    echo = Server("echo")
    relay = Relay(stack, lambda flow: ("127.0.0.1", echo.port))
    try:
        c = _echoed(ns, v, 4 << 20)
        (flow,) = relay.flows
        assert (str(flow.dst), flow.dport) == (TARGET[v], 8443)
        assert (flow.src, flow.sport) == (ipaddress.ip_address(c.getsockname()[0]),
                                          c.getsockname()[1])  # fmt: skip
        c.close()
        st = stack.stats()
        assert st["tcp_created"] == 1 and st["write_errors"] == 0
        assert st["packets_out"] > 100 and st["drop_no_session"] == 0
    finally:
        relay.close()
        stack.stop()
        echo.close()


@pytest.mark.parametrize("v", [4, 6])
def test_offloads_carry_gso_bursts_byte_exact(ns: TunNetns, v: int) -> None:
    """vnet_hdr at MTU 1500: 16 MiB each way arrive byte-exact, most bytes read as GSO
    bursts (many MTUs a read), every header accepted, every write taken."""
    stack = start_stack(ns, vnet_hdr=True)
    try:
        relay = _echo_through(ns, stack, v, 16 << 20)
        (flow,) = relay.flows
        assert (str(flow.dst), flow.dport) == (TARGET[v], 8443)
        st = stack.stats()
        assert st["tcp_created"] == 1 and st["write_errors"] == 0
        assert st["drop_bad_vnet"] == 0 and st["drop_too_big"] == 0
        assert st["drop_no_session"] == 0
        assert st["gso_packets_in"] > 0 and st["gso_bytes_in"] > st["bytes_in"] // 2
        assert st["bytes_in"] / st["packets_in"] > 4 * 1500, st  # several MTUs a read
        assert st["csum_partial_in"] > 0
    finally:
        stack.stop()


def test_accepted_sockets_do_not_pace(ns: TunNetns) -> None:
    """With BBR as the namespace's default (where the kernel has it), the listeners and
    the sockets they accept still use a congestion control that does not pace
    (stack.LISTENER_CONGESTION): their peer is a local socket behind the TUN."""
    from spliceway.native.tun import LISTENER_CONGESTION

    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        if "bbr" in f.read().split():
            ns.sysctl("net.ipv4.tcp_congestion_control", "bbr")
    stack = start_stack(ns, vnet_hdr=True)
    try:
        for lsock in stack.listeners.values():
            cc = lsock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            assert cc.rstrip(b"\0") in LISTENER_CONGESTION
        relay = _echo_through(ns, stack, 4, 1 << 20)
        assert len(relay.congestion) == 1 and relay.congestion[0] in LISTENER_CONGESTION
    finally:
        stack.stop()


def test_device_with_offloads(ns: TunNetns) -> None:
    """TunDevice.create(vnet_hdr=True): IFF_VNET_HDR, a 10-byte header, the raised
    transmit queue, and offloads the kernel uses: a transfer through it comes in GSO
    bursts."""
    from spliceway.tun import device as D

    with ns.entered():
        dev = D.TunDevice.create(
            "swk1", mtu=1500, addresses=[ipaddress.ip_interface(a) for a in ADDRS],
            vnet_hdr=True,
        )  # fmt: skip
    try:
        fd = dev.fds[0]
        assert D.tun_flags(fd) & D.IFF_VNET_HDR and D.vnet_hdr_size(fd) == D.VNET_HDR_LEN == 10
        link = ns.run("ip", "-d", "link", "show", "swk1").stdout.decode()
        assert "qlen 5000" in link and "vnet_hdr on" in link, link
        for prefix in ROUTES:
            ns.run("ip", "-6" if ":" in prefix else "-4", "route", "add", prefix, "dev", "swk1")
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
        stack = TunStack(fd, ADDRS, 1500, vnet_hdr=True)
        with ns.entered():
            stack.start()
        try:
            _echo_through(ns, stack, 4, 8 << 20)
            st = stack.stats()
            assert st["gso_packets_in"] > 0 and st["drop_bad_vnet"] == st["write_errors"] == 0
        finally:
            stack.stop()
    finally:
        dev.close()


def test_curl_gets_a_page_through_the_stack(ns: TunNetns) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    stack = start_stack(ns)
    http = Server("http")
    relay = Relay(stack, lambda flow: ("127.0.0.1", http.port))
    try:
        res = ns.run("curl", "-sS", "--max-time", "10", "http://203.0.113.80:8080/x", check=False)
        assert res.returncode == 0, res.stderr
        assert res.stdout == b"hello through the tun\n"
        assert http.received[0].startswith(b"GET /x HTTP/1.1\r\nHost: 203.0.113.80:8080\r\n")
        assert [(str(f.dst), f.dport) for f in relay.flows] == [("203.0.113.80", 8080)]
    finally:
        relay.close()
        stack.stop()
        http.close()


@pytest.mark.parametrize("vnet", [False, True], ids=["raw", "vnet"])
def test_many_connections_and_nat_expiry(ns: TunNetns, vnet: bool) -> None:
    stack = start_stack(ns, tcp_closed_timeout=0.2, vnet_hdr=vnet)
    echo = Server("echo")
    relay = Relay(stack, lambda flow: ("127.0.0.1", echo.port))
    try:
        for i in range(40):
            c = client(ns, 4 if i % 2 else 6)
            c.settimeout(10)
            c.connect((TARGET[4 if i % 2 else 6], 1000 + i))
            c.sendall(b"n%d" % i)
            assert c.recv(16) == b"n%d" % i
            c.shutdown(socket.SHUT_WR)
            assert c.recv(16) == b""
            c.close()
        end = time.monotonic() + 10
        while stack.stats()["tcp_active"] and time.monotonic() < end:
            time.sleep(0.1)
        st = stack.stats()
        assert (st["tcp_created"], st["tcp_active"], st["tcp_expired"]) == (40, 0, 40)
        assert sorted(f.dport for f in relay.flows) == list(range(1000, 1040))
    finally:
        relay.close()
        stack.stop()
        echo.close()


@pytest.mark.parametrize("vnet", [False, True], ids=["raw", "vnet"])
@pytest.mark.parametrize("v", [4, 6])
def test_udp_round_trip(ns: TunNetns, v: int, vnet: bool) -> None:
    stack = start_stack(ns, udp_idle_timeout=0.3, vnet_hdr=vnet)
    try:
        c = client(ns, v, socket.SOCK_DGRAM)
        c.settimeout(5)
        c.sendto(b"question", (TARGET[v], 53))
        recs: list = []
        end = time.monotonic() + 5
        while not recs and time.monotonic() < end:
            select.select([stack.fileno()], [], [], 0.5)
            recs = stack.records()
        (rec,) = recs
        assert (rec.kind, rec.payload, str(rec.dst), rec.dport) == ("udp", b"question",
                                                                    TARGET[v], 53)  # fmt: skip
        assert rec.sport == c.getsockname()[1] and rec.new_session
        stack.udp_send(rec.session, b"answer" * 200)
        data, peer = c.recvfrom(4096)
        assert data == b"answer" * 200 and (peer[0], peer[1]) == (TARGET[v], 53)
        end = time.monotonic() + 5
        ended: list = []
        while not ended and time.monotonic() < end:
            ended = [r for r in stack.records() if r.kind == "ended"]
            time.sleep(0.05)
        assert [(r.reason, r.packets_in, r.packets_out) for r in ended] == [("idle", 1, 1)]
    finally:
        stack.stop()


def _icmp_echo(v: int, ident: int, payload: bytes) -> bytes:
    typ = 8 if v == 4 else 128
    body = struct.pack("!BBHHH", typ, 0, 0, ident, 1) + payload
    if v == 4:  # the kernel fills in ICMPv6 checksums on raw sockets, not ICMP ones
        body = body[:2] + P.checksum(body).to_bytes(2, "big") + body[4:]
    return body


@pytest.mark.parametrize("vnet", [False, True], ids=["raw", "vnet"])
@pytest.mark.parametrize("v", [4, 6])
def test_ping_is_answered(ns: TunNetns, v: int, vnet: bool) -> None:
    stack = start_stack(ns, vnet_hdr=vnet)
    try:
        fam, proto = (socket.AF_INET, socket.IPPROTO_ICMP) if v == 4 else (
            socket.AF_INET6, socket.IPPROTO_ICMPV6)  # fmt: skip
        with ns.entered():
            s = socket.socket(fam, socket.SOCK_RAW, proto)
        s.settimeout(5)
        s.sendto(_icmp_echo(v, 0x4242, b"are you there"), (TARGET[v], 0))
        end = time.monotonic() + 5
        while time.monotonic() < end:
            data, peer = s.recvfrom(2048)
            icmp = data[(data[0] & 0x0F) * 4 :] if v == 4 else data
            if icmp[0] == (0 if v == 4 else 129):
                break
        assert peer[0] == TARGET[v]
        assert icmp[4:6] == b"\x42\x42" and icmp[8:] == b"are you there"
        assert stack.stats()["icmp_echo_replies"] == 1
        s.close()
    finally:
        stack.stop()


def test_raw_malformed_packets_are_counted_and_harmless(ns: TunNetns) -> None:
    """Packets the kernel routes into the TUN as written (raw IP_HDRINCL): a TCP
    header cut short, a fragment, an unknown protocol. Each is dropped and counted, and
    a connection made afterwards still works."""
    stack = start_stack(ns)
    echo = Server("echo")
    relay = Relay(stack, lambda flow: ("127.0.0.1", echo.port))
    try:
        with ns.entered():
            raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        src, dst = bytes([198, 18, 0, 1]), bytes([203, 0, 113, 9])
        short_tcp = P.ip_header(4, 6, src, dst, 10) + bytes(10)
        frag = bytearray(P.ip_header(4, 17, src, dst, 16) + bytes(16))
        frag[6:8] = b"\x20\x00"  # MF (the kernel fixes the header checksum)
        proto = P.ip_header(4, 200, src, dst, 8) + bytes(8)
        for pkt in (short_tcp, bytes(frag), proto):
            raw.sendto(pkt, ("203.0.113.9", 0))
        end = time.monotonic() + 5
        want = {"drop_bad_l4": 1, "drop_fragment": 1, "drop_unsupported": 1}
        while time.monotonic() < end:
            st = stack.stats()
            if all(st[k] >= n for k, n in want.items()):
                break
            time.sleep(0.05)
        assert {k: st[k] for k in want} == want
        c = client(ns, 4)
        c.settimeout(10)
        c.connect((TARGET[4], 7))
        c.sendall(b"still fine")
        assert c.recv(64) == b"still fine"
        c.close()
        raw.close()
    finally:
        relay.close()
        stack.stop()
        echo.close()
