/*
 * spliceway IP packet parser and rewriter for the TUN "system stack"
 * (csrc/tun.c): pure functions over one IPv4 or IPv6 packet as a TUN device
 * (IFF_TUN | IFF_NO_PI) reads and writes it.  spliceway/tun/packet.py is
 * their reference: for every input the C parser gives the same status and
 * fields, and every rewrite or builder the same bytes, as the Python one;
 * tests/csrc/test_pkt_diff.py holds them to that with Hypothesis and
 * benchmarks/fuzz_parse.c fuzzes them under ASan/UBSan.
 *
 * What the parser accepts (anything else is a status other than OK, which
 * the loop counts as a drop by that reason):
 *   IPv4  version 4, IHL >= 5, IHL*4 <= total length <= the bytes given
 *         (bytes past the total length are ignored, as the kernel does), a
 *         header checksum that verifies, not a fragment (MF clear, offset 0:
 *         a later fragment has no transport header to rewrite).
 *   IPv6  version 6, payload length != 0 (no jumbograms), 40 + payload
 *         length <= the bytes given; hop-by-hop (first only) and destination
 *         options headers are walked (at most 8 extension headers); a
 *         fragment header is FRAGMENT; a routing header is EXT_HEADER (its
 *         final destination, not the header's, would be in the transport
 *         checksum's pseudo-header).
 *   TCP   data offset >= 5 and the header within the IP length.
 *   UDP   length >= 8 and <= the IP payload (a shorter one ends the payload,
 *         as RFC 768 and the kernel have it).
 *   ICMP / ICMPv6  at least 8 bytes (type, code, checksum, id, sequence).
 *   Any other transport protocol is OK with only the IP fields set (and
 *   l4_off/l4_len): the caller decides what it does with it.
 * Transport checksums are not verified by the parser (sw_pkt_l4_csum_ok
 * does): the NAT rewrite is incremental, so a packet that arrived with a
 * wrong checksum leaves with a wrong checksum and the kernel drops it.
 *
 * Checksums follow RFC 1071; the NAT rewrite updates them incrementally per
 * RFC 1624 equation 3, HC' = ~(~HC + ~m + m'), 16 bits at a time.  For a
 * packet whose checksum verified, that gives exactly the checksum a full
 * recomputation gives, but for the two forms of zero (0x0000/0xffff) when
 * the original held 0xffff; a UDP checksum that comes out 0 is sent as
 * 0xffff (RFC 768), and an IPv4 UDP checksum of 0 (none) stays 0.
 *
 * With a TUN opened with IFF_VNET_HDR (csrc/tun.h, "Offloads"), every packet
 * comes with a virtio-net header (sw_vnet_hdr).  Its NEEDS_CSUM flag means
 * the transport checksum field does not hold a checksum but the folded,
 * uncomplemented one's complement sum of the pseudo-header (what Linux leaves
 * there for CHECKSUM_PARTIAL: the device, here whoever the packet is written
 * back to, finishes the sum over the segment).  sw_pkt_rewrite_partial keeps
 * such a field what it is: the pseudo-header's ports are not in it, so only
 * the address change moves it, P' = P + ~m + m' (RFC 1624 in the other
 * sense: a sum, not a checksum); for a field that held the pseudo-header sum
 * of the old addresses, that is exactly the sum for the new ones.  The
 * parser never looks at a transport checksum, so it needs no flag.
 *
 * Multi-byte fields in sw_pkt are host order; addresses are network order
 * bytes, an IPv4 address in the first 4 of 16 (the rest zero).  Everything
 * between the SW_CDEF markers is part of the cffi cdef.
 */
#ifndef SW_PKT_H
#define SW_PKT_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

enum sw_pkt_status {
    SW_PKT_OK = 0,
    SW_PKT_SHORT = 1,        /* fewer bytes than the IP header or its length say */
    SW_PKT_BAD_VERSION = 2,  /* neither 4 nor 6 (or no byte at all) */
    SW_PKT_BAD_HEADER = 3,   /* IPv4 IHL < 5 or total length < IHL*4; IPv6
                                payload length 0 (a jumbogram) */
    SW_PKT_BAD_CHECKSUM = 4, /* IPv4 header checksum */
    SW_PKT_FRAGMENT = 5,     /* IPv4 MF or fragment offset; IPv6 fragment header */
    SW_PKT_EXT_HEADER = 6,   /* IPv6: routing header, a second hop-by-hop, more
                                than 8 extension headers, or one past the end */
    SW_PKT_BAD_L4 = 7        /* TCP/UDP/ICMP header truncated or inconsistent */
};

