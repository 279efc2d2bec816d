/*
 * spliceway IP packet parser and rewriter.  See pkt.h for the contract; this
 * file explains the choices behind it.
 *
 * Every read is bounds-checked against the length the caller gave before it
 * happens, so the parser is safe on any bytes (benchmarks/fuzz_parse.c runs
 * it under ASan).  Fields are read with explicit big-endian byte loads, never
 * through casts to wider types: a TUN buffer has no alignment promise for the
 * transport header (IPv4 options, IPv6 extension headers).
 */
#include "pkt.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>

enum {
    IP4_MIN = 20,
    IP6_HDR = 40,
    TCP_MIN = 20,
    UDP_HDR = 8,
    ICMP_HDR = 8,
    /* Extension headers walked before the packet is refused: real traffic has
     * one or two; the bound keeps a crafted chain from costing more. */
    IP6_EXT_MAX = 8,
    TTL_REPLY = 64,
};

static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void put32(uint8_t *p, uint32_t v)
{
    put16(p, (uint16_t)(v >> 16));
    put16(p + 2, (uint16_t)v);
}

/* One's complement sum of len bytes (big-endian 16-bit words, an odd last
 * byte as the high half of a word), added to sum.  Not folded: a uint64_t
 * accumulator cannot overflow for any packet (< 2^48 bytes). */
static uint64_t sum_bytes(const uint8_t *p, size_t len, uint64_t sum)
{
    while (len >= 8) {
        sum += (uint64_t)get16(p) + get16(p + 2) + get16(p + 4) + get16(p + 6);
        p += 8;
        len -= 8;
    }
    while (len >= 2) {
        sum += get16(p);
        p += 2;
        len -= 2;
    }
    if (len)
        sum += (uint64_t)p[0] << 8;
    return sum;
}

static uint16_t fold(uint64_t sum)
{
    while (sum >> 16)
        sum = (sum & 0xffff) + (sum >> 16);
    return (uint16_t)sum;
}

uint16_t sw_pkt_checksum(const uint8_t *p, size_t len)
{
    return (uint16_t)~fold(sum_bytes(p, len, 0));
}

/* The pseudo-header's sum (RFC 793/768 for IPv4, RFC 8200 8.1 for IPv6):
 * addresses, protocol and the transport length. */
static uint64_t pseudo_sum(const sw_pkt *pk, uint32_t l4_len)
{
    size_t alen = pk->version == 4 ? 4 : 16;
    uint64_t sum = sum_bytes(pk->src, alen, 0);
    sum = sum_bytes(pk->dst, alen, sum);
    return sum + pk->proto + (l4_len & 0xffff) + (l4_len >> 16);
}

/* RFC 1624 equation 3 for n bytes (n even) changed from old to new:
 * HC' = ~(~HC + sum(~m) + sum(m')).  Equation 3 rather than 2 because it
 * never turns a correct checksum into the other zero the receiver would
 * still have to accept (see pkt.h). */
static uint16_t csum_replace(uint16_t hc, const uint8_t *old, const uint8_t *new, size_t n)
{
    uint64_t sum = (uint16_t)~hc;
    for (size_t i = 0; i < n; i += 2)
        sum += (uint16_t)~get16(old + i) + (uint64_t)get16(new + i);
    return (uint16_t)~fold(sum);
}

