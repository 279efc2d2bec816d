/*
 * spliceway TUN "system stack": the packet loop that turns what a TUN device
 * captures into ordinary kernel TCP connections and UDP datagram records,
 * without terminating TCP in userspace (the design of sing-tun's
 * stack_system.go).
 *
 * Addresses
 *   The TUN's prefix gives A, the interface address (assigned to the TUN),
 *   and B, a second address in the prefix that is not assigned to anything.
 *   The caller runs a kernel TCP listener on A:P (port4/port6), per family.
 *
 * TCP
 *   A SYN read from the TUN for a new (source, destination) pair gets a NAT
 *   entry and a NAT port N; the packet is rewritten to B:N -> A:P (IP and
 *   TCP checksums updated incrementally, RFC 1624) and written back to the
 *   TUN, so the kernel delivers it to the listener and completes the
 *   handshake itself.  Packets from A:P to B:N are rewritten back to
 *   (original destination -> original source).  The listener accepts an
 *   ordinary socket whose peer is B:N; sw_tun_nat_lookup(N) gives the
 *   original source and destination, so the socket can enter the same path
 *   as any inbound connection (conn.c's SW_IN_TUN listener does exactly
 *   that) and be relayed with splice.
 *   An entry lives through the handshake for syn_timeout_ms, while
 *   established for tcp_idle_ms without a packet, and tcp_closed_ms after
 *   FINs both ways or a reset (late retransmissions still translate).  A
 *   SYN for a closed entry's pair starts a new entry (a new NAT port).  At
 *   max_tcp entries, a new SYN evicts the oldest closed entry, else the
 *   oldest half-open one, else it is dropped (drop_nat_full).  NAT ports are
 *   handed out in a cycle over 10000..65535, so a port comes back only after
 *   the others were used (the kernel's TIME_WAIT for B:N is on A's side).
 *   A TCP packet with no entry (not a SYN, or from A:P to an unknown N) is
 *   answered with a reset (unless no_rst), so neither side hangs.
 *
 * DNS over TCP (dns_port4 / dns_port6)
 *   With a family's dns_port set (not 0), a new connection whose original
 *   destination port is 53 goes to a second listener, A:D (D = dns_port),
 *   instead of A:P: the same NAT entry and NAT port, only the listener's
 *   port differs (the entry remembers which).  The reverse path takes
 *   packets from A:P and from A:D, each only for the entries made for that
 *   listener (a packet from the other one is answered as having no entry).
 *   sw_tun_nat_lookup is unchanged: the flow still names port 53.  So a DNS
 *   hijack can answer TCP queries itself while every other connection,
 *   port 53 of a family without dns_port included, reaches A:P.
 *
 * UDP
 *   A datagram (checksum verified) goes to the caller as a record
 *   (SW_TUN_REC_UDP) carrying its session, endpoints and payload, on a
 *   single-producer ring signalled by an eventfd (sw_tun_fd, readable while
 *   records are pending), drained with sw_tun_drain.  A session is one
 *   (source, destination) pair; its first record has new_session 1; it ends
 *   after udp_idle_ms with no datagram either way (SW_TUN_REC_UDP_ENDED,
 *   which waits for ring room rather than being lost), on sw_tun_udp_close,
 *   or at shutdown.  Replies: sw_tun_udp_send builds IP+UDP headers from the
 *   session's saved endpoints (swapped, or from another source for a
 *   full-cone reply) with a full checksum and writes the packet to the TUN.
 *   No room in the ring (ring_records, ring_bytes): the datagram is dropped
 *   (drop_udp_ring) and, for a new pair, no session is made.
 *
 * ICMP
 *   An echo request (ICMP 8 / ICMPv6 128) to any unicast destination is
 *   answered from the destination (built in place: addresses swapped, type,
 *   checksum).  Other ICMP is dropped (drop_unsupported).
 *
 * Offloads (vnet_hdr)
 *   With vnet_hdr 1 the fd is a TUN opened with IFF_VNET_HDR, its header
 *   size SW_VNET_HDR_LEN (TUNSETVNETHDRSZ 10: struct virtio_net_hdr, no
 *   num_buffers) and, for the offloads to happen, TUNSETOFFLOAD TUN_F_CSUM |
 *   TUN_F_TSO4 | TUN_F_TSO6 (spliceway/tun/device.py does all three).  Every
 *   read is then [sw_vnet_hdr][packet], the packet up to 64 KiB: the kernel
 *   hands over TCP segments it has not cut yet (GSO, a whole burst of a
 *   connection per read) and leaves TCP/UDP checksums to finish
 *   (NEEDS_CSUM: the field holds the pseudo-header's sum, csum_start and
 *   csum_offset say where; see csrc/pkt.h).  The header must pass
 *   sw_pkt_vnet_check against the parsed packet, else the packet is
 *   drop_bad_vnet (a read shorter than the header too); a packet without
 *   GSO is still limited to the MTU (drop_too_big), one with GSO to 64 KiB.
 *   TCP is NATed as without it, but a partial checksum is updated as a
 *   partial sum (sw_pkt_rewrite_partial: only the address change moves it;
 *   the IPv4 header checksum is complete and updated as always), and the
 *   packet is written back with the header it came with, unchanged (the
 *   rewrite changes no length, so gso_type, gso_size, hdr_len, csum_start
 *   and csum_offset still hold): the kernel takes the segments in one write
 *   and finishes the checksums or cuts the segments only where it has to.
 *   A packet without NEEDS_CSUM has a full checksum and is updated as
 *   without offloads.  A UDP datagram with NEEDS_CSUM has no checksum to
 *   verify; its payload goes to the ring as any other.  What the loop makes
 *   itself (resets, echo replies, UDP replies from sw_tun_udp_send and
 *   sw_tun_inject_udp) goes out with a zeroed header (no GSO, no NEEDS_CSUM)
 *   and full checksums.  bytes_in and bytes_out count packets without their
 *   headers; gso_packets_in and gso_bytes_in show how much came as GSO.
 *
 * Drops
 *   Every packet read is either written back (rewritten or answered), handed
 *   over (UDP), or dropped and counted by exactly one reason in
 *   sw_tun_stats; see its fields.
 *
 * Threads
 *   One loop thread per sw_tun (sw_tun_new starts it) reads the TUN fd
 *   (non-blocking) in batches of up to `batch` packets and never touches
 *   Python.  The NAT tables, sessions, ring producer side and counters are
 *   guarded by one mutex that the loop holds while it processes a batch (not
 *   while it reads or writes the device); every sw_tun_* call takes it, so
 *   calls are synchronous and may come from any thread (cffi releases the
 *   GIL around them).
 *
 * Conventions as relay.h: 0 or a count on success, -errno on failure.
 * Everything between the SW_CDEF markers is the cffi cdef.
 */
