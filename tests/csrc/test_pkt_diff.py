"""The C packet parser and rewriter (csrc/pkt.c) against its Python reference,
spliceway/tun/packet.py, input for input.

Contract (csrc/pkt.h): the same status and fields from ``sw_pkt_parse``; the same
bytes from ``sw_pkt_rewrite``, ``sw_pkt_echo_reply``, ``sw_pkt_build_udp`` and
``sw_pkt_build_tcp_rst``; the same verdict from ``sw_pkt_l4_csum_ok``.  Beyond
agreement, the properties that make the NAT correct: a rewritten packet whose checksums
verified still verifies, with exactly the checksums a full recomputation gives (up to
the two forms of zero), and the builders' output parses back to what was asked for.

Inputs: well-formed packets (IPv4 with and without options, IPv6 with hop-by-hop and
destination options headers; TCP with options, UDP, ICMP/ICMPv6 echo, other protocols)
with correct checksums, the same with a wrong checksum, mutations (bit flips, byte
sets, cuts, extensions), random bytes, and every prefix of some.  Under an ASan build
every input goes to C in a malloc() block of its exact length (test_parse_diff.exact).

Offloads (a TUN with IFF_VNET_HDR): ``sw_pkt_vnet_check`` gives Python's ``vnet_check``
verdict for headers near and across every bound, and ``sw_pkt_rewrite_partial`` the
same bytes as ``rewrite(partial=True)``; a field that held the pseudo-header's partial
sum holds exactly the new addresses' after it, finishing it gives a checksum that
verifies, and the reverse rewrite gives back every byte.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway import _relay
from spliceway.tun import packet as P
from tests.csrc.test_parse_diff import exact, note
from tests.helpers.examples import diff_settings as _settings

ffi, lib = _relay.ffi, _relay.lib


# -- the C side ----------------------------------------------------------------------------

_FIELDS = ("version", "proto", "ttl", "ip_len", "l4_off", "l4_len", "payload_off",
           "payload_len", "sport", "dport", "l4_csum", "tcp_flags", "icmp_type",
           "icmp_code", "seq", "ack")  # fmt: skip


def c_parse(buf: bytes):
    out = ffi.new("sw_pkt *")
    with exact(buf) as p:
        rc = lib.sw_pkt_parse(p, len(buf), out)
    if rc != lib.SW_PKT_OK:
        assert bytes(ffi.buffer(out)) == bytes(ffi.sizeof("sw_pkt")), "out not zeroed"
        return P.Status(rc), out
    alen = 4 if out.version == 4 else 16
    src, dst = bytes(out.src), bytes(out.dst)
    assert src[alen:] == dst[alen:] == bytes(16 - alen)
    return (P.Status.OK, {f: getattr(out, f) for f in _FIELDS} | {"src": src[:alen],
            "dst": dst[:alen]}), out  # fmt: skip


def py_parse(buf: bytes):
    try:
        pk = P.parse(buf)
    except P.PacketError as exc:
        return exc.status, None
    return (P.Status.OK, {f: getattr(pk, f) for f in (*_FIELDS, "src", "dst")}), pk


def check_parse(buf: bytes):
    """Both parsers on buf; returns (C's sw_pkt, Python's Packet) when OK."""
    (cv, cpk), (pv, ppk) = c_parse(buf), py_parse(buf)
    assert cv == pv, buf.hex()
    status = cv if isinstance(cv, P.Status) else cv[0]
    note(f"parse: {status.name}" + (f" proto {ppk.proto}" if ppk else ""))
    if ppk is not None:
        assert ppk.ip_len <= len(buf)
        assert ppk.payload_off + ppk.payload_len <= ppk.ip_len
        with exact(buf) as p:
            assert bool(lib.sw_pkt_l4_csum_ok(p, cpk)) == P.l4_csum_ok(buf, ppk)
    return (cpk, ppk) if ppk is not None else None


def _addr(a: bytes) -> bytes:
    return a + bytes(16 - len(a))


def c_rewrite(buf: bytes, cpk, src: bytes, sport: int, dst: bytes, dport: int):
    b = ffi.new("uint8_t[]", buf)
    pk = ffi.new("sw_pkt *", cpk[0])
    rc = lib.sw_pkt_rewrite(b, pk, _addr(src), sport, _addr(dst), dport)
    return rc, bytes(ffi.buffer(b, len(buf))), pk


def c_rewrite_partial(buf: bytes, cpk, src: bytes, sport: int, dst: bytes, dport: int):
    b = ffi.new("uint8_t[]", buf)
    pk = ffi.new("sw_pkt *", cpk[0])
    rc = lib.sw_pkt_rewrite_partial(b, pk, _addr(src), sport, _addr(dst), dport)
    return rc, bytes(ffi.buffer(b, len(buf))), pk


def c_vnet_check(hdr: P.VnetHeader, cpk) -> int:
    h = ffi.new("sw_vnet_hdr *")
    ffi.memmove(h, hdr.pack(), P.VNET_HDR_LEN)
    return int(lib.sw_pkt_vnet_check(h, cpk))


def c_echo(buf: bytes, cpk):
    b = ffi.new("uint8_t[]", buf)
    pk = ffi.new("sw_pkt *", cpk[0])
    rc = lib.sw_pkt_echo_reply(b, pk)
    return rc, bytes(ffi.buffer(b, len(buf))), pk


def c_build_udp(version: int, src: bytes, sport: int, dst: bytes, dport: int, payload: bytes,
                cap: int):  # fmt: skip
    out = ffi.new("uint8_t[]", max(cap, 1))
    rc = lib.sw_pkt_build_udp(out, cap, version, _addr(src), sport, _addr(dst), dport,
                              payload, len(payload))  # fmt: skip
    return rc, bytes(ffi.buffer(out, max(rc, 0)))


def c_build_rst(cpk, cap: int = 64):
    out = ffi.new("uint8_t[]", cap)
    rc = lib.sw_pkt_build_tcp_rst(out, cap, cpk)
    return rc, bytes(ffi.buffer(out, max(rc, 0)))


# -- packet generators ----------------------------------------------------------------------

addr4 = st.binary(min_size=4, max_size=4)
addr6 = st.binary(min_size=16, max_size=16)
port = st.integers(0, 65535)


def _ip4(proto: int, src: bytes, dst: bytes, l4: bytes, options: bytes, ttl: int,
         flags_frag: int = 0x4000) -> bytes:  # fmt: skip
    ihl = (20 + len(options)) // 4
    hdr = bytearray(20)
    hdr[0] = 0x40 | ihl
    hdr[2:4] = (20 + len(options) + len(l4)).to_bytes(2, "big")
    hdr[4:6] = b"\x12\x34"
    hdr[6:8] = flags_frag.to_bytes(2, "big")
    hdr[8], hdr[9] = ttl, proto
    hdr[12:16], hdr[16:20] = src, dst
    hdr = hdr + options
    hdr[10:12] = P.checksum(bytes(hdr)).to_bytes(2, "big")
    return bytes(hdr) + l4


def _ip6(proto: int, src: bytes, dst: bytes, l4: bytes, exts: list[tuple[int, bytes]],
         ttl: int) -> bytes:  # fmt: skip
    """exts: (next-header code of the extension, its body after the 2 fixed bytes)."""
    chain = b""
    first = exts[0][0] if exts else proto
    for i, (_code, body) in enumerate(exts):
        nxt = exts[i + 1][0] if i + 1 < len(exts) else proto
        chain += bytes([nxt, (2 + len(body)) // 8 - 1]) + body
    plen = len(chain) + len(l4)
    return (
        bytes([0x60, 0, 0, 0])
        + plen.to_bytes(2, "big")
        + bytes([first, ttl])
        + src
        + dst
        + chain
        + l4
    )


def _l4(version: int, proto: int, src: bytes, dst: bytes, body: bytes, csum_at: int | None,
        udp_zero: bool) -> bytes:  # fmt: skip
    if csum_at is None:
        return body
    b = bytearray(body)
    b[csum_at : csum_at + 2] = b"\0\0"
    if proto == P.PROTO_ICMP:
        c = P.checksum(bytes(b))
    else:
        c = P.checksum(P.pseudo_header(version, proto, src, dst, len(b)) + bytes(b))
    if proto == P.PROTO_UDP:
        c = 0 if (udp_zero and version == 4) else (c or 0xFFFF)
    b[csum_at : csum_at + 2] = c.to_bytes(2, "big")
    return bytes(b)


@st.composite
def packets(draw) -> bytes:
    version = draw(st.sampled_from([4, 6]))
    src = draw(addr4 if version == 4 else addr6)
    dst = draw(addr4 if version == 4 else addr6)
    kind = draw(st.sampled_from(["tcp", "udp", "icmp", "other"]))
    payload = draw(st.binary(max_size=96))
    ttl = draw(st.integers(0, 255))
    csum_at: int | None
    if kind == "tcp":
        proto = P.PROTO_TCP
        opts = draw(st.binary(max_size=40).map(lambda b: b[: len(b) // 4 * 4]))
        hdr = bytearray(20)
        hdr[0:4] = draw(port).to_bytes(2, "big") + draw(port).to_bytes(2, "big")
        hdr[4:12] = draw(st.binary(min_size=8, max_size=8))
        hdr[12] = ((20 + len(opts)) // 4) << 4
        hdr[13] = draw(st.integers(0, 255))
        hdr[14:16] = b"\xff\xff"
        body, csum_at = bytes(hdr) + opts + payload, 16
    elif kind == "udp":
        proto = P.PROTO_UDP
        body = (draw(port).to_bytes(2, "big") + draw(port).to_bytes(2, "big")
                + (8 + len(payload)).to_bytes(2, "big") + b"\0\0" + payload)  # fmt: skip
        csum_at = 6
    elif kind == "icmp":
        proto = P.PROTO_ICMP if version == 4 else P.PROTO_ICMPV6
        typ = draw(st.sampled_from([8, 8, 128, 128, 0, 129, 3, 1]))
        body = (
            bytes([typ, draw(st.sampled_from([0, 0, 0, 1]))])
            + b"\0\0"
            + draw(st.binary(min_size=4, max_size=4))
            + payload
        )
        csum_at = 2
    else:
        proto = draw(st.sampled_from([0x2F, 0x32, 0x84, 59, 255]))
        body, csum_at = payload, None
    l4 = _l4(version, proto, src, dst, body, csum_at, draw(st.booleans()))
    if draw(st.integers(0, 9)) == 0 and csum_at is not None and len(l4) > csum_at:
        l4 = l4[:csum_at] + bytes([l4[csum_at] ^ 1]) + l4[csum_at + 1 :]  # a wrong checksum
    if version == 4:
        opts = draw(st.binary(max_size=40).map(lambda b: b[: len(b) // 4 * 4]))
        ff = draw(st.sampled_from([0x4000] * 4 + [0x0000, 0x0000, 0x2000, 0x0001]))
        pkt = _ip4(proto, src, dst, l4, opts, ttl, ff)
    else:
        exts = draw(st.lists(
            st.tuples(st.sampled_from([0, 60, 60, 60, 43, 44]),
                      st.integers(0, 3).map(lambda n: bytes(6 + 8 * n))),
            max_size=2,
        ))  # fmt: skip
        pkt = _ip6(proto, src, dst, l4, exts, ttl)
    trailer = draw(st.binary(max_size=4)) if draw(st.integers(0, 7)) == 0 else b""
    return pkt + trailer


@st.composite
def mutated(draw) -> bytes:
    b = bytearray(draw(packets()))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    for _ in range(draw(st.integers(1, 4))):
        op = rnd.randrange(5)
        if op == 0 and b:
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:
            b[rnd.randrange(len(b))] = rnd.choice([0, 0xFF, 0x45, 0x60, 0x05, 0x50, 0x0F, 0x80])
        elif op == 2 and b:
            del b[rnd.randrange(len(b)) :]
        elif op == 3:
            b += bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 16)))
        elif op == 4 and len(b) > 4:
            i = rnd.randrange(min(len(b) - 1, 48))
            b[i : i + 2] = rnd.randrange(65536).to_bytes(2, "big")
    return bytes(b)


# -- the tests ------------------------------------------------------------------------------


def _assert_rewrite(buf: bytes, both, src: bytes, sport: int, dst: bytes, dport: int) -> None:
    cpk, ppk = both
    rc, cbytes, cout = c_rewrite(buf, cpk, src, sport, dst, dport)
    if ppk.proto not in (P.PROTO_TCP, P.PROTO_UDP):
        assert rc == -22
        return
    assert rc == 0
    pbytes, pout = P.rewrite(buf, ppk, src, sport, dst, dport)
    assert cbytes == pbytes
    assert (cout.sport, cout.dport, cout.l4_csum) == (pout.sport, pout.dport, pout.l4_csum)
    # The rewritten packet parses to the new endpoints; checksums that verified still do.
    again = P.parse(pbytes)
    assert (again.src, again.sport, again.dst, again.dport) == (src, sport, dst, dport)
    if P.l4_csum_ok(buf, ppk):
        assert P.l4_csum_ok(pbytes, again)
        _assert_full_recompute(pbytes, again)
        note("rewrite: verified")


def _zero_normalized(buf: bytes, pk: P.Packet) -> bytes:
    """buf with a transport checksum of 0xffff written as 0 (the same one's complement
    value: a rewrite and its reverse may trade one form for the other)."""
    at = pk.l4_off + (16 if pk.proto == P.PROTO_TCP else 6)
    if buf[at : at + 2] == b"\xff\xff":
        return buf[:at] + b"\0\0" + buf[at + 2 :]
    return buf


def _assert_full_recompute(buf: bytes, pk: P.Packet) -> None:
    """The incremental checksum is the full recomputation's (up to +0/-0)."""
    at = pk.l4_off + (16 if pk.proto == P.PROTO_TCP else 6)
    if pk.proto == P.PROTO_UDP and pk.version == 4 and pk.l4_csum == 0:
        return
    seg = bytearray(buf[pk.l4_off : pk.ip_len if pk.proto == P.PROTO_TCP else
                        pk.payload_off + pk.payload_len])  # fmt: skip
    seg[at - pk.l4_off : at - pk.l4_off + 2] = b"\0\0"
    full = P.checksum(P.pseudo_header(pk.version, pk.proto, pk.src, pk.dst, len(seg)) + seg)
    if pk.proto == P.PROTO_UDP:
        full = full or 0xFFFF
    got = int.from_bytes(buf[at : at + 2], "big")
    assert got == full or {got, full} == {0, 0xFFFF}


