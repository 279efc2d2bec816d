/*
 * Internal to the C connection path (conn.c and its conn_*.c parts): the
 * types every part shares and the functions one part calls in another.
 * Not part of the cffi cdef (conn.h is); conn.c explains the design.
 */
#ifndef SW_CONN_INT_H
#define SW_CONN_INT_H

#define _GNU_SOURCE
#include "clock.h"
#include "conn.h"
#include "evloop.h"
#include "heap.h"
#include "ip6text.h"
#include "iplit.h"
#include "parse.h"
#include "ring.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SO_MARK
#define SO_MARK 36 /* <asm-generic/socket.h> */
#endif

enum {
    MAX_LISTENERS = 256,
    EVENTS_MAX = 128,
    /* Accepts per listener wake-up before the loop serves the others. */
    ACCEPT_BATCH = 64,
    BUF_INITIAL = 512,
    /* Failure texts kept for Python at most (it takes each at once). */
    MESSAGES_MAX = 1024,
    /* Records promised per held connection: STARTED + ROUTED or ENDED. */
    RECORDS_PER_FLOW = 2,
    /* Out of descriptors, a loop stops accepting for this long, doubled after
     * each further failure up to the cap (spliceway/support/fdlimit.py does the same). */
    ACCEPT_BACKOFF_MIN_MS = 50,
    ACCEPT_BACKOFF_MAX_MS = 1000,
    DNS_BUCKETS = 1024,
    DNS_MAX_ENTRIES = 8192,
};
/* A route table can defer any listener slot to Python (the flow hook). */
_Static_assert(MAX_LISTENERS == SW_TABLE_INBOUND_SLOTS, "listener slots != table slots");

#define DEFAULT_RING 8192u

/* epoll cookie types: the cookie points at a struct whose first member is one. */
enum ep_type { EP_WAKE = 1, EP_LISTENER, EP_CLIENT, EP_UPSTREAM };

enum state {
    ST_HS_FIRST = 1, /* mixed: waiting for the first byte */
    ST_S5_GREETING,
    ST_S5_USERPASS,
    ST_S5_REQUEST,
    ST_HTTP_HEAD,
    ST_SNIFF_PRE,     /* replied; sniffing before the route is final */
    ST_CONNECT,       /* non-blocking connect in progress */
    ST_UP_S5_METHOD,  /* upstream socks5: waiting for the method selection */
    ST_UP_S5_AUTH,    /* upstream socks5: waiting for the user/password status */
    ST_UP_S5_REPLY,   /* upstream socks5: waiting for the CONNECT reply */
    ST_UP_HTTP_REPLY, /* upstream http: waiting for the CONNECT response head */
    ST_SNIFF_POST,    /* replied; sniffing before the hand-off */
    ST_TUN,           /* TUN: looked up, about to be routed */
    ST_FWD_RESP,      /* forwarding: the request went up, its answer is awaited */
    ST_FWD_FLUSH,     /* forwarding: the answer waits for room in the client socket */
};

struct ep {
    int type;
};

struct user {
    char *name;
    char *pass;
    size_t pass_len;
    uint32_t principal;
};

struct listener {
    struct ep ep;
    int fd;
    uint32_t index;
    _Atomic int active;
    sw_listener_opts opts;
    struct user *users;
    size_t nusers;
    sw_tun *tun;                   /* SW_IN_TUN: the stack whose NAT names the flows */
    struct listener *next_retired; /* in conn->retired_listeners once unlistened */
    /* Out of descriptors: the number of the outage under way (0: none), the
     * last one's number, and the accepts failed in the one under way.  Any
     * loop may start or end an outage: the exchange decides which reports it. */
    _Atomic uint32_t outage;
    _Atomic uint32_t outages;
    _Atomic uint64_t outage_failures;
};