/* IP protocol numbers the TUN stack handles. */
enum sw_pkt_proto {
    SW_PROTO_ICMP = 1,
    SW_PROTO_TCP = 6,
    SW_PROTO_UDP = 17,
    SW_PROTO_ICMPV6 = 58
};

/* TCP flags (the 13th header byte). */
enum sw_tcp_flag {
    SW_TCP_FIN = 1,
    SW_TCP_SYN = 2,
    SW_TCP_RST = 4,
    SW_TCP_PSH = 8,
    SW_TCP_ACK = 16
};

typedef struct sw_pkt {
    uint8_t version;      /* 4 or 6 */
    uint8_t proto;        /* transport protocol (IPv6: past the extension headers) */
    uint8_t ttl;          /* IPv4 TTL, IPv6 hop limit */
    uint8_t tcp_flags;    /* TCP: enum sw_tcp_flag bits (and ECE, CWR, URG) */
    uint8_t icmp_type;    /* ICMP/ICMPv6 */
    uint8_t icmp_code;
    uint16_t sport;       /* TCP/UDP ports; ICMP: the echo identifier */
    uint16_t dport;       /* ICMP: the echo sequence number */
    uint16_t l4_csum;     /* TCP/UDP/ICMP: the checksum field as it is */
    uint32_t ip_len;      /* bytes the IP header says the packet has (<= len) */
    uint32_t l4_off;      /* offset of the transport header */
    uint32_t l4_len;      /* ip_len - l4_off */
    uint32_t payload_off; /* past the TCP/UDP/ICMP header (l4_off for others) */
    uint32_t payload_len; /* TCP, ICMP: to ip_len; UDP: to its length field */
    uint32_t seq;         /* TCP */
    uint32_t ack;         /* TCP */
    uint8_t src[16];
    uint8_t dst[16];
} sw_pkt;

/* The virtio-net header (linux/virtio_net.h, struct virtio_net_hdr: 10
 * bytes, no num_buffers) a TUN opened with IFF_VNET_HDR puts before every
 * packet it reads and wants before every packet written.  Its 16-bit fields
 * are in host byte order (the legacy layout, which the TUN uses unless told
 * TUNSETVNETLE/BE); copy it out of a buffer with memcpy. */
#define SW_VNET_HDR_LEN 10

enum sw_vnet_flag {
    SW_VNET_F_NEEDS_CSUM = 1, /* the transport checksum is partial (see above):
                                 csum_start is the transport header, csum_offset
                                 its checksum field */
    SW_VNET_F_DATA_VALID = 2  /* the checksum was verified (informational) */
};

enum sw_vnet_gso {
    SW_VNET_GSO_NONE = 0,
    SW_VNET_GSO_TCPV4 = 1,    /* a TCP segment of several, gso_size payload bytes
                                 each (the last may be shorter) */
    SW_VNET_GSO_UDP = 3,      /* UFO: never accepted */
    SW_VNET_GSO_TCPV6 = 4,
    SW_VNET_GSO_UDP_L4 = 5,   /* USO: never accepted (not offered) */
    SW_VNET_GSO_ECN = 0x80    /* flag: the TCP segments carry CWR */
};

typedef struct sw_vnet_hdr {
    uint8_t flags;            /* enum sw_vnet_flag */
    uint8_t gso_type;         /* enum sw_vnet_gso */
    uint16_t hdr_len;         /* a hint: bytes of headers (Linux sends the
                                 skb's linear length, which may be more) */
    uint16_t gso_size;        /* GSO: payload bytes per segment */
    uint16_t csum_start;      /* NEEDS_CSUM: where the checksummed bytes start */
    uint16_t csum_offset;     /* ... and the field's offset from there */
} sw_vnet_hdr;