@_settings(600)
@given(packets(), st.data())
def test_wellformed(buf: bytes, data) -> None:
    both = check_parse(buf)
    if both is None:
        return
    cpk, ppk = both
    alen = 4 if ppk.version == 4 else 16
    src = data.draw(st.binary(min_size=alen, max_size=alen))
    dst = data.draw(st.binary(min_size=alen, max_size=alen))
    _assert_rewrite(buf, both, src, data.draw(port), dst, data.draw(port))
    # The TUN stack's own pair: a rewrite and its reverse give the packet back.
    if ppk.proto in (P.PROTO_TCP, P.PROTO_UDP):
        fwd, fpk = P.rewrite(buf, ppk, src, 10000, dst, 4242)
        back, _ = P.rewrite(fwd, fpk, ppk.src, ppk.sport, ppk.dst, ppk.dport)
        assert _zero_normalized(back, ppk) == _zero_normalized(buf, ppk)
    rc, cbytes, cout = c_echo(buf, cpk)
    try:
        pbytes, pout = P.echo_reply(buf, ppk)
    except ValueError:
        assert rc == -22
    else:
        assert rc == 0 and cbytes == pbytes, (cbytes.hex(), pbytes.hex())
        again = P.parse(pbytes)
        assert (again.src, again.dst, again.icmp_type) == (ppk.dst, ppk.src, pout.icmp_type)
        assert cout.icmp_type == pout.icmp_type and cout.l4_csum == pout.l4_csum
        assert P.l4_csum_ok(pbytes, again) == P.l4_csum_ok(buf, ppk)
        note("echo reply")
    rc, cbytes = c_build_rst(cpk)
    try:
        pbytes = P.build_tcp_rst(ppk)
    except ValueError:
        assert rc == -22
    else:
        assert rc == len(pbytes) and cbytes == pbytes
        rst = P.parse(pbytes)
        assert rst.tcp_flags & P.TCP_RST and P.l4_csum_ok(pbytes, rst)
        assert (rst.src, rst.sport, rst.dst, rst.dport) == (ppk.dst, ppk.dport, ppk.src, ppk.sport)
        assert c_build_rst(cpk, len(pbytes) - 1)[0] == -90  # EMSGSIZE
        note("rst")


