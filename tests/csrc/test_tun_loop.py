"""The TUN packet loop (csrc/tun.c) packet by packet, without a TUN device.

The loop only read()s and write()s its fd one packet at a time, so one end of an
AF_UNIX SOCK_DGRAM socketpair stands in for the TUN: the test writes crafted packets
(spliceway/tun/packet.py builds them) into the other end and reads what the loop
writes back. That reaches every branch deterministically and needs no privileges:
the NAT rewrite both ways with checksums that verify, the entry's states and its
expiry, resets for packets with no entry, eviction at max_tcp, every drop reason, UDP
records, replies and session ends, ICMP echo. With vnet_hdr (offloads) every frame
starts with a virtio-net header: GSO bursts and partial checksums NATed and written back
with their headers, the loop's own packets with a zeroed one, malformed headers counted.
tests/integration/test_tun_netns.py runs the same loop on a real TUN in a network
namespace.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from spliceway.native.tun import TunStack, TunStackError, ffi, lib
from spliceway.tun import packet as P

A4, B4 = ipaddress.ip_address("198.18.0.1"), ipaddress.ip_address("198.18.0.2")
A6, B6 = ipaddress.ip_address("fdfe::1"), ipaddress.ip_address("fdfe::2")
CLIENT = {4: ipaddress.ip_address("198.18.0.1"), 6: ipaddress.ip_address("fdfe::1")}
SERVER = {4: ipaddress.ip_address("203.0.113.9"), 6: ipaddress.ip_address("2001:db8::9")}
NAT = {4: B4, 6: B6}
LISTENER = {4: A4, 6: A6}


def tcp(version: int, src, sport: int, dst, dport: int, flags: int, seq: int = 1000,
        ack: int = 0, payload: bytes = b"") -> bytes:  # fmt: skip
    s, d = ipaddress.ip_address(src).packed, ipaddress.ip_address(dst).packed
    hdr = bytearray(20)
    hdr[0:4] = sport.to_bytes(2, "big") + dport.to_bytes(2, "big")
    hdr[4:12] = seq.to_bytes(4, "big") + ack.to_bytes(4, "big")
    hdr[12], hdr[13], hdr[14:16] = 5 << 4, flags, b"\xff\xff"
    seg = bytes(hdr) + payload
    c = P.checksum(P.pseudo_header(version, P.PROTO_TCP, s, d, len(seg)) + seg)
    seg = seg[:16] + c.to_bytes(2, "big") + seg[18:]
    return P.ip_header(version, P.PROTO_TCP, s, d, len(seg)) + seg


def udp(version: int, src, sport: int, dst, dport: int, payload: bytes) -> bytes:
    s, d = ipaddress.ip_address(src).packed, ipaddress.ip_address(dst).packed
    return P.build_udp(version, s, sport, d, dport, payload)


def echo(version: int, src, dst, ident: int = 7, seq: int = 1, data: bytes = b"ping") -> bytes:
    s, d = ipaddress.ip_address(src).packed, ipaddress.ip_address(dst).packed
    typ, proto = (8, P.PROTO_ICMP) if version == 4 else (128, P.PROTO_ICMPV6)
    body = bytearray(bytes([typ, 0, 0, 0]) + ident.to_bytes(2, "big") + seq.to_bytes(2, "big"))
    body += data
    if version == 4:
        c = P.checksum(bytes(body))
    else:
        c = P.checksum(P.pseudo_header(6, proto, s, d, len(body)) + bytes(body))
    body[2:4] = c.to_bytes(2, "big")
    return P.ip_header(version, proto, s, d, len(body)) + bytes(body)


class Loop:
    """A TunStack over one end of a socketpair; ``send``/``recv`` at the other end."""

    def __init__(self, **kw) -> None:
        self.peer, self.dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.peer.settimeout(2)
        mtu = kw.pop("mtu", 1500)
        self.stack = TunStack(self.dev.fileno(), ["198.18.0.1/30", "fdfe::1/126"], mtu, **kw)
        self.stack.start()
        self.port = {v: self.stack.listen_port(v) for v in (4, 6)}

    def send(self, pkt: bytes) -> None:
        self.peer.send(pkt)

    def recv(self, timeout: float = 2) -> P.Packet:
        self.peer.settimeout(timeout)
        data = self.peer.recv(70000)
        pk = P.parse(data)
        assert P.l4_csum_ok(data, pk), data.hex()
        self.last = data
        return pk

    def nothing(self, timeout: float = 0.2) -> None:
        self.peer.settimeout(timeout)
        with pytest.raises(TimeoutError):
            self.peer.recv(70000)

    def stats(self) -> dict[str, int]:
        return self.stack.stats()

    def wait(self, cond: Callable[[dict[str, int]], bool], timeout: float = 4) -> dict[str, int]:
        end = time.monotonic() + timeout
        while True:
            st = self.stats()
            if cond(st) or time.monotonic() > end:
                return st
            time.sleep(0.05)

    def records(self, n: int = 1, timeout: float = 2):
        out: list = []
        end = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < end:
            out += self.stack.records()
            if len(out) < n:
                time.sleep(0.01)
        return out

    def close(self) -> None:
        self.stack.stop()
        self.peer.close()
        self.dev.close()


@pytest.fixture
def loop_factory() -> Iterator[Callable[..., Loop]]:
    made: list[Loop] = []

    def make(**kw) -> Loop:
        made.append(Loop(**kw))
        return made[-1]

    yield make
    for lp in made:
        lp.close()


@pytest.fixture
def loop(loop_factory) -> Loop:
    return loop_factory()


@pytest.mark.parametrize("v", [4, 6])
def test_tcp_nat_both_ways(loop: Loop, v: int) -> None:
    c, s = CLIENT[v], SERVER[v]
    loop.send(tcp(v, c, 40000, s, 443, P.TCP_SYN, seq=111))
    syn = loop.recv()
    assert (syn.src, syn.dst) == (NAT[v].packed, LISTENER[v].packed)
    assert (syn.dport, syn.seq, syn.tcp_flags) == (loop.port[v], 111, P.TCP_SYN)
    natport = syn.sport
    assert 10000 <= natport <= 65535
    flow = loop.stack.nat_lookup(v, natport)
    assert flow is not None and flow.state == "syn"
    assert (flow.src, flow.sport, flow.dst, flow.dport) == (c, 40000, s, 443)
    assert loop.stack.nat_lookup(10 - v, natport) is None  # the other family
    # The listener's answer goes back as if from the real destination.
    loop.send(tcp(v, LISTENER[v], loop.port[v], NAT[v], natport, P.TCP_SYN | P.TCP_ACK, 999, 112))
    synack = loop.recv()
    assert (synack.src, synack.sport, synack.dst, synack.dport) == (s.packed, 443, c.packed, 40000)
    assert (synack.seq, synack.ack) == (999, 112)
    loop.send(tcp(v, c, 40000, s, 443, P.TCP_ACK, 112, 1000, b"GET / HTTP/1.0\r\n\r\n"))
    data = loop.recv()
    assert data.sport == natport and loop.last[data.payload_off :] == b"GET / HTTP/1.0\r\n\r\n"
    flow = loop.stack.nat_lookup(v, natport)
    assert flow.state == "established" and (flow.packets_out, flow.packets_in) == (2, 1)
    st = loop.stats()
    assert (st["tcp_created"], st["tcp_active"], st["packets_in"], st["packets_out"]) == (
        1,
        1,
        3,
        3,
    )


@pytest.mark.parametrize("v", [4, 6])
def test_port_53_goes_to_the_dns_listener(loop_factory, v: int) -> None:
    """dns_tcp: a connection to port 53 is NATed onto A:dns_port (same NAT entry, same
    port cycle, same lookup); the rest onto A:port; each listener's packets translate
    only for its own entries."""
    loop = loop_factory(dns_tcp=True)
    dns_port = loop.stack.dns_port(v)
    assert dns_port not in (0, loop.port[v])
    c, s = CLIENT[v], SERVER[v]
    loop.send(tcp(v, c, 40010, s, 53, P.TCP_SYN, seq=7))
    syn = loop.recv()
    assert (syn.src, syn.dst, syn.dport, syn.seq) == (NAT[v].packed, LISTENER[v].packed,
                                                      dns_port, 7)  # fmt: skip
    dns_nat = syn.sport
    flow = loop.stack.nat_lookup(v, dns_nat)
    assert (flow.src, flow.sport, flow.dst, flow.dport) == (c, 40010, s, 53)
    loop.send(tcp(v, LISTENER[v], dns_port, NAT[v], dns_nat, P.TCP_SYN | P.TCP_ACK, 500, 8))
    synack = loop.recv()
    assert (synack.src, synack.sport, synack.dst, synack.dport) == (s.packed, 53, c.packed, 40010)
    loop.send(tcp(v, c, 40010, s, 53, P.TCP_ACK | P.TCP_PSH, 8, 501, b"\x00\x01q"))
    data = loop.recv()
    assert (data.sport, data.dport) == (dns_nat, dns_port)
    assert loop.stack.nat_lookup(v, dns_nat).state == "established"
    # Another port: the main listener, the next NAT port of the same cycle.
    loop.send(tcp(v, c, 40011, s, 853, P.TCP_SYN))
    other = loop.recv()
    assert (other.dport, other.sport) == (loop.port[v], dns_nat + 1)
    # The main listener speaking for the DNS entry, or the DNS listener for the other:
    # no such entry for that listener, answered with a reset, nothing translated.
    loop.send(tcp(v, LISTENER[v], loop.port[v], NAT[v], dns_nat, P.TCP_ACK, 501, 9))
    rst = loop.recv()
    assert rst.tcp_flags == P.TCP_RST and (rst.src, rst.sport) == (NAT[v].packed, dns_nat)
    loop.send(tcp(v, LISTENER[v], dns_port, NAT[v], other.sport, P.TCP_SYN | P.TCP_ACK, 1, 2))
    rst = loop.recv()
    assert rst.tcp_flags == P.TCP_RST and rst.dport == dns_port
    st = loop.stats()
    assert (st["tcp_created"], st["drop_no_session"], st["tcp_resets_sent"]) == (2, 2, 2)
    # The entries are untouched by the refused packets.
    assert loop.stack.nat_lookup(v, dns_nat).state == "established"
    assert loop.stack.nat_lookup(v, other.sport).state == "syn"


def test_port_53_without_dns_listener_goes_to_the_main_one(loop: Loop) -> None:
    assert loop.stack.dns_listeners == {} and loop.stack.dns_port(4) == 0
    loop.send(tcp(4, CLIENT[4], 40012, SERVER[4], 53, P.TCP_SYN))
    assert loop.recv().dport == loop.port[4]


def _raw_tun(dev: socket.socket, **fields: int):
    """A sw_tun over ``dev`` from explicit options (both families, ports 1000/2000)."""
    opts = ffi.new("sw_tun_opts *")
    opts.fd, opts.has4, opts.has6, opts.port4, opts.port6 = dev.fileno(), 1, 1, 1000, 2000
    ffi.memmove(opts.addr4, A4.packed, 4)
    ffi.memmove(opts.next4, B4.packed, 4)
    ffi.memmove(opts.addr6, A6.packed, 16)
    ffi.memmove(opts.next6, B6.packed, 16)
    for name, value in fields.items():
        setattr(opts, name, value)
    out = ffi.new("sw_tun **")
    return lib.sw_tun_new(opts, out), out[0]


def test_dns_port_is_per_family_and_checked() -> None:
    peer, dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    peer.settimeout(2)
    try:
        assert _raw_tun(dev, dns_port4=1000)[0] == -22  # EINVAL: the main listener's port
        assert _raw_tun(dev, dns_port6=2000)[0] == -22
        rc, tun = _raw_tun(dev, dns_port4=1053)  # IPv6 without one
        assert rc == 0
        try:
            got = {}
            for v in (4, 6):
                peer.send(tcp(v, CLIENT[v], 5, SERVER[v], 53, P.TCP_SYN))
                got[v] = P.parse(peer.recv(2048)).dport
            assert got == {4: 1053, 6: 2000}
        finally:
            lib.sw_tun_free(tun)
    finally:
        peer.close()
        dev.close()


def test_close_linger_then_expiry(loop_factory) -> None:
    loop = loop_factory(tcp_closed_timeout=0.1)
    c, s = CLIENT[4], SERVER[4]
    loop.send(tcp(4, c, 40001, s, 80, P.TCP_SYN))
    natport = loop.recv().sport
    back = (LISTENER[4], loop.port[4], NAT[4], natport)
    loop.send(tcp(4, *back, P.TCP_SYN | P.TCP_ACK))
    loop.recv()
    loop.send(tcp(4, c, 40001, s, 80, P.TCP_ACK | P.TCP_FIN))
    loop.recv()
    assert loop.stack.nat_lookup(4, natport).state == "fin"
    loop.send(tcp(4, *back, P.TCP_ACK | P.TCP_FIN))
    loop.recv()
    assert loop.stack.nat_lookup(4, natport).state == "closed"
    # Lingering: the last ACK still translates.
    loop.send(tcp(4, c, 40001, s, 80, P.TCP_ACK))
    assert loop.recv().sport == natport
    st = loop.wait(lambda st: st["tcp_expired"] == 1)
    assert (st["tcp_expired"], st["tcp_active"]) == (1, 0)
    assert loop.stack.nat_lookup(4, natport) is None


def test_reset_closes_and_syn_reopens_with_a_new_port(loop: Loop) -> None:
    c, s = CLIENT[6], SERVER[6]
    loop.send(tcp(6, c, 40002, s, 80, P.TCP_SYN))
    first = loop.recv().sport
    loop.send(tcp(6, LISTENER[6], loop.port[6], NAT[6], first, P.TCP_RST | P.TCP_ACK))
    loop.recv()
    assert loop.stack.nat_lookup(6, first).state == "closed"
    loop.send(tcp(6, c, 40002, s, 80, P.TCP_SYN))
    second = loop.recv().sport
    assert second != first and loop.stack.nat_lookup(6, first) is None
    assert loop.stats()["tcp_replaced"] == 1


@pytest.mark.parametrize("v", [4, 6])
def test_no_entry_is_answered_with_a_reset(loop: Loop, v: int) -> None:
    c, s = CLIENT[v], SERVER[v]
    loop.send(tcp(v, c, 40003, s, 80, P.TCP_ACK, seq=5, ack=77))
    rst = loop.recv()
    assert rst.tcp_flags == P.TCP_RST and rst.seq == 77
    assert (rst.src, rst.sport, rst.dst, rst.dport) == (s.packed, 80, c.packed, 40003)
    # From the listener to a NAT port nobody holds: reset back to the listener.
    loop.send(tcp(v, LISTENER[v], loop.port[v], NAT[v], 12345, P.TCP_ACK | P.TCP_PSH, 9, 10))
    rst = loop.recv()
    assert (rst.src, rst.sport, rst.dst, rst.dport) == (
        NAT[v].packed, 12345, LISTENER[v].packed, loop.port[v])  # fmt: skip
    loop.send(tcp(v, c, 40003, s, 80, P.TCP_RST))  # a reset is never answered
    loop.nothing()
    st = loop.stats()
    assert (st["drop_no_session"], st["tcp_resets_sent"], st["tcp_created"]) == (3, 2, 0)


def test_no_rst_drops_silently(loop_factory) -> None:
    loop = loop_factory(no_rst=True)
    loop.send(tcp(4, CLIENT[4], 40004, SERVER[4], 80, P.TCP_ACK))
    loop.nothing()
    assert loop.stats()["drop_no_session"] == 1


def test_eviction_at_max_tcp(loop_factory) -> None:
    loop = loop_factory(max_tcp=2)
    c, s = CLIENT[4], SERVER[4]
    ports = []
    for sport in (1, 2):
        loop.send(tcp(4, c, sport, s, 80, P.TCP_SYN))
        ports.append(loop.recv().sport)
    loop.send(tcp(4, c, 3, s, 80, P.TCP_SYN))  # evicts the oldest half-open one
    ports.append(loop.recv().sport)
    assert loop.stack.nat_lookup(4, ports[0]) is None
    assert loop.stats()["tcp_evicted"] == 1
    for sport in (2, 3):  # both established: nothing left to evict
        loop.send(tcp(4, c, sport, s, 80, P.TCP_ACK))
        loop.recv()
    loop.send(tcp(4, c, 4, s, 80, P.TCP_SYN))
    loop.nothing()
    st = loop.stats()
    assert (st["drop_nat_full"], st["tcp_active"], st["tcp_created"]) == (1, 2, 3)


def test_nat_ports_cycle(loop: Loop) -> None:
    """Ports are handed out in order and not reused while the cycle has others."""
    got = []
    for sport in range(1, 6):
        loop.send(tcp(4, CLIENT[4], sport, SERVER[4], 80, P.TCP_SYN))
        got.append(loop.recv().sport)
    assert got == list(range(got[0], got[0] + 5))


def _malformed() -> dict[str, bytes]:
    c, s = CLIENT[4].packed, SERVER[4].packed
    good = tcp(4, CLIENT[4], 5, SERVER[4], 80, P.TCP_SYN)
    frag = bytearray(good)
    frag[6:8] = b"\x20\x00"
    frag[10:12] = b"\0\0"
    frag[10:12] = P.checksum(bytes(frag[:20])).to_bytes(2, "big")
    bad_udp = bytearray(udp(4, CLIENT[4], 5, SERVER[4], 53, b"query"))
    bad_udp[-1] ^= 0xFF
    gre = P.ip_header(4, 47, c, s, 4) + b"\0\0\x08\x00"
    unreachable = bytearray(echo(4, CLIENT[4], SERVER[4]))
    unreachable[20] = 3  # destination unreachable, not an echo request
    six = tcp(6, CLIENT[6], 5, SERVER[6], 80, P.TCP_SYN)
    rh = bytearray(six)
    rh[6] = 43
    rh[4:6] = (len(six) - 40 + 8).to_bytes(2, "big")
    rh = rh[:40] + bytes([6, 0]) + bytes(6) + rh[40:]
    return {
        "drop_short": good[:30],
        "drop_bad_version": b"\x50" + good[1:],
        "drop_bad_header": b"\x44" + good[1:],
        "drop_bad_checksum": good[:10] + bytes([good[10] ^ 1]) + good[11:],
        "drop_fragment": bytes(frag),
        "drop_ext_header": bytes(rh),
        "drop_bad_l4": P.ip_header(4, 6, c, s, 12) + bytes(12),
        "drop_not_unicast": tcp(4, CLIENT[4], 5, "224.0.0.251", 80, P.TCP_SYN),
        "drop_unsupported": gre,
        "drop_udp_checksum": bytes(bad_udp),
    } | {"drop_unsupported ": bytes(unreachable)}


def test_every_drop_is_counted_by_its_reason(loop: Loop) -> None:
    cases = _malformed()
    for name, pkt in cases.items():
        before = loop.stats()
        loop.send(pkt)
        key = name.strip()
        after = loop.wait(lambda st, b=before, k=key: st[k] == b[k] + 1, 2)
        assert after[key] == before[key] + 1, name
        assert after["packets_in"] == before["packets_in"] + 1
        others = {k: after[k] - before[k] for k in after if k.startswith("drop_") and k != key}
        assert not any(others.values()), (name, others)
    loop.nothing()
    assert loop.stats()["packets_out"] == 0


def test_family_and_mtu_drops(loop_factory) -> None:
    loop = loop_factory(mtu=1280)
    loop.send(tcp(4, CLIENT[4], 1, SERVER[4], 80, P.TCP_SYN, payload=bytes(1300)))
    assert loop.wait(lambda st: st["drop_too_big"] == 1)["drop_too_big"] == 1
    peer, dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    only4 = TunStack(dev.fileno(), ["198.18.0.1/30"])
    only4.start()
    try:
        peer.send(tcp(6, CLIENT[6], 1, SERVER[6], 80, P.TCP_SYN))
        end = time.monotonic() + 2
        while only4.stats()["drop_family"] == 0 and time.monotonic() < end:
            time.sleep(0.02)
        assert only4.stats()["drop_family"] == 1
    finally:
        only4.stop()
        peer.close()
        dev.close()


@pytest.mark.parametrize("v", [4, 6])
def test_icmp_echo_is_answered(loop: Loop, v: int) -> None:
    loop.send(echo(v, CLIENT[v], SERVER[v], ident=0x1234, seq=9, data=b"abc" * 50))
    rep = loop.recv()
    assert (rep.src, rep.dst) == (SERVER[v].packed, CLIENT[v].packed)
    assert rep.icmp_type == (0 if v == 4 else 129) and (rep.sport, rep.dport) == (0x1234, 9)
    assert loop.last[rep.payload_off :] == b"abc" * 50
    assert loop.stats()["icmp_echo_replies"] == 1


@pytest.mark.parametrize("v", [4, 6])
def test_udp_records_and_replies(loop: Loop, v: int) -> None:
    c, s = CLIENT[v], SERVER[v]
    loop.send(udp(v, c, 5353, s, 53, b"query-1"))
    loop.send(udp(v, c, 5353, s, 53, b""))
    loop.send(udp(v, c, 5354, s, 53, b"other"))
    recs = loop.records(3)
    assert [(r.kind, r.payload, r.new_session) for r in recs] == [
        ("udp", b"query-1", True), ("udp", b"", False), ("udp", b"other", True)]  # fmt: skip
    first = recs[0]
    assert (first.src, first.sport, first.dst, first.dport) == (c, 5353, s, 53)
    assert recs[1].session == first.session != recs[2].session
    n = loop.stack.udp_send(first.session, b"answer")
    assert n == (20 if v == 4 else 40) + 8 + 6
    rep = loop.recv()
    assert (rep.src, rep.sport, rep.dst, rep.dport) == (s.packed, 53, c.packed, 5353)
    assert loop.last[rep.payload_off :] == b"answer"
    other = ipaddress.ip_address("203.0.113.77" if v == 4 else "2001:db8::77")
    loop.stack.udp_send(first.session, b"cone", src=(other, 9999))
    rep = loop.recv()
    assert (rep.src, rep.sport) == (other.packed, 9999)
    loop.stack.udp_close(recs[2].session)
    ended = loop.records(1)
    assert [(r.kind, r.reason, r.session, r.packets_in) for r in ended] == [
        ("ended", "closed", recs[2].session, 1)]  # fmt: skip
    with pytest.raises(TunStackError) as err:
        loop.stack.udp_send(recs[2].session, b"late")
    assert err.value.errno == 2  # ENOENT: a closed session's id never matches again
    loop.stack.inject_udp((s, 53), (c, 5354), b"late")
    rep = loop.recv()
    assert (rep.sport, rep.dport) == (53, 5354)
    st = loop.stats()
    assert (st["udp_created"], st["udp_ended"], st["udp_active"]) == (2, 1, 1)
    assert (st["udp_datagrams_in"], st["udp_datagrams_out"]) == (3, 3)
    rest = loop.stack.stop()
    assert [(r.kind, r.reason, r.packets_in, r.packets_out, r.bytes_out) for r in rest] == [
        ("ended", "shutdown", 2, 2, 10)]  # fmt: skip


def test_udp_idle_expiry(loop_factory) -> None:
    loop = loop_factory(udp_idle_timeout=0.2)
    loop.send(udp(4, CLIENT[4], 1, SERVER[4], 53, b"x"))
    (rec,) = loop.records(1)
    end = loop.records(1, timeout=4)
    assert [(r.kind, r.reason, r.session) for r in end] == [("ended", "idle", rec.session)]
    assert loop.stats()["udp_active"] == 0


def test_udp_ring_full_drops_and_signals(loop_factory) -> None:
    loop = loop_factory(ring_records=2)
    for i in range(4):
        loop.send(udp(4, CLIENT[4], 100 + i, SERVER[4], 53, b"x"))
    st = loop.wait(lambda st: st["drop_udp_ring"] == 2)
    assert (st["drop_udp_ring"], st["udp_created"]) == (2, 2)
    os.read(loop.stack.fileno(), 8)  # the eventfd was signalled
    assert len(loop.stack.records()) == 2
    loop.send(udp(4, CLIENT[4], 200, SERVER[4], 53, b"y"))
    assert [r.sport for r in loop.records(1)] == [200]


def test_drain_keeps_what_does_not_fit(loop: Loop) -> None:
    for i in range(3):
        loop.send(udp(4, CLIENT[4], 300, SERVER[4], 53, bytes([i]) * 1000))
    loop.wait(lambda st: st["udp_datagrams_in"] == 3)
    out = ffi.new("sw_tun_record[]", 8)
    buf = ffi.new("uint8_t[]", 2500)
    used = ffi.new("size_t *")
    assert lib.sw_tun_drain(loop.stack._tun, out, 8, buf, 2500, used) == 2
    assert used[0] == 2000 and out[1].payload_off == 1000
    assert [r.payload[:1] for r in loop.stack.records()] == [b"\x02"]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="second address"):
        TunStack(0, ["198.18.0.3/30"])  # .4 is outside the /30 (.3 is its broadcast)
    with pytest.raises(ValueError, match="no address"):
        TunStack(0, [])
    peer, dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with pytest.raises(TunStackError):
            TunStack(dev.fileno(), ["198.18.0.1/30"], mtu=100).start()
        with pytest.raises(TunStackError):
            TunStack(dev.fileno(), ["198.18.0.1/30"], max_tcp=60000).start()
    finally:
        peer.close()
        dev.close()


# -- offloads (vnet_hdr): every frame is [virtio-net header][packet] ----------------------


def _partial_of(pkt: bytes, pk: P.Packet) -> bytes:
    """pkt (TCP or UDP) with the checksum field holding the pseudo-header's partial sum,
    as Linux hands over a CHECKSUM_PARTIAL packet (NEEDS_CSUM)."""
    at = pk.l4_off + (16 if pk.proto == P.PROTO_TCP else 6)
    seg = pk.l4_len if pk.proto == P.PROTO_TCP else pk.payload_len + 8
    psum = P.partial_csum(pk.version, pk.proto, pk.src, pk.dst, seg)
    return pkt[:at] + psum.to_bytes(2, "big") + pkt[at + 2 :]


def _partial(pkt: bytes) -> bytes:
    return _partial_of(pkt, P.parse(pkt))


def _csum_hdr(pkt: bytes, gso_size: int = 0) -> P.VnetHeader:
    """The header Linux sends with pkt: NEEDS_CSUM, and GSO (TCP) when gso_size is given;
    hdr_len the whole linear part, as Linux's skb_headlen may be."""
    pk = P.parse(pkt)
    off = 16 if pk.proto == P.PROTO_TCP else 6
    if not gso_size:
        return P.VnetHeader(P.VNET_F_NEEDS_CSUM, 0, 0, 0, pk.l4_off, off)
    gso = P.VNET_GSO_TCPV4 if pk.version == 4 else P.VNET_GSO_TCPV6
    return P.VnetHeader(P.VNET_F_NEEDS_CSUM, gso, pk.payload_off + 100, gso_size, pk.l4_off, off)


