/*
 * spliceway C connection path.  See conn.h for the contract; this file
 * explains the choices behind it.
 *
 * Threads
 *   Each loop is a pthread with its own epoll set and owns the connections it
 *   accepted until they are handed to the relay, deferred to Python or closed.
 *   Listening sockets are in every loop's epoll set (EPOLLEXCLUSIVE, so one
 *   connection wakes one loop).  Other threads reach a loop only through its
 *   command list (mutex + eventfd): close a flow, a barrier for unlisten, stop.
 *
 * Records
 *   One single-producer ring per loop.  A loop accepts a connection only if
 *   the ring has room for two records per connection it holds (STARTED, then
 *   ROUTED or ENDED), counted in `promised`: so a record never waits for room,
 *   and a full ring pauses accepting until Python drains (sw_conn_drain wakes
 *   paused loops).  The relay's completion of a routed flow comes through the
 *   relay's own queue; Python matches the two by the relay handle.
 *
 * Tables
 *   The route table is read through an atomic pointer.  A loop publishes the
 *   global epoch it has seen at the top of every iteration and 0 while it
 *   sleeps in epoll_wait (holding no table then); a replaced table is freed
 *   once every loop that is awake has seen an epoch at least its retirement
 *   epoch (quiescent-state reclamation).  Connections that wait across
 *   iterations copy what they need from the table (target kind, address,
 *   credentials) instead of keeping a pointer.
 *
 * Timers
 *   One deadline per connection (handshake, sniff or connect), kept in a
 *   binary min-heap per loop: O(log n) per change, and the loop sleeps until
 *   the earliest.
 */
#define _GNU_SOURCE
#include "conn.h"
#include "clock.h"
#include "evloop.h"
#include "heap.h"
#include "iplit.h"
#include "ip6text.h"
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
    ST_HS_FIRST = 1,  /* mixed: waiting for the first byte */
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
    sw_tun *tun;              /* SW_IN_TUN: the stack whose NAT names the flows */
    struct listener *next_retired; /* in conn->retired_listeners once unlistened */
    /* Out of descriptors: the number of the outage under way (0: none), the
     * last one's number, and the accepts failed in the one under way.  Any
     * loop may start or end an outage: the exchange decides which reports it. */
    _Atomic uint32_t outage;
    _Atomic uint32_t outages;
    _Atomic uint64_t outage_failures;
};

struct cconn {
    struct ep ep_client;      /* .type EP_CLIENT */
    struct ep ep_up;          /* .type EP_UPSTREAM */
    struct cloop *loop;
    struct listener *listener;
    struct cconn *next_dead;  /* freed at the end of the epoll batch */
    struct cconn *prev, *next;/* the loop's list of held connections */
    int cfd, ufd;
    int state;
    bool dead, replied, started, dialled;
    bool up_watched;          /* ufd is in the loop's epoll set */
    bool client_eof;          /* the client's FIN was read during the handshake */
    uint8_t promise;          /* records this connection may still write */
    uint8_t proto;            /* 1 socks5, 2 http */
    uint8_t auth;
    uint32_t principal;
    uint64_t flow;
    uint64_t started_ms;
    uint64_t deadline;        /* monotonic ms, 0 = none */
    size_t heap_idx;          /* SIZE_MAX when not in the heap */
    uint8_t *buf;
    uint32_t len, cap, consumed;
    uint32_t crx, ctx, urx, utx, early, late;
    uint32_t hs_tx;           /* client bytes written by the handshake itself */
    uint8_t src_family;
    uint16_t src_port;
    uint8_t src_ip[16];
    uint16_t port, host_len, sniffed_len;
    uint8_t command;          /* SOCKS5 command; 3 (UDP ASSOCIATE) goes to Python */
    char host[SW_HOST_MAX];
    char sniffed[SW_HOST_MAX];
    /* the route, copied from the table */
    uint64_t epoch;
    sw_route_result rr;
    bool sniff_may_reroute;   /* a domain rule ranks before the matched one */
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
    char *up_tag;             /* the proxy outbound's tag, for failure messages */
    uint8_t *http_buf;        /* upstream http: the CONNECT request, then its response */
    uint32_t http_req_len, http_len, http_cap;
    const uint8_t *left;      /* upstream bytes past the proxy's answer, for the client */
    uint32_t left_len;
    char up_where[300];       /* "server:port" of the proxy, as Python writes it */
    uint8_t up_buf[600];
    uint32_t up_len;
    /* Forwarding an absolute-URI request (fwd_try): one flow per request. */
    bool fwd;                 /* the current request is one C forwards */
    bool fwd_keep;            /* its client keeps the connection after it */
    bool fwd_head;            /* its method is HEAD */
    bool fwd_served;          /* C answered a request on this connection before */
    bool fwd_reuse;           /* ST_FWD_FLUSH: the upstream may serve the next request */
    bool fwd_out_watch;       /* the client's epoll mask has EPOLLOUT (ST_FWD_FLUSH) */
    uint32_t fwd_head_len;    /* the request head, at the start of buf */
    int32_t fwd_target;       /* what the kept upstream connection was dialled for */
    uint64_t fwd_epoch;
    uint16_t fwd_port;
    char fwd_host[SW_HOST_MAX];
    uint8_t *fbuf;            /* the request's origin-form head, then the answer */
    uint32_t flen, foff;
    uint8_t *rbuf;            /* what the upstream answered */
    uint32_t rlen;
};

struct cmd {
    struct cmd *next;
    int kind;                 /* CMD_CLOSE, CMD_BARRIER */
    uint64_t flow;
    int done;                 /* barrier: set by the loop */
};
enum { CMD_CLOSE = 1, CMD_BARRIER = 2 };

struct ring {
    sw_conn_record *slots;
    size_t bytes;
    uint32_t mask;
    _Atomic uint32_t head;    /* written by the loop */
    _Atomic uint32_t tail;    /* written by the consumer */
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
    _Atomic uint64_t seen;    /* epoch seen this iteration, 0 while asleep */
    _Atomic int paused;       /* accepting paused for ring room */
    struct ring ring;
    uint32_t promised;        /* records held connections may still write */
    struct cconn **heap;
    size_t heap_len, heap_cap;
    struct cconn *held;       /* list of held connections */
    struct cconn *dead;
    bool published;           /* a record went into the ring this iteration */
    bool accept_more;         /* a listener's batch ended before EAGAIN */
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
    uint64_t expires;         /* monotonic ms */
    uint8_t n;                /* addresses, in the resolver's order */
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
    int efd;                  /* readable while records or deferrals are pending */
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

/* ---- small helpers ------------------------------------------------------ */

static uint32_t hash_str(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* Writes all of `data` to a non-blocking socket or fails: handshake replies
 * are a few bytes on a fresh socket, so a short write means the client
 * stopped reading, which ends the connection like any other client error. */
static int write_all(int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* ---- timers (min-heap by deadline) --------------------------------------- */

SW_HEAP_DEFINE(heap, struct cloop, struct cconn, heap_idx, deadline)

static void timer_clear(struct cconn *c)
{
    struct cloop *L = c->loop;
    size_t i = c->heap_idx;
    if (i == SIZE_MAX)
        return;
    c->heap_idx = SIZE_MAX;
    c->deadline = 0;
    heap_remove(L, i);
}

static int timer_set(struct cconn *c, uint64_t deadline)
{
    struct cloop *L = c->loop;
    timer_clear(c);
    c->deadline = deadline;
    int e = heap_push(L, c, 256);
    if (e)
        c->deadline = 0; /* not in the heap: no deadline, as timer_clear leaves it */
    return e;
}

/* ---- records ------------------------------------------------------------- */

static uint32_t ring_used(struct ring *R) { return sw_ring_used(&R->head, &R->tail); }

/* Room for one more held connection's records? */
static bool ring_has_room(struct cloop *L)
{
    uint32_t cap = L->ring.mask + 1;
    return ring_used(&L->ring) + L->promised + RECORDS_PER_FLOW <= cap;
}

static sw_conn_record *record_begin(struct cconn *c, uint32_t kind)
{
    struct ring *R = &c->loop->ring;
    uint32_t head = sw_ring_head(&R->head);
    sw_conn_record *r = &R->slots[head & R->mask];
    memset(r, 0, offsetof(sw_conn_record, name));
    r->name[0] = 0;
    r->flow = c->flow;
    r->at_unix_ms = sw_real_ms();
    r->kind = kind;
    r->inbound = c->listener->index;
    r->principal = c->principal;
    r->rule = c->rr.rule;
    r->target = c->rr.target;
    r->action = c->rr.action;
    r->epoch = c->epoch;
    r->client_rx = c->crx;
    r->client_tx = c->ctx;
    r->upstream_rx = c->urx;
    r->upstream_tx = c->utx;
    r->early = c->early;
    r->late = c->late;
    r->port = c->port;
    r->source_port = c->src_port;
    r->protocol = c->proto;
    r->auth = c->auth;
    r->source_family = c->src_family;
    r->replied = c->replied;
    r->dialled = c->dialled;
    memcpy(r->source_ip, c->src_ip, 16);
    return r;
}

/* A listener's record (SW_REC_ACCEPT_*): no connection promised it, so the
 * caller checks the ring has room for one more. */
static void record_listener(struct cloop *L, struct listener *l, uint32_t kind, uint32_t outage,
                            int err, int32_t detail)
{
    struct ring *R = &L->ring;
    uint32_t head = sw_ring_head(&R->head);
    sw_conn_record *r = &R->slots[head & R->mask];
    memset(r, 0, sizeof *r);
    r->flow = outage;
    r->at_unix_ms = sw_real_ms();
    r->kind = kind;
    r->inbound = l->index;
    r->principal = SW_NO_PRINCIPAL;
    r->rule = -1;
    r->target = -1;
    r->err = err;
    r->detail = detail;
    sw_ring_publish(&R->head, head);
    L->published = true;
}

static void record_name(sw_conn_record *r, const char *s, uint16_t len)
{
    memcpy(r->name, s, len);
    r->name[len] = 0;
    r->name_len = len;
}

static void record_commit(struct cconn *c)
{
    struct cloop *L = c->loop;
    struct ring *R = &L->ring;
    sw_ring_publish(&R->head, sw_ring_head(&R->head));
    L->promised--;
    c->promise--;
    L->published = true;
}

/* ---- connection lifetime ------------------------------------------------- */

static void conn_release(struct cconn *c)
{
    struct cloop *L = c->loop;
    if (c->dead)
        return;
    c->dead = true;
    timer_clear(c);
    if (c->cfd >= 0)
        close(c->cfd);
    if (c->ufd >= 0)
        close(c->ufd);
    c->cfd = c->ufd = -1;
    /* Records it promised and will no longer write. */
    L->promised -= c->promise;
    c->promise = 0;
    if (c->prev)
        c->prev->next = c->next;
    else
        L->held = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next_dead = L->dead;
    L->dead = c;
}

static void conn_free_dead(struct cloop *L)
{
    while (L->dead) {
        struct cconn *c = L->dead;
        L->dead = c->next_dead;
        free(c->buf);
        free(c->up_user);
        free(c->up_pass);
        free(c->up_tag);
        free(c->http_buf);
        free(c->fbuf);
        free(c->rbuf);
        free(c);
    }
}

/* A connection that never became a flow (handshake failure, client gone). */
static void conn_drop(struct cconn *c)
{
    atomic_fetch_add_explicit(&c->loop->conn->stats.handshake_failed, 1, memory_order_relaxed);
    conn_release(c);
}

/* End a started flow before the relay: one ENDED record, then close. */
static void conn_end(struct cconn *c, uint32_t end, int err, int detail)
{
    sw_conn_record *r = record_begin(c, SW_REC_ENDED);
    record_name(r, c->sniffed, c->sniffed_len);
    if (end == SW_END_CLOSED && c->state == ST_SNIFF_PRE)
        detail = 1; /* closed before its route was final */
    r->end = end;
    r->err = err;
    r->detail = detail;
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.ended, 1, memory_order_relaxed);
    conn_release(c);
}

/* ---- DNS answer cache ---------------------------------------------------- */

/* Address i of the connection's list as a socket address. */
static void addr_select(struct cconn *c, uint8_t i)
{
    struct sockaddr_storage *ss = &c->up_addr;
    memset(ss, 0, sizeof *ss);
    c->addr_idx = i;
    if (c->addr_family[i] == 4) {
        struct sockaddr_in *sin = (struct sockaddr_in *)ss;
        sin->sin_family = AF_INET;
        sin->sin_port = htons(c->up_port);
        memcpy(&sin->sin_addr, c->addr_raw[i], 4);
        c->up_addr_len = sizeof *sin;
    } else {
        struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(c->up_port);
        memcpy(&sin6->sin6_addr, c->addr_raw[i], 16);
        c->up_addr_len = sizeof *sin6;
    }
}

/* The cached addresses of `host` into the connection (and the first selected). */
static bool dns_get(sw_conn *conn, const char *host, struct cconn *c, uint16_t port)
{
    uint32_t b = hash_str(host) % DNS_BUCKETS;
    uint64_t now = sw_mono_ms();
    bool found = false;
    pthread_mutex_lock(&conn->dns_lock);
    for (struct dns_entry *e = conn->dns[b]; e; e = e->next) {
        if (e->expires > now && strcmp(e->host, host) == 0) {
            c->naddrs = e->n;
            memcpy(c->addr_family, e->family, e->n);
            memcpy(c->addr_raw, e->addr, (size_t)e->n * 16);
            found = true;
            break;
        }
    }
    pthread_mutex_unlock(&conn->dns_lock);
    if (found) {
        c->up_port = port;
        addr_select(c, 0);
    }
    return found;
}

static void dns_purge_locked(sw_conn *conn, uint64_t now)
{
    for (size_t b = 0; b < DNS_BUCKETS; b++) {
        struct dns_entry **pp = &conn->dns[b];
        while (*pp) {
            struct dns_entry *e = *pp;
            if (e->expires <= now) {
                *pp = e->next;
                free(e);
                conn->dns_count--;
            } else {
                pp = &e->next;
            }
        }
    }
}

void sw_conn_dns_flush(sw_conn *conn)
{
    if (!conn)
        return;
    pthread_mutex_lock(&conn->dns_lock);
    dns_purge_locked(conn, UINT64_MAX);
    pthread_mutex_unlock(&conn->dns_lock);
}

int sw_conn_dns_put(sw_conn *conn, const char *host, uint32_t n, const uint8_t *families,
                    const uint8_t *addrs, uint32_t ttl_ms)
{
    if (!conn || !host || !families || !addrs || n == 0 || n > SW_DNS_MAX_ADDRS)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (families[i] != 4 && families[i] != 6)
            return -EINVAL;
    size_t len = strlen(host);
    if (len == 0 || len >= SW_HOST_MAX)
        return -EINVAL;
    uint64_t now = sw_mono_ms();
    uint32_t b = hash_str(host) % DNS_BUCKETS;
    pthread_mutex_lock(&conn->dns_lock);
    struct dns_entry *e = conn->dns[b];
    for (; e; e = e->next)
        if (strcmp(e->host, host) == 0)
            break;
    if (!e) {
        if (conn->dns_count >= DNS_MAX_ENTRIES)
            dns_purge_locked(conn, now);
        if (conn->dns_count >= DNS_MAX_ENTRIES) {
            pthread_mutex_unlock(&conn->dns_lock);
            return -ENOSPC;
        }
        e = calloc(1, sizeof *e + len + 1);
        if (!e) {
            pthread_mutex_unlock(&conn->dns_lock);
            return -ENOMEM;
        }
        memcpy(e->host, host, len + 1);
        e->next = conn->dns[b];
        conn->dns[b] = e;
        conn->dns_count++;
    }
    e->n = (uint8_t)n;
    memcpy(e->family, families, n);
    memset(e->addr, 0, sizeof e->addr);
    for (uint32_t i = 0; i < n; i++)
        memcpy(e->addr[i], addrs + 16 * i, families[i] == 4 ? 4 : 16);
    e->expires = now + ttl_ms;
    pthread_mutex_unlock(&conn->dns_lock);
    return 0;
}

/* ---- deferral -------------------------------------------------------------- */

static void conn_defer(struct cconn *c, uint32_t stage)
{
    sw_conn *conn = c->loop->conn;
    struct deferred_item *it = malloc(sizeof *it);
    if (!it) {
        if (c->started)
            conn_end(c, SW_END_INTERNAL, ENOMEM, 0); /* its flow needs its end */
        else
            conn_drop(c);
        return;
    }
    sw_deferred *d = &it->d;
    memset(d, 0, offsetof(sw_deferred, raw));
    d->fd = c->cfd;
    d->stage = stage;
    d->inbound = c->listener->index;
    d->protocol = c->proto;
    d->principal = c->principal;
    d->auth = c->auth;
    d->client_rx = c->crx;
    d->client_tx = c->ctx;
    d->started_unix_ms = c->started_ms;
    d->flow = c->started ? c->flow : 0;
    d->port = c->port;
    d->source_port = c->src_port;
    d->source_family = c->src_family;
    d->replied = c->replied;
    d->command = c->command ? c->command : 1;
    memcpy(d->source_ip, c->src_ip, 16);
    d->host_len = c->host_len;
    memcpy(d->host, c->host, c->host_len);
    d->host[c->host_len] = 0;
    d->sniffed_len = c->sniffed_len;
    memcpy(d->sniffed, c->sniffed, c->sniffed_len);
    d->sniffed[c->sniffed_len] = 0;
    d->ufd = -1;
    if (stage == SW_DEFER_FORWARD) {
        /* The request head (still at the start of buf) and the answer so far;
         * fwd_readable keeps both within raw. */
        d->ufd = c->ufd;
        d->split = c->fwd_head_len;
        d->upstream_rx = c->urx;
        d->upstream_tx = c->utx;
        d->raw_len = c->fwd_head_len + c->rlen;
        memcpy(d->raw, c->buf, c->fwd_head_len);
        memcpy(d->raw + c->fwd_head_len, c->rbuf, c->rlen);
        if (c->up_watched)
            epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->ufd, NULL);
        c->ufd = -1;
    } else {
        uint32_t from = stage == SW_DEFER_HANDSHAKE ? 0 : c->consumed;
        d->raw_len = c->len - from;
        memcpy(d->raw, c->buf + from, d->raw_len);
    }
    it->next = NULL;
    /* The fd is Python's now: take it out of our epoll set before anyone can
     * close it, and forget it so conn_release does not close it. */
    epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->cfd, NULL);
    c->cfd = -1;
    pthread_mutex_lock(&conn->defer_lock);
    if (conn->defer_tail)
        conn->defer_tail->next = it;
    else
        conn->defer_head = it;
    conn->defer_tail = it;
    pthread_mutex_unlock(&conn->defer_lock);
    atomic_fetch_add_explicit(&conn->stats.deferred, 1, memory_order_relaxed);
    efd_signal(conn->efd);
    conn_release(c);
}