@_settings(1500)
@given(mutated())
def test_mutated(buf: bytes) -> None:
    both = check_parse(buf)
    if both is not None and both[1].proto in (P.PROTO_TCP, P.PROTO_UDP):
        alen = 4 if both[1].version == 4 else 16
        _assert_rewrite(buf, both, bytes(range(alen)), 1, bytes(alen), 65535)


@_settings(400)
@given(st.binary(max_size=120))
def test_random_bytes(buf: bytes) -> None:
    check_parse(buf)


@_settings(60)
@given(packets())
def test_prefixes(buf: bytes) -> None:
    """Every prefix: a packet cut short is refused (never read past), never OK with
    fields other than the whole packet's."""
    whole = py_parse(buf)[0]
    for cut in range(len(buf) + 1):
        check_parse(buf[:cut])
        part = py_parse(buf[:cut])[0]
        if not isinstance(part, P.Status):
            assert part == whole


@_settings(400)
@given(st.sampled_from([4, 6]), st.data(), port, port, st.binary(max_size=300),
       st.integers(0, 400))  # fmt: skip
def test_build_udp(version: int, data, sport: int, dport: int, payload: bytes, cap: int) -> None:
    alen = 4 if version == 4 else 16
    src = data.draw(st.binary(min_size=alen, max_size=alen))
    dst = data.draw(st.binary(min_size=alen, max_size=alen))
    rc, cbytes = c_build_udp(version, src, sport, dst, dport, payload, cap)
    pbytes = P.build_udp(version, src, sport, dst, dport, payload)
    if cap < len(pbytes):
        assert rc == -90
        return
    assert rc == len(pbytes) and cbytes == pbytes
    pk = P.parse(pbytes)
    assert (pk.src, pk.sport, pk.dst, pk.dport, pk.proto) == (src, sport, dst, dport, 17)
    assert pbytes[pk.payload_off : pk.payload_off + pk.payload_len] == payload
    assert P.l4_csum_ok(pbytes, pk) and pk.l4_csum != 0


