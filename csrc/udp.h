/*
 * spliceway C UDP datagram relay for SOCKS5 UDP ASSOCIATE (RFC 1928 section
 * 7).  C moves datagrams, Python decides: epoll loops on their own pthreads
 * (never touching Python) read client datagrams in recvmmsg batches, check
 * their source, parse the SOCKS5 UDP header (sw_parse_s5_udp_fields), and
 * send the payload on with sendmmsg; replies are wrapped in a SOCKS5 header
 * and sent to the client the same way.  Every routing decision is Python's.
 *
 * Objects
 *   association  one UDP ASSOCIATE: the client-facing UDP socket Python bound
 *                (the BND.ADDR/BND.PORT it told the client) and the client's
 *                address.  Lives until sw_udp_assoc_close (the TCP control
 *                connection ended) or shutdown.  Id: uint64, never 0, never
 *                reused within one sw_udp.
 *   destination  one (ATYP, DST.ADDR, DST.PORT) the client sent to, exactly
 *                as sent (a domain is compared byte for byte, not resolved):
 *                Python's UDP flow.  Id: uint32 from 1, per association,
 *                never reused within it.  Ends when idle for the
 *                association's dest_idle_timeout_ms, on sw_udp_dest_close,
 *                when its upstream ends, or with its association.
 *   upstream     one UDP socket Python created for an (association,
 *                outbound) pair and handed over (sw_udp_upstream_add), shared
 *                by every DIRECT destination Python puts on it.  Id: uint32
 *                from 1, per association.  Ends when idle for its own
 *                idle_timeout_ms (runtime.udp_upstream_idle_timeout_seconds),
 *                on sw_udp_upstream_close, on a socket error, or with its
 *                association.  Python creates the sockets (not C) because
 *                the outbound decides how: bind address, interface, SO_MARK,
 *                address family.
 *
 * Flow of a datagram from the client
 *   From any source other than the client's address: dropped, counted
 *   (dropped_foreign).  A client that declared port 0 (or, with
 *   client_family 0, no address at all) is learned from the first datagram
 *   that fits; from then on only that exact address:port is accepted.
 *   A header Python's parse_udp_datagram refuses, or a truncated read:
 *   dropped_malformed.  FRAG != 0: dropped_fragment (no reassembly, as RFC
 *   1928 allows).  A destination seen for the first time gets an id and a
 *   SW_UDP_REC_NEW_DEST record; its datagrams wait in a bounded queue
 *   (pending_max per destination, pending_bytes_max per loop; beyond:
 *   dropped_pending) until Python answers sw_udp_dest_set:
 *     SW_UDP_DIRECT  the payload goes to the resolved address over the
 *                    upstream's socket; replies from that address are
 *                    wrapped with the destination's address as the client
 *                    sent it (a domain stays a domain) and sent to the client.
 *     SW_UDP_DROP    discarded and counted (dropped_blocked): a block rule.
 *     SW_UDP_PYTHON  handed to Python as SW_UDP_REC_DATAGRAM records (the
 *                    socks5 and shadowsocks outbounds relay in Python);
 *                    Python answers with sw_udp_send_to_client.
 *   Python may call sw_udp_dest_set again to change a destination's verdict.
 *
 * Flow of a datagram from an upstream
 *   Attributed to the DIRECT destination on that upstream whose resolved
 *   address:port is the datagram's source (of several, the one that sent
 *   last).  None: dropped_unsolicited (address- and port-dependent
 *   filtering: a peer the client never sent to cannot reach it).
 *
 * Records
 *   Python hears about destinations and endings through fixed-size records
 *   (sw_udp_record), one single-producer ring per loop, signalled by an
 *   eventfd (sw_udp_fd) that is readable while records are pending, drained
 *   with sw_udp_drain.  Per association, records come in order: a
 *   destination's NEW_DEST before its DATAGRAMs before its DEST_ENDED, every
 *   DEST_ENDED and UPSTREAM_ENDED of an association before its ASSOC_ENDED.
 *   NEW_DEST and DATAGRAM records need room in the ring: without it the
 *   datagram is dropped and counted (dropped_no_dest, dropped_python).
 *   *_ENDED records are not lost to a full ring: they wait in an overflow
 *   list, in order, which sw_udp_drain reads after the ring (only a failed
 *   malloc of that list's item would lose one).
 *
 * Threads
 *   Each association belongs to one loop, with its destinations and
 *   upstreams.  A loop holds its mutex while it handles a batch of events;
 *   every sw_udp_* call takes the mutex of the loop it concerns, so calls are
 *   synchronous (their result is final when they return) and may come from
 *   any thread.  cffi releases the GIL around them.
 *
 * Counters
 *   Per destination, sw_udp_counters (exact; see its comments): the four
 *   boundaries (client and upstream, each way) in packets and bytes as
 *   read or written, the payload bytes delivered each way, and what was
 *   dropped, why.  Global, sw_udp_stats: its first eleven fields are
 *   stats.udp_upstream (spliceway/events/catalogue.py UDP_COUNTERS) for what
 *   C relays; the Python outbounds add their own.
 *
 * Conventions as relay.h: 0 or a count on success, -errno on failure
 * (sw_strerror renders it); -ENOENT names an association, destination or
 * upstream that does not exist (any more).  Everything between the SW_CDEF
 * markers is the cffi cdef (csrc/relay_build.py).
 */