static int parse_l4(const uint8_t *p, sw_pkt *o)
{
    const uint8_t *l4 = p + o->l4_off;
    o->payload_off = o->l4_off;
    o->payload_len = o->l4_len;
    switch (o->proto) {
    case SW_PROTO_TCP: {
        if (o->l4_len < TCP_MIN)
            return SW_PKT_BAD_L4;
        uint32_t hlen = (uint32_t)(l4[12] >> 4) * 4;
        if (hlen < TCP_MIN || hlen > o->l4_len)
            return SW_PKT_BAD_L4;
        o->sport = get16(l4);
        o->dport = get16(l4 + 2);
        o->seq = get32(l4 + 4);
        o->ack = get32(l4 + 8);
        o->tcp_flags = l4[13];
        o->l4_csum = get16(l4 + 16);
        o->payload_off = o->l4_off + hlen;
        o->payload_len = o->l4_len - hlen;
        return SW_PKT_OK;
    }
    case SW_PROTO_UDP: {
        if (o->l4_len < UDP_HDR)
            return SW_PKT_BAD_L4;
        uint32_t ulen = get16(l4 + 4);
        if (ulen < UDP_HDR || ulen > o->l4_len)
            return SW_PKT_BAD_L4;
        o->sport = get16(l4);
        o->dport = get16(l4 + 2);
        o->l4_csum = get16(l4 + 6);
        o->payload_off = o->l4_off + UDP_HDR;
        o->payload_len = ulen - UDP_HDR;
        return SW_PKT_OK;
    }
    case SW_PROTO_ICMP:
    case SW_PROTO_ICMPV6:
        /* ICMP in IPv6 or ICMPv6 in IPv4 is not refused here: the loop
         * answers echo only for its own family's protocol. */
        if (o->l4_len < ICMP_HDR)
            return SW_PKT_BAD_L4;
        o->icmp_type = l4[0];
        o->icmp_code = l4[1];
        o->l4_csum = get16(l4 + 2);
        o->sport = get16(l4 + 4);
        o->dport = get16(l4 + 6);
        o->payload_off = o->l4_off + ICMP_HDR;
        o->payload_len = o->l4_len - ICMP_HDR;
        return SW_PKT_OK;
    default:
        return SW_PKT_OK;
    }
}

static int parse4(const uint8_t *p, size_t len, sw_pkt *o)
{
    if (len < IP4_MIN)
        return SW_PKT_SHORT;
    uint32_t ihl = (uint32_t)(p[0] & 0x0f) * 4;
    uint32_t total = get16(p + 2);
    if (ihl < IP4_MIN || total < ihl)
        return SW_PKT_BAD_HEADER;
    if (total > len)
        return SW_PKT_SHORT;
    /* A header that verifies sums to 0xffff (0 is impossible: byte 0 != 0). */
    if (fold(sum_bytes(p, ihl, 0)) != 0xffff)
        return SW_PKT_BAD_CHECKSUM;
    if (get16(p + 6) & 0x3fff) /* MF or a fragment offset; DF (0x4000) is fine */
        return SW_PKT_FRAGMENT;
    o->version = 4;
    o->ttl = p[8];
    o->proto = p[9];
    memcpy(o->src, p + 12, 4);
    memcpy(o->dst, p + 16, 4);
    o->ip_len = total;
    o->l4_off = ihl;
    o->l4_len = total - ihl;
    return parse_l4(p, o);
}

static int parse6(const uint8_t *p, size_t len, sw_pkt *o)
{
    if (len < IP6_HDR)
        return SW_PKT_SHORT;
    uint32_t plen = get16(p + 4);
    if (plen == 0)
        return SW_PKT_BAD_HEADER;
    if (IP6_HDR + plen > len)
        return SW_PKT_SHORT;
    uint32_t total = IP6_HDR + plen;
    uint32_t off = IP6_HDR;
    uint8_t next = p[6];
    for (int n = 0;; n++) {
        if (next == 0 && n > 0) /* hop-by-hop options only right after the header */
            return SW_PKT_EXT_HEADER;
        if (next == 44)
            return SW_PKT_FRAGMENT;
        if (next == 43)
            return SW_PKT_EXT_HEADER;
        if (next != 0 && next != 60)
            break;
        if (n == IP6_EXT_MAX || total - off < 8)
            return SW_PKT_EXT_HEADER;
        uint32_t elen = ((uint32_t)p[off + 1] + 1) * 8;
        if (elen > total - off)
            return SW_PKT_EXT_HEADER;
        next = p[off];
        off += elen;
    }
    o->version = 6;
    o->ttl = p[7];
    o->proto = next;
    memcpy(o->src, p + 8, 16);
    memcpy(o->dst, p + 24, 16);
    o->ip_len = total;
    o->l4_off = off;
    o->l4_len = total - off;
    return parse_l4(p, o);
}

