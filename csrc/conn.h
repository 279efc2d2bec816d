/*
 * spliceway C connection path: accepts on listening sockets Python handed
 * over, runs the inbound handshake (socks5, http CONNECT, mixed), sniffs,
 * routes from the compiled table (route.h), dials (direct, block, socks5 and
 * http upstreams), replies, and hands both sockets to the relay (relay.h) --
 * all on its own epoll loops, never touching Python.
 *
 * Python hears about it through fixed-size records (sw_conn_record) in one
 * ring per loop, signalled by an eventfd that is readable while any record is
 * pending, and drained in batches with sw_conn_drain().  A full ring is
 * backpressure: a loop accepts only while the ring has room for every record
 * its open flows may still write, so no record is ever dropped.
 *
 * What the table cannot decide (an opaque rule, a DNS miss, a target kind C
 * does not dial, an HTTP head C does not parse) is deferred: the client socket
 * and what C read and wrote so far go to Python (sw_conn_take_deferred), which
 * completes the connection on its own path (a flow C had already started, to
 * sniff before routing, goes to that flow's owner: sw_deferred.flow).
 *
 * Conventions as relay.h: 0 or a count on success, -errno on failure.
 */
#ifndef SW_CONN_H
#define SW_CONN_H

#include <stddef.h>
#include <stdint.h>

#include "relay.h"
#include "route.h"
#include "tun.h"

/* SW_CDEF_BEGIN */

typedef struct sw_conn sw_conn;

enum sw_inbound_protocol {
    SW_IN_SOCKS5 = 1,
    SW_IN_HTTP = 2,
    SW_IN_MIXED = 3,
    SW_IN_TUN = 4   /* the TUN stack's kernel listener (sw_conn_listen_tun): the
                       "handshake" is the NAT lookup of the peer (no byte read or
                       written); the flow's source and target are the original
                       ones; a refused flow is closed with a reset */
};

#define SW_DNS_MAX_ADDRS 8

enum sw_rec_kind {
    SW_REC_STARTED = 1, /* handshake done, C owns the flow; name = target host */
    SW_REC_ROUTED = 2,  /* dialled, replied, handed to the relay; name = sniffed host */
    SW_REC_ENDED = 3,   /* ended before the relay (blocked, failed, closed); name = sniffed host */
    /* Not a flow's: listener `inbound` could not accept for want of descriptors
     * (err: EMFILE, ENFILE, ENOBUFS or ENOMEM), the first failure of an outage;
     * flow = the outage's number (per listener, from 1).  The loop that failed
     * stops accepting (every listener) for a delay growing from 50 ms to 1 s
     * instead of retrying at once, and serves its open connections meanwhile. */
    SW_REC_ACCEPT_FAILED = 4,
    /* Listener `inbound` accepted again: outage `flow` is over; detail = the
     * accepts that failed in it (saturating).  At most one per FAILED record
     * (none when the listener is unlistened first). */
    SW_REC_ACCEPT_RESUMED = 5
};

/* Why a flow ended before the relay (SW_REC_ENDED). */
enum sw_end {
    SW_END_BLOCKED = 1,        /* route action block or a block outbound */
    SW_END_CONNECT_FAILED = 2, /* connect() failed: err is the errno */
    SW_END_CONNECT_TIMEOUT = 3,/* connect or the upstream handshake timed out */
    SW_END_UPSTREAM_PROTO = 4, /* the upstream proxy broke its protocol */
    SW_END_UPSTREAM_AUTH = 5,  /* the upstream refused our auth (detail below) */
    SW_END_UPSTREAM_REPLY = 6, /* the upstream answered a failure (detail = code) */
    SW_END_CLOSED = 7,         /* sw_conn_request_close() or shutdown; detail 1 when
                                  still sniffing before routing (no route applies) */
    SW_END_CLIENT = 8,         /* the client went away before the hand-off */
    SW_END_INTERNAL = 9,       /* a local resource failed (err is the errno) */
    /* A request C forwarded itself (an http inbound's absolute-URI request in C's
     * subset, docs/http-forward.md): its ROUTED record has relay_handle 0, and its
     * ENDED record one of these, with the request's own byte counts. */
    SW_END_FORWARDED = 10,     /* answered whole: the response went to the client */
    SW_END_FWD_CLIENT = 11,    /* the client went away while its answer was sent */
    SW_END_FWD_TIMEOUT = 12    /* the upstream went quiet: detail 0 before its response
                                  head (the client got a 502), 1 mid-body (the client got
                                  what had come, then the close) */
};