#ifndef SW_UDP_H
#define SW_UDP_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

/* Bumped whenever a struct layout or a function signature below changes. */
#define SW_UDP_ABI_VERSION 2

typedef struct sw_udp sw_udp;

/* 0 in any field means its default. */
typedef struct sw_udp_opts {
    uint32_t loops;             /* epoll threads; default 1 */
    uint32_t max_assocs;        /* concurrent associations; default 4096 */
    uint32_t ring_records;      /* record ring per loop, rounded up to a power
                                   of two; default 4096 */
    uint32_t max_dests;         /* live destinations per association; a new one
                                   beyond it is dropped_no_dest; default 1024 */
    uint32_t pending_max;       /* datagrams held per undecided destination;
                                   default 16 */
    uint32_t pending_bytes_max; /* payload bytes held for undecided
                                   destinations, per loop; default 4 MiB */
    uint32_t python_bytes_max;  /* DATAGRAM payload bytes waiting in a loop's
                                   ring for Python; default 8 MiB */
    uint32_t busy_poll_us;      /* after a batch with datagrams, poll (without
                                   sleeping) for this long before the loop
                                   sleeps again; 0 = never (the default).
                                   Saves two thread wake-ups per round trip
                                   when traffic is ping-pong, at the cost of
                                   spinning a CPU while traffic flows */
} sw_udp_opts;

enum sw_udp_action {
    SW_UDP_PENDING = 0, /* no verdict yet: datagrams are held (bounded) */
    SW_UDP_DIRECT = 1,  /* send to the resolved address over an upstream */
    SW_UDP_DROP = 2,    /* discard (a block rule) */
    SW_UDP_PYTHON = 3   /* hand each datagram to Python (SW_UDP_REC_DATAGRAM) */
};

typedef struct sw_udp_verdict {
    uint32_t action;   /* enum sw_udp_action, not SW_UDP_PENDING */
    uint32_t upstream; /* DIRECT: the upstream's id */
    uint8_t family;    /* DIRECT: 4 or 6, the resolved address below */
    uint8_t reserved;
    uint16_t port;     /* DIRECT: the resolved port */
    uint8_t ip[16];    /* DIRECT: an IPv4 address in the first 4 bytes */
} sw_udp_verdict;

/* Exact counts for one destination (an upstream's record uses the
 * upstream_* and send_failures fields, an association's record holds the
 * sum over all its destinations).  "Wire" sizes are what the socket read or
 * wrote: a client datagram with its SOCKS5 header, an upstream datagram
 * (DIRECT) as bare payload.  The flow record's bytes_up/bytes_down are
 * bytes_up/bytes_down here (plus what Python relayed itself for PYTHON
 * destinations); packets_up/packets_down are upstream_tx_packets (plus
 * Python's) and client_tx_packets; the four boundary byte counters are
 * client_rx_bytes, client_tx_bytes, upstream_rx_bytes, upstream_tx_bytes. */