int sw_pkt_parse(const uint8_t *p, size_t len, sw_pkt *out)
{
    memset(out, 0, sizeof *out);
    int rc = len == 0 ? SW_PKT_BAD_VERSION
             : p[0] >> 4 == 4 ? parse4(p, len, out)
             : p[0] >> 4 == 6 ? parse6(p, len, out)
                              : SW_PKT_BAD_VERSION;
    if (rc != SW_PKT_OK)
        memset(out, 0, sizeof *out);
    return rc;
}

int sw_pkt_l4_csum_ok(const uint8_t *p, const sw_pkt *pk)
{
    const uint8_t *l4 = p + pk->l4_off;
    switch (pk->proto) {
    case SW_PROTO_UDP: {
        if (pk->version == 4 && pk->l4_csum == 0)
            return 1;
        uint32_t ulen = pk->payload_len + UDP_HDR;
        return fold(sum_bytes(l4, ulen, pseudo_sum(pk, ulen))) == 0xffff;
    }
    case SW_PROTO_TCP:
    case SW_PROTO_ICMPV6:
        return fold(sum_bytes(l4, pk->l4_len, pseudo_sum(pk, pk->l4_len))) == 0xffff;
    case SW_PROTO_ICMP:
        return fold(sum_bytes(l4, pk->l4_len, 0)) == 0xffff;
    default:
        return 0;
    }
}

/* Offsets of the address fields in the IP header. */
static size_t src_off(const sw_pkt *pk) { return pk->version == 4 ? 12 : 8; }
static size_t dst_off(const sw_pkt *pk) { return pk->version == 4 ? 16 : 24; }

/* The partial (pseudo-header) sum P of n bytes (n even) changed from old to
 * new: P' = P + sum(~m) + sum(m'), folded.  Never 0 for a P that is not 0
 * (a positive sum folds to 1..0xffff), which is also how Linux's own
 * pseudo-header sums look, so the result equals a recomputation exactly. */
static uint16_t psum_replace(uint16_t psum, const uint8_t *old, const uint8_t *new, size_t n)
{
    uint64_t sum = psum;
    for (size_t i = 0; i < n; i += 2)
        sum += (uint16_t)~get16(old + i) + (uint64_t)get16(new + i);
    return fold(sum);
}

static int rewrite(uint8_t *p, sw_pkt *pk, const uint8_t *src, uint16_t sport,
                   const uint8_t *dst, uint16_t dport, bool partial)
{
    size_t csum_at;
    if (pk->proto == SW_PROTO_TCP)
        csum_at = 16;
    else if (pk->proto == SW_PROTO_UDP)
        csum_at = 6;
    else
        return -EINVAL;
    size_t alen = pk->version == 4 ? 4 : 16;
    uint8_t *l4 = p + pk->l4_off;
    uint8_t *sa = p + src_off(pk), *da = p + dst_off(pk);
    uint8_t ports[4];
    put16(ports, sport);
    put16(ports + 2, dport);

    /* The transport checksum covers the addresses (pseudo-header) and the
     * ports; IPv4 UDP without a checksum (0) keeps none.  A partial one is
     * the pseudo-header's sum alone: the ports are not in it. */
    uint16_t hc = get16(l4 + csum_at);
    if (partial) {
        hc = psum_replace(hc, sa, src, alen);
        hc = psum_replace(hc, da, dst, alen);
        put16(l4 + csum_at, hc);
    } else if (!(pk->proto == SW_PROTO_UDP && pk->version == 4 && hc == 0)) {
        hc = csum_replace(hc, sa, src, alen);
        hc = csum_replace(hc, da, dst, alen);
        hc = csum_replace(hc, l4, ports, 4);
        if (pk->proto == SW_PROTO_UDP && hc == 0)
            hc = 0xffff;
        put16(l4 + csum_at, hc);
    }
    if (pk->version == 4) {
        uint16_t ipc = get16(p + 10);
        ipc = csum_replace(ipc, sa, src, 4);
        ipc = csum_replace(ipc, da, dst, 4);
        put16(p + 10, ipc);
    }
    memcpy(sa, src, alen);
    memcpy(da, dst, alen);
    memcpy(l4, ports, 4);
    memcpy(pk->src, src, alen);
    memcpy(pk->dst, dst, alen);
    pk->sport = sport;
    pk->dport = dport;
    pk->l4_csum = get16(l4 + csum_at);
    return 0;
}