class VnetLoop(Loop):
    """The same harness with vnet_hdr: frames carry a virtio-net header."""

    def __init__(self, **kw) -> None:
        super().__init__(vnet_hdr=True, **kw)

    def send_frame(self, hdr: P.VnetHeader, pkt: bytes) -> None:
        self.peer.send(hdr.pack() + pkt)

    def send(self, pkt: bytes) -> None:
        self.send_frame(P.VnetHeader(), pkt)

    def recv_frame(self, timeout: float = 2) -> tuple[P.VnetHeader, P.Packet]:
        """The next frame's header and packet; a partial checksum must be exactly the
        pseudo-header's sum and finish into one that verifies, a full one verify."""
        self.peer.settimeout(timeout)
        frame = self.peer.recv(70000 + P.VNET_HDR_LEN)
        hdr, data = P.VnetHeader.unpack(frame), frame[P.VNET_HDR_LEN :]
        pk = P.parse(data)
        assert pk.ip_len == len(data)
        if hdr.flags & P.VNET_F_NEEDS_CSUM:
            assert data == _partial_of(data, pk), data.hex()
            done = P.complete_csum(data, hdr.csum_start, hdr.csum_offset)
            assert P.l4_csum_ok(done, P.parse(done))
            self.last = done
        else:
            assert P.l4_csum_ok(data, pk), data.hex()
            self.last = data
        return hdr, pk

    def recv(self, timeout: float = 2) -> P.Packet:
        return self.recv_frame(timeout)[1]