/* ---- failure messages ---------------------------------------------------- */

struct message {
    struct message *next;
    uint64_t flow;
    char text[];
};

/* Keep the text of flow c's failure for Python (sw_conn_take_message), which
 * takes it when the ENDED record says so; the oldest go beyond the bound. */
static void conn_message(struct cconn *c, const char *text)
{
    sw_conn *conn = c->loop->conn;
    size_t n = strlen(text);
    struct message *m = malloc(sizeof *m + n + 1);
    if (!m)
        return;
    m->flow = c->flow;
    memcpy(m->text, text, n + 1);
    pthread_mutex_lock(&conn->defer_lock);
    m->next = conn->messages;
    conn->messages = m;
    if (++conn->nmessages > MESSAGES_MAX) {
        struct message **pp = &conn->messages;
        while ((*pp)->next)
            pp = &(*pp)->next;
        free(*pp);
        *pp = NULL;
        conn->nmessages--;
    }
    pthread_mutex_unlock(&conn->defer_lock);
}

int sw_conn_take_message(sw_conn *conn, uint64_t flow, char *out, size_t cap)
{
    if (!conn || !out || cap == 0)
        return -EINVAL;
    pthread_mutex_lock(&conn->defer_lock);
    struct message **pp = &conn->messages, *m = NULL;
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->flow == flow) {
            m = *pp;
            *pp = m->next;
            conn->nmessages--;
            break;
        }
    }
    pthread_mutex_unlock(&conn->defer_lock);
    if (!m)
        return -ENOENT;
    size_t n = strlen(m->text);
    if (n >= cap)
        n = cap - 1;
    memcpy(out, m->text, n);
    out[n] = 0;
    free(m);
    return (int)n;
}

int sw_conn_take_deferred(sw_conn *conn, sw_deferred *out)
{
    if (!conn || !out)
        return -EINVAL;
    pthread_mutex_lock(&conn->defer_lock);
    struct deferred_item *it = conn->defer_head;
    if (it) {
        conn->defer_head = it->next;
        if (!conn->defer_head)
            conn->defer_tail = NULL;
    }
    pthread_mutex_unlock(&conn->defer_lock);
    if (!it)
        return 0;
    memcpy(out, &it->d, offsetof(sw_deferred, raw) + it->d.raw_len);
    free(it);
    return 1;
}

/* ---- reading the client ----------------------------------------------------- */

/* Reads what is available into c->buf (bounded by SW_CONN_RAW_MAX).
 * Returns >0 bytes read, 0 on EAGAIN with nothing new, -1 on EOF or error,
 * -2 when the buffer is full. */
static int client_read(struct cconn *c, uint32_t events)
{
    /* A short read means the socket is drained, unless the peer's FIN came
     * with this edge: then only a read of 0 sees it, and no further edge
     * will come for it. */
    bool hup = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
    int total = 0;
    for (;;) {
        if (c->len == c->cap) {
            if (c->cap >= SW_CONN_RAW_MAX)
                return total ? total : -2;
            uint32_t cap = c->cap ? c->cap * 4 : BUF_INITIAL;
            if (cap > SW_CONN_RAW_MAX)
                cap = SW_CONN_RAW_MAX;
            uint8_t *b = realloc(c->buf, cap);
            if (!b)
                return -1;
            c->buf = b;
            c->cap = cap;
        }
        uint32_t room = c->cap - c->len;
        ssize_t n = recv(c->cfd, c->buf + c->len, room, 0);
        if (n > 0) {
            c->len += (uint32_t)n;
            c->crx += (uint32_t)n;
            total += (int)n;
            if ((uint32_t)n < room && !hup)
                return total;
            continue;
        }
        if (n == 0) {
            c->client_eof = true;
            return total ? total : -1;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN)
            return total;
        return -1;
    }
}

static int client_send(struct cconn *c, const void *data, size_t len)
{
    int rc = write_all(c->cfd, data, len);
    if (rc == 0)
        c->ctx += (uint32_t)len;
    return rc;
}

/* ---- replies ---------------------------------------------------------------- */

static const uint8_t S5_SUCCESS[10] = {5, 0, 0, 1, 0, 0, 0, 0, 0, 0};
static const char HTTP_ESTABLISHED[] = "HTTP/1.1 200 Connection established\r\n\r\n";

static int success_reply(struct cconn *c)
{
    if (c->proto == 3)
        return 0; /* TUN: the kernel's handshake was the reply */
    if (c->proto == 1)
        return client_send(c, S5_SUCCESS, sizeof S5_SUCCESS);
    return client_send(c, HTTP_ESTABLISHED, sizeof HTTP_ESTABLISHED - 1);
}

static const char *http_phrase(int status)
{
    switch (status) {
    case 403:
        return "Forbidden";
    case 502:
        return "Bad Gateway";
    case 504:
        return "Gateway Timeout";
    default:
        return "";
    }
}

/* The failure reply the Python inbound sends (Handshake.failure_reply): a
 * SOCKS5 reply code, or an HTTP error with the message as its body. */
static void failure_reply(struct cconn *c, int socks_code, int http_status, const char *message)
{
    if (c->replied)
        return;
    if (c->proto == 3) {
        /* TUN: the client only knows a TCP connection; a reset on close is
         * the nearest to the refusal a direct connection would have met. */
        struct linger lg = {1, 0};
        (void)setsockopt(c->cfd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        return;
    }
    if (c->proto == 1) {
        uint8_t r[10] = {5, (uint8_t)socks_code, 0, 1, 0, 0, 0, 0, 0, 0};
        (void)client_send(c, r, sizeof r);
        return;
    }
    /* The body is the failure message, as Python's reply carries it: a
     * proxy's malformed answer can make that long, so size the buffer. */
    static const char fmt[] =
        "HTTP/1.1 %d %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s\n";
    char small[1024], *out = small;
    size_t body = strlen(message) + 1;
    int n = snprintf(small, sizeof small, fmt, http_status, http_phrase(http_status), body,
                     message);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof small) {
        out = malloc((size_t)n + 1);
        if (!out)
            return;
        snprintf(out, (size_t)n + 1, fmt, http_status, http_phrase(http_status), body, message);
    }
    (void)client_send(c, out, (size_t)n);
    if (out != small)
        free(out);
}