#ifndef SW_TUN_H
#define SW_TUN_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

#define SW_TUN_ABI_VERSION 3

typedef struct sw_tun sw_tun;

/* 0 in a numeric field means its default. */
typedef struct sw_tun_opts {
    int32_t fd;               /* the TUN device (IFF_TUN | IFF_NO_PI); C sets it
                                 non-blocking; the caller keeps owning it and
                                 closes it after sw_tun_free */
    uint32_t mtu;             /* largest packet read or written; default 1500,
                                 at most 65535; a longer read is drop_too_big
                                 (with vnet_hdr: a longer one without GSO) */
    uint8_t has4;             /* 1: IPv4 is captured (addr4, next4, port4) */
    uint8_t has6;             /* 1: IPv6 is captured (addr6, next6, port6) */
    uint16_t port4;           /* the kernel listener's port on addr4 */
    uint16_t port6;           /* ... on addr6 */
    uint8_t no_rst;           /* 1: drop TCP packets with no NAT entry silently */
    uint8_t vnet_hdr;         /* 1: every read and write starts with a
                                 sw_vnet_hdr (IFF_VNET_HDR, see "Offloads");
                                 0: raw packets */
    uint8_t addr4[4];         /* A: the TUN's IPv4 address, where the listener is */
    uint8_t next4[4];         /* B: the NAT source, in the prefix, not assigned */
    uint8_t addr6[16];
    uint8_t next6[16];
    uint32_t max_tcp;         /* NAT entries; default 16384, at most 55535 */
    uint32_t max_udp;         /* UDP sessions; default 4096 */
    uint32_t syn_timeout_ms;  /* handshake not completed; default 30000 */
    uint32_t tcp_idle_ms;     /* established, no packet either way; default
                                 7200000 (2 h) */
    uint32_t tcp_closed_ms;   /* after FIN both ways or a reset; default 10000 */
    uint32_t udp_idle_ms;     /* UDP session; default 60000 */
    uint32_t ring_records;    /* record ring, rounded up to a power of two;
                                 default 4096 */
    uint32_t ring_bytes;      /* UDP payload bytes waiting in the ring; default
                                 8 MiB */
    uint32_t batch;           /* packets read per wake-up; default 64, max 1024 */
    uint16_t dns_port4;       /* 0: off; else the DNS listener's port on addr4,
                                 where connections to port 53 go (not port4) */
    uint16_t dns_port6;       /* ... on addr6 */
} sw_tun_opts;

