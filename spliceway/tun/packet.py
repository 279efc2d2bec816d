"""IPv4/IPv6 packets as a TUN device carries them: the reference for csrc/pkt.c.

Pure functions, written for clarity rather than speed: the TUN stack's packet loop
runs the C versions (``sw_pkt_*``), and tests/csrc/test_pkt_diff.py holds every one of
them to these, status for status and byte for byte.  csrc/pkt.h states the contract
(what is accepted, why fragments and routing headers are refused, how checksums are
updated); the docstrings here repeat only what a reader of Python needs.

Addresses are ``bytes`` of 4 (IPv4) or 16 (IPv6); ports and other fields are ints.

With offloads (a TUN opened with IFF_VNET_HDR), each packet comes with a
:class:`VnetHeader`; :func:`vnet_check` says whether it fits its packet, and a packet
whose transport checksum is partial (``VNET_F_NEEDS_CSUM``: the field holds
:func:`partial_csum`, the pseudo-header's sum) is rewritten with
``rewrite(..., partial=True)``. :func:`complete_csum` finishes such a checksum, as the
kernel does when it takes the packet back.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, replace

IP4_MIN = 20
IP6_HDR = 40
TCP_MIN = 20
UDP_HDR = 8
ICMP_HDR = 8
IP6_EXT_MAX = 8
TTL_REPLY = 64

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_ICMPV6 = 58

#: linux/virtio_net.h: sizeof(struct virtio_net_hdr), its flags and GSO types.
VNET_HDR_LEN = 10
VNET_F_NEEDS_CSUM = 1
VNET_F_DATA_VALID = 2
VNET_GSO_NONE = 0
VNET_GSO_TCPV4 = 1
VNET_GSO_UDP = 3
VNET_GSO_TCPV6 = 4
VNET_GSO_UDP_L4 = 5
VNET_GSO_ECN = 0x80
#: Host byte order, as the TUN uses it (the legacy layout), no padding.
_VNET = struct.Struct("=BBHHHH")

TCP_FIN = 1
TCP_SYN = 2
TCP_RST = 4
TCP_PSH = 8
TCP_ACK = 16


class Status(enum.IntEnum):
    """sw_pkt_status: why a packet was refused (OK when it was not)."""

    OK = 0
    SHORT = 1
    BAD_VERSION = 2
    BAD_HEADER = 3
    BAD_CHECKSUM = 4
    FRAGMENT = 5
    EXT_HEADER = 6
    BAD_L4 = 7


class PacketError(ValueError):
    """A packet the parser refuses; ``status`` says why."""

    def __init__(self, status: Status) -> None:
        super().__init__(status.name)
        self.status = status


@dataclass(frozen=True)
class Packet:
    """sw_pkt: the fields of a parsed packet (offsets into the bytes parsed)."""

    version: int
    proto: int
    ttl: int
    src: bytes
    dst: bytes
    ip_len: int
    l4_off: int
    l4_len: int
    payload_off: int
    payload_len: int
    sport: int = 0
    dport: int = 0
    l4_csum: int = 0
    tcp_flags: int = 0
    icmp_type: int = 0
    icmp_code: int = 0
    seq: int = 0
    ack: int = 0


@dataclass(frozen=True)
class VnetHeader:
    """sw_vnet_hdr: the virtio-net header before each packet of an IFF_VNET_HDR TUN."""

    flags: int = 0
    gso_type: int = VNET_GSO_NONE
    hdr_len: int = 0
    gso_size: int = 0
    csum_start: int = 0
    csum_offset: int = 0

    def pack(self) -> bytes:
        return _VNET.pack(self.flags, self.gso_type, self.hdr_len, self.gso_size,
                          self.csum_start, self.csum_offset)  # fmt: skip

    @classmethod
    def unpack(cls, data: bytes) -> VnetHeader:
        """From the first VNET_HDR_LEN bytes of ``data``."""
        return cls(*_VNET.unpack_from(data))


def _u16(b: bytes | bytearray, off: int) -> int:
    return int.from_bytes(b[off : off + 2], "big")


def _u32(b: bytes | bytearray, off: int) -> int:
    return int.from_bytes(b[off : off + 4], "big")


def ones_sum(data: bytes, start: int = 0) -> int:
    """The one's complement sum of ``data`` as big-endian 16-bit words (an odd last
    byte is the high half of a word), added to ``start``, folded to 16 bits."""
    if len(data) % 2:
        data = data + b"\0"
    total = start + sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    return ~ones_sum(data) & 0xFFFF


def pseudo_header(version: int, proto: int, src: bytes, dst: bytes, l4_len: int) -> bytes:
    """The transport checksum's pseudo-header (RFC 793/768; RFC 8200 8.1)."""
    if version == 4:
        return src + dst + bytes([0, proto]) + l4_len.to_bytes(2, "big")
    return src + dst + l4_len.to_bytes(4, "big") + bytes([0, 0, 0, proto])