/* ---- sniffing ----------------------------------------------------------------- */

enum sniff_result { SNIFF_DONE, SNIFF_WAIT };

/* Peek at the client's first bytes (they stay in the socket for the relay).
 * Early bytes C already holds are sniffed instead, as the Python path does. */
static int sniff_step(struct cconn *c)
{
    sw_sniffed s;
    if (c->len > c->consumed) {
        if (sw_sniff(c->buf + c->consumed, c->len - c->consumed, &s) == SW_PARSE_OK) {
            memcpy(c->sniffed, s.host, s.host_len);
            c->sniffed_len = s.host_len;
        }
        return SNIFF_DONE;
    }
    ssize_t n = recv(c->cfd, c->loop->peek, SW_CONN_RAW_MAX + 5, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return SNIFF_WAIT;
    if (n <= 0)
        return SNIFF_DONE;
    int rc = sw_sniff(c->loop->peek, (size_t)n, &s);
    if (rc == SW_PARSE_NEED_MORE)
        return SNIFF_WAIT;
    if (rc == SW_PARSE_OK) {
        memcpy(c->sniffed, s.host, s.host_len);
        c->sniffed_len = s.host_len;
    }
    return SNIFF_DONE;
}

/* ---- routing and dialling -------------------------------------------------------- */

static void start_flow(struct cconn *c);
static void record_started(struct cconn *c);
static void proceed_after_reply(struct cconn *c);
static void hand_off(struct cconn *c);

/* An IP literal as Python's resolver and encode_address read it (iplit.h). */
static bool parse_ip_literal(const char *host, struct sockaddr_storage *ss, socklen_t *len,
                             uint16_t port)
{
    size_t n = strlen(host);
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *sin = (struct sockaddr_in *)ss;
    if (sw_ip4_parse((const uint8_t *)host, n, (uint8_t *)&sin->sin_addr)) {
        sin->sin_family = AF_INET;
        sin->sin_port = htons(port);
        *len = sizeof *sin;
        return true;
    }
    struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;
    if (!memchr(host, '%', n) && sw_ip6_parse((const uint8_t *)host, n, sin6->sin6_addr.s6_addr)) {
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(port);
        *len = sizeof *sin6;
        return true;
    }
    return false;
}

/* The target host as the engine routes, dials and records it: canonical
 * (sw_host_canon, hostnorm.canonical_host), so every spelling of an address
 * ("2130706433", "127.1", "0x7f.0.0.1", "127.0.0.1.", "::ffff:127.0.0.1",
 * "0") is that address, and a name has no trailing dot.  A host C cannot be
 * sure of (non-ASCII, a '%') keeps its bytes for Python to read. */
static void set_host(struct cconn *c, const char *s, size_t n)
{
    size_t m = 0;
    if (n >= sizeof c->host ||
        sw_host_canon((const uint8_t *)s, n, c->host, sizeof c->host, &m) < 0) {
        m = n < sizeof c->host ? n : sizeof c->host - 1;
        memmove(c->host, s, m);
        c->host[m] = 0;
    }
    c->host_len = (uint16_t)m;
}

/* Decide the route from the table installed now; returns false when the flow
 * must be deferred.  Everything later steps need from that table is copied
 * into the connection: the table may be swapped and freed before they run. */
static bool decide(struct cconn *c)
{
    /* A flow sniffed before routing decides twice: nothing of the first
     * decision's upstream may leak into the second. */
    free(c->up_user);
    free(c->up_pass);
    free(c->up_tag);
    free(c->http_buf);
    c->up_user = c->up_pass = c->up_tag = NULL;
    c->http_buf = NULL;
    c->http_req_len = 0;
    const sw_table *t = atomic_load(&c->loop->conn->table);
    if (!t)
        return false;
    /* An inbound the flow hook selects: Python asks the hook, then routes. */
    if (sw_table_inbound_deferred(t, c->listener->index))
        return false;
    /* A fake-ip address: Python routes it by the domain it stands for. */
    if (sw_table_host_deferred(t, c->host, c->host_len))
        return false;
    /* process_lookup always, a client on this host: Python finds its process
     * before routing, so every record of the flow carries it. */
    if (sw_table_source_deferred(t, c->src_family, c->src_ip))
        return false;
    sw_route_query q;
    memset(&q, 0, sizeof q);
    q.host = c->host;
    q.host_len = c->host_len;
    if (c->sniffed_len) {
        q.sniffed = c->sniffed;
        q.sniffed_len = c->sniffed_len;
    }
    q.port = c->port;
    q.source_port = c->src_port;
    q.source_family = c->src_family;
    q.network = SW_NET_TCP;
    memcpy(q.source_ip, c->src_ip, 16);
    q.inbound = c->listener->index;
    q.principal = c->principal;
    /* A name whose address an ip_cidr rule may look at (routing.needs_address):
     * the first address the DNS cache has for it decides, and is then the only
     * one a direct dial tries (the Python path pins it too).  Without one the
     * table defers, and Python resolves the name. */
    bool pinned = false;
    uint8_t a[16];
    if (sw_table_mode(t) == SW_MODE_RULE && sw_table_first_ip_rule(t) < sw_table_rule_count(t) &&
        sw_host_addr((const uint8_t *)c->host, c->host_len, a) == SW_HOST_NAME &&
        dns_get(c->loop->conn, c->host, c, c->port)) {
        q.resolved_family = c->addr_family[0];
        memcpy(q.resolved_ip, c->addr_raw[0], 16);
        pinned = true;
    }
    if (sw_table_decide(t, &q, &c->rr) != 0 || c->rr.action == SW_ROUTE_DEFER)
        return false;
    c->epoch = sw_table_epoch(t);
    /* As the Python path's _sniff_may_reroute: only rule mode, and only when
     * a domain rule ranks before the match (before the end for the final). */
    int64_t matched = c->rr.rule >= 0 ? c->rr.rule : (int64_t)sw_table_rule_count(t);
    c->sniff_may_reroute = sw_table_mode(t) == SW_MODE_RULE &&
                           (int64_t)sw_table_first_domain_rule(t) < matched;
    c->out_kind = SW_OUT_BLOCK;
    if (c->rr.action == SW_ROUTE_BLOCK)
        return true;
    const sw_target_info *ti = sw_table_target_info(t, (uint32_t)c->rr.target);
    if (!ti || ti->kind == SW_OUT_DEFER)
        return false;
    c->out_kind = ti->kind;
    c->connect_timeout_ms = ti->connect_timeout_ms;
    if (ti->kind == SW_OUT_BLOCK)
        return true;
    const char *host = ti->kind == SW_OUT_DIRECT ? c->host : ti->server;
    uint16_t port = ti->kind == SW_OUT_DIRECT ? c->port : ti->port;
    if (!host)
        return false;
    c->naddrs = 1;
    c->addr_idx = 0;
    if (pinned && ti->kind == SW_OUT_DIRECT)
        addr_select(c, 0); /* the address the route was decided on, alone */
    else if (!parse_ip_literal(host, &c->up_addr, &c->up_addr_len, port) &&
             !dns_get(c->loop->conn, host, c, port))
        return false; /* a DNS miss: Python resolves (and fills the cache) */
    if (ti->kind == SW_OUT_SOCKS5 || ti->kind == SW_OUT_HTTP) {
        free(c->up_tag);
        c->up_tag = strdup(ti->tag ? ti->tag : "");
        if (!c->up_tag)
            return false;
        snprintf(c->up_where, sizeof c->up_where, "%s:%u", ti->server, ti->port);
    }
    if (ti->kind == SW_OUT_HTTP) {
        /* Built now, from the table's credentials: where http.connect_request
         * raises ValueError, Python's path must meet it too (-EINVAL: defer). */
        uint8_t req[4096];
        int n = sw_http_connect_request(c->host, c->port, ti->user, ti->pass, req, sizeof req);
        if (n < 0)
            return false;
        free(c->http_buf);
        c->http_buf = malloc((size_t)n);
        if (!c->http_buf)
            return false;
        memcpy(c->http_buf, req, (size_t)n);
        c->http_req_len = (uint32_t)n;
    } else if (ti->kind == SW_OUT_SOCKS5) {
        /* Non-ASCII targets need IDNA on the wire: Python's job. */
        for (uint16_t i = 0; i < c->host_len; i++)
            if ((uint8_t)c->host[i] >= 0x80)
                return false;
        if (ti->user) {
            c->up_user = strdup(ti->user);
            c->up_pass = strdup(ti->pass ? ti->pass : "");
            if (!c->up_user || !c->up_pass)
                return false;
        }
    } else if (ti->kind != SW_OUT_DIRECT) {
        return false;
    }
    return true;
}

static void fwd_refuse(struct cconn *c, uint32_t end, int err, int detail, int http_status,
                       const char *message);

static void fail_flow(struct cconn *c, uint32_t end, int err, int detail, int socks_code,
                      int http_status, const char *message)
{
    if (c->fwd) {
        fwd_refuse(c, end, err, detail, http_status, message);
        return;
    }
    failure_reply(c, socks_code, http_status, message);
    conn_end(c, end, err, detail);
}

static void start_connect(struct cconn *c);
static void connect_timed_out(struct cconn *c);
static void connected(struct cconn *c);
static int up_watch(struct cconn *c);
static void fwd_send(struct cconn *c);

static void connect_failed(struct cconn *c, int err)
{
    if (err == ETIMEDOUT) {
        /* Python's connect raises TimeoutError for it: "timed out", at once. */
        connect_timed_out(c);
        return;
    }
    if (c->addr_idx + 1 < c->naddrs) {
        /* open_tcp tries the next address, within the same deadline. */
        close(c->ufd); /* its epoll registration goes with it (never dup'ed) */
        c->ufd = -1;
        addr_select(c, (uint8_t)(c->addr_idx + 1));
        start_connect(c);
        return;
    }
    char msg[600];
    int socks = 1, http = 502;
    switch (err) {
    case ECONNREFUSED:
        socks = 5;
        break;
    case ENETUNREACH:
        socks = 3;
        break;
    case EHOSTUNREACH:
        socks = 4;
        break;
    case ETIMEDOUT:
        socks = 6;
        http = 504;
        break;
    default:
        break;
    }
    /* Python names what it connected to: the target, or the proxy server. */
    if (c->out_kind == SW_OUT_DIRECT)
        snprintf(msg, sizeof msg, "connect to %s:%u failed: %s", c->host, c->port, strerror(err));
    else
        snprintf(msg, sizeof msg, "connect to %s failed: %s", c->up_where, strerror(err));
    fail_flow(c, SW_END_CONNECT_FAILED, err, 0, socks, http, msg);
}

static void start_connect(struct cconn *c)
{
    int fd = socket(c->up_addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* The engine's own traffic must leave by the physical egress, not loop back
     * into the TUN it serves (spliceway/tun/mark.py): the route is chosen at
     * connect(), so the mark goes on first.  A refusal (EPERM: no CAP_NET_ADMIN)
     * is counted, not fatal: the flow is dialled unmarked, as it would be
     * without a TUN. */
    uint32_t mark = atomic_load_explicit(&c->loop->conn->mark, memory_order_relaxed);
    if (mark && setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark) < 0)
        atomic_fetch_add_explicit(&c->loop->conn->stats.mark_failed, 1, memory_order_relaxed);
    c->ufd = fd;
    c->up_watched = false;
    int rc = connect(fd, (struct sockaddr *)&c->up_addr, c->up_addr_len);
    if (rc < 0 && errno != EINPROGRESS) {
        connect_failed(c, errno);
        return;
    }
    c->state = ST_CONNECT;
    if (c->addr_idx == 0) /* one deadline for every address, as open_tcp has */
        timer_set(c, sw_mono_ms() + c->connect_timeout_ms);
    /* A loopback (or otherwise local) handshake has finished inside connect()
     * though it said EINPROGRESS: go on now rather than one epoll round later
     * (and never put a relayed direct upstream in this loop's set at all). */
    struct pollfd pfd = {.fd = fd, .events = POLLOUT};
    if (rc == 0 || (poll(&pfd, 1, 0) == 1 && pfd.revents)) {
        connected(c);
        return;
    }
    if (up_watch(c) < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
    }
}

/* Puts the upstream in the loop's epoll set (once): for a connect in flight
 * or an upstream proxy's reply. */
static int up_watch(struct cconn *c)
{
    if (c->up_watched)
        return 0;
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN | EPOLLRDHUP | EPOLLET,
                             .data.ptr = &c->ep_up};
    if (epoll_ctl(c->loop->epfd, EPOLL_CTL_ADD, c->ufd, &ev) < 0)
        return -1;
    c->up_watched = true;
    return 0;
}