/* Upstream-auth details (SW_END_UPSTREAM_AUTH). */
enum sw_auth_detail {
    SW_AUTH_REFUSED_USERPASS = 1, /* socks5 server refused user/password auth */
    SW_AUTH_REJECTED = 2,         /* socks5 server rejected the credentials */
    SW_AUTH_REQUIRED = 3          /* socks5 server requires authentication */
};

/* Upstream protocol failures (SW_END_UPSTREAM_PROTO): detail = kind | byte << 8,
 * enough for Python to write the very message its own outbound would. */
enum sw_proto_detail {
    SW_PROTO_CLOSED = 1,         /* EOF or an error before the handshake ended */
    SW_PROTO_METHOD_VERSION = 2, /* method selection's version byte (byte) */
    SW_PROTO_AUTH_VERSION = 3,   /* user/password status's version byte (byte) */
    SW_PROTO_REPLY_VERSION = 4,  /* CONNECT reply's version byte (byte) */
    SW_PROTO_REPLY_ATYP = 5,     /* CONNECT reply's unknown address type (byte) */
    SW_PROTO_EMPTY_DOMAIN = 6,   /* CONNECT reply's domain of length 0 */
    SW_PROTO_BAD_DOMAIN = 7,     /* CONNECT reply's undecodable domain */
    SW_PROTO_HTTP = 8            /* http proxy's malformed response: the message is
                                    kept for sw_conn_take_message */
};

enum sw_conn_auth {
    SW_CAUTH_NONE = 0,
    SW_CAUTH_USERPASS = 1, /* SOCKS5 RFC 1929 */
    SW_CAUTH_BASIC = 2     /* HTTP Proxy-Authorization: Basic */
};

typedef struct sw_conn_record {
    uint64_t flow;            /* C's flow number, unique per sw_conn, from 1 */
    uint64_t at_unix_ms;      /* when it happened (CLOCK_REALTIME) */
    uint64_t relay_handle;    /* ROUTED: the relay's handle */
    uint64_t epoch;           /* ROUTED/ENDED: epoch of the table that routed */
    uint32_t kind;            /* enum sw_rec_kind */
    uint32_t inbound;         /* listener index */
    uint32_t principal;       /* principal id or SW_NO_PRINCIPAL */
    int32_t rule;             /* ROUTED/ENDED: sw_route_result.rule */
    int32_t target;           /* ROUTED/ENDED: target index or -1 */
    int32_t action;           /* ROUTED/ENDED: enum sw_route_action */
    uint32_t client_rx;       /* bytes read from / written to the client by C so far */
    uint32_t client_tx;
    uint32_t upstream_rx;     /* bytes of the upstream handshake (and early data) */
    uint32_t upstream_tx;
    uint32_t early;           /* ROUTED: client bytes C forwarded upstream itself */
    uint32_t late;            /* ROUTED: upstream bytes past its proxy reply that C
                                 forwarded to the client itself */
    uint32_t end;             /* ENDED: enum sw_end */
    int32_t err;              /* ENDED: positive errno, 0 when none */
    int32_t detail;           /* ENDED: auth detail, reply code or HTTP status */
    uint16_t port;            /* target port */
    uint16_t source_port;
    uint16_t resolved_port;   /* ROUTED: port connected to */
    uint8_t protocol;         /* the handshake spoken: 1 socks5, 2 http (CONNECT), 3 tun,
                                 4 http (an absolute-URI request C forwards) */
    uint8_t auth;             /* enum sw_conn_auth */
    uint8_t source_family;    /* 4 or 6 */
    uint8_t resolved_family;  /* ROUTED: 4, 6, or 0 */
    uint8_t replied;          /* the success reply went out before routing */
    uint8_t dialled;          /* the upstream connection (and its handshake) was made */
    uint8_t source_ip[16];
    uint8_t resolved_ip[16];  /* ROUTED: the address connect() reached */
    uint16_t name_len;
    char name[256];           /* NUL-terminated (see sw_rec_kind) */
} sw_conn_record;