int sw_pkt_rewrite(uint8_t *p, sw_pkt *pk, const uint8_t *src, uint16_t sport,
                   const uint8_t *dst, uint16_t dport)
{
    return rewrite(p, pk, src, sport, dst, dport, false);
}

int sw_pkt_rewrite_partial(uint8_t *p, sw_pkt *pk, const uint8_t *src, uint16_t sport,
                           const uint8_t *dst, uint16_t dport)
{
    return rewrite(p, pk, src, sport, dst, dport, true);
}

int sw_pkt_vnet_check(const sw_vnet_hdr *h, const sw_pkt *pk)
{
    bool needs_csum = h->flags & SW_VNET_F_NEEDS_CSUM;
    if (h->flags != 0 && h->flags != SW_VNET_F_NEEDS_CSUM && h->flags != SW_VNET_F_DATA_VALID)
        return -EINVAL;
    uint8_t gso = h->gso_type & (uint8_t)~SW_VNET_GSO_ECN;
    if (gso != SW_VNET_GSO_NONE) {
        uint8_t want = pk->version == 4 ? SW_VNET_GSO_TCPV4 : SW_VNET_GSO_TCPV6;
        if (pk->proto != SW_PROTO_TCP || gso != want || !needs_csum || h->gso_size == 0 ||
            h->gso_size == 0xffff)
            return -EINVAL;
    } else if (h->gso_type != SW_VNET_GSO_NONE) {
        return -EINVAL; /* ECN alone */
    }
    if (needs_csum) {
        uint32_t off = pk->proto == SW_PROTO_TCP ? 16 : pk->proto == SW_PROTO_UDP ? 6 : 0;
        if (!off || h->csum_start != pk->l4_off || h->csum_offset != off)
            return -EINVAL;
    }
    if (h->hdr_len > pk->ip_len)
        return -EINVAL;
    return 0;
}

/* IPv4 header checksum, recomputed over the whole header. */
static void ip4_csum(uint8_t *p, size_t ihl)
{
    put16(p + 10, 0);
    put16(p + 10, sw_pkt_checksum(p, ihl));
}

int sw_pkt_echo_reply(uint8_t *p, sw_pkt *pk)
{
    uint8_t req, rep;
    if (pk->version == 4 && pk->proto == SW_PROTO_ICMP)
        req = 8, rep = 0;
    else if (pk->version == 6 && pk->proto == SW_PROTO_ICMPV6)
        req = 128, rep = 129;
    else
        return -EINVAL;
    if (pk->icmp_type != req || pk->icmp_code != 0)
        return -EINVAL;
    uint8_t *l4 = p + pk->l4_off;
    /* Swapping the addresses leaves the ICMPv6 pseudo-header sum as it was,
     * so only the type byte (the high half of the first word) changes. */
    uint8_t oldw[2] = {l4[0], l4[1]}, neww[2] = {rep, l4[1]};
    put16(l4 + 2, csum_replace(get16(l4 + 2), oldw, neww, 2));
    l4[0] = rep;
    size_t alen = pk->version == 4 ? 4 : 16;
    uint8_t tmp[16];
    memcpy(tmp, p + src_off(pk), alen);
    memcpy(p + src_off(pk), p + dst_off(pk), alen);
    memcpy(p + dst_off(pk), tmp, alen);
    if (pk->version == 4) {
        p[8] = TTL_REPLY;
        ip4_csum(p, pk->l4_off);
    } else {
        p[7] = TTL_REPLY;
    }
    memcpy(tmp, pk->src, 16);
    memcpy(pk->src, pk->dst, 16);
    memcpy(pk->dst, tmp, 16);
    pk->ttl = TTL_REPLY;
    pk->icmp_type = rep;
    pk->l4_csum = get16(l4 + 2);
    return 0;
}

/* Writes a bare IP header (no options, no extension headers) for a transport
 * payload of l4_len bytes; IPv4 with DF, id 0 and its checksum. */