static void connect_timed_out(struct cconn *c)
{
    char msg[600];
    if (c->out_kind == SW_OUT_DIRECT)
        snprintf(msg, sizeof msg, "connect to %s:%u timed out", c->host, c->port);
    else if (c->state == ST_CONNECT)
        snprintf(msg, sizeof msg, "connect to %s timed out", c->up_where);
    else
        snprintf(msg, sizeof msg, "proxy %s handshake timed out", c->up_tag);
    fail_flow(c, SW_END_CONNECT_TIMEOUT, 0, 0, 6, 504, msg);
}

/* Routed and ready to dial (or block). */
static void dial(struct cconn *c)
{
    if (c->out_kind == SW_OUT_BLOCK) {
        fail_flow(c, SW_END_BLOCKED, 0, 0, 2, 403, "blocked by rule");
        return;
    }
    start_connect(c);
}

/* The handshake completed: route, maybe sniff first, then dial. */
static void after_handshake(struct cconn *c)
{
    c->started_ms = sw_real_ms();
    c->hs_tx = c->ctx;
    if (!decide(c)) {
        conn_defer(c, SW_DEFER_ROUTE);
        return;
    }
    if (c->listener->opts.sniff && c->sniff_may_reroute) {
        /* A domain rule ranked before the match could claim this flow by its
         * first bytes, which the client sends only once told the tunnel is
         * open: answer first, then sniff and decide again. */
        if (success_reply(c) < 0) {
            conn_drop(c);
            return;
        }
        c->replied = true;
        /* The client was told the tunnel is open: from here the flow exists
         * (listed, closable, completed on stop), as on the Python path. */
        record_started(c);
        c->state = ST_SNIFF_PRE;
        if (sniff_step(c) == SNIFF_WAIT) {
            timer_set(c, sw_mono_ms() + c->listener->opts.sniff_timeout_ms);
            return;
        }
        if (!decide(c)) {
            conn_defer(c, SW_DEFER_ROUTE);
            return;
        }
    }
    start_flow(c);
}

static void sniff_pre_done(struct cconn *c)
{
    timer_clear(c);
    if (!decide(c)) {
        conn_defer(c, SW_DEFER_ROUTE);
        return;
    }
    start_flow(c);
}

/* C owns the flow from here: STARTED, then dial. */
static void start_flow(struct cconn *c)
{
    if (!c->started)
        record_started(c);
    dial(c);
}

/* The STARTED record (once per flow). */
static void record_started(struct cconn *c)
{
    sw_conn *conn = c->loop->conn;
    c->flow = atomic_fetch_add_explicit(&conn->next_flow, 1, memory_order_relaxed);
    sw_conn_record *r = record_begin(c, SW_REC_STARTED);
    r->at_unix_ms = c->started_ms;
    /* The handshake's bytes only, as flow.started carries; a success reply sent
     * before routing is counted in ROUTED/ENDED. */
    r->client_tx = c->hs_tx;
    record_name(r, c->host, c->host_len);
    record_commit(c);
    c->started = true;
    atomic_fetch_add_explicit(&conn->stats.started, 1, memory_order_relaxed);
}

/* ---- upstream socks5 ------------------------------------------------------------ */

static int up_send(struct cconn *c, const void *p, size_t n)
{
    int rc = write_all(c->ufd, p, n);
    if (rc == 0)
        c->utx += (uint32_t)n;
    return rc;
}

/* The upstream proxy broke its protocol: Python's DialError message for it. */
static void up_broken(struct cconn *c, int kind, uint8_t byte)
{
    char msg[600];
    const char *tag = c->up_tag ? c->up_tag : "";
    switch (kind) {
    case SW_PROTO_CLOSED:
        snprintf(msg, sizeof msg, "upstream proxy closed during handshake");
        break;
    case SW_PROTO_METHOD_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: server is not SOCKS5: version byte 0x%02x", tag, byte);
        break;
    case SW_PROTO_AUTH_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: bad username/password status version %u", tag, byte);
        break;
    case SW_PROTO_REPLY_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: server reply is not SOCKS5: version byte 0x%02x", tag,
                 byte);
        break;
    case SW_PROTO_REPLY_ATYP:
        snprintf(msg, sizeof msg, "proxy %s: unknown address type %u", tag, byte);
        break;
    case SW_PROTO_EMPTY_DOMAIN:
        snprintf(msg, sizeof msg, "proxy %s: empty domain name", tag);
        break;
    default:
        snprintf(msg, sizeof msg, "proxy %s: undecodable domain name", tag);
        break;
    }
    fail_flow(c, SW_END_UPSTREAM_PROTO, 0, kind | byte << 8, 1, 502, msg);
}