def csum_replace(hc: int, old: bytes, new: bytes) -> int:
    """RFC 1624 equation 3, HC' = ~(~HC + sum(~m) + sum(m')), 16 bits at a time."""
    total = ~hc & 0xFFFF
    for i in range(0, len(old), 2):
        total += (~_u16(old, i) & 0xFFFF) + _u16(new, i)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def partial_csum(version: int, proto: int, src: bytes, dst: bytes, l4_len: int) -> int:
    """What a partial (NEEDS_CSUM) checksum field holds: the pseudo-header's one's
    complement sum, folded and not complemented (Linux's ``~csum_tcpudp_magic``)."""
    return ones_sum(pseudo_header(version, proto, src, dst, l4_len))


def complete_csum(buf: bytes, csum_start: int, csum_offset: int) -> bytes:
    """Finishes a partial checksum: the complemented sum of everything from
    ``csum_start`` on, the field's partial sum included, written into the field (what
    the kernel, or wireguard-go's gsoNoneChecksum, does for CHECKSUM_PARTIAL)."""
    at = csum_start + csum_offset
    initial = _u16(buf, at)
    out = bytearray(buf)
    out[at : at + 2] = b"\0\0"
    out[at : at + 2] = (~ones_sum(bytes(out[csum_start:]), initial) & 0xFFFF).to_bytes(2, "big")
    return bytes(out)


def _parse_l4(buf: bytes, version: int, proto: int, ttl: int, src: bytes, dst: bytes,
              ip_len: int, l4_off: int) -> Packet:  # fmt: skip
    l4_len = ip_len - l4_off
    base = Packet(version, proto, ttl, src, dst, ip_len, l4_off, l4_len, l4_off, l4_len)
    l4 = buf[l4_off:ip_len]
    if proto == PROTO_TCP:
        if l4_len < TCP_MIN:
            raise PacketError(Status.BAD_L4)
        hlen = (l4[12] >> 4) * 4
        if hlen < TCP_MIN or hlen > l4_len:
            raise PacketError(Status.BAD_L4)
        return replace(
            base, sport=_u16(l4, 0), dport=_u16(l4, 2), seq=_u32(l4, 4), ack=_u32(l4, 8),
            tcp_flags=l4[13], l4_csum=_u16(l4, 16), payload_off=l4_off + hlen,
            payload_len=l4_len - hlen,
        )  # fmt: skip
    if proto == PROTO_UDP:
        if l4_len < UDP_HDR:
            raise PacketError(Status.BAD_L4)
        ulen = _u16(l4, 4)
        if ulen < UDP_HDR or ulen > l4_len:
            raise PacketError(Status.BAD_L4)
        return replace(
            base, sport=_u16(l4, 0), dport=_u16(l4, 2), l4_csum=_u16(l4, 6),
            payload_off=l4_off + UDP_HDR, payload_len=ulen - UDP_HDR,
        )  # fmt: skip
    if proto in (PROTO_ICMP, PROTO_ICMPV6):
        if l4_len < ICMP_HDR:
            raise PacketError(Status.BAD_L4)
        return replace(
            base, icmp_type=l4[0], icmp_code=l4[1], l4_csum=_u16(l4, 2), sport=_u16(l4, 4),
            dport=_u16(l4, 6), payload_off=l4_off + ICMP_HDR, payload_len=l4_len - ICMP_HDR,
        )  # fmt: skip
    return base