def test_build_udp_limits() -> None:
    big = bytes(65535 - 8 - 20)
    assert c_build_udp(4, bytes(4), 1, bytes(4), 2, big, 70000)[0] == 65535
    assert c_build_udp(4, bytes(4), 1, bytes(4), 2, big + b"x", 70000)[0] == -90
    assert c_build_udp(6, bytes(16), 1, bytes(16), 2, bytes(65535 - 8), 70000)[0] == 65535 + 40
    assert c_build_udp(6, bytes(16), 1, bytes(16), 2, bytes(65535 - 7), 70000)[0] == -90
    assert c_build_udp(5, bytes(16), 1, bytes(16), 2, b"", 100)[0] == -22
    with pytest.raises(ValueError, match="too long"):
        P.build_udp(4, bytes(4), 1, bytes(4), 2, big + b"x")


def test_checksum_matches() -> None:
    rnd = random.Random(5)
    for n in range(70):
        data = bytes(rnd.randrange(256) for _ in range(n))
        assert lib.sw_pkt_checksum(data, len(data)) == P.checksum(data)
    # The RFC 1071 example: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2.
    assert P.checksum(bytes.fromhex("0001f203f4f5f6f7")) == (~0xDDF2) & 0xFFFF


def test_known_packets() -> None:
    """Hand-checked statuses, so a bug both sides share still shows."""
    tcp = bytes.fromhex("3039005000000001000000005002ffff00000000")
    a, b = bytes([10, 0, 0, 1]), bytes([1, 2, 3, 4])
    good = _ip4(6, a, b, _l4(4, 6, a, b, tcp, 16, False), b"", 64)
    pk = P.parse(good)
    assert (pk.sport, pk.dport, pk.tcp_flags, pk.seq) == (12345, 80, P.TCP_SYN, 1)
    assert P.l4_csum_ok(good, pk)
    cases = {
        b"": P.Status.BAD_VERSION,
        b"\x45": P.Status.SHORT,
        good[:19]: P.Status.SHORT,
        good[:39]: P.Status.SHORT,  # total length says 40
        bytes([0x44]) + good[1:]: P.Status.BAD_HEADER,
        good[:10] + bytes([good[10] ^ 1]) + good[11:]: P.Status.BAD_CHECKSUM,
        bytes([0x75]) + good[1:]: P.Status.BAD_VERSION,
        bytes.fromhex("60000000") + b"\0\0" + bytes([6, 64]) + bytes(32): P.Status.BAD_HEADER,
    }
    frag = _ip4(6, bytes(4), bytes(4), tcp, b"", 64, 0x2000)
    cases[frag] = P.Status.FRAGMENT
    cases[_ip4(6, bytes(4), bytes(4), tcp[:19], b"", 64)] = P.Status.BAD_L4
    cases[_ip6(6, bytes(16), bytes(16), tcp, [(44, bytes(6))], 64)] = P.Status.FRAGMENT
    cases[_ip6(6, bytes(16), bytes(16), tcp, [(43, bytes(6))], 64)] = P.Status.EXT_HEADER
    cases[_ip6(6, bytes(16), bytes(16), tcp, [(60, bytes(6)), (0, bytes(6))], 64)] = (
        P.Status.EXT_HEADER
    )
    for buf, want in cases.items():
        assert c_parse(buf)[0] == want, (buf.hex(), want)
        assert py_parse(buf)[0] == want
    ok6 = _ip6(6, bytes(16), bytes(16), tcp, [(0, bytes(6)), (60, bytes(14))], 64)
    pk6 = P.parse(ok6)
    assert (pk6.l4_off, pk6.proto, pk6.sport) == (40 + 8 + 16, 6, 12345)
    assert check_parse(ok6) is not None