static void s5_send_request(struct cconn *c)
{
    uint8_t req[4 + 1 + 255 + 2];
    size_t n = 0;
    struct sockaddr_storage ss;
    socklen_t sslen;
    req[n++] = 5;
    req[n++] = 1;
    req[n++] = 0;
    if (parse_ip_literal(c->host, &ss, &sslen, 0) && ss.ss_family == AF_INET) {
        req[n++] = 1;
        memcpy(req + n, &((struct sockaddr_in *)&ss)->sin_addr, 4);
        n += 4;
    } else if (ss.ss_family == AF_INET6) {
        req[n++] = 4;
        memcpy(req + n, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
        n += 16;
    } else {
        req[n++] = 3;
        req[n++] = (uint8_t)c->host_len;
        memcpy(req + n, c->host, c->host_len);
        n += c->host_len;
    }
    req[n++] = (uint8_t)(c->port >> 8);
    req[n++] = (uint8_t)c->port;
    if (up_send(c, req, n) < 0) {
        connect_failed(c, errno ? errno : EPIPE);
        return;
    }
    c->state = ST_UP_S5_REPLY;
}

/* The upstream's next two-byte answer (VER VALUE): 1 and *value when it is
 * there, 0 while incomplete, -1 when VER is wrong (the flow has failed). */
static int up_pair(struct cconn *c, uint8_t version, uint8_t *value)
{
    if (c->up_len < 2)
        return 0;
    if (c->up_buf[0] != version) {
        up_broken(c, version == 5 ? SW_PROTO_METHOD_VERSION : SW_PROTO_AUTH_VERSION,
                  c->up_buf[0]);
        return -1;
    }
    *value = c->up_buf[1];
    memmove(c->up_buf, c->up_buf + 2, c->up_len - 2);
    c->up_len -= 2;
    return 1;
}

static void s5_send_userpass(struct cconn *c)
{
    uint8_t a[3 + 255 + 255];
    size_t ul = strlen(c->up_user), pl = strlen(c->up_pass), k = 0;
    if (ul > 255 || pl > 255) { /* config validation keeps them shorter */
        fail_flow(c, SW_END_INTERNAL, EINVAL, 0, 1, 502, "credentials too long");
        return;
    }
    a[k++] = 1;
    a[k++] = (uint8_t)ul;
    memcpy(a + k, c->up_user, ul);
    k += ul;
    a[k++] = (uint8_t)pl;
    memcpy(a + k, c->up_pass, pl);
    k += pl;
    if (up_send(c, a, k) < 0) {
        up_broken(c, SW_PROTO_CLOSED, 0);
        return;
    }
    c->state = ST_UP_S5_AUTH;
}

static void s5_on_reply(struct cconn *c)
{
    sw_s5_request rep;
    uint8_t ignored[SW_PARSE_REPLY_MAX];
    size_t ignored_len = 0;
    /* A reply has the request's layout (VER REP RSV ATYP ADDR PORT). */
    int rc = sw_parse_s5_request(c->up_buf, c->up_len, &rep, ignored, &ignored_len);
    if (rc == SW_PARSE_NEED_MORE)
        return;
    if (rc != SW_PARSE_OK) {
        /* Which of parse_reply's errors (the parser agrees with it on which
         * inputs fail; these bytes tell why). */
        const uint8_t *b = c->up_buf;
        if (b[0] != 5)
            up_broken(c, SW_PROTO_REPLY_VERSION, b[0]);
        else if (b[3] != 1 && b[3] != 3 && b[3] != 4)
            up_broken(c, SW_PROTO_REPLY_ATYP, b[3]);
        else if (b[3] == 3 && b[4] == 0)
            up_broken(c, SW_PROTO_EMPTY_DOMAIN, 0);
        else
            up_broken(c, SW_PROTO_BAD_DOMAIN, 0);
        return;
    }
    if (rep.command != 0) {
        /* What the Python path answers: the upstream's refused, unreachable
         * and TTL codes pass through (TTL as 504), anything else is a general
         * failure (outbounds.SOCKS_REPLY_NAMES, then DialError.socks_reply). */
        uint8_t code = rep.command;
        int socks = code >= 3 && code <= 6 ? code : 1;
        int http = code == 6 ? 504 : 502;
        char msg[600];
        snprintf(msg, sizeof msg, "proxy %s answered SOCKS5 reply %u for %s:%u", c->up_tag, code,
                 c->host, c->port);
        fail_flow(c, SW_END_UPSTREAM_REPLY, 0, code, socks, http, msg);
        return;
    }
    /* Bytes past the reply are the target's first: they go to the client at
     * the hand-off, as the Python path sends its dial's leftover. */
    c->left = c->up_buf + rep.consumed;
    c->left_len = c->up_len - (uint32_t)rep.consumed;
    timer_clear(c);
    proceed_after_reply(c);
}

/* The upstream refused our authentication: Python's "proxy TAG <what>". */
static void auth_failed(struct cconn *c, int detail, const char *what)
{
    char msg[600];
    snprintf(msg, sizeof msg, "proxy %s %s", c->up_tag, what);
    fail_flow(c, SW_END_UPSTREAM_AUTH, 0, detail, 1, 502, msg);
}

/* One step of the upstream SOCKS5 handshake on what it sent; false once it
 * must wait for more, or the flow has moved on or ended. */
static bool s5_step(struct cconn *c)
{
    uint8_t v;
    switch (c->state) {
    case ST_UP_S5_METHOD:
        if (up_pair(c, 5, &v) <= 0)
            return false;
        if (c->up_user && v != 2) {
            auth_failed(c, SW_AUTH_REFUSED_USERPASS, "refused user/password auth");
            return false;
        }
        if (!c->up_user && v != 0) {
            auth_failed(c, SW_AUTH_REQUIRED, "requires authentication");
            return false;
        }
        if (c->up_user)
            s5_send_userpass(c);
        else
            s5_send_request(c);
        return !c->dead;
    case ST_UP_S5_AUTH:
        if (up_pair(c, 1, &v) <= 0)
            return false;
        if (v != 0) {
            auth_failed(c, SW_AUTH_REJECTED, "rejected the credentials");
            return false;
        }
        s5_send_request(c);
        return !c->dead;
    case ST_UP_S5_REPLY:
        s5_on_reply(c);
        return false;
    default:
        return false;
    }
}

/* Upstream bytes during its handshake. */
static void upstream_readable(struct cconn *c)
{
    for (;;) {
        ssize_t n = recv(c->ufd, c->up_buf + c->up_len, sizeof c->up_buf - c->up_len, 0);
        if (n > 0) {
            c->up_len += (uint32_t)n;
            c->urx += (uint32_t)n;
            if (c->up_len == sizeof c->up_buf)
                break;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        /* EOF or an error: what arrived before it still counts (a server that
         * rejects the credentials answers, then closes). */
        while (s5_step(c)) {
        }
        if (!c->dead && c->state >= ST_UP_S5_METHOD && c->state <= ST_UP_S5_REPLY)
            up_broken(c, SW_PROTO_CLOSED, 0);
        return;
    }
    while (s5_step(c)) {
    }
}

/* The upstream http proxy's response head, read as HttpOutbound reads it:
 * 4 KiB at a time, parsed after each read (parse_response_head's verdicts). */
static void http_readable(struct cconn *c)
{
    for (;;) {
        if (c->http_cap - c->http_len < 4096) {
            uint32_t cap = c->http_cap ? c->http_cap * 2 : 8192;
            if (cap > SW_HTTP_MAX_HEAD + 8192)
                cap = SW_HTTP_MAX_HEAD + 8192;
            uint8_t *b = realloc(c->http_buf, cap);
            if (!b) {
                fail_flow(c, SW_END_INTERNAL, ENOMEM, 0, 1, 502, strerror(ENOMEM));
                return;
            }
            c->http_buf = b;
            c->http_cap = cap;
        }
        ssize_t n = recv(c->ufd, c->http_buf + c->http_len, 4096, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        if (n <= 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->http_len += (uint32_t)n;
        c->urx += (uint32_t)n;
        sw_http_response resp;
        int rc = sw_parse_http_response(c->http_buf, c->http_len, SW_HTTP_MAX_HEAD, &resp);
        if (rc == SW_PARSE_NEED_MORE)
            continue;
        if (rc != SW_PARSE_OK) {
            /* HttpOutbound._broken's "proxy TAG: <ProtocolError>", which can be
             * long (the error quotes the head): kept for Python too. */
            size_t cap = SW_HTTP_RESPONSE_ERROR_MAX + strlen(c->up_tag) + 16;
            char *msg = malloc(cap);
            if (!msg) {
                fail_flow(c, SW_END_INTERNAL, ENOMEM, 0, 1, 502, strerror(ENOMEM));
                return;
            }
            int k = snprintf(msg, cap, "proxy %s: ", c->up_tag);
            if (sw_http_response_error(c->http_buf, c->http_len, SW_HTTP_MAX_HEAD, msg + k,
                                       cap - (size_t)k) < 0)
                snprintf(msg + k, cap - (size_t)k, "malformed response");
            conn_message(c, msg);
            fail_flow(c, SW_END_UPSTREAM_PROTO, 0, SW_PROTO_HTTP, 1, 502, msg);
            free(msg);
            return;
        }
        if (resp.status < 200 || resp.status > 299) {
            char msg[700];
            snprintf(msg, sizeof msg, "proxy %s answered %d to CONNECT %s:%u", c->up_tag,
                     resp.status, c->host, c->port);
            fail_flow(c, SW_END_UPSTREAM_REPLY, 0, resp.status, 1, 502, msg);
            return;
        }
        c->left = c->http_buf + resp.consumed;
        c->left_len = c->http_len - (uint32_t)resp.consumed;
        timer_clear(c);
        proceed_after_reply(c);
        return;
    }
}

static void up_watch_or_fail(struct cconn *c)
{
    if (up_watch(c) < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
    }
}

/* connect() finished (EPOLLOUT on the upstream, or at once). */
static void connected(struct cconn *c)
{
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->ufd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        err = errno;
    if (err) {
        connect_failed(c, err);
        return;
    }
    if (c->out_kind == SW_OUT_SOCKS5) {
        uint8_t greeting[3] = {5, 1, c->up_user ? 2 : 0};
        if (up_send(c, greeting, sizeof greeting) < 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->state = ST_UP_S5_METHOD;
        up_watch_or_fail(c);
        return; /* the deadline of the connect covers the handshake too */
    }
    if (c->out_kind == SW_OUT_HTTP) {
        if (up_send(c, c->http_buf, c->http_req_len) < 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->state = ST_UP_HTTP_REPLY;
        up_watch_or_fail(c);
        return;
    }
    timer_clear(c);
    if (c->fwd) {
        fwd_send(c);
        return;
    }
    proceed_after_reply(c);
}

/* Upstream ready: reply success (unless done), sniff, flush, hand off. */
static void proceed_after_reply(struct cconn *c)
{
    c->dialled = true;
    if (!c->replied) {
        if (success_reply(c) < 0) {
            conn_end(c, SW_END_CLIENT, EPIPE, 0);
            return;
        }
        c->replied = true;
        if (c->listener->opts.sniff) {
            c->state = ST_SNIFF_POST;
            if (sniff_step(c) == SNIFF_WAIT) {
                timer_set(c, sw_mono_ms() + c->listener->opts.sniff_timeout_ms);
                return;
            }
        }
    }
    hand_off(c);
}


/* The address a ROUTED record says the upstream was dialled at. */
static void record_resolved(sw_conn_record *r, const struct sockaddr_storage *addr)
{
    if (addr->ss_family == AF_INET) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)addr;
        r->resolved_family = 4;
        memcpy(r->resolved_ip, &sin->sin_addr, 4);
        r->resolved_port = ntohs(sin->sin_port);
    } else {
        const struct sockaddr_in6 *sin6 = (const struct sockaddr_in6 *)addr;
        r->resolved_family = 6;
        memcpy(r->resolved_ip, &sin6->sin6_addr, 16);
        r->resolved_port = ntohs(sin6->sin6_port);
    }
}

static void hand_off(struct cconn *c)
{
    sw_conn *conn = c->loop->conn;
    timer_clear(c);
    if (c->len > c->consumed) {
        /* Client bytes pipelined past the request go upstream first. */
        uint32_t n = c->len - c->consumed;
        if (write_all(c->ufd, c->buf + c->consumed, n) < 0) {
            conn_end(c, SW_END_INTERNAL, errno ? errno : EPIPE, 0);
            return;
        }
        c->early = n;
        c->utx += n;
        c->consumed = c->len;
    }
    if (c->left_len) {
        if (client_send(c, c->left, c->left_len) < 0) {
            conn_end(c, SW_END_CLIENT, errno ? errno : EPIPE, 0);
            return;
        }
        c->late = c->left_len;
        c->left_len = 0;
    }
    epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->cfd, NULL);
    if (c->up_watched)
        epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->ufd, NULL);
    sw_conn_record *r = record_begin(c, SW_REC_ROUTED);
    record_name(r, c->sniffed, c->sniffed_len);
    record_resolved(r, &c->up_addr);
    uint64_t handle = 0;
    int rc = sw_relay_add_own(conn->relay, c->cfd, c->ufd, c->listener->opts.idle_timeout_ms,
                              &handle);
    if (rc < 0) {
        /* Not published yet: turn the slot into an ENDED record instead. */
        r->kind = SW_REC_ENDED;
        r->end = SW_END_INTERNAL;
        r->err = -rc;
        r->name[0] = 0;
        r->name_len = 0;
        record_commit(c);
        atomic_fetch_add_explicit(&conn->stats.ended, 1, memory_order_relaxed);
        conn_release(c);
        return;
    }
    r->relay_handle = handle;
    record_commit(c);
    atomic_fetch_add_explicit(&conn->stats.routed, 1, memory_order_relaxed);
    /* The relay owns both fds now. */
    c->cfd = c->ufd = -1;
    conn_release(c);
}

/* ---- absolute-URI forwarding (docs/http-forward.md) --------------------------------- */

/* What C forwards itself: a whole request head in sw_parse_http_forward's
 * subset, alone in the buffer (pipelined requests are Python's), routed
 * direct by the table; its answer when sw_parse_http_fwd_response takes it
 * and it has come whole within the buffer.  Anything else goes to Python
 * before a byte of it is written: the connection at its head (as a first
 * request would), or, once the request went up, with the upstream socket and
 * the answer so far (SW_DEFER_FORWARD), where actors/http_forward.py carries
 * on.  One STARTED / ROUTED (relay_handle 0) / ENDED triple per request. */
enum { FWD_BUF = SW_CONN_RAW_MAX + 64 };

static void fwd_next(struct cconn *c);
static void fwd_readable(struct cconn *c);
static void client_event(struct cconn *c, uint32_t events);

/* Room in the ring for `k` more records of held connections. */
static bool fwd_room(struct cloop *L, uint32_t k)
{
    return ring_used(&L->ring) + L->promised + k <= L->ring.mask + 1;
}

/* A kept upstream connection with nothing unread and not closed: as
 * _Upstream.usable's peek. */
static bool fwd_usable(int fd)
{
    uint8_t b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static void fwd_drop_upstream(struct cconn *c)
{
    if (c->ufd >= 0)
        close(c->ufd); /* its epoll registration goes with it (never dup'ed) */
    c->ufd = -1;
    c->up_watched = false;
}

/* 1: C forwards the request at buf[0..n) (or already answered it); 0: a
 * head that may still become one, wait; -1: Python's. */
static int fwd_try(struct cconn *c, const uint8_t *p, size_t n)
{
    if (!c->fbuf && !(c->fbuf = malloc(FWD_BUF)))
        return -1;
    if (!c->rbuf && !(c->rbuf = malloc(SW_CONN_RAW_MAX)))
        return -1;
    sw_http_forward f;
    int rc = sw_parse_http_forward(p, n, &f, c->fbuf, FWD_BUF);
    if (rc == SW_PARSE_NEED_MORE)
        return 0;
    if (rc != SW_PARSE_OK || f.consumed != n || c->consumed != 0)
        return -1;
    /* Three records per forwarded flow: the accept promised two. */
    uint32_t more = c->fwd_served ? RECORDS_PER_FLOW + 1 : 1;
    if (!fwd_room(c->loop, more))
        return -1;
    set_host(c, f.host, f.host_len);
    c->port = f.port;
    c->started_ms = sw_real_ms();
    c->hs_tx = 0;
    if (!decide(c) || c->out_kind != SW_OUT_DIRECT)
        return -1; /* blocked, a proxy outbound, a DNS miss...: Python's answer */
    timer_clear(c);
    c->promise += (uint8_t)more;
    c->loop->promised += more;
    c->fwd = true;
    c->fwd_keep = f.keep_alive;
    c->fwd_head = f.head;
    c->fwd_head_len = f.consumed;
    c->flen = f.wire_len;
    c->consumed = f.consumed;
    record_started(c);
    if (c->ufd >= 0) {
        if (c->fwd_target == c->rr.target && c->fwd_epoch == c->epoch &&
            c->fwd_port == c->port && !strcmp(c->fwd_host, c->host) && fwd_usable(c->ufd)) {
            fwd_send(c);
            return 1;
        }
        fwd_drop_upstream(c);
    }
    start_connect(c);
    return 1;
}

/* The ENDED record of the current request's flow (the connection lives on). */
static void fwd_end(struct cconn *c, uint32_t end, int err, int detail)
{
    sw_conn_record *r = record_begin(c, SW_REC_ENDED);
    record_name(r, c->sniffed, c->sniffed_len);
    r->end = end;
    r->err = err;
    r->detail = detail;
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.ended, 1, memory_order_relaxed);
}

/* Python's _refuse_request for a dial that failed: the status and message,
 * the connection kept when the client keeps it (its request had no body). */
static void fwd_refuse(struct cconn *c, uint32_t end, int err, int detail, int http_status,
                       const char *message)
{
    char reply[1024];
    size_t body = strlen(message) + 1;
    int n = snprintf(reply, sizeof reply, "HTTP/1.1 %d %s\r\n%sContent-Length: %zu\r\n%s\r\n%s\n",
                     http_status, http_phrase(http_status),
                     c->fwd_keep ? "Connection: keep-alive\r\n" : "", body,
                     c->fwd_keep ? "" : "Connection: close\r\n", message);
    bool sent = n > 0 && (size_t)n < sizeof reply && client_send(c, reply, (size_t)n) == 0;
    fwd_end(c, end, err, detail);
    fwd_drop_upstream(c);
    if (sent && c->fwd_keep)
        fwd_next(c);
    else
        conn_release(c);
}

/* Connected (or kept): the request goes up, then its ROUTED record. */
static void fwd_send(struct cconn *c)
{
    timer_clear(c);
    c->dialled = true;
    c->fwd_target = c->rr.target;
    c->fwd_epoch = c->epoch;
    c->fwd_port = c->port;
    memcpy(c->fwd_host, c->host, (size_t)c->host_len + 1);
    bool sent = write_all(c->ufd, c->fbuf, c->flen) == 0;
    if (sent)
        c->utx += c->flen;
    sw_conn_record *r = record_begin(c, SW_REC_ROUTED);
    record_name(r, c->sniffed, c->sniffed_len);
    record_resolved(r, &c->up_addr);
    r->relay_handle = 0; /* forwarded by C: no relay */
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.routed, 1, memory_order_relaxed);
    c->rlen = 0;
    c->state = ST_FWD_RESP;
    if (!sent || up_watch(c) < 0) {
        /* Python reads what became of the upstream and answers as its path does. */
        conn_defer(c, SW_DEFER_FORWARD);
        return;
    }
    timer_set(c, sw_mono_ms() + c->listener->opts.idle_timeout_ms);
    fwd_readable(c);
}

/* The answer, from fbuf[foff..flen), to the client; then the next request. */
static void fwd_flush(struct cconn *c)
{
    while (c->foff < c->flen) {
        ssize_t n = send(c->cfd, c->fbuf + c->foff, c->flen - c->foff, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->foff += (uint32_t)n;
            c->ctx += (uint32_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN) {
            /* As sock_sendall on the Python path: wait for room, no deadline. */
            timer_clear(c);
            c->state = ST_FWD_FLUSH;
            if (!c->fwd_out_watch) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                                         .data.ptr = &c->ep_client};
                epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->cfd, &ev);
                c->fwd_out_watch = true;
            }
            return;
        }
        /* The client went away mid-answer: its flow ends, and the connection. */
        fwd_end(c, SW_END_FWD_CLIENT, n < 0 ? errno : EPIPE, 0);
        conn_release(c);
        return;
    }
    fwd_end(c, SW_END_FORWARDED, 0, 0);
    if (!c->fwd_keep) {
        conn_release(c);
        return;
    }
    if (!c->fwd_reuse)
        fwd_drop_upstream(c);
    fwd_next(c);
}