struct cconn {
    struct ep ep_client; /* .type EP_CLIENT */
    struct ep ep_up;     /* .type EP_UPSTREAM */
    struct cloop *loop;
    struct listener *listener;
    struct cconn *next_dead;   /* freed at the end of the epoll batch */
    struct cconn *prev, *next; /* the loop's list of held connections */
    int cfd, ufd;
    int state;
    bool dead, replied, started, dialled;
    bool up_watched; /* ufd is in the loop's epoll set */
    bool client_eof; /* the client's FIN was read during the handshake */
    uint8_t promise; /* records this connection may still write */
    uint8_t proto;   /* 1 socks5, 2 http */
    uint8_t auth;
    uint32_t principal;
    uint64_t flow;
    uint64_t started_ms;
    uint64_t deadline; /* monotonic ms, 0 = none */
    size_t heap_idx;   /* SIZE_MAX when not in the heap */
    uint8_t *buf;
    uint32_t len, cap, consumed;
    uint32_t crx, ctx, urx, utx, early, late;
    uint32_t hs_tx; /* client bytes written by the handshake itself */
    uint8_t src_family;
    uint16_t src_port;
    uint8_t src_ip[16];
    uint16_t port, host_len, sniffed_len;
    uint8_t command; /* SOCKS5 command; 3 (UDP ASSOCIATE) goes to Python */
    char host[SW_HOST_MAX];
    char sniffed[SW_HOST_MAX];
    /* the route, copied from the table */
    uint64_t epoch;
    sw_route_result rr;
    bool sniff_may_reroute; /* a domain rule ranks before the matched one */
    int out_kind;
    uint32_t connect_timeout_ms;
    struct sockaddr_storage up_addr;
    socklen_t up_addr_len;
    /* Every address of the upstream's name, tried in order as open_tcp does. */
    uint8_t naddrs, addr_idx;
    uint16_t up_port;
    uint8_t addr_family[SW_DNS_MAX_ADDRS];
    uint8_t addr_raw[SW_DNS_MAX_ADDRS][16];
    char *up_user, *up_pass; /* socks5 upstream credentials (copied) */
    char *up_tag;            /* the proxy outbound's tag, for failure messages */
    uint8_t *http_buf;       /* upstream http: the CONNECT request, then its response */
    uint32_t http_req_len, http_len, http_cap;
    const uint8_t *left; /* upstream bytes past the proxy's answer, for the client */
    uint32_t left_len;
    char up_where[300]; /* "server:port" of the proxy, as Python writes it */
    uint8_t up_buf[600];
    uint32_t up_len;
    /* Forwarding an absolute-URI request (fwd_try): one flow per request. */
    bool fwd;              /* the current request is one C forwards */
    bool fwd_keep;         /* its client keeps the connection after it */
    bool fwd_head;         /* its method is HEAD */
    bool fwd_served;       /* C answered a request on this connection before */
    bool fwd_reuse;        /* ST_FWD_FLUSH: the upstream may serve the next request */
    bool fwd_out_watch;    /* the client's epoll mask has EPOLLOUT (ST_FWD_FLUSH) */
    uint32_t fwd_head_len; /* the request head, at the start of buf */
    int32_t fwd_target;    /* what the kept upstream connection was dialled for */
    uint64_t fwd_epoch;
    uint16_t fwd_port;
    char fwd_host[SW_HOST_MAX];
    uint8_t *fbuf; /* the request's origin-form head, then the answer */
    uint32_t flen, foff;
    uint8_t *rbuf; /* what the upstream answered */
    uint32_t rlen;
};

struct cmd {
    struct cmd *next;
    int kind; /* CMD_CLOSE, CMD_BARRIER */
    uint64_t flow;
    int done; /* barrier: set by the loop */
};
enum { CMD_CLOSE = 1, CMD_BARRIER = 2 };

struct ring {
    sw_conn_record *slots;
    size_t bytes;
    uint32_t mask;
    _Atomic uint32_t head; /* written by the loop */
    _Atomic uint32_t tail; /* written by the consumer */
};

struct cloop {
    struct ep wake_ep;
    sw_conn *conn;
    pthread_t thread;
    bool started;
    int epfd;
    int wakefd;
    pthread_mutex_t cmd_lock;
    pthread_cond_t cmd_cond;
    struct cmd *cmds;
    _Atomic int stop;
    _Atomic uint64_t seen; /* epoch seen this iteration, 0 while asleep */
    _Atomic int paused;    /* accepting paused for ring room */
    struct ring ring;
    uint32_t promised; /* records held connections may still write */
    struct cconn **heap;
    size_t heap_len, heap_cap;
    struct cconn *held; /* list of held connections */
    struct cconn *dead;
    bool published;   /* a record went into the ring this iteration */
    bool accept_more; /* a listener's batch ended before EAGAIN */
    /* Out of descriptors: no accept before accept_retry_at (monotonic ms, 0:
     * accepting); accept_delay_ms is the pause the last failure chose. */
    uint64_t accept_retry_at;
    uint32_t accept_delay_ms;
    uint8_t peek[SW_CONN_RAW_MAX + 8];
};

struct retired {
    struct retired *next;
    sw_table *table;
    uint64_t epoch;
};

struct dns_entry {
    struct dns_entry *next;
    uint64_t expires; /* monotonic ms */
    uint8_t n;        /* addresses, in the resolver's order */
    uint8_t family[SW_DNS_MAX_ADDRS];
    uint8_t addr[SW_DNS_MAX_ADDRS][16];
    char host[];
};

struct deferred_item {
    struct deferred_item *next;
    sw_deferred d;
};