# -- offloads: the virtio-net header and partial checksums ----------------------------------


def _csum_at(pk: P.Packet) -> int:
    return pk.l4_off + (16 if pk.proto == P.PROTO_TCP else 6)


def _seg_len(pk: P.Packet) -> int:
    """The transport length Linux's partial sum covers: the TCP segment, the UDP length."""
    return pk.l4_len if pk.proto == P.PROTO_TCP else pk.payload_len + P.UDP_HDR


def _with_partial(buf: bytes, pk: P.Packet) -> bytes:
    """buf with its transport checksum field turned partial, as Linux leaves it for a
    CHECKSUM_PARTIAL packet (NEEDS_CSUM)."""
    at = _csum_at(pk)
    psum = P.partial_csum(pk.version, pk.proto, pk.src, pk.dst, _seg_len(pk))
    return buf[:at] + psum.to_bytes(2, "big") + buf[at + 2 :]


@st.composite
def partial_packets(draw) -> tuple[bytes, P.Packet]:
    """TCP or UDP packets that parse, with a partial checksum (and sometimes a large
    payload, as GSO brings)."""
    buf = draw(packets())
    try:
        pk = P.parse(buf)
    except P.PacketError:
        pk = None
    if pk is None or pk.proto not in (P.PROTO_TCP, P.PROTO_UDP):
        version = draw(st.sampled_from([4, 6]))
        alen = 4 if version == 4 else 16
        src, dst = draw(st.binary(min_size=alen, max_size=alen)), draw(
            st.binary(min_size=alen, max_size=alen))  # fmt: skip
        payload = bytes(draw(st.sampled_from([0, 1, 1400, 9000, 65000 - 60])))
        tcp = bytes.fromhex("3039005000000001000000005010ffff00000000") + payload
        buf = (_ip4(6, src, dst, tcp, b"", 64) if version == 4
               else _ip6(6, src, dst, tcp, [], 64))  # fmt: skip
        pk = P.parse(buf)
    return _with_partial(buf, pk), pk