static void fwd_readable(struct cconn *c)
{
    /* The head and the answer must fit raw for a hand-over. */
    const uint32_t cap = SW_CONN_RAW_MAX - c->fwd_head_len;
    bool eof = false, failed = false;
    while (c->rlen < cap) {
        ssize_t n = recv(c->ufd, c->rbuf + c->rlen, cap - c->rlen, 0);
        if (n > 0) {
            c->rlen += (uint32_t)n;
            c->urx += (uint32_t)n;
            continue;
        }
        if (n == 0) {
            eof = true;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            failed = true;
        break;
    }
    sw_http_fwd_response fr;
    int rc = sw_parse_http_fwd_response(c->rbuf, c->rlen, c->fwd_head, !c->fwd_keep, &fr,
                                        c->fbuf, FWD_BUF);
    if (rc == SW_PARSE_OK && fr.consumed + fr.length <= c->rlen &&
        fr.wire_len + fr.length <= FWD_BUF) {
        const uint32_t body = (uint32_t)fr.length;
        memcpy(c->fbuf + fr.wire_len, c->rbuf + fr.consumed, body);
        c->flen = fr.wire_len + body;
        c->foff = 0;
        /* Bytes past the answer put the upstream out of step (as _download). */
        c->fwd_reuse = fr.consumed + body == c->rlen && !eof && !failed;
        timer_clear(c);
        fwd_flush(c);
        return;
    }
    if (rc == SW_PARSE_DEFER || eof || failed || c->rlen >= cap) {
        conn_defer(c, SW_DEFER_FORWARD);
        return;
    }
    /* More to come: the timer set when the request went up still runs. */
}

/* The upstream went quiet (runtime.tcp_idle_timeout): as _download's
 * TimeoutError, a 502 before the head, the part that came after it. */
static void fwd_timed_out(struct cconn *c)
{
    sw_http_fwd_response fr;
    int rc = sw_parse_http_fwd_response(c->rbuf, c->rlen, c->fwd_head, !c->fwd_keep, &fr,
                                        c->fbuf, FWD_BUF);
    if (rc != SW_PARSE_OK) {
        failure_reply(c, 1, 502, "upstream connection failed: timed out");
        fwd_end(c, SW_END_FWD_TIMEOUT, 0, 0);
    } else {
        /* Whole answers never wait here: this one's body is cut short. */
        uint32_t part = c->rlen - fr.consumed;
        if (fr.wire_len + part <= FWD_BUF) {
            memcpy(c->fbuf + fr.wire_len, c->rbuf + fr.consumed, part);
            if (write_all(c->cfd, c->fbuf, fr.wire_len + part) == 0)
                c->ctx += fr.wire_len + part;
        }
        fwd_end(c, SW_END_FWD_TIMEOUT, 0, 1);
    }
    conn_release(c);
}

/* The request's flow is over and the client keeps its connection: wait for
 * its next head (idle timeout), the upstream kept when it may serve it. */
static void fwd_next(struct cconn *c)
{
    c->fwd = false;
    c->fwd_served = true;
    c->started = c->dialled = c->replied = false;
    c->crx = c->ctx = c->urx = c->utx = c->early = c->late = 0;
    c->sniffed_len = 0;
    c->sniffed[0] = 0;
    c->rlen = 0;
    c->len = c->consumed = 0; /* the head it answered was all the buffer held */
    c->state = ST_HTTP_HEAD;
    if (c->fwd_out_watch) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET,
                                 .data.ptr = &c->ep_client};
        epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->cfd, &ev);
        c->fwd_out_watch = false;
    }
    if (timer_set(c, sw_mono_ms() + c->listener->opts.idle_timeout_ms) < 0) {
        conn_release(c);
        return;
    }
    /* A next request that came meanwhile left its edge behind: read now. */
    client_event(c, EPOLLIN);
}

/* ---- client handshake ------------------------------------------------------------ */

static const struct user *find_user(const struct listener *l, const uint8_t *name, size_t nlen)
{
    for (size_t i = 0; i < l->nusers; i++) {
        if (strlen(l->users[i].name) == nlen && memcmp(l->users[i].name, name, nlen) == 0)
            return &l->users[i];
    }
    return NULL;
}

/* Constant-time in the password length, like hmac.compare_digest. */
static bool pass_ok(const struct user *u, const uint8_t *pass, size_t plen)
{
    if (!u)
        return false;
    uint8_t diff = (uint8_t)(u->pass_len != plen);
    size_t n = plen < u->pass_len ? plen : u->pass_len;
    for (size_t i = 0; i < n; i++)
        diff |= (uint8_t)(u->pass[i] ^ pass[i]);
    return diff == 0;
}

static void s5_fail(struct cconn *c, const uint8_t *reply, size_t len)
{
    if (len)
        (void)client_send(c, reply, len);
    conn_drop(c);
}

/* Run the handshake on what the client sent so far. */
static void handshake_step(struct cconn *c)
{
    uint8_t reply[SW_PARSE_REPLY_MAX];
    size_t rlen = 0;
    for (;;) {
        const uint8_t *p = c->buf + c->consumed;
        size_t n = c->len - c->consumed;
        int rc;
        switch (c->state) {
        case ST_HS_FIRST:
            if (n == 0)
                return;
            if (p[0] == 5) {
                c->proto = 1;
                c->state = ST_S5_GREETING;
            } else {
                c->proto = 2;
                c->state = ST_HTTP_HEAD;
            }
            continue;
        case ST_S5_GREETING: {
            sw_s5_greeting g;
            rc = sw_parse_s5_greeting(p, n, &g, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc == SW_PARSE_DEFER) {
                /* Nothing written yet: Python can take the whole handshake. */
                conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            c->consumed += g.consumed;
            uint8_t sel[2] = {5, 0xFF};
            if (c->listener->opts.users_required) {
                if (!g.userpass) {
                    s5_fail(c, sel, 2);
                    return;
                }
                sel[1] = 2;
                c->state = ST_S5_USERPASS;
            } else {
                if (!g.no_auth) {
                    s5_fail(c, sel, 2);
                    return;
                }
                sel[1] = 0;
                c->state = ST_S5_REQUEST;
            }
            if (client_send(c, sel, 2) < 0) {
                conn_drop(c);
                return;
            }
            continue;
        }
        case ST_S5_USERPASS: {
            sw_s5_userpass up;
            rc = sw_parse_s5_userpass(p, n, &up, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            const struct user *u = find_user(c->listener, p + up.user_off, up.user_len);
            bool ok = pass_ok(u, p + up.pass_off, up.pass_len);
            c->consumed += up.consumed;
            static const uint8_t good[2] = {1, 0}, bad[2] = {1, 1};
            if (!ok) {
                s5_fail(c, bad, 2);
                return;
            }
            if (client_send(c, good, 2) < 0) {
                conn_drop(c);
                return;
            }
            c->principal = u->principal;
            c->auth = SW_CAUTH_USERPASS;
            c->state = ST_S5_REQUEST;
            continue;
        }
        case ST_S5_REQUEST: {
            sw_s5_request rq;
            rc = sw_parse_s5_request(p, n, &rq, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            c->consumed += rq.consumed;
            if (rq.command != 1 && rq.command != 3) {
                /* BIND is not offered (as the Python path). */
                static const uint8_t unsupported[10] = {5, 7, 0, 1, 0, 0, 0, 0, 0, 0};
                s5_fail(c, unsupported, sizeof unsupported);
                return;
            }
            if (rq.command == 1) {
                set_host(c, rq.host, rq.host_len);
            } else {
                /* An association's declared source (0.0.0.0 is "any"): as given. */
                memcpy(c->host, rq.host, rq.host_len);
                c->host[rq.host_len] = 0;
                c->host_len = rq.host_len;
            }
            c->port = rq.port;
            c->command = rq.command;
            timer_clear(c);
            if (rq.command == 3) {
                /* An association is Python's (its UDP socket, its flows); the
                 * handshake is done, the reply is Python's to send. */
                conn_defer(c, SW_DEFER_ROUTE);
                return;
            }
            after_handshake(c);
            return;
        }
        case ST_HTTP_HEAD: {
            sw_http_connect h;
            rc = sw_parse_http_connect(p, n, &h);
            if (rc == SW_PARSE_NEED_MORE) {
                if (c->len >= SW_CONN_RAW_MAX)
                    conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (rc != SW_PARSE_OK) {
                /* Not a CONNECT C takes: maybe a request C forwards itself. */
                if (c->listener->opts.forward && !c->listener->opts.users_required) {
                    int fr = fwd_try(c, p, n);
                    if (fr > 0)
                        return;
                    if (fr == 0 && c->len < SW_CONN_RAW_MAX)
                        return;
                }
                conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (c->listener->opts.users_required) {
                const struct user *u =
                    h.has_creds ? find_user(c->listener, (const uint8_t *)h.user, h.user_len)
                                : NULL;
                if (!h.has_creds || !pass_ok(u, (const uint8_t *)h.pass, h.pass_len)) {
                    /* The 407 and its wording are Python's: let it answer. */
                    conn_defer(c, SW_DEFER_HANDSHAKE);
                    return;
                }
                c->principal = u->principal;
                c->auth = SW_CAUTH_BASIC;
            }
            c->consumed += h.consumed;
            set_host(c, h.host, h.host_len);
            c->port = h.port;
            timer_clear(c);
            after_handshake(c);
            return;
        }
        default:
            return;
        }
    }
}

/* ---- events ------------------------------------------------------------------------ */

static void client_event(struct cconn *c, uint32_t events)
{
    switch (c->state) {
    case ST_HS_FIRST:
    case ST_S5_GREETING:
    case ST_S5_USERPASS:
    case ST_S5_REQUEST:
    case ST_HTTP_HEAD: {
        int n = client_read(c, events);
        if (n == -2) {
            /* Only an HTTP head can outgrow the buffer: Python reads on. */
            if (c->state == ST_HTTP_HEAD)
                conn_defer(c, SW_DEFER_HANDSHAKE);
            else
                conn_drop(c);
            return;
        }
        if (n < 0) {
            if (c->fwd_served)
                conn_release(c); /* closed (or failed) between requests: no flow */
            else
                conn_drop(c);
            return;
        }
        if (n > 0)
            handshake_step(c);
        /* The client hung up with its handshake unfinished: nothing more can come. */
        if (c->client_eof && !c->dead && c->state <= ST_HTTP_HEAD) {
            if (c->fwd_served)
                conn_release(c);
            else
                conn_drop(c);
        }
        return;
    }
    case ST_FWD_FLUSH:
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))
            fwd_flush(c);
        return;
    case ST_SNIFF_PRE:
        if (sniff_step(c) == SNIFF_DONE)
            sniff_pre_done(c);
        return;
    case ST_SNIFF_POST:
        if (sniff_step(c) == SNIFF_DONE)
            hand_off(c);
        return;
    default:
        /* Dialling: client bytes wait in the socket for the relay.  A hang-up
         * is seen by the relay too; only an error ends the flow here -- except
         * a forwarded request's, which, as on the Python path, finds out when
         * its answer is written (SW_END_FWD_CLIENT). */
        if ((events & EPOLLERR) && !c->fwd)
            conn_end(c, SW_END_CLIENT, ECONNRESET, 0);
        return;
    }
}

static void upstream_event(struct cconn *c, uint32_t events)
{
    if (c->state == ST_CONNECT) {
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))
            connected(c);
        return;
    }
    if (c->state == ST_UP_S5_METHOD || c->state == ST_UP_S5_AUTH ||
        c->state == ST_UP_S5_REPLY) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            upstream_readable(c);
    } else if (c->state == ST_UP_HTTP_REPLY) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            http_readable(c);
    } else if (c->state == ST_FWD_RESP) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            fwd_readable(c);
    }
}