typedef struct sw_udp_counters {
    uint64_t client_rx_packets;    /* client datagrams for this destination:
                                      from the client, parsed, FRAG 0 */
    uint64_t client_rx_bytes;      /* their wire size (header + payload) */
    uint64_t upstream_tx_packets;  /* sent on the upstream socket by C */
    uint64_t upstream_tx_bytes;    /* their wire size */
    uint64_t bytes_up;             /* payload bytes C delivered upstream */
    uint64_t upstream_rx_packets;  /* upstream datagrams attributed to it */
    uint64_t upstream_rx_bytes;    /* their wire size */
    uint64_t client_tx_packets;    /* written to the client (by the loop or
                                      sw_udp_send_to_client) */
    uint64_t client_tx_bytes;      /* their wire size (header + payload) */
    uint64_t bytes_down;           /* their payload bytes */
    uint64_t python_packets;       /* handed to Python (SW_UDP_REC_DATAGRAM) */
    uint64_t python_bytes;         /* their payload bytes */
    uint64_t dropped_pending;      /* undecided: its queue or the loop's
                                      pending_bytes_max was full */
    uint64_t dropped_blocked;      /* verdict DROP */
    uint64_t dropped_python;       /* verdict PYTHON: no ring room or
                                      python_bytes_max reached */
    uint64_t send_failures;        /* the upstream socket refused it */
    uint64_t client_send_failures; /* the client socket refused a reply */
    uint64_t last_activity_unix_ms;/* CLOCK_REALTIME ms of the last datagram
                                      either way (creation until then) */
} sw_udp_counters;

/* What an association (or an upstream: unsolicited, recv_failures) dropped
 * that belongs to no destination. */
typedef struct sw_udp_drops {
    uint64_t dropped_foreign;     /* client socket: from another source */
    uint64_t dropped_fragment;    /* FRAG != 0 */
    uint64_t dropped_malformed;   /* header refused, or a truncated read */
    uint64_t dropped_no_dest;     /* a new destination beyond max_dests, or no
                                     ring room for its NEW_DEST record */
    uint64_t dropped_unsolicited; /* upstream datagram from an address no
                                     DIRECT destination on it sends to */
    uint64_t recv_failures;       /* read errors other than EAGAIN/EINTR */
    uint64_t destinations;        /* destinations created */
    uint64_t reserved;
} sw_udp_drops;

enum sw_udp_rec_kind {
    SW_UDP_REC_NEW_DEST = 1,      /* a destination appeared: answer with
                                     sw_udp_dest_set */
    SW_UDP_REC_DATAGRAM = 2,      /* a PYTHON destination's datagram */
    SW_UDP_REC_DEST_ENDED = 3,    /* final counters */
    SW_UDP_REC_UPSTREAM_ENDED = 4,/* its socket is closed; final counters */
    SW_UDP_REC_ASSOC_ENDED = 5    /* after all of its other records */
};

enum sw_udp_end {
    SW_UDP_END_IDLE = 1,          /* idle timeout */
    SW_UDP_END_CLOSED = 2,        /* sw_udp_dest_close / sw_udp_upstream_close /
                                     sw_udp_assoc_close */
    SW_UDP_END_ASSOC = 3,         /* its association ended */
    SW_UDP_END_UPSTREAM = 4,      /* destination: its upstream ended */
    SW_UDP_END_ERROR = 5,         /* its socket failed FAIL_LIMIT (16) reads in a
                                     row; err is the last errno */
    SW_UDP_END_SHUTDOWN = 6       /* sw_udp_shutdown */
};

typedef struct sw_udp_record {
    uint64_t assoc;
    uint64_t at_unix_ms;      /* CLOCK_REALTIME */
    uint32_t kind;            /* enum sw_udp_rec_kind */
    uint32_t dest;            /* NEW_DEST, DATAGRAM, DEST_ENDED */
    uint32_t upstream;        /* UPSTREAM_ENDED; DEST_ENDED: its last (0 none) */
    uint32_t reason;          /* *_ENDED: enum sw_udp_end */
    int32_t err;              /* END_ERROR: positive errno */
    uint32_t action;          /* DEST_ENDED: its verdict then (sw_udp_action) */
    uint32_t payload_off;     /* DATAGRAM: the payload is sw_udp_drain's
                                 payload[payload_off, + payload_len) */
    uint32_t payload_len;
    uint16_t port;            /* NEW_DEST: DST.PORT */
    uint8_t atyp;             /* NEW_DEST: 1 IPv4, 3 domain, 4 IPv6 */
    uint8_t client_family;    /* NEW_DEST: the client's (learned) address, 4/6 */
    uint16_t client_port;
    uint16_t host_len;
    uint8_t ip[16];           /* NEW_DEST: DST.ADDR for atyp 1 (4 bytes) or 4 */
    uint8_t client_ip[16];    /* NEW_DEST: IPv4 in the first 4 bytes */
    sw_udp_counters counters; /* *_ENDED: final */
    sw_udp_drops drops;       /* ASSOC_ENDED, UPSTREAM_ENDED: final */
    char host[256];           /* NEW_DEST: exactly Python's UdpDatagram.host
                                 (socks5.parse_udp_datagram), NUL-terminated */
} sw_udp_record;