@pytest.fixture
def vloop() -> Iterator[VnetLoop]:
    lp = VnetLoop()
    yield lp
    lp.close()


@pytest.mark.parametrize("v", [4, 6])
def test_vnet_gso_nat_both_ways(vloop: VnetLoop, v: int) -> None:
    """A GSO burst each way (60000 bytes, past the MTU) with a partial checksum: NATed,
    written back in one frame with the header it came with, the checksum still the
    pseudo-header's sum (of the new addresses), the payload untouched."""
    c, s = CLIENT[v], SERVER[v]
    syn = _partial(tcp(v, c, 41000, s, 443, P.TCP_SYN, seq=10))
    vloop.send_frame(_csum_hdr(syn), syn)
    hdr, out = vloop.recv_frame()
    assert hdr == _csum_hdr(syn) and out.dport == vloop.port[v]
    natport = out.sport
    back = (LISTENER[v], vloop.port[v], NAT[v], natport)
    synack = _partial(tcp(v, *back, P.TCP_SYN | P.TCP_ACK, 500, 11))
    vloop.send_frame(_csum_hdr(synack), synack)
    hdr, out = vloop.recv_frame()
    assert (out.src, out.sport, out.dst, out.dport) == (s.packed, 443, c.packed, 41000)
    body = os.urandom(60000)
    burst = _partial(tcp(v, c, 41000, s, 443, P.TCP_ACK | P.TCP_PSH, 11, 501, body))
    assert len(burst) > 1500
    sent = _csum_hdr(burst, gso_size=1448)
    vloop.send_frame(sent, burst)
    hdr, out = vloop.recv_frame()
    assert hdr == sent and out.ip_len == len(burst)
    up = (NAT[v].packed, natport, LISTENER[v].packed, vloop.port[v])
    assert (out.src, out.sport, out.dst, out.dport) == up
    assert vloop.last[out.payload_off :] == body
    down = _partial(tcp(v, *back, P.TCP_ACK, 501, 60011, body[::-1]))
    sent = _csum_hdr(down, gso_size=1428)
    vloop.send_frame(sent, down)
    hdr, out = vloop.recv_frame()
    assert hdr == sent and (out.src, out.dst) == (s.packed, c.packed)
    assert vloop.last[out.payload_off :] == body[::-1]
    flow = vloop.stack.nat_lookup(v, natport)
    assert flow.state == "established" and (flow.packets_out, flow.packets_in) == (2, 2)
    st = vloop.stats()
    assert (st["gso_packets_in"], st["csum_partial_in"], st["drop_bad_vnet"]) == (2, 4, 0)
    assert st["gso_bytes_in"] == 2 * len(burst)
    assert st["bytes_in"] == st["bytes_out"] == len(syn) + len(synack) + 2 * len(burst)