def _hdr_for(pk: P.Packet, gso: bool = False) -> P.VnetHeader:
    """The header Linux sends with pk (NEEDS_CSUM; GSO when asked, TCP only)."""
    if not gso:
        return P.VnetHeader(P.VNET_F_NEEDS_CSUM, 0, 0, 0, pk.l4_off, _csum_at(pk) - pk.l4_off)
    gso_type = P.VNET_GSO_TCPV4 if pk.version == 4 else P.VNET_GSO_TCPV6
    return P.VnetHeader(P.VNET_F_NEEDS_CSUM, gso_type, pk.payload_off, 1448, pk.l4_off, 16)


@_settings(500)
@given(partial_packets(), st.data())
def test_partial_rewrite(both: tuple[bytes, P.Packet], data) -> None:
    buf, ppk = both
    parsed = check_parse(buf)
    assert parsed is not None
    cpk = parsed[0]
    assert c_vnet_check(_hdr_for(ppk), cpk) == 0 and P.vnet_check(_hdr_for(ppk), ppk)
    if ppk.proto == P.PROTO_TCP:
        assert c_vnet_check(_hdr_for(ppk, True), cpk) == 0
    alen = 4 if ppk.version == 4 else 16
    src = data.draw(st.binary(min_size=alen, max_size=alen))
    dst = data.draw(st.binary(min_size=alen, max_size=alen))
    sport, dport = data.draw(port), data.draw(port)
    rc, cbytes, cout = c_rewrite_partial(buf, cpk, src, sport, dst, dport)
    pbytes, pout = P.rewrite(buf, ppk, src, sport, dst, dport, partial=True)
    assert rc == 0 and cbytes == pbytes
    assert (cout.sport, cout.dport, cout.l4_csum) == (pout.sport, pout.dport, pout.l4_csum)
    again = P.parse(pbytes)  # the IPv4 header checksum still verifies
    assert (again.src, again.sport, again.dst, again.dport) == (src, sport, dst, dport)
    # Exactly the new addresses' partial sum, which finishes into a good checksum.
    assert pbytes == _with_partial(pbytes, again)
    done = P.complete_csum(pbytes[: again.ip_len], again.l4_off, _csum_at(again) - again.l4_off)
    assert P.l4_csum_ok(done, P.parse(done))
    # And back: every byte as it was (a partial sum has one form of zero only).
    back, _ = P.rewrite(pbytes, pout, ppk.src, ppk.sport, ppk.dst, ppk.dport, partial=True)
    assert back == buf