static void timer_fired(struct cconn *c)
{
    c->heap_idx = SIZE_MAX;
    c->deadline = 0;
    switch (c->state) {
    case ST_SNIFF_PRE:
        sniff_pre_done(c);
        return;
    case ST_SNIFF_POST:
        hand_off(c);
        return;
    case ST_CONNECT:
    case ST_UP_S5_METHOD:
    case ST_UP_S5_AUTH:
    case ST_UP_S5_REPLY:
    case ST_UP_HTTP_REPLY:
        connect_timed_out(c);
        return;
    case ST_FWD_RESP:
        fwd_timed_out(c);
        return;
    default:
        if (c->fwd_served) {
            /* Idle between requests (runtime.tcp_idle_timeout): no flow to end. */
            conn_release(c);
            return;
        }
        /* The handshake timed out: no flow existed, nothing to answer. */
        conn_drop(c);
        return;
    }
}

/* The TUN "handshake": the accepted socket's peer is the stack's NAT address
 * and port; its entry holds the original source and destination. */
static bool tun_handshake(struct cconn *c)
{
    sw_tun_flow f;
    if (!c->src_family ||
        sw_tun_peer_lookup(c->listener->tun, c->src_family, c->src_ip, c->src_port, &f) < 0)
        return false;
    c->proto = 3;
    c->command = 1;
    c->src_family = f.version;
    memcpy(c->src_ip, f.src, 16);
    c->src_port = f.sport;
    if (f.version == 4)
        c->host_len = (uint16_t)sprintf(c->host, "%u.%u.%u.%u", f.dst[0], f.dst[1], f.dst[2],
                                        f.dst[3]);
    else
        c->host_len = (uint16_t)sw_ip6_text(f.dst, c->host);
    c->port = f.dport;
    return true;
}

static bool fd_exhausted(int err)
{
    return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

/* accept4 failed for want of descriptors.  The connection stays in the backlog,
 * so retrying at once (or on the next edge) would only fail again, and a
 * level-triggered loop would spin: this loop stops accepting on every listener
 * (the limit is the process's) until accept_retry_at, serving what it holds,
 * and the first failure of the listener's outage is reported to Python. */
static void accept_exhausted(struct cloop *L, struct listener *l, int err)
{
    uint32_t delay = L->accept_delay_ms ? L->accept_delay_ms * 2 : ACCEPT_BACKOFF_MIN_MS;
    L->accept_delay_ms = delay > ACCEPT_BACKOFF_MAX_MS ? ACCEPT_BACKOFF_MAX_MS : delay;
    L->accept_retry_at = sw_mono_ms() + L->accept_delay_ms;
    atomic_fetch_add_explicit(&l->outage_failures, 1, memory_order_relaxed);
    uint32_t none = 0;
    uint32_t number = atomic_load(&l->outages) + 1;
    /* ring_has_room held before this accept: one record fits. */
    if (atomic_compare_exchange_strong(&l->outage, &none, number)) {
        atomic_store(&l->outages, number);
        record_listener(L, l, SW_REC_ACCEPT_FAILED, number, err, 0);
    }
}

/* An accept succeeded: this loop accepts freely again, and the listener's
 * outage, if one is under way, ends (reported when the ring has room for the
 * record; else a later accept ends it). */
static void accept_recovered(struct cloop *L, struct listener *l)
{
    L->accept_delay_ms = 0;
    if (!atomic_load_explicit(&l->outage, memory_order_relaxed) ||
        ring_used(&L->ring) + L->promised + 1 > L->ring.mask + 1)
        return;
    uint32_t number = atomic_exchange(&l->outage, 0);
    if (!number)
        return;
    uint64_t failed = atomic_exchange(&l->outage_failures, 0);
    record_listener(L, l, SW_REC_ACCEPT_RESUMED, number, 0,
                    failed > INT32_MAX ? INT32_MAX : (int32_t)failed);
}

static void accept_on(struct cloop *L, struct listener *l)
{
    sw_conn *conn = L->conn;
    /* Listeners are edge-triggered: a batch that ends before EAGAIN must be
     * resumed by the loop itself (accept_more), and a paused loop resumes
     * every listener when Python makes room.  Out of descriptors, the loop's
     * retry timer resumes them (loop_main). */
    if (L->accept_retry_at)
        return;
    for (int i = 0;; i++) {
        if (i == ACCEPT_BATCH) {
            L->accept_more = true;
            return;
        }
        if (!atomic_load_explicit(&l->active, memory_order_acquire))
            return;
        if (!ring_has_room(L)) {
            if (!atomic_exchange(&L->paused, 1))
                atomic_fetch_add_explicit(&conn->stats.accept_paused, 1, memory_order_relaxed);
            return;
        }
        struct sockaddr_storage peer;
        socklen_t plen = sizeof peer;
        int fd = accept4(l->fd, (struct sockaddr *)&peer, &plen, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN)
                atomic_fetch_add_explicit(&conn->stats.accept_errors, 1, memory_order_relaxed);
            if (fd_exhausted(errno))
                accept_exhausted(L, l, errno);
            return;
        }
        atomic_fetch_add_explicit(&conn->stats.accepted, 1, memory_order_relaxed);
        struct cconn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->ep_client.type = EP_CLIENT;
        c->ep_up.type = EP_UPSTREAM;
        c->loop = L;
        c->listener = l;
        c->cfd = fd;
        c->ufd = -1;
        c->heap_idx = SIZE_MAX;
        c->principal = SW_NO_PRINCIPAL;
        c->rr.rule = -1;
        c->rr.target = -1;
        c->promise = RECORDS_PER_FLOW;
        L->promised += RECORDS_PER_FLOW;
        accept_recovered(L, l);
        if (peer.ss_family == AF_INET) {
            struct sockaddr_in *sin = (struct sockaddr_in *)&peer;
            c->src_family = 4;
            memcpy(c->src_ip, &sin->sin_addr, 4);
            c->src_port = ntohs(sin->sin_port);
        } else if (peer.ss_family == AF_INET6) {
            struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)&peer;
            static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
            if (memcmp(&sin6->sin6_addr, mapped, 12) == 0) {
                c->src_family = 4;
                memcpy(c->src_ip, (uint8_t *)&sin6->sin6_addr + 12, 4);
            } else {
                c->src_family = 6;
                memcpy(c->src_ip, &sin6->sin6_addr, 16);
            }
            c->src_port = ntohs(sin6->sin6_port);
        }
        switch (l->opts.protocol) {
        case SW_IN_SOCKS5:
            c->proto = 1;
            c->state = ST_S5_GREETING;
            break;
        case SW_IN_HTTP:
            c->proto = 2;
            c->state = ST_HTTP_HEAD;
            break;
        case SW_IN_TUN:
            c->proto = 3;
            c->state = ST_TUN;
            break;
        default:
            c->state = ST_HS_FIRST;
            break;
        }
        c->next = L->held;
        if (L->held)
            L->held->prev = c;
        L->held = c;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET,
                                 .data.ptr = &c->ep_client};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ||
            timer_set(c, sw_mono_ms() + l->opts.handshake_timeout_ms) < 0) {
            conn_drop(c);
            continue;
        }
        if (c->state == ST_TUN) {
            /* Nothing to read first: the NAT entry is the whole handshake. */
            if (!tun_handshake(c)) {
                conn_drop(c);
                continue;
            }
            timer_clear(c);
            after_handshake(c);
            continue;
        }
        /* Clients usually send their greeting with the ACK: read it now
         * rather than wait for the next epoll round. */
        client_event(c, EPOLLIN);
    }
}

static void run_commands(struct cloop *L)
{
    efd_clear(L->wakefd);
    pthread_mutex_lock(&L->cmd_lock);
    struct cmd *cmds = L->cmds;
    L->cmds = NULL;
    pthread_mutex_unlock(&L->cmd_lock);
    while (cmds) {
        struct cmd *next = cmds->next;
        if (cmds->kind == CMD_CLOSE) {
            for (struct cconn *c = L->held; c; c = c->next) {
                if (c->started && c->flow == cmds->flow && !c->dead) {
                    conn_end(c, SW_END_CLOSED, 0, 0);
                    break;
                }
            }
            free(cmds);
        } else {
            pthread_mutex_lock(&L->cmd_lock);
            cmds->done = 1;
            pthread_cond_broadcast(&L->cmd_cond);
            pthread_mutex_unlock(&L->cmd_lock);
        }
        cmds = next;
    }
}

static void resume_accepting(struct cloop *L)
{
    sw_conn *conn = L->conn;
    for (int i = 0; i < MAX_LISTENERS; i++) {
        struct listener *l = conn->listeners[i];
        if (l && atomic_load(&l->active))
            accept_on(L, l);
    }
}

static void *loop_main(void *arg)
{
    struct cloop *L = arg;
    sw_conn *conn = L->conn;
    struct epoll_event events[EVENTS_MAX];
    while (!atomic_load(&L->stop)) {
        int timeout = -1;
        if (L->accept_more) {
            timeout = 0;
        } else if (L->heap_len || L->accept_retry_at) {
            uint64_t now = sw_mono_ms();
            uint64_t first = L->heap_len ? L->heap[0]->deadline : UINT64_MAX;
            if (L->accept_retry_at && L->accept_retry_at < first)
                first = L->accept_retry_at;
            timeout = first <= now ? 0 : (int)(first - now > 60000 ? 60000 : first - now);
        }
        atomic_store(&L->seen, 0); /* asleep: holds no table */
        int n = epoll_wait(L->epfd, events, EVENTS_MAX, timeout);
        atomic_store(&L->seen, atomic_load(&conn->epoch));
        if (n < 0 && errno != EINTR)
            break;
        L->published = false;
        for (int i = 0; i < n; i++) {
            struct ep *ep = events[i].data.ptr;
            switch (ep->type) {
            case EP_WAKE:
                run_commands(L);
                if (atomic_exchange(&L->paused, 0))
                    resume_accepting(L);
                break;
            case EP_LISTENER:
                accept_on(L, (struct listener *)ep);
                break;
            case EP_CLIENT: {
                struct cconn *c = (struct cconn *)((char *)ep - offsetof(struct cconn, ep_client));
                if (!c->dead)
                    client_event(c, events[i].events);
                break;
            }
            case EP_UPSTREAM: {
                struct cconn *c = (struct cconn *)((char *)ep - offsetof(struct cconn, ep_up));
                if (!c->dead)
                    upstream_event(c, events[i].events);
                break;
            }
            default:
                break;
            }
        }
        uint64_t now = sw_mono_ms();
        while (L->heap_len && L->heap[0]->deadline <= now) {
            struct cconn *c = L->heap[0];
            timer_clear(c);
            timer_fired(c);
        }
        if (L->accept_retry_at && L->accept_retry_at <= now) {
            /* The backoff is over: try every listener (edges that came meanwhile
             * were ignored); a failure starts the next, longer pause. */
            L->accept_retry_at = 0;
            L->accept_more = false;
            if (!atomic_load(&L->paused))
                resume_accepting(L);
        }
        if (L->accept_more) {
            L->accept_more = false;
            if (!atomic_load(&L->paused))
                resume_accepting(L);
        }
        conn_free_dead(L);
        if (L->published)
            efd_signal(conn->efd);
    }
    atomic_store(&L->seen, 0);
    return NULL;
}

/* ---- public API --------------------------------------------------------------------- */

static void loop_post(struct cloop *L, struct cmd *cmd)
{
    pthread_mutex_lock(&L->cmd_lock);
    cmd->next = L->cmds;
    L->cmds = cmd;
    pthread_mutex_unlock(&L->cmd_lock);
    efd_signal(L->wakefd);
}

int sw_conn_new(sw_relay *relay, int nloops, uint32_t ring_records, sw_conn **out)
{
    if (!relay || !out || nloops < 0 || nloops > 64)
        return -EINVAL;
    if (nloops == 0)
        nloops = 1;
    uint32_t cap = ring_records ? ring_records : DEFAULT_RING;
    if (cap < 16 || cap > (1u << 24) || (cap & (cap - 1)))
        return -EINVAL;
    sw_conn *conn = calloc(1, sizeof *conn);
    if (!conn)
        return -ENOMEM;
    conn->relay = relay;
    conn->nloops = nloops;
    atomic_init(&conn->next_flow, 1);
    atomic_init(&conn->epoch, 1);
    pthread_mutex_init(&conn->retire_lock, NULL);
    pthread_mutex_init(&conn->listen_lock, NULL);
    pthread_mutex_init(&conn->dns_lock, NULL);
    pthread_mutex_init(&conn->defer_lock, NULL);
    pthread_mutex_init(&conn->drain_lock, NULL);
    conn->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    conn->loops = calloc((size_t)nloops, sizeof *conn->loops);
    int rc = 0;
    if (conn->efd < 0 || !conn->loops) {
        rc = conn->efd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    for (int i = 0; i < nloops; i++) {
        struct cloop *L = &conn->loops[i];
        L->conn = conn;
        L->wake_ep.type = EP_WAKE;
        L->epfd = L->wakefd = -1;
        pthread_mutex_init(&L->cmd_lock, NULL);
        pthread_cond_init(&L->cmd_cond, NULL);
        L->ring.mask = cap - 1;
        /* mmap: pages of the ring cost memory only once records reach them. */
        L->ring.bytes = (size_t)cap * sizeof(sw_conn_record);
        void *slots = mmap(NULL, L->ring.bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (slots == MAP_FAILED) {
            rc = -errno;
            goto fail;
        }
        L->ring.slots = slots;
        L->epfd = epoll_create1(EPOLL_CLOEXEC);
        L->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (L->epfd < 0 || L->wakefd < 0) {
            rc = -errno;
            goto fail;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &L->wake_ep};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, L->wakefd, &ev) < 0) {
            rc = -errno;
            goto fail;
        }
    }
    for (int i = 0; i < nloops; i++) {
        struct cloop *L = &conn->loops[i];
        rc = loop_thread_start(&L->thread, loop_main, L, "sw-conn", i);
        if (rc)
            goto fail;
        L->started = true;
    }
    *out = conn;
    return 0;
fail:
    sw_conn_free(conn);
    return rc;
}