@pytest.mark.parametrize("v", [4, 6])
def test_vnet_full_checksums_stay_full(vloop: VnetLoop, v: int) -> None:
    """Without NEEDS_CSUM the checksum is complete and updated as without offloads; the
    header (here DATA_VALID) goes back as it came."""
    c, s = CLIENT[v], SERVER[v]
    pkt = tcp(v, c, 41001, s, 80, P.TCP_SYN)
    vloop.send_frame(P.VnetHeader(P.VNET_F_DATA_VALID), pkt)
    hdr, out = vloop.recv_frame()
    assert hdr == P.VnetHeader(P.VNET_F_DATA_VALID) and out.dst == LISTENER[v].packed
    assert vloop.stats()["csum_partial_in"] == 0


@pytest.mark.parametrize("v", [4, 6])
def test_vnet_own_packets_have_a_zeroed_header(vloop: VnetLoop, v: int) -> None:
    """Resets, echo replies and UDP replies: a zeroed header and full checksums. A UDP
    datagram with a partial checksum (unverifiable) is handed over as any other."""
    c, s = CLIENT[v], SERVER[v]
    data = _partial(tcp(v, c, 41002, s, 80, P.TCP_ACK, seq=5, ack=77, payload=b"x" * 3000))
    vloop.send_frame(_csum_hdr(data, gso_size=1000), data)
    hdr, rst = vloop.recv_frame()
    assert hdr == P.VnetHeader() and rst.tcp_flags == P.TCP_RST and rst.seq == 77
    vloop.send(echo(v, c, s, data=b"ping" * 10))
    hdr, rep = vloop.recv_frame()
    assert hdr == P.VnetHeader() and rep.icmp_type == (0 if v == 4 else 129)
    dgram = _partial(udp(v, c, 5353, s, 53, b"question"))
    assert not P.l4_csum_ok(dgram, P.parse(dgram))
    vloop.send_frame(_csum_hdr(dgram), dgram)
    (rec,) = vloop.records(1)
    assert (rec.payload, rec.sport, rec.dport) == (b"question", 5353, 53)
    vloop.stack.udp_send(rec.session, b"answer")
    hdr, ans = vloop.recv_frame()
    assert hdr == P.VnetHeader() and vloop.last[ans.payload_off :] == b"answer"
    vloop.stack.inject_udp((s, 53), (c, 5353), b"late")
    hdr, late = vloop.recv_frame()
    assert hdr == P.VnetHeader() and vloop.last[late.payload_off :] == b"late"
    st = vloop.stats()
    assert (st["tcp_resets_sent"], st["icmp_echo_replies"], st["udp_datagrams_in"]) == (1, 1, 1)
    assert st["drop_udp_checksum"] == 0 and st["bytes_out"] == sum(
        p.ip_len for p in (rst, rep, ans, late))  # fmt: skip