struct sw_conn {
    sw_relay *relay;
    int nloops;
    struct cloop *loops;
    int efd; /* readable while records or deferrals are pending */
    _Atomic uint64_t next_flow;
    _Atomic(sw_table *) table;
    _Atomic uint64_t epoch;
    pthread_mutex_t retire_lock;
    struct retired *retired;
    struct listener *listeners[MAX_LISTENERS];
    /* Unlistened listeners: connections they accepted may still read their options
     * and users, so they live (unchanged) until sw_conn_free. */
    struct listener *retired_listeners;
    pthread_mutex_t listen_lock;
    pthread_mutex_t dns_lock;
    struct dns_entry *dns[DNS_BUCKETS];
    size_t dns_count;
    pthread_mutex_t defer_lock;
    struct deferred_item *defer_head, *defer_tail;
    /* Failure messages too long for a record (guarded by defer_lock). */
    struct message *messages;
    size_t nmessages;
    pthread_mutex_t drain_lock;
    _Atomic int shut;
    /* SO_MARK for upstream sockets, 0 for none (sw_conn_set_mark): read once per
     * dial, so a change applies to the next socket. */
    _Atomic uint32_t mark;
    struct {
        _Atomic uint64_t accepted, handshake_failed, deferred, started, routed, ended,
            accept_paused, accept_errors, mark_failed;
    } stats;
};

struct message {
    struct message *next;
    uint64_t flow;
    char text[];
};

enum sniff_result { SNIFF_DONE, SNIFF_WAIT };

/* Called across the parts; hidden, so the extension exports only sw_conn_*. */
#pragma GCC visibility push(hidden)

/* conn_flow.c */
uint32_t hash_str(const char *s);
int write_all(int fd, const void *data, size_t len);
void timer_clear(struct cconn *c);
int timer_set(struct cconn *c, uint64_t deadline);
uint32_t ring_used(struct ring *R);
bool ring_has_room(struct cloop *L);
sw_conn_record *record_begin(struct cconn *c, uint32_t kind);
void record_listener(struct cloop *L, struct listener *l, uint32_t kind, uint32_t outage, int err,
                     int32_t detail);
void record_name(sw_conn_record *r, const char *s, uint16_t len);
void record_commit(struct cconn *c);
void conn_release(struct cconn *c);
void conn_free_dead(struct cloop *L);
void conn_drop(struct cconn *c);
void conn_end(struct cconn *c, uint32_t end, int err, int detail);
void conn_defer(struct cconn *c, uint32_t stage);
void conn_message(struct cconn *c, const char *text);
int client_read(struct cconn *c, uint32_t events);
int client_send(struct cconn *c, const void *data, size_t len);
int success_reply(struct cconn *c);
const char *http_phrase(int status);
void failure_reply(struct cconn *c, int socks_code, int http_status, const char *message);
int sniff_step(struct cconn *c);

/* conn_dns.c */
void addr_select(struct cconn *c, uint8_t i);
bool dns_get(sw_conn *conn, const char *host, struct cconn *c, uint16_t port);

/* conn_route.c */
bool parse_ip_literal(const char *host, struct sockaddr_storage *ss, socklen_t *len, uint16_t port);
void set_host(struct cconn *c, const char *s, size_t n);
bool decide(struct cconn *c);
void fail_flow(struct cconn *c, uint32_t end, int err, int detail, int socks_code, int http_status,
               const char *message);
void connect_failed(struct cconn *c, int err);
void start_connect(struct cconn *c);
int up_watch(struct cconn *c);
void connect_timed_out(struct cconn *c);
void after_handshake(struct cconn *c);
void sniff_pre_done(struct cconn *c);
void record_started(struct cconn *c);

/* conn_upstream.c */
void upstream_readable(struct cconn *c);
void http_readable(struct cconn *c);
void connected(struct cconn *c);
void proceed_after_reply(struct cconn *c);
void record_resolved(sw_conn_record *r, const struct sockaddr_storage *addr);
void hand_off(struct cconn *c);

/* conn_forward.c */
int fwd_try(struct cconn *c, const uint8_t *p, size_t n);
void fwd_refuse(struct cconn *c, uint32_t end, int err, int detail, int http_status,
                const char *message);
void fwd_send(struct cconn *c);
void fwd_flush(struct cconn *c);
void fwd_readable(struct cconn *c);
void fwd_timed_out(struct cconn *c);

/* conn_handshake.c */
void handshake_step(struct cconn *c);

/* conn.c */
void client_event(struct cconn *c, uint32_t events);
void *loop_main(void *arg);

#pragma GCC visibility pop

#endif /* SW_CONN_INT_H */