int sw_conn_shutdown(sw_conn *conn)
{
    if (!conn)
        return -EINVAL;
    if (atomic_exchange(&conn->shut, 1))
        return 0;
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (!L->started)
            continue;
        atomic_store(&L->stop, 1);
        efd_signal(L->wakefd);
        pthread_join(L->thread, NULL);
        L->started = false;
    }
    /* The loops are gone: end what they held from this thread. */
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        while (L->held) {
            struct cconn *c = L->held;
            if (c->started)
                conn_end(c, SW_END_CLOSED, 0, 0);
            else
                conn_release(c);
        }
        conn_free_dead(L);
        L->heap_len = 0;
    }
    efd_signal(conn->efd);
    return 0;
}

static void listener_free(struct listener *l)
{
    for (size_t u = 0; u < l->nusers; u++) {
        free(l->users[u].name);
        free(l->users[u].pass);
    }
    free(l->users);
    free(l);
}

void sw_conn_free(sw_conn *conn)
{
    if (!conn)
        return;
    sw_conn_shutdown(conn);
    for (int i = 0; conn->loops && i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (L->epfd >= 0)
            close(L->epfd);
        if (L->wakefd >= 0)
            close(L->wakefd);
        if (L->ring.slots)
            munmap(L->ring.slots, L->ring.bytes);
        free(L->heap);
        while (L->cmds) {
            struct cmd *c = L->cmds;
            L->cmds = c->next;
            free(c);
        }
        pthread_mutex_destroy(&L->cmd_lock);
        pthread_cond_destroy(&L->cmd_cond);
    }
    free(conn->loops);
    for (int i = 0; i < MAX_LISTENERS; i++) {
        if (conn->listeners[i])
            listener_free(conn->listeners[i]);
    }
    while (conn->retired_listeners) {
        struct listener *l = conn->retired_listeners;
        conn->retired_listeners = l->next_retired;
        listener_free(l);
    }
    sw_table_free(atomic_load(&conn->table));
    while (conn->retired) {
        struct retired *r = conn->retired;
        conn->retired = r->next;
        sw_table_free(r->table);
        free(r);
    }
    for (size_t b = 0; b < DNS_BUCKETS; b++) {
        while (conn->dns[b]) {
            struct dns_entry *e = conn->dns[b];
            conn->dns[b] = e->next;
            free(e);
        }
    }
    while (conn->defer_head) {
        struct deferred_item *it = conn->defer_head;
        conn->defer_head = it->next;
        close(it->d.fd);
        free(it);
    }
    while (conn->messages) {
        struct message *m = conn->messages;
        conn->messages = m->next;
        free(m);
    }
    if (conn->efd >= 0)
        close(conn->efd);
    free(conn);
}

static struct listener *listener_get(sw_conn *conn, uint32_t inbound, bool create)
{
    if (inbound >= MAX_LISTENERS)
        return NULL;
    struct listener *l = conn->listeners[inbound];
    if (!l && create) {
        l = calloc(1, sizeof *l);
        if (!l)
            return NULL;
        l->ep.type = EP_LISTENER;
        l->fd = -1;
        l->index = inbound;
        conn->listeners[inbound] = l;
    }
    return l;
}

int sw_conn_listener_user(sw_conn *conn, uint32_t inbound, const char *user, const char *pass,
                          uint32_t principal)
{
    if (!conn || !user || !pass)
        return -EINVAL;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, true);
    int rc = -EINVAL;
    if (l && !atomic_load(&l->active)) {
        struct user *u = realloc(l->users, (l->nusers + 1) * sizeof *u);
        rc = -ENOMEM;
        if (u) {
            l->users = u;
            u = &l->users[l->nusers];
            u->name = strdup(user);
            u->pass = strdup(pass);
            u->pass_len = strlen(pass);
            u->principal = principal;
            if (u->name && u->pass) {
                l->nusers++;
                rc = 0;
            } else {
                free(u->name);
                free(u->pass);
            }
        }
    }
    pthread_mutex_unlock(&conn->listen_lock);
    return rc;
}

static int listen_on(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                     sw_tun *tun);

int sw_conn_listen(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts)
{
    if (!conn || fd < 0 || !opts || opts->protocol < SW_IN_SOCKS5 || opts->protocol > SW_IN_MIXED)
        return -EINVAL;
    return listen_on(conn, inbound, fd, opts, NULL);
}

int sw_conn_listen_tun(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                       sw_tun *tun)
{
    if (!conn || fd < 0 || !opts || !tun || opts->protocol != SW_IN_TUN)
        return -EINVAL;
    return listen_on(conn, inbound, fd, opts, tun);
}

static int listen_on(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                     sw_tun *tun)
{
    if (atomic_load(&conn->shut))
        return -ESHUTDOWN;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, true);
    int rc = 0;
    if (!l || atomic_load(&l->active) || (opts->users_required && l->nusers == 0)) {
        rc = l ? -EINVAL : -ENOMEM;
        goto out;
    }
    /* Accepted sockets inherit TCP_NODELAY from the listener (Linux copies
     * the socket): one setsockopt here instead of one per connection. */
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        rc = -errno;
        goto out;
    }
    l->fd = fd;
    l->opts = *opts;
    l->tun = tun;
    atomic_store(&l->active, 1);
    for (int i = 0; i < conn->nloops; i++) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLET | EPOLLEXCLUSIVE,
                                 .data.ptr = &l->ep};
        if (epoll_ctl(conn->loops[i].epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
            rc = -errno;
            for (int j = 0; j < i; j++)
                epoll_ctl(conn->loops[j].epfd, EPOLL_CTL_DEL, fd, NULL);
            atomic_store(&l->active, 0);
            l->fd = -1;
            goto out;
        }
    }
out:
    pthread_mutex_unlock(&conn->listen_lock);
    return rc;
}

int sw_conn_unlisten(sw_conn *conn, uint32_t inbound)
{
    if (!conn)
        return -EINVAL;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, false);
    if (!l || !atomic_load(&l->active)) {
        pthread_mutex_unlock(&conn->listen_lock);
        return -ENOENT;
    }
    atomic_store(&l->active, 0);
    for (int i = 0; i < conn->nloops; i++)
        epoll_ctl(conn->loops[i].epfd, EPOLL_CTL_DEL, l->fd, NULL);
    l->fd = -1;
    /* The slot may serve a new listener (a reload), with other options and users;
     * connections this one accepted keep pointing at it, so it is kept, not reused. */
    conn->listeners[inbound] = NULL;
    l->next_retired = conn->retired_listeners;
    conn->retired_listeners = l;
    pthread_mutex_unlock(&conn->listen_lock);
    /* A barrier per loop: once each has run it, none is inside accept_on for
     * this listener any more, so the caller may close the fd. */
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (!L->started || atomic_load(&L->stop))
            continue;
        struct cmd *cmd = calloc(1, sizeof *cmd);
        if (!cmd)
            return -ENOMEM;
        cmd->kind = CMD_BARRIER;
        loop_post(L, cmd);
        pthread_mutex_lock(&L->cmd_lock);
        while (!cmd->done && L->started && !atomic_load(&L->stop)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&L->cmd_cond, &L->cmd_lock, &ts);
        }
        int done = cmd->done;
        pthread_mutex_unlock(&L->cmd_lock);
        if (done)
            free(cmd);
        /* else the loop stopped with it queued: sw_conn_free frees it. */
    }
    return 0;
}

static void reclaim_tables(sw_conn *conn)
{
    uint64_t min_seen = UINT64_MAX;
    for (int i = 0; i < conn->nloops; i++) {
        uint64_t s = atomic_load(&conn->loops[i].seen);
        if (s && s < min_seen)
            min_seen = s;
    }
    struct retired **pp = &conn->retired;
    while (*pp) {
        struct retired *r = *pp;
        if (r->epoch <= min_seen) {
            *pp = r->next;
            sw_table_free(r->table);
            free(r);
        } else {
            pp = &r->next;
        }
    }
}

int sw_conn_set_table(sw_conn *conn, sw_table *table)
{
    if (!conn || !table) {
        sw_table_free(table);
        return -EINVAL;
    }
    struct retired *r = malloc(sizeof *r);
    if (!r) {
        sw_table_free(table);
        return -ENOMEM;
    }
    pthread_mutex_lock(&conn->retire_lock);
    sw_table *old = atomic_exchange(&conn->table, table);
    uint64_t e = atomic_fetch_add(&conn->epoch, 1) + 1;
    if (old) {
        r->table = old;
        r->epoch = e;
        r->next = conn->retired;
        conn->retired = r;
    } else {
        free(r);
    }
    reclaim_tables(conn);
    pthread_mutex_unlock(&conn->retire_lock);
    return 0;
}

int sw_conn_request_close(sw_conn *conn, uint64_t flow)
{
    if (!conn || flow == 0)
        return -EINVAL;
    if (atomic_load(&conn->shut))
        return -ESHUTDOWN;
    /* Which loop holds it is not recorded: every loop checks (there are few). */
    for (int i = 0; i < conn->nloops; i++) {
        struct cmd *cmd = calloc(1, sizeof *cmd);
        if (!cmd)
            return -ENOMEM;
        cmd->kind = CMD_CLOSE;
        cmd->flow = flow;
        loop_post(&conn->loops[i], cmd);
    }
    return 0;
}

int sw_conn_fd(sw_conn *conn)
{
    return conn ? conn->efd : -EINVAL;
}

int sw_conn_drain(sw_conn *conn, sw_conn_record *out, size_t max)
{
    if (!conn || (!out && max))
        return -EINVAL;
    pthread_mutex_lock(&conn->drain_lock);
    efd_clear(conn->efd);
    size_t n = 0;
    bool more = false;
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        struct ring *R = &L->ring;
        uint32_t tail = sw_ring_tail(&R->tail);
        uint32_t head = sw_ring_ready(&R->head);
        uint32_t took = 0;
        while (tail != head && n < max) {
            memcpy(&out[n++], &R->slots[tail & R->mask], sizeof(sw_conn_record));
            tail++;
            took++;
        }
        if (tail != head)
            more = true;
        sw_ring_release(&R->tail, tail);
        if (took && atomic_load(&L->paused))
            efd_signal(L->wakefd); /* room again: let it accept */
    }
    pthread_mutex_lock(&conn->defer_lock);
    if (conn->defer_head)
        more = true;
    pthread_mutex_unlock(&conn->defer_lock);
    if (more)
        efd_signal(conn->efd);
    pthread_mutex_unlock(&conn->drain_lock);
    return (int)n;
}

int sw_conn_stats_get(sw_conn *conn, sw_conn_stats *out)
{
    if (!conn || !out)
        return -EINVAL;
    out->accepted = atomic_load(&conn->stats.accepted);
    out->handshake_failed = atomic_load(&conn->stats.handshake_failed);
    out->deferred = atomic_load(&conn->stats.deferred);
    out->started = atomic_load(&conn->stats.started);
    out->routed = atomic_load(&conn->stats.routed);
    out->ended = atomic_load(&conn->stats.ended);
    out->accept_paused = atomic_load(&conn->stats.accept_paused);
    out->accept_errors = atomic_load(&conn->stats.accept_errors);
    out->mark_failed = atomic_load(&conn->stats.mark_failed);
    return 0;
}

int sw_conn_set_mark(sw_conn *conn, uint32_t mark)
{
    if (!conn)
        return -EINVAL;
    atomic_store_explicit(&conn->mark, mark, memory_order_relaxed);
    return 0;
}