def _parse4(buf: bytes) -> Packet:
    if len(buf) < IP4_MIN:
        raise PacketError(Status.SHORT)
    ihl = (buf[0] & 0x0F) * 4
    total = _u16(buf, 2)
    if ihl < IP4_MIN or total < ihl:
        raise PacketError(Status.BAD_HEADER)
    if total > len(buf):
        raise PacketError(Status.SHORT)
    if ones_sum(buf[:ihl]) != 0xFFFF:
        raise PacketError(Status.BAD_CHECKSUM)
    if _u16(buf, 6) & 0x3FFF:
        raise PacketError(Status.FRAGMENT)
    return _parse_l4(buf, 4, buf[9], buf[8], buf[12:16], buf[16:20], total, ihl)


def _parse6(buf: bytes) -> Packet:
    if len(buf) < IP6_HDR:
        raise PacketError(Status.SHORT)
    plen = _u16(buf, 4)
    if plen == 0:
        raise PacketError(Status.BAD_HEADER)
    total = IP6_HDR + plen
    if total > len(buf):
        raise PacketError(Status.SHORT)
    off, nxt, n = IP6_HDR, buf[6], 0
    while True:
        if nxt == 0 and n > 0:
            raise PacketError(Status.EXT_HEADER)
        if nxt == 44:
            raise PacketError(Status.FRAGMENT)
        if nxt == 43:
            raise PacketError(Status.EXT_HEADER)
        if nxt not in (0, 60):
            break
        if n == IP6_EXT_MAX or total - off < 8:
            raise PacketError(Status.EXT_HEADER)
        elen = (buf[off + 1] + 1) * 8
        if elen > total - off:
            raise PacketError(Status.EXT_HEADER)
        nxt = buf[off]
        off += elen
        n += 1
    return _parse_l4(buf, 6, nxt, buf[7], buf[8:24], buf[24:40], total, off)


def parse(buf: bytes) -> Packet:
    """Parse one packet; raises PacketError with the reason it is refused."""
    if not buf:
        raise PacketError(Status.BAD_VERSION)
    version = buf[0] >> 4
    if version == 4:
        return _parse4(buf)
    if version == 6:
        return _parse6(buf)
    raise PacketError(Status.BAD_VERSION)


def l4_csum_ok(buf: bytes, pk: Packet) -> bool:
    """Whether the transport checksum verifies (IPv4 UDP checksum 0: none, so yes)."""
    if pk.proto == PROTO_UDP:
        if pk.version == 4 and pk.l4_csum == 0:
            return True
        ulen = pk.payload_len + UDP_HDR
        seg = buf[pk.l4_off : pk.l4_off + ulen]
        return ones_sum(pseudo_header(pk.version, pk.proto, pk.src, pk.dst, ulen) + seg) == 0xFFFF
    seg = buf[pk.l4_off : pk.ip_len]
    if pk.proto in (PROTO_TCP, PROTO_ICMPV6):
        ph = pseudo_header(pk.version, pk.proto, pk.src, pk.dst, pk.l4_len)
        return ones_sum(ph + seg) == 0xFFFF
    if pk.proto == PROTO_ICMP:
        return ones_sum(seg) == 0xFFFF
    return False