/* Parses one packet of len bytes.  Returns enum sw_pkt_status; out is
 * filled on SW_PKT_OK (and zeroed otherwise). */
int sw_pkt_parse(const uint8_t *p, size_t len, sw_pkt *out);

/* The Internet checksum (RFC 1071) of len bytes: ~(one's complement sum). */
uint16_t sw_pkt_checksum(const uint8_t *p, size_t len);

/* 1 when the transport checksum of a parsed TCP, UDP, ICMP or ICMPv6 packet
 * verifies (an IPv4 UDP checksum of 0 means none, and verifies), else 0.
 * Covers payload_off + payload_len for UDP, ip_len for the others. */
int sw_pkt_l4_csum_ok(const uint8_t *p, const sw_pkt *pk);

/* Rewrites a parsed TCP or UDP packet in place: source address and port,
 * destination address and port (16 bytes each, IPv4 in the first 4, of the
 * packet's own family), with the IPv4 header checksum and the transport
 * checksum updated incrementally.  pk is updated to match.  -EINVAL for
 * another protocol. */
int sw_pkt_rewrite(uint8_t *p, sw_pkt *pk, const uint8_t *src, uint16_t sport,
                   const uint8_t *dst, uint16_t dport);

/* sw_pkt_rewrite for a packet whose transport checksum field is partial
 * (SW_VNET_F_NEEDS_CSUM): the field moves by the address change only (see
 * above), the IPv4 header checksum as in sw_pkt_rewrite. */
int sw_pkt_rewrite_partial(uint8_t *p, sw_pkt *pk, const uint8_t *src, uint16_t sport,
                           const uint8_t *dst, uint16_t dport);

/* Whether a virtio-net header fits the parsed packet it came with: 0, or
 * -EINVAL when any of these fails:
 *   flags is 0, NEEDS_CSUM or DATA_VALID;
 *   gso_type is NONE, or TCPV4 (with or without ECN) on an IPv4 TCP packet,
 *     or TCPV6 on an IPv6 one; GSO comes with NEEDS_CSUM and a gso_size
 *     other than 0 and 0xffff (GSO_BY_FRAGS);
 *   NEEDS_CSUM only on TCP or UDP, csum_start the transport header's offset
 *     and csum_offset its checksum field's (16 / 6);
 *   hdr_len <= ip_len (so the packet can be written back with it).
 * csum_start/csum_offset without NEEDS_CSUM, and gso_size without GSO, are
 * ignored (Linux sends zeros). */
int sw_pkt_vnet_check(const sw_vnet_hdr *h, const sw_pkt *pk);

/* Turns a parsed ICMP echo request (type 8 code 0, or ICMPv6 128 code 0)
 * into its echo reply in place: addresses swapped, type 0 (or 129), TTL or
 * hop limit 64, transport checksum updated incrementally, IPv4 header
 * checksum recomputed.  pk is updated to match.  -EINVAL for anything else. */
int sw_pkt_echo_reply(uint8_t *p, sw_pkt *pk);

/* Builds an IPv4 (version 4) or IPv6 (6) UDP datagram into out: src:sport
 * -> dst:dport, TTL or hop limit 64, IPv4 with DF and id 0, a full UDP
 * checksum.  Returns its length; -EMSGSIZE when it would exceed cap or the
 * IP length field; -EINVAL for another version. */
int sw_pkt_build_udp(uint8_t *out, size_t cap, uint8_t version, const uint8_t *src,
                     uint16_t sport, const uint8_t *dst, uint16_t dport,
                     const uint8_t *payload, size_t len);

/* The TCP reset answering a parsed TCP packet (RFC 9293 3.10.7.1, as for a
 * segment to a closed port): from its destination to its source; with ACK
 * set in it, seq = its ack and flags RST; else seq 0, ack = its seq + its
 * payload length (+1 for SYN, +1 for FIN) and flags RST|ACK.  A 20-byte TCP
 * header, TTL or hop limit 64.  Returns its length; -EINVAL for a packet that
 * is not TCP or is itself a reset (never answered); -EMSGSIZE when cap is
 * short. */
int sw_pkt_build_tcp_rst(uint8_t *out, size_t cap, const sw_pkt *pk);

/* SW_CDEF_END */

#endif /* SW_PKT_H */