/* The original endpoints behind a NAT port. */
typedef struct sw_tun_flow {
    uint8_t version;          /* 4 or 6 */
    uint8_t state;            /* enum sw_tun_tcp_state */
    uint16_t sport;           /* the client's port */
    uint16_t dport;           /* the original destination's port */
    uint16_t natport;
    uint8_t src[16];          /* the client (IPv4 in the first 4 bytes) */
    uint8_t dst[16];          /* the original destination */
    uint64_t created_unix_ms;
    uint64_t packets_out;     /* client -> destination, through the NAT */
    uint64_t packets_in;      /* destination -> client */
} sw_tun_flow;

enum sw_tun_tcp_state {
    SW_TUN_TCP_SYN = 1,       /* SYN seen, the client has not ACKed yet */
    SW_TUN_TCP_ESTABLISHED = 2,
    SW_TUN_TCP_FIN = 3,       /* a FIN one way */
    SW_TUN_TCP_CLOSED = 4     /* FINs both ways, or a reset: lingering */
};

enum sw_tun_rec_kind {
    SW_TUN_REC_UDP = 1,       /* a datagram from the TUN */
    SW_TUN_REC_UDP_ENDED = 2  /* a session ended (reason, totals) */
};

enum sw_tun_end {
    SW_TUN_END_IDLE = 1,
    SW_TUN_END_CLOSED = 2,    /* sw_tun_udp_close */
    SW_TUN_END_SHUTDOWN = 3
};

typedef struct sw_tun_record {
    uint64_t session;         /* never 0, never reused within one sw_tun */
    uint64_t at_unix_ms;      /* CLOCK_REALTIME */
    uint32_t kind;            /* enum sw_tun_rec_kind */
    uint32_t reason;          /* UDP_ENDED: enum sw_tun_end */
    uint32_t payload_off;     /* UDP: sw_tun_drain's payload[off, off + len) */
    uint32_t payload_len;
    uint8_t version;          /* 4 or 6 */
    uint8_t new_session;      /* UDP: the session's first datagram */
    uint16_t sport;           /* the client's port */
    uint16_t dport;           /* the destination's */
    uint16_t reserved;
    uint8_t src[16];          /* the client */
    uint8_t dst[16];          /* the destination it sent to */
    uint64_t packets_in;      /* UDP_ENDED: datagrams from the client */
    uint64_t bytes_in;        /* ... their payload bytes */
    uint64_t packets_out;     /* UDP_ENDED: replies written to the TUN */
    uint64_t bytes_out;
} sw_tun_record;

/* Totals since sw_tun_new; "active" fields are current. */
typedef struct sw_tun_stats {
    uint64_t packets_in;        /* read from the TUN */
    uint64_t bytes_in;
    uint64_t packets_out;       /* written to the TUN: rewritten, echo replies,
                                   resets, UDP replies */
    uint64_t bytes_out;
    uint64_t tcp_active;        /* NAT entries now */
    uint64_t tcp_created;
    uint64_t tcp_expired;       /* ended by a timeout */
    uint64_t tcp_evicted;       /* ended to make room at max_tcp */
    uint64_t tcp_replaced;      /* a closed entry's pair started again */
    uint64_t udp_active;        /* sessions now */
    uint64_t udp_created;
    uint64_t udp_ended;
    uint64_t udp_datagrams_in;  /* handed over as records */
    uint64_t udp_datagrams_out; /* replies written (sw_tun_udp_send) */
    uint64_t icmp_echo_replies;
    uint64_t tcp_resets_sent;
    uint64_t read_errors;       /* read() failures other than EAGAIN/EINTR */
    uint64_t write_errors;      /* write() failures (the packet is lost) */
    /* Drops by reason; one reason per dropped packet. */
    uint64_t drop_short;        /* the parser's statuses (enum sw_pkt_status) */
    uint64_t drop_bad_version;
    uint64_t drop_bad_header;
    uint64_t drop_bad_checksum;
    uint64_t drop_fragment;
    uint64_t drop_ext_header;
    uint64_t drop_bad_l4;
    uint64_t drop_too_big;      /* longer than the MTU */
    uint64_t drop_family;       /* a family the stack does not capture */
    uint64_t drop_not_unicast;  /* destination unspecified, loopback,
                                   multicast, broadcast or link-local */
    uint64_t drop_unsupported;  /* another protocol, ICMP other than echo */
    uint64_t drop_no_session;   /* TCP with no NAT entry (answered or not) */
    uint64_t drop_nat_full;     /* a SYN at max_tcp with nothing to evict */
    uint64_t drop_udp_checksum; /* a UDP checksum that does not verify */
    uint64_t drop_udp_full;     /* a new UDP pair at max_udp */
    uint64_t drop_udp_ring;     /* no ring room (records or ring_bytes) */
    uint64_t drop_bad_vnet;     /* vnet_hdr: a header sw_pkt_vnet_check refuses,
                                   or a read shorter than the header */
    uint64_t gso_packets_in;    /* vnet_hdr: packets read with GSO (each several
                                   TCP segments; counted in packets_in once) */
    uint64_t gso_bytes_in;      /* ... their bytes (in bytes_in too) */
    uint64_t csum_partial_in;   /* vnet_hdr: packets read with NEEDS_CSUM */
} sw_tun_stats;