def _psum_replace(psum: int, old: bytes, new: bytes) -> int:
    """A partial sum moved from ``old`` to ``new``: P + sum(~m) + sum(m'), folded."""
    total = psum
    for i in range(0, len(old), 2):
        total += (~_u16(old, i) & 0xFFFF) + _u16(new, i)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def vnet_check(hdr: VnetHeader, pk: Packet) -> bool:
    """Whether a virtio-net header fits the parsed packet it came with (sw_pkt_vnet_check:
    known flags, GSO only TCP of the packet's family with NEEDS_CSUM and a usable
    gso_size, NEEDS_CSUM only on TCP/UDP at their checksum field, hdr_len <= ip_len)."""
    needs_csum = bool(hdr.flags & VNET_F_NEEDS_CSUM)
    if hdr.flags not in (0, VNET_F_NEEDS_CSUM, VNET_F_DATA_VALID):
        return False
    gso = hdr.gso_type & ~VNET_GSO_ECN & 0xFF
    if gso != VNET_GSO_NONE:
        want = VNET_GSO_TCPV4 if pk.version == 4 else VNET_GSO_TCPV6
        if pk.proto != PROTO_TCP or gso != want or not needs_csum:
            return False
        if hdr.gso_size in (0, 0xFFFF):
            return False
    elif hdr.gso_type != VNET_GSO_NONE:
        return False
    if needs_csum:
        off = {PROTO_TCP: 16, PROTO_UDP: 6}.get(pk.proto)
        if off is None or hdr.csum_start != pk.l4_off or hdr.csum_offset != off:
            return False
    return hdr.hdr_len <= pk.ip_len


def _addr_offsets(version: int) -> tuple[int, int, int]:
    return (12, 16, 4) if version == 4 else (8, 24, 16)


def rewrite(buf: bytes, pk: Packet, src: bytes, sport: int, dst: bytes, dport: int,
            *, partial: bool = False) -> tuple[bytes, Packet]:  # fmt: skip
    """The NAT rewrite of a TCP or UDP packet: new endpoints, checksums updated
    incrementally (RFC 1624).  Returns the new bytes (the whole buffer, bytes past
    ip_len untouched) and fields.  ``partial``: the transport checksum field holds the
    pseudo-header's sum (NEEDS_CSUM), which only the address change moves, as a sum:
    P' = P + ~m + m' (sw_pkt_rewrite_partial)."""
    if pk.proto == PROTO_TCP:
        csum_at = pk.l4_off + 16
    elif pk.proto == PROTO_UDP:
        csum_at = pk.l4_off + 6
    else:
        raise ValueError("not TCP or UDP")
    so, do, alen = _addr_offsets(pk.version)
    out = bytearray(buf)
    ports = sport.to_bytes(2, "big") + dport.to_bytes(2, "big")
    hc = _u16(out, csum_at)
    if partial:
        hc = _psum_replace(hc, bytes(out[so : so + alen]), src)
        hc = _psum_replace(hc, bytes(out[do : do + alen]), dst)
        out[csum_at : csum_at + 2] = hc.to_bytes(2, "big")
    elif not (pk.proto == PROTO_UDP and pk.version == 4 and hc == 0):
        hc = csum_replace(hc, bytes(out[so : so + alen]), src)
        hc = csum_replace(hc, bytes(out[do : do + alen]), dst)
        hc = csum_replace(hc, bytes(out[pk.l4_off : pk.l4_off + 4]), ports)
        if pk.proto == PROTO_UDP and hc == 0:
            hc = 0xFFFF
        out[csum_at : csum_at + 2] = hc.to_bytes(2, "big")
    if pk.version == 4:
        ipc = csum_replace(_u16(out, 10), bytes(out[12:16]), src)
        ipc = csum_replace(ipc, bytes(out[16:20]), dst)
        out[10:12] = ipc.to_bytes(2, "big")
    out[so : so + alen] = src
    out[do : do + alen] = dst
    out[pk.l4_off : pk.l4_off + 4] = ports
    return bytes(out), replace(pk, src=src, dst=dst, sport=sport, dport=dport, l4_csum=hc)


def _ip4_with_checksum(hdr: bytearray) -> bytearray:
    hdr[10:12] = b"\0\0"
    hdr[10:12] = checksum(bytes(hdr)).to_bytes(2, "big")
    return hdr