/* stats.udp_upstream first (spliceway/events/catalogue.py UDP_COUNTER_TEXT),
 * counting what happens inside C only, so that Python adds its own (the
 * proxies it relays) without counting anything twice: a call C refuses is
 * counted by its caller, never here.  Then the client side.  Totals since
 * sw_udp_new; "active" fields are current. */
typedef struct sw_udp_stats {
    uint64_t active_associations;  /* upstreams open now */
    uint64_t created_associations; /* sw_udp_upstream_add successes */
    uint64_t reused_associations;  /* DIRECT verdicts that put a destination
                                      on an upstream an earlier destination
                                      already used */
    uint64_t closed_associations;  /* upstreams ended, for any reason */
    uint64_t idle_timeouts;        /* ... of which for idleness */
    uint64_t dropped_associations; /* always 0: a refused sw_udp_assoc_add is
                                      the caller's to count */
    uint64_t failed_association_attempts; /* sw_udp_upstream_add refusals
                                      (other than -ENOENT/-ESHUTDOWN) */
    uint64_t send_failures;        /* datagrams a socket refused: upstream
                                      sends, and the loops' replies to clients
                                      (not sw_udp_send_to_client's: its caller
                                      sees the error) */
    uint64_t recv_failures;        /* read errors (not EAGAIN/EINTR) on upstream
                                      and client sockets */
    uint64_t packets_sent;         /* datagrams sent on upstream sockets */
    uint64_t packets_received;     /* datagrams read from upstream sockets and
                                      relayed to a client (attributed to a
                                      destination; see dropped_unsolicited) */
    /* client side */
    uint64_t assocs_active;
    uint64_t assocs_added;
    uint64_t assocs_ended;
    uint64_t dests_active;
    uint64_t dests_created;
    uint64_t dests_ended;
    uint64_t dest_idle_timeouts;
    uint64_t client_packets_received; /* every datagram read from clients */
    uint64_t client_packets_sent;     /* every datagram written to clients */
    uint64_t client_send_failures;    /* every refused write to a client */
    uint64_t client_recv_failures;
    uint64_t dropped_foreign;
    uint64_t dropped_fragment;
    uint64_t dropped_malformed;
    uint64_t dropped_no_dest;
    uint64_t dropped_pending;
    uint64_t dropped_blocked;
    uint64_t dropped_python;
    uint64_t dropped_unsolicited;
    uint64_t records_overflowed;   /* *_ENDED records that waited outside a
                                      full ring */
    uint64_t upstream_errors;      /* upstreams ended for a socket error */
    uint64_t upstream_recv_failures; /* the upstream share of recv_failures */
} sw_udp_stats;

int sw_udp_abi_version(void);

/* opts NULL = all defaults.  Starts the loops. */
int sw_udp_new(const sw_udp_opts *opts, sw_udp **out);
/* Stops and joins the loops, then ends every association (DEST_ENDED,
 * UPSTREAM_ENDED, ASSOC_ENDED records, reason SHUTDOWN; they stay drainable)
 * and closes its sockets.  Every later call but drain, stats and free
 * answers -ESHUTDOWN.  Idempotent. */
int sw_udp_shutdown(sw_udp *udp);
/* sw_udp_shutdown and release.  No other call may be in progress or follow. */
void sw_udp_free(sw_udp *udp);

/* Readable while records are pending (level: drain until it is not). */
int sw_udp_fd(sw_udp *udp);
/* Copies up to max records, oldest first per loop; DATAGRAM payloads are
 * copied into payload[0, cap) (see payload_off), *payload_used set to the
 * bytes used.  A DATAGRAM whose payload does not fit stays for the next
 * call; with cap >= 65536 at least one record always fits.  Returns the
 * count. */