@_settings(800)
@given(mutated(), st.data())
def test_partial_rewrite_mutated(buf: bytes, data) -> None:
    """Whatever the field holds, C and Python move it the same way."""
    both = check_parse(buf)
    if both is None or both[1].proto not in (P.PROTO_TCP, P.PROTO_UDP):
        return
    cpk, ppk = both
    alen = 4 if ppk.version == 4 else 16
    src, dst = bytes(range(alen)), data.draw(st.binary(min_size=alen, max_size=alen))
    rc, cbytes, _ = c_rewrite_partial(buf, cpk, src, 1, dst, 65535)
    assert rc == 0 and cbytes == P.rewrite(buf, ppk, src, 1, dst, 65535, partial=True)[0]


def _near(x: int) -> st.SearchStrategy[int]:
    return st.sampled_from([x, x - 1, x + 1, 0]).filter(lambda v: 0 <= v <= 0xFFFF) | st.integers(
        0, 0xFFFF)  # fmt: skip


@st.composite
def vnet_headers(draw, pk: P.Packet) -> P.VnetHeader:
    flags = draw(st.sampled_from([0, 1, 1, 1, 2, 3, 4, 0x81]) | st.integers(0, 255))
    gso = draw(st.sampled_from([0, 0, 1, 4, 0x81, 0x84, 3, 5, 0x80, 2]) | st.integers(0, 255))
    return P.VnetHeader(
        flags, gso,
        draw(_near(pk.ip_len) | _near(pk.payload_off)),
        draw(st.sampled_from([0, 1, 1448, 0xFFFF, 0xFFFE]) | st.integers(0, 0xFFFF)),
        draw(_near(pk.l4_off)),
        draw(st.sampled_from([16, 6, 2, 0, 17]) | st.integers(0, 0xFFFF)),
    )  # fmt: skip


@_settings(1500)
@given(st.one_of(packets(), mutated()), st.data())
def test_vnet_check(buf: bytes, data) -> None:
    both = check_parse(buf)
    if both is None:
        return
    cpk, ppk = both
    hdr = data.draw(vnet_headers(ppk))
    ok = P.vnet_check(hdr, ppk)
    assert (c_vnet_check(hdr, cpk) == 0) == ok, hdr
    note(f"vnet: {'ok' if ok else 'refused'}")