enum sw_defer_stage {
    SW_DEFER_HANDSHAKE = 1, /* C did not finish the handshake: raw holds what it read,
                               nothing was written to the client */
    SW_DEFER_ROUTE = 2,     /* handshake done: host/port/principal set, raw holds the
                               client bytes read past the request (early data) */
    SW_DEFER_FORWARD = 3    /* a forwarded request's response C does not take (chunked,
                               interim, too long, an error...): `flow` started and routed,
                               its request sent on `ufd`; raw holds the request head
                               (raw[0..split)) and what the upstream answered so far;
                               nothing was written to the client for it */
};

/* Largest client prefix C buffers; a longer HTTP head is deferred. */
#define SW_CONN_RAW_MAX 16384

typedef struct sw_deferred {
    int32_t fd;               /* the client socket, now Python's */
    uint32_t stage;           /* enum sw_defer_stage */
    uint32_t inbound;
    uint32_t protocol;        /* the handshake spoken: 1 socks5, 2 http, 3 tun (host
                                 is the original destination's address; nothing
                                 was or is to be written to the client) */
    uint32_t principal;
    uint32_t auth;            /* enum sw_conn_auth */
    uint32_t client_rx;       /* bytes C read from the client */
    uint32_t client_tx;       /* bytes C wrote to the client */
    uint64_t started_unix_ms; /* SW_DEFER_ROUTE: when the handshake completed */
    uint64_t flow;            /* SW_DEFER_ROUTE: the flow's number when its STARTED
                                 record went out (it was sniffed before routing), else 0:
                                 that flow's owner takes the connection over */
    uint16_t port;
    uint16_t source_port;
    uint8_t source_family;
    uint8_t replied;          /* the success reply was sent (sniffing before routing) */
    uint8_t command;          /* SOCKS5 command: 1 CONNECT, 3 UDP ASSOCIATE (deferred at
                                 SW_DEFER_ROUTE, host:port the client's declared source);
                                 1 for HTTP */
    uint8_t reserved[1];
    uint8_t source_ip[16];
    uint16_t host_len;
    uint16_t sniffed_len;
    char host[256];
    char sniffed[256];
    int32_t ufd;              /* SW_DEFER_FORWARD: the upstream socket, now Python's; else -1 */
    uint32_t split;           /* SW_DEFER_FORWARD: the request head's length in raw */
    uint32_t upstream_rx;     /* SW_DEFER_FORWARD: bytes read from / written to ufd */
    uint32_t upstream_tx;
    uint32_t raw_len;
    uint8_t raw[16384];
} sw_deferred;

typedef struct sw_listener_opts {
    uint32_t protocol;             /* enum sw_inbound_protocol */
    uint32_t sniff;                /* 1: sniff TLS SNI / HTTP Host */
    uint32_t sniff_timeout_ms;
    uint32_t handshake_timeout_ms;
    uint32_t idle_timeout_ms;      /* handed to the relay */
    uint32_t users_required;       /* 1: users added with sw_conn_listener_user */
    uint32_t forward;              /* 1: forward absolute-URI requests in C's subset
                                      (http / mixed, no users): sw_parse_http_forward */
} sw_listener_opts;

/* nloops 0 = one.  relay: where established flows go (not owned). */
int sw_conn_new(sw_relay *relay, int nloops, uint32_t ring_records, sw_conn **out);
/* Closes every connection C still holds (ENDED/SW_END_CLOSED records for
 * started flows), stops and joins the loops.  Idempotent. */