int sw_udp_drain(sw_udp *udp, sw_udp_record *out, size_t max, uint8_t *payload, size_t cap,
                 size_t *payload_used);

typedef struct sw_udp_assoc_opts {
    int32_t client_fd;            /* a bound AF_INET/AF_INET6 UDP socket; C owns
                                     it on success (and closes it) */
    uint8_t client_family;        /* 4 or 6: the client's IP below; 0: any IP
                                     (the first datagram's address is learned) */
    uint8_t reserved;
    uint16_t client_port;         /* 0: learned from the first datagram */
    uint8_t client_ip[16];        /* an IPv4 address in the first 4 bytes; an
                                     IPv4-mapped source matches it too */
    uint32_t dest_idle_timeout_ms;/* a destination with no datagram either way
                                     for this long ends; 0 = never */
    uint32_t reserved2;
} sw_udp_assoc_opts;

/* -EINVAL: not a UDP socket, bad family; -ENOSPC: max_assocs reached. */
int sw_udp_assoc_add(sw_udp *udp, const sw_udp_assoc_opts *opts, uint64_t *assoc_out);
/* Ends the association now: DEST_ENDED and UPSTREAM_ENDED (reason ASSOC)
 * for what it holds, then ASSOC_ENDED (reason CLOSED); closes its sockets. */
int sw_udp_assoc_close(sw_udp *udp, uint64_t assoc);
/* Live totals: the sum over its destinations (ended ones included), drops. */
int sw_udp_assoc_counters(sw_udp *udp, uint64_t assoc, sw_udp_counters *total,
                          sw_udp_drops *drops);
/* The live destinations of an association, in no particular order: up to
 * max ids and their counters (out may be NULL), in one call for samplers.
 * Returns how many live destinations there are, which may exceed max. */
int sw_udp_assoc_dests(sw_udp *udp, uint64_t assoc, uint32_t *ids, sw_udp_counters *out,
                       size_t max);

/* Hands a UDP socket (AF_INET or AF_INET6, bound or not, not connected) to
 * the association; C owns it on success.  idle_timeout_ms 0 = never. */
int sw_udp_upstream_add(sw_udp *udp, uint64_t assoc, int fd, uint32_t idle_timeout_ms,
                        uint32_t *upstream_out);
/* Ends the upstream (UPSTREAM_ENDED, reason CLOSED) and the destinations on
 * it (DEST_ENDED, reason UPSTREAM). */
int sw_udp_upstream_close(sw_udp *udp, uint64_t assoc, uint32_t upstream);

/* The verdict for a destination (again to change it).  Held datagrams are
 * then sent, dropped or handed to Python at once.  -ENOENT: no such
 * association or destination; -ENXIO: no such upstream (it may have ended:
 * watch for its UPSTREAM_ENDED); -EAFNOSUPPORT: an IPv6 address for an
 * AF_INET (or IPv4 for an IPV6_V6ONLY) upstream socket. */
int sw_udp_dest_set(sw_udp *udp, uint64_t assoc, uint32_t dest, const sw_udp_verdict *verdict);
/* Ends a destination now (DEST_ENDED, reason CLOSED). */
int sw_udp_dest_close(sw_udp *udp, uint64_t assoc, uint32_t dest);
int sw_udp_dest_counters(sw_udp *udp, uint64_t assoc, uint32_t dest, sw_udp_counters *out);

/* Wraps payload in a SOCKS5 UDP header and sends it to the client, counted
 * as the destination's (client_tx_*, bytes_down).  The header's address is
 * the destination's as the client sent it, or with src_family 4/6 the given
 * src_ip:src_port.  Returns the bytes written; -ENOTCONN before the client's
 * address is known; -EMSGSIZE for a datagram too large; else the send's
 * -errno (counted in client_send_failures). */
int sw_udp_send_to_client(sw_udp *udp, uint64_t assoc, uint32_t dest, uint8_t src_family,
                          const uint8_t *src_ip, uint16_t src_port, const uint8_t *payload,
                          size_t len);

int sw_udp_stats_get(sw_udp *udp, sw_udp_stats *out);

/* SW_CDEF_END */

#endif /* SW_UDP_H */