def test_vnet_known_headers() -> None:
    """Hand-checked verdicts, so a bug both sides share still shows."""
    assert ffi.sizeof("sw_vnet_hdr") == P.VNET_HDR_LEN == lib.SW_VNET_HDR_LEN
    a, b = bytes([10, 0, 0, 1]), bytes([1, 2, 3, 4])
    tcp = bytes.fromhex("3039005000000001000000005010ffff00000000") + bytes(3000)
    t4 = _ip4(6, a, b, tcp, b"", 64)
    t6 = _ip6(6, bytes(16), bytes(16), tcp, [(60, bytes(6))], 64)
    u4 = _ip4(17, a, b, bytes.fromhex("3039003500100000") + bytes(8), b"", 64)
    icmp = _ip4(1, a, b, bytes([8, 0, 0, 0, 0, 1, 0, 1]), b"", 64)
    ip_len = len(t4)
    gso4 = P.VnetHeader(1, P.VNET_GSO_TCPV4, 40, 1448, 20, 16)
    gso6 = P.VnetHeader(1, P.VNET_GSO_TCPV6, 68, 1428, 48, 16)
    cases = [
        (t4, P.VnetHeader(), True),
        (t4, P.VnetHeader(2), True),  # DATA_VALID
        (t4, P.VnetHeader(1, 0, 0, 0, 20, 16), True),
        (t4, gso4, True),
        (t4, replace(gso4, gso_type=P.VNET_GSO_TCPV4 | P.VNET_GSO_ECN), True),
        (t4, replace(gso4, hdr_len=ip_len), True),
        (t4, replace(gso4, hdr_len=ip_len + 1), False),
        (t4, replace(gso4, gso_type=P.VNET_GSO_TCPV6), False),
        (t4, replace(gso4, gso_type=P.VNET_GSO_UDP_L4), False),
        (t4, replace(gso4, gso_type=P.VNET_GSO_UDP), False),
        (t4, replace(gso4, gso_type=2), False),
        (t4, replace(gso4, flags=0), False),  # GSO without NEEDS_CSUM
        (t4, replace(gso4, flags=3), False),
        (t4, replace(gso4, flags=5), False),
        (t4, replace(gso4, gso_size=0), False),
        (t4, replace(gso4, gso_size=0xFFFF), False),
        (t4, replace(gso4, csum_start=21), False),
        (t4, replace(gso4, csum_offset=6), False),
        (t4, P.VnetHeader(0, P.VNET_GSO_ECN), False),
        (t4, P.VnetHeader(0, 0, 0, 1448, 99, 99), True),  # ignored without the flags
        (t6, gso6, True),
        (t6, replace(gso6, gso_type=P.VNET_GSO_TCPV4), False),
        (t6, replace(gso6, csum_start=40), False),  # the options header is not TCP
        (u4, P.VnetHeader(1, 0, 0, 0, 20, 6), True),
        (u4, P.VnetHeader(1, 0, 0, 0, 20, 16), False),
        (u4, P.VnetHeader(1, P.VNET_GSO_TCPV4, 28, 8, 20, 6), False),  # GSO on UDP
        (icmp, P.VnetHeader(), True),
        (icmp, P.VnetHeader(1, 0, 0, 0, 20, 2), False),
    ]
    for buf, hdr, want in cases:
        parsed = check_parse(buf)
        assert parsed is not None
        cpk, pk = parsed
        assert P.vnet_check(hdr, pk) == want, hdr
        assert (c_vnet_check(hdr, cpk) == 0) == want, hdr


def test_partial_csum_is_what_finishes_into_the_checksum() -> None:
    """The partial sum, finished over the segment, is the full checksum (both families,
    TCP and UDP), so the partial rewrite's expectations are Linux's."""
    for version, alen in ((4, 4), (6, 16)):
        src, dst = bytes(range(1, alen + 1)), bytes(range(100, 100 + alen))
        tcp = bytes.fromhex("3039005000000001000000005010ffff00000000") + b"data" * 300
        buf = _ip4(6, src, dst, tcp, b"", 64) if version == 4 else _ip6(6, src, dst, tcp, [], 64)
        pk = P.parse(buf)
        full = _l4(version, 6, src, dst, tcp, 16, False)
        assert P.complete_csum(_with_partial(buf, pk), pk.l4_off, 16)[pk.l4_off :] == full
        udp = b"\x30\x39\x00\x35" + (8 + 5).to_bytes(2, "big") + b"\0\0" + b"hello"
        mk = _ip4 if version == 4 else _ip6
        ubuf = mk(17, src, dst, udp, b"" if version == 4 else [], 64)
        upk = P.parse(ubuf)
        done = P.complete_csum(_with_partial(ubuf, upk), upk.l4_off, 6)
        assert P.l4_csum_ok(done, P.parse(done))