int sw_tun_abi_version(void);

/* Validates opts, starts the loop.  -EINVAL: bad fd, no family, an MTU over
 * 65535 or under 576 (IPv4) / 1280 (IPv6), max_tcp over 55535, A == B, a
 * dns_port equal to its family's listener port, vnet_hdr other than 0 or 1. */
int sw_tun_new(const sw_tun_opts *opts, sw_tun **out);
/* Stops and joins the loop, ends every UDP session (UDP_ENDED, reason
 * SHUTDOWN; drainable after) and drops the NAT.  Later calls but drain,
 * stats, lookup and free answer -ESHUTDOWN.  Sessions past what a full ring
 * holds end without a record.  Idempotent. */
int sw_tun_shutdown(sw_tun *tun);
/* Shutdown and release.  Nothing may use tun any more (a conn.c listener
 * holding it must be unlistened first). */
void sw_tun_free(sw_tun *tun);

/* The original endpoints of NAT port natport (version 4 or 6).  -ENOENT when
 * there is no such entry (expired, never made, or another family). */
int sw_tun_nat_lookup(sw_tun *tun, uint8_t version, uint16_t natport, sw_tun_flow *out);

/* The same for a socket accepted on the listener: its peer (peer_ip 4 or 16
 * bytes of version's family) must be B, else -ENOENT: a local process that
 * connects to A:P directly gets no one else's flow. */
int sw_tun_peer_lookup(sw_tun *tun, uint8_t version, const uint8_t *peer_ip, uint16_t peer_port,
                       sw_tun_flow *out);

/* Readable while records are pending (drain until it is not). */
int sw_tun_fd(sw_tun *tun);
/* Copies up to max records, oldest first; UDP payloads into payload[0, cap)
 * (see payload_off), *payload_used set to the bytes used.  A record whose
 * payload does not fit stays for the next call; with cap >= 65536 at least
 * one always fits.  Returns the count. */
int sw_tun_drain(sw_tun *tun, sw_tun_record *out, size_t max, uint8_t *payload, size_t cap,
                 size_t *payload_used);

/* A reply to a UDP session, written to the TUN: from src:sport (version's
 * family; src NULL: the session's destination and dport, sport ignored) to
 * the session's client; src is read as an address of the session's family.
 * Returns the packet's length; -ENOENT: no such session (ended);
 * -EMSGSIZE: longer than the MTU; else the write's -errno. */
int sw_tun_udp_send(sw_tun *tun, uint64_t session, const uint8_t *src, uint16_t sport,
                    const uint8_t *payload, size_t len);
/* Ends a session now (UDP_ENDED, reason CLOSED, when the ring has room,
 * else at the loop's next timer pass). */
int sw_tun_udp_close(sw_tun *tun, uint64_t session);
/* A UDP datagram built from explicit endpoints (version 4 or 6) and written
 * to the TUN, with no session (a late reply).  Length or -errno as above. */
int sw_tun_inject_udp(sw_tun *tun, uint8_t version, const uint8_t *src, uint16_t sport,
                      const uint8_t *dst, uint16_t dport, const uint8_t *payload, size_t len);

int sw_tun_stats_get(sw_tun *tun, sw_tun_stats *out);

/* SW_CDEF_END */

#endif /* SW_TUN_H */