def echo_reply(buf: bytes, pk: Packet) -> tuple[bytes, Packet]:
    """The echo reply to an ICMP (type 8) or ICMPv6 (type 128) echo request, code 0:
    addresses swapped, TTL/hop limit 64, checksums updated."""
    if pk.version == 4 and pk.proto == PROTO_ICMP:
        req, rep = 8, 0
    elif pk.version == 6 and pk.proto == PROTO_ICMPV6:
        req, rep = 128, 129
    else:
        raise ValueError("not ICMP echo")
    if pk.icmp_type != req or pk.icmp_code != 0:
        raise ValueError("not an echo request")
    out = bytearray(buf)
    l4 = pk.l4_off
    hc = csum_replace(_u16(out, l4 + 2), bytes(out[l4 : l4 + 2]), bytes([rep, out[l4 + 1]]))
    out[l4 + 2 : l4 + 4] = hc.to_bytes(2, "big")
    out[l4] = rep
    so, do, alen = _addr_offsets(pk.version)
    out[so : so + alen], out[do : do + alen] = pk.dst, pk.src
    if pk.version == 4:
        out[8] = TTL_REPLY
        out[:l4] = _ip4_with_checksum(out[:l4])
    else:
        out[7] = TTL_REPLY
    return bytes(out), replace(pk, src=pk.dst, dst=pk.src, ttl=TTL_REPLY, icmp_type=rep, l4_csum=hc)


def ip_header(version: int, proto: int, src: bytes, dst: bytes, l4_len: int) -> bytes:
    """A bare IP header as the builders write it: IPv4 with DF, id 0, TTL 64 and its
    checksum; IPv6 with traffic class and flow label 0, hop limit 64."""
    if version == 4:
        hdr = bytearray(IP4_MIN)
        hdr[0] = 0x45
        hdr[2:4] = (IP4_MIN + l4_len).to_bytes(2, "big")
        hdr[6:8] = (0x4000).to_bytes(2, "big")
        hdr[8], hdr[9] = TTL_REPLY, proto
        hdr[12:16], hdr[16:20] = src, dst
        return bytes(_ip4_with_checksum(hdr))
    return (
        bytes([0x60, 0, 0, 0]) + l4_len.to_bytes(2, "big") + bytes([proto, TTL_REPLY]) + src + dst
    )


def build_udp(version: int, src: bytes, sport: int, dst: bytes, dport: int, payload: bytes
              ) -> bytes:  # fmt: skip
    """An IP+UDP datagram with a full checksum (0 sent as 0xffff)."""
    if version not in (4, 6):
        raise ValueError("version")
    if len(payload) > 65535 - UDP_HDR - (IP4_MIN if version == 4 else 0):
        raise ValueError("too long")
    ulen = UDP_HDR + len(payload)
    udp = sport.to_bytes(2, "big") + dport.to_bytes(2, "big") + ulen.to_bytes(2, "big")
    c = checksum(pseudo_header(version, PROTO_UDP, src, dst, ulen) + udp + b"\0\0" + payload)
    udp += (c or 0xFFFF).to_bytes(2, "big")
    return ip_header(version, PROTO_UDP, src, dst, ulen) + udp + payload


def build_tcp_rst(pk: Packet) -> bytes:
    """The reset answering a TCP packet that is not itself a reset (RFC 9293 3.10.7.1)."""
    if pk.proto != PROTO_TCP or pk.tcp_flags & TCP_RST:
        raise ValueError("not answerable")
    if pk.tcp_flags & TCP_ACK:
        seq, ack, flags = pk.ack, 0, TCP_RST
    else:
        ack = pk.seq + pk.payload_len + bool(pk.tcp_flags & TCP_SYN) + bool(pk.tcp_flags & TCP_FIN)
        seq, ack, flags = 0, ack & 0xFFFFFFFF, TCP_RST | TCP_ACK
    tcp = bytearray(TCP_MIN)
    tcp[0:2], tcp[2:4] = pk.dport.to_bytes(2, "big"), pk.sport.to_bytes(2, "big")
    tcp[4:8], tcp[8:12] = seq.to_bytes(4, "big"), ack.to_bytes(4, "big")
    tcp[12], tcp[13] = 5 << 4, flags
    c = checksum(pseudo_header(pk.version, PROTO_TCP, pk.dst, pk.src, TCP_MIN) + bytes(tcp))
    tcp[16:18] = c.to_bytes(2, "big")
    return ip_header(pk.version, PROTO_TCP, pk.dst, pk.src, TCP_MIN) + bytes(tcp)