int sw_conn_shutdown(sw_conn *conn);
void sw_conn_free(sw_conn *conn);

/* A credential of listener `inbound` (before sw_conn_listen). */
int sw_conn_listener_user(sw_conn *conn, uint32_t inbound, const char *user,
                          const char *pass, uint32_t principal);
/* Start accepting on `fd` (a bound, listening socket the caller keeps owning)
 * as listener `inbound`. */
int sw_conn_listen(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts);
/* Start accepting on the TUN stack's kernel listener `fd` (its listener on
 * address A, family 4 or 6) as listener `inbound`: opts->protocol must be
 * SW_IN_TUN.  Each accepted socket's peer must be the stack's NAT address B;
 * its NAT entry (sw_tun_peer_lookup) gives the flow's source and target
 * (the target's host is the address as Python's ipaddress writes it), and
 * the flow is routed, dialled and relayed as any other.  A peer with no
 * entry is closed (handshake_failed).  tun must outlive the listener:
 * sw_conn_unlisten before sw_tun_free. */
int sw_conn_listen_tun(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                       sw_tun *tun);
/* Stop accepting on `inbound`; returns once no loop will touch its fd again. */
int sw_conn_unlisten(sw_conn *conn, uint32_t inbound);

/* Install a sealed table (ownership passes to conn, also on failure); the
 * previous one is freed once every loop has stopped using it. */
int sw_conn_set_table(sw_conn *conn, sw_table *table);

/* Remember what `host` resolved to, for ttl_ms: n addresses (at most
 * SW_DNS_MAX_ADDRS, tried in this order), families[i] 4 or 6, addrs 16 bytes
 * each (an IPv4 address in the first 4). */
int sw_conn_dns_put(sw_conn *conn, const char *host, uint32_t n, const uint8_t *families,
                    const uint8_t *addrs, uint32_t ttl_ms);

/* Forget every remembered answer (the resolver that gave them was replaced). */
void sw_conn_dns_flush(sw_conn *conn);

/* Close a flow C still holds (started, not yet handed to the relay).
 * -ENOENT when C holds no such flow. */
int sw_conn_request_close(sw_conn *conn, uint64_t flow);

/* The failure message C kept for `flow` (SW_PROTO_HTTP), NUL-terminated and
 * truncated to cap; its length, or -ENOENT. */
int sw_conn_take_message(sw_conn *conn, uint64_t flow, char *out, size_t cap);

int sw_conn_fd(sw_conn *conn);
/* Copies up to max pending records, oldest first per loop. */
int sw_conn_drain(sw_conn *conn, sw_conn_record *out, size_t max);
/* 1 and fills *out when a deferred connection was waiting, 0 when none. */
int sw_conn_take_deferred(sw_conn *conn, sw_deferred *out);

typedef struct sw_conn_stats {
    uint64_t accepted;
    uint64_t handshake_failed;
    uint64_t deferred;
    uint64_t started;
    uint64_t routed;
    uint64_t ended;
    uint64_t accept_paused;   /* times a loop stopped accepting on a full ring */
    uint64_t accept_errors;
    uint64_t mark_failed;     /* upstream sockets setsockopt(SO_MARK) refused (EPERM
                                 without CAP_NET_ADMIN): dialled unmarked */
} sw_conn_stats;

int sw_conn_stats_get(sw_conn *conn, sw_conn_stats *out);

/* The SO_MARK every upstream socket gets before connect() from now on (0: none,
 * the default): the TUN's auto_route sends marked packets around the TUN
 * (spliceway/support/socket_mark.py).  Read once per dial; flows already connected keep
 * theirs.  A socket whose setsockopt fails is dialled unmarked and counted in
 * sw_conn_stats.mark_failed. */
int sw_conn_set_mark(sw_conn *conn, uint32_t mark);

/* SW_CDEF_END */

#endif /* SW_CONN_H */