static size_t put_ip(uint8_t *out, uint8_t version, uint8_t proto, const uint8_t *src,
                     const uint8_t *dst, size_t l4_len)
{
    if (version == 4) {
        memset(out, 0, IP4_MIN);
        out[0] = 0x45;
        put16(out + 2, (uint16_t)(IP4_MIN + l4_len));
        put16(out + 6, 0x4000);
        out[8] = TTL_REPLY;
        out[9] = proto;
        memcpy(out + 12, src, 4);
        memcpy(out + 16, dst, 4);
        ip4_csum(out, IP4_MIN);
        return IP4_MIN;
    }
    memset(out, 0, IP6_HDR);
    out[0] = 0x60;
    put16(out + 4, (uint16_t)l4_len);
    out[6] = proto;
    out[7] = TTL_REPLY;
    memcpy(out + 8, src, 16);
    memcpy(out + 24, dst, 16);
    return IP6_HDR;
}

/* The transport checksum of a packet put_ip built, over l4_len bytes. */
static uint16_t l4_csum(uint8_t version, uint8_t proto, const uint8_t *src, const uint8_t *dst,
                        const uint8_t *l4, size_t l4_len)
{
    sw_pkt ph = {.version = version, .proto = proto};
    memcpy(ph.src, src, version == 4 ? 4 : 16);
    memcpy(ph.dst, dst, version == 4 ? 4 : 16);
    return (uint16_t)~fold(sum_bytes(l4, l4_len, pseudo_sum(&ph, (uint32_t)l4_len)));
}

int sw_pkt_build_udp(uint8_t *out, size_t cap, uint8_t version, const uint8_t *src,
                     uint16_t sport, const uint8_t *dst, uint16_t dport,
                     const uint8_t *payload, size_t len)
{
    if (version != 4 && version != 6)
        return -EINVAL;
    size_t hlen = version == 4 ? IP4_MIN : IP6_HDR;
    /* IPv4's total length and UDP's length field are both 16 bits; an IPv6
     * payload length is too (no jumbograms). */
    size_t max_payload = 65535 - UDP_HDR - (version == 4 ? IP4_MIN : 0);
    if (len > max_payload || hlen + UDP_HDR + len > cap)
        return -EMSGSIZE;
    put_ip(out, version, SW_PROTO_UDP, src, dst, UDP_HDR + len);
    uint8_t *u = out + hlen;
    put16(u, sport);
    put16(u + 2, dport);
    put16(u + 4, (uint16_t)(UDP_HDR + len));
    put16(u + 6, 0);
    if (len)
        memmove(u + UDP_HDR, payload, len); /* payload may already sit there */
    uint16_t c = l4_csum(version, SW_PROTO_UDP, src, dst, u, UDP_HDR + len);
    put16(u + 6, c ? c : 0xffff);
    return (int)(hlen + UDP_HDR + len);
}

int sw_pkt_build_tcp_rst(uint8_t *out, size_t cap, const sw_pkt *pk)
{
    if (pk->proto != SW_PROTO_TCP || (pk->tcp_flags & SW_TCP_RST))
        return -EINVAL;
    size_t hlen = pk->version == 4 ? IP4_MIN : IP6_HDR;
    if (hlen + TCP_MIN > cap)
        return -EMSGSIZE;
    put_ip(out, pk->version, SW_PROTO_TCP, pk->dst, pk->src, TCP_MIN);
    uint8_t *t = out + hlen;
    memset(t, 0, TCP_MIN);
    put16(t, pk->dport);
    put16(t + 2, pk->sport);
    if (pk->tcp_flags & SW_TCP_ACK) {
        put32(t + 4, pk->ack);
        t[13] = SW_TCP_RST;
    } else {
        uint32_t ack = pk->seq + pk->payload_len + !!(pk->tcp_flags & SW_TCP_SYN) +
                       !!(pk->tcp_flags & SW_TCP_FIN);
        put32(t + 8, ack);
        t[13] = SW_TCP_RST | SW_TCP_ACK;
    }
    t[12] = 5 << 4;
    put16(t + 16, l4_csum(pk->version, SW_PROTO_TCP, pk->dst, pk->src, t, TCP_MIN));
    return (int)(hlen + TCP_MIN);
}