def test_vnet_malformed_headers_are_counted(vloop: VnetLoop) -> None:
    """Each frame with a header that does not fit its packet is dropped as drop_bad_vnet
    (one reason, nothing written); the loop goes on."""
    c, s = CLIENT[4], SERVER[4]
    syn = _partial(tcp(4, c, 41003, s, 80, P.TCP_SYN))
    big = _partial(tcp(4, c, 41003, s, 80, P.TCP_ACK, payload=bytes(5000)))
    syn6 = _partial(tcp(6, CLIENT[6], 41003, SERVER[6], 80, P.TCP_SYN))
    dgram = _partial(udp(4, c, 5, s, 53, b"q"))
    good, gso = _csum_hdr(syn), _csum_hdr(big, gso_size=1448)
    frames = {
        "unknown gso type": (replace(gso, gso_type=2), big),
        "udp gso (ufo)": (replace(gso, gso_type=P.VNET_GSO_UDP), big),
        "udp gso (uso)": (replace(gso, gso_type=P.VNET_GSO_UDP_L4), big),
        "ecn without gso": (replace(good, gso_type=P.VNET_GSO_ECN), syn),
        "gso of the other family": (replace(gso, gso_type=P.VNET_GSO_TCPV6), big),
        "tcpv4 gso on ipv6": (replace(_csum_hdr(syn6, 1428), gso_type=P.VNET_GSO_TCPV4), syn6),
        "gso on udp": (P.VnetHeader(1, P.VNET_GSO_TCPV4, 28, 8, 20, 6), dgram),
        "gso without needs_csum": (replace(gso, flags=0), big),
        "gso_size 0": (replace(gso, gso_size=0), big),
        "gso_size GSO_BY_FRAGS": (replace(gso, gso_size=0xFFFF), big),
        "csum_start past the header": (replace(good, csum_start=24), syn),
        "csum_start in the ip header": (replace(good, csum_start=0), syn),
        "csum_offset of udp on tcp": (replace(good, csum_offset=6), syn),
        "hdr_len past the packet": (replace(gso, hdr_len=len(big) + 1), big),
        "unknown flag": (replace(good, flags=P.VNET_F_NEEDS_CSUM | 4), syn),
        "needs_csum on icmp": (P.VnetHeader(1, 0, 0, 0, 20, 2), echo(4, c, s)),
    }
    for name, (hdr, pkt) in frames.items():
        before = vloop.stats()
        vloop.send_frame(hdr, pkt)
        after = vloop.wait(lambda st, b=before: st["drop_bad_vnet"] == b["drop_bad_vnet"] + 1, 2)
        assert after["drop_bad_vnet"] == before["drop_bad_vnet"] + 1, name
        others = {k: after[k] - before[k] for k in after
                  if k.startswith("drop_") and k != "drop_bad_vnet"}  # fmt: skip
        assert not any(others.values()), (name, others)
    # Shorter than a header: counted the same way.
    vloop.peer.send(b"\x01\x01\x00")
    st = vloop.wait(lambda st: st["drop_bad_vnet"] == len(frames) + 1)
    assert st["drop_bad_vnet"] == len(frames) + 1 and st["packets_in"] == len(frames) + 1
    vloop.nothing()
    assert (st["tcp_created"], st["packets_out"], st["gso_packets_in"]) == (0, 0, 0)
    # Still working.
    vloop.send_frame(good, syn)
    assert vloop.recv_frame()[0] == good


def test_vnet_mtu_holds_without_gso() -> None:
    """Past the MTU only with GSO (up to 64 KiB); a packet without it is drop_too_big."""
    loop = VnetLoop(mtu=1280)
    try:
        c, s = CLIENT[4], SERVER[4]
        syn = _partial(tcp(4, c, 41004, s, 80, P.TCP_SYN))
        loop.send_frame(_csum_hdr(syn), syn)
        loop.recv_frame()
        data = _partial(tcp(4, c, 41004, s, 80, P.TCP_ACK, payload=bytes(2000)))
        loop.send_frame(_csum_hdr(data), data)
        assert loop.wait(lambda st: st["drop_too_big"] == 1)["drop_too_big"] == 1
        biggest = _partial(tcp(4, c, 41004, s, 80, P.TCP_ACK, payload=bytes(65535 - 40)))
        loop.send_frame(_csum_hdr(biggest, gso_size=1240), biggest)
        hdr, out = loop.recv_frame()
        assert hdr.gso_size == 1240 and out.ip_len == 65535
        assert loop.stats()["drop_too_big"] == 1
    finally:
        loop.close()


def test_vnet_hdr_option_is_checked() -> None:
    peer, dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert _raw_tun(dev, vnet_hdr=2)[0] == -22
    finally:
        peer.close()
        dev.close()
