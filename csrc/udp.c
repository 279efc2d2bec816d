/*
 * spliceway C UDP datagram relay.  See udp.h for the contract; this file
 * explains the choices behind it.
 *
 * Threads and locking
 *   Each loop is a pthread with its own epoll set and a mutex it holds while
 *   it handles one epoll batch (never while it sleeps in epoll_wait).  The
 *   public calls take the same mutex, so an association's state has exactly
 *   one writer at a time and a call's answer is final when it returns (no
 *   command queue, no "maybe later" errors for Python to chase).  A call
 *   waits at most for one batch: a bounded number of recvmmsg/sendmmsg.
 *
 * Object lifetime
 *   Associations and upstreams are in the epoll set by pointer.  One that
 *   ends is removed from the set at once and its socket closed, but its
 *   memory is only freed by the loop at the end of an iteration: an
 *   epoll_wait that returned before the removal may still hold its pointer,
 *   and that iteration's batch is handled (skipping dead objects) before the
 *   free.  Destinations are not in the epoll set and are freed at once.
 *
 * The hot path
 *   Level-triggered EPOLLIN, up to ROUNDS recvmmsg batches of BATCH per
 *   wake-up (fairness between sockets of one loop).  Payloads are sent
 *   straight from the receive buffers: client -> upstream with msg_name the
 *   destination's resolved sockaddr (built once by sw_udp_dest_set), upstream
 *   -> client with a two-part iovec, the destination's prebuilt SOCKS5
 *   header and the payload.  Consecutive datagrams for one socket go out in
 *   one sendmmsg.  Nothing is allocated per datagram except held (pending)
 *   and Python-bound copies.
 *
 * Lookups
 *   Destinations are keyed by the header bytes from ATYP to DST.PORT
 *   exactly as the client sent them (buf[3, header_len)), in a chained hash
 *   per association with a per-process random seed, so a client cannot aim
 *   collisions at another association's table (nor, knowing nothing of the
 *   seed, at its own beyond max_dests).  Replies find their destination in
 *   the upstream's table keyed by the resolved address:port, IPv4 kept in
 *   IPv4-mapped form so a dual-stack socket's source addresses compare equal.
 *
 * Timers
 *   One idle timer per destination and per upstream in a binary min-heap per
 *   loop.  The per-datagram cost is one store of "last activity"; the heap
 *   is only touched when a deadline passes: the entry is then re-armed at
 *   last + timeout, or the object ends.
 *
 * Records
 *   One single-producer ring per loop (the loop or a caller holding the loop
 *   mutex produces, sw_udp_drain consumes).  NEW_DEST and DATAGRAM records
 *   are droppable (the datagram behind them is counted as dropped), ENDED
 *   ones are not: when the ring is full, or anything already waits in the
 *   overflow list, they go to that list, which keeps order because nothing
 *   is put in the ring while the list is non-empty.
 */
#define _GNU_SOURCE
#include "udp.h"
#include "clock.h"
#include "evloop.h"
#include "heap.h"
#include "parse.h"
#include "ring.h"

#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum {
    BATCH = 32,           /* datagrams per recvmmsg/sendmmsg */
    ROUNDS = 8,           /* recvmmsg batches per socket per wake-up */
    RX_BUF = 65536,       /* > any UDP payload without jumbograms */
    EVENTS_MAX = 64,
    HDR_MAX = 3 + 1 + 1 + 255 + 2, /* RSV RSV FRAG ATYP LEN DOMAIN PORT */
    /* Consecutive read errors after which a socket is given up. */
    FAIL_LIMIT = 16,
    DEFAULT_ASSOCS = 4096,
    DEFAULT_RING = 4096,
    DEFAULT_DESTS = 1024,
    DEFAULT_PENDING = 16,
    DEFAULT_PENDING_BYTES = 4 << 20,
    DEFAULT_PYTHON_BYTES = 8 << 20,
    MAX_LOOPS = 256,
};

enum ep_type { EP_WAKE = 1, EP_CLIENT, EP_UPSTREAM };
enum timer_kind { T_DEST = 1, T_UPSTREAM };

struct ep {
    int type;
};

/* ---- time, hashing --------------------------------------------------------- */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t hash_bytes(uint64_t seed, const uint8_t *p, size_t n)
{
    uint64_t h = mix64(seed ^ (n * 0x9E3779B97F4A7C15ull));
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = mix64(h ^ v);
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    return mix64(h ^ v ^ ((uint64_t)n << 59));
}

/* ---- intrusive chained hash table ----------------------------------------- */

struct hlink {
    struct hlink *next;
    uint64_t hash;
};

struct htab {
    struct hlink **b;
    uint32_t mask;
    uint32_t n;
};

static int htab_init(struct htab *t, uint32_t buckets)
{
    t->b = calloc(buckets, sizeof *t->b);
    t->mask = buckets - 1;
    t->n = 0;
    return t->b ? 0 : -ENOMEM;
}

/* Doubles at load 1; a failed allocation just keeps the chains longer. */
static void htab_grow(struct htab *t)
{
    uint32_t size = (t->mask + 1) * 2;
    struct hlink **nb = calloc(size, sizeof *nb);
    if (!nb)
        return;
    for (uint32_t i = 0; i <= t->mask; i++) {
        struct hlink *l = t->b[i];
        while (l) {
            struct hlink *next = l->next;
            l->next = nb[l->hash & (size - 1)];
            nb[l->hash & (size - 1)] = l;
            l = next;
        }
    }
    free(t->b);
    t->b = nb;
    t->mask = size - 1;
}

static void htab_insert(struct htab *t, struct hlink *l, uint64_t hash)
{
    if (t->n > t->mask && t->mask < (1u << 24))
        htab_grow(t);
    l->hash = hash;
    l->next = t->b[hash & t->mask];
    t->b[hash & t->mask] = l;
    t->n++;
}

static void htab_remove(struct htab *t, struct hlink *l)
{
    for (struct hlink **pp = &t->b[l->hash & t->mask]; *pp; pp = &(*pp)->next) {
        if (*pp == l) {
            *pp = l->next;
            t->n--;
            return;
        }
    }
}

#define CONTAINER(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* ---- objects ----------------------------------------------------------------- */

/* An address in one form for comparisons: IPv4 as ::ffff:a.b.c.d. */
struct addr16 {
    uint8_t ip[16];
    uint16_t port;
};

struct timer {
    uint64_t deadline; /* monotonic ms the heap orders by */
    uint64_t last;     /* monotonic ms of the last activity */
    uint32_t timeout;  /* ms; 0 = not armed */
    uint8_t kind;
    size_t idx;        /* in the heap; SIZE_MAX when not */
};

struct pkt {
    struct pkt *next;
    uint32_t len;
    uint8_t data[];
};

struct upstream;
struct assoc;

struct dest {
    struct hlink by_key, by_id, by_addr;
    struct assoc *a;
    struct upstream *up;  /* DIRECT only */
    struct timer t;
    uint32_t id;
    uint8_t action;
    bool in_addr;         /* in up->addrs */
    uint16_t hdr_len;
    struct addr16 res;
    union {
        struct sockaddr sa;
        struct sockaddr_in v4;
        struct sockaddr_in6 v6;
    } to;
    socklen_t to_len;
    struct pkt *pend_head, *pend_tail;
    uint32_t npend;
    uint64_t last_up;     /* L->send_seq when C last sent for it: a reply from
                             an address several destinations share goes to the
                             one that sent last (a sequence, not a clock: two
                             sends in one millisecond must still be ordered) */
    sw_udp_counters c;
    /* The reply header: RSV RSV FRAG=0, then the key (ATYP..PORT as sent). */
    uint8_t hdr[HDR_MAX];
};

struct upstream {
    struct ep ep;         /* EP_UPSTREAM */
    struct assoc *a;
    struct upstream *next;      /* a->ups */
    struct upstream *next_dead;
    struct timer t;
    uint32_t id;
    int fd;
    int family;           /* AF_INET or AF_INET6 */
    bool v6only;
    bool dead;
    uint32_t fails;       /* consecutive read errors */
    uint32_t ever;        /* destinations ever put on it */
    struct htab addrs;    /* DIRECT destinations by resolved address */
    sw_udp_counters c;
    sw_udp_drops drops;
};

struct assoc {
    struct ep ep;         /* EP_CLIENT */
    struct uloop *L;
    struct assoc *next_dead;
    uint64_t id;
    uint32_t slot;
    int fd;
    bool dead;
    bool learned;         /* `client` and client_sa are the client's */
    bool any_ip;
    uint32_t fails;
    uint16_t want_port;
    uint8_t want_ip[16];
    struct addr16 client;
    struct sockaddr_storage client_sa;
    socklen_t client_salen;
    uint32_t idle_ms;
    uint32_t next_dest, next_up;
    uint32_t ndests;
    struct htab by_key, by_id;
    struct upstream *ups;
    sw_udp_counters ended; /* destinations that ended, summed */
    sw_udp_drops drops;
};

/* A ring slot or an overflow item: the record and, for DATAGRAM, the payload. */
struct rslot {
    sw_udp_record rec;
    struct pkt *payload;
};

struct ovf {
    struct ovf *next;
    struct rslot s;
};

struct uloop {
    struct ep wake_ep;
    sw_udp *udp;
    int index;
    pthread_t thread;
    bool started;
    int epfd;
    int wakefd;
    pthread_mutex_t lock;
    _Atomic int stop;
    /* records */
    struct rslot *slots;
    uint32_t mask;
    _Atomic uint32_t head; /* written under `lock` */
    _Atomic uint32_t tail; /* written by sw_udp_drain */
    struct ovf *ovf_head, *ovf_tail; /* under `lock` */
    _Atomic uint32_t ovf_n;
    _Atomic uint64_t python_bytes;
    bool published;
    /* everything below: under `lock` */
    uint64_t pending_bytes;
    struct timer **heap;
    size_t heap_len, heap_cap;
    uint64_t now, now_unix;
    uint64_t send_seq;         /* counts datagrams C sent upstream (dest->last_up) */
    struct assoc *dead_assocs;
    struct upstream *dead_ups;
    uint32_t *free_slots;
    uint32_t nfree;
    sw_udp_stats st;
    /* batches */
    uint8_t *rx_buf;
    struct mmsghdr rx[BATCH];
    struct iovec rx_iov[BATCH];
    struct sockaddr_storage rx_sa[BATCH];
    struct mmsghdr tx[BATCH];
    struct iovec tx_iov[BATCH][2];
    int tx_fd[BATCH];
    struct dest *tx_dest[BATCH];
    unsigned ntx;
};

struct sw_udp {
    sw_udp_opts o;
    int nloops;
    struct uloop *loops;
    int efd;
    uint64_t seed;
    uint32_t nslots;
    struct assoc **slots;  /* slot s belongs to loop s % nloops, under its lock */
    uint32_t *gens;
    _Atomic uint32_t rr;
    pthread_mutex_t drain_lock;
    pthread_mutex_t shut_lock;
    _Atomic int shut;
};

static void now_update(struct uloop *L)
{
    L->now = sw_mono_ms();
    L->now_unix = sw_real_ms();
}

static void flush_signal(struct uloop *L)
{
    if (L->published) {
        L->published = false;
        efd_signal(L->udp->efd);
    }
}

/* ---- addresses ------------------------------------------------------------- */

static const uint8_t v4_mapped_prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF};

static bool sa_to_addr16(const struct sockaddr_storage *ss, struct addr16 *out)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)ss;
        memcpy(out->ip, v4_mapped_prefix, 12);
        memcpy(out->ip + 12, &s->sin_addr, 4);
        out->port = ntohs(s->sin_port);
        return true;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)ss;
        memcpy(out->ip, &s->sin6_addr, 16);
        out->port = ntohs(s->sin6_port);
        return true;
    }
    return false;
}

static bool ip16_is_v4(const uint8_t ip[16]) { return !memcmp(ip, v4_mapped_prefix, 12); }

/* family 4/6 + bytes -> the 16-byte form. */
static void ip_to16(uint8_t family, const uint8_t *ip, uint8_t out[16])
{
    if (family == 4) {
        memcpy(out, v4_mapped_prefix, 12);
        memcpy(out + 12, ip, 4);
    } else {
        memcpy(out, ip, 16);
    }
}

/* The 16-byte form -> a record's family + bytes. */
static uint8_t ip_from16(const uint8_t ip[16], uint8_t out[16])
{
    memset(out, 0, 16);
    if (ip16_is_v4(ip)) {
        memcpy(out, ip + 12, 4);
        return 4;
    }
    memcpy(out, ip, 16);
    return 6;
}

static uint64_t addr_hash(sw_udp *u, const struct addr16 *a)
{
    uint8_t k[18];
    memcpy(k, a->ip, 16);
    k[16] = (uint8_t)(a->port >> 8);
    k[17] = (uint8_t)a->port;
    return hash_bytes(u->seed ^ 0x5555, k, sizeof k);
}

static uint64_t id_hash(sw_udp *u, uint32_t id) { return mix64(u->seed ^ 0xAAAA ^ id); }

static int sock_info(int fd, int *family)
{
    int type = 0, domain = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0)
        return -errno;
    len = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) < 0)
        return -errno;
    if (type != SOCK_DGRAM || (domain != AF_INET && domain != AF_INET6))
        return -EINVAL;
    *family = domain;
    return 0;
}

/* ---- counters ----------------------------------------------------------------- */

static void counters_add(sw_udp_counters *to, const sw_udp_counters *from)
{
    uint64_t last = to->last_activity_unix_ms > from->last_activity_unix_ms
                        ? to->last_activity_unix_ms
                        : from->last_activity_unix_ms;
    uint64_t *t = (uint64_t *)to;
    const uint64_t *f = (const uint64_t *)from;
    for (size_t i = 0; i < sizeof *to / sizeof(uint64_t); i++)
        t[i] += f[i];
    to->last_activity_unix_ms = last;
}

/* ---- timers -------------------------------------------------------------------- */

SW_HEAP_DEFINE(heap, struct uloop, struct timer, idx, deadline)

/* Arms t (timeout > 0) from its `last`.  Returns -ENOMEM only when the heap
 * cannot grow. */
static int timer_arm(struct uloop *L, struct timer *t)
{
    if (!t->timeout)
        return 0;
    uint64_t old = t->deadline;
    t->deadline = t->last + t->timeout;
    int e = heap_push(L, t, 64);
    if (e)
        t->deadline = old; /* unarmed, as it was */
    return e;
}

static void timer_disarm(struct uloop *L, struct timer *t)
{
    size_t i = t->idx;
    if (i == SIZE_MAX)
        return;
    t->idx = SIZE_MAX;
    heap_remove(L, i);
}

/* ---- records --------------------------------------------------------------------- */

static bool ring_room(struct uloop *L)
{
    return sw_ring_has_room(&L->head, &L->tail, L->mask);
}

static void rec_init(struct uloop *L, sw_udp_record *r, uint32_t kind, uint64_t assoc)
{
    memset(r, 0, offsetof(sw_udp_record, host));
    r->host[0] = 0;
    r->kind = kind;
    r->assoc = assoc;
    r->at_unix_ms = L->now_unix;
}

static void ring_put(struct uloop *L, const sw_udp_record *r, struct pkt *payload)
{
    uint32_t head = sw_ring_head(&L->head);
    struct rslot *s = &L->slots[head & L->mask];
    memcpy(&s->rec, r, sizeof *r);
    s->payload = payload;
    sw_ring_publish(&L->head, head);
    L->published = true;
}

/* A record that may be refused: false when there is no room (the caller
 * drops what it was about). */
static bool rec_try(struct uloop *L, const sw_udp_record *r, struct pkt *payload)
{
    if (atomic_load_explicit(&L->ovf_n, memory_order_relaxed) || !ring_room(L))
        return false;
    ring_put(L, r, payload);
    return true;
}

/* An ENDED record: into the ring, or behind what already waits outside it. */
static void rec_must(struct uloop *L, const sw_udp_record *r)
{
    if (!atomic_load_explicit(&L->ovf_n, memory_order_relaxed) && ring_room(L)) {
        ring_put(L, r, NULL);
        return;
    }
    struct ovf *o = malloc(sizeof *o);
    if (!o)
        return; /* out of memory: nothing better to do than lose it */
    o->next = NULL;
    memcpy(&o->s.rec, r, sizeof *r);
    o->s.payload = NULL;
    if (L->ovf_tail)
        L->ovf_tail->next = o;
    else
        L->ovf_head = o;
    L->ovf_tail = o;
    atomic_fetch_add_explicit(&L->ovf_n, 1, memory_order_relaxed);
    L->st.records_overflowed++;
    L->published = true;
}

/* ---- ending things ---------------------------------------------------------------- */

static void free_pending(struct uloop *L, struct dest *d, bool count)
{
    struct pkt *p = d->pend_head;
    while (p) {
        struct pkt *next = p->next;
        L->pending_bytes -= p->len;
        if (count) {
            d->c.dropped_pending++;
            L->st.dropped_pending++;
        }
        free(p);
        p = next;
    }
    d->pend_head = d->pend_tail = NULL;
    d->npend = 0;
}

static void dest_detach(struct dest *d)
{
    if (d->in_addr) {
        htab_remove(&d->up->addrs, &d->by_addr);
        d->in_addr = false;
    }
    d->up = NULL;
}

static void dest_end(struct dest *d, uint32_t reason, int err)
{
    struct assoc *a = d->a;
    struct uloop *L = a->L;
    sw_udp_record r;
    rec_init(L, &r, SW_UDP_REC_DEST_ENDED, a->id);
    r.dest = d->id;
    r.upstream = d->up ? d->up->id : 0;
    r.reason = reason;
    r.err = err;
    r.action = d->action;
    /* Held datagrams never reached anyone: they count as dropped. */
    free_pending(L, d, true);
    r.counters = d->c;
    rec_must(L, &r);
    timer_disarm(L, &d->t);
    dest_detach(d);
    htab_remove(&a->by_key, &d->by_key);
    htab_remove(&a->by_id, &d->by_id);
    counters_add(&a->ended, &d->c);
    a->ndests--;
    L->st.dests_active--;
    L->st.dests_ended++;
    if (reason == SW_UDP_END_IDLE)
        L->st.dest_idle_timeouts++;
    free(d);
}

/* Ends every destination of `a` (only those on upstream `only`, if given). */
static void dests_end_where(struct assoc *a, struct upstream *only, uint32_t reason)
{
    for (uint32_t i = 0; i <= a->by_id.mask; i++) {
        struct hlink *l = a->by_id.b[i];
        while (l) {
            struct hlink *next = l->next;
            struct dest *d = CONTAINER(l, struct dest, by_id);
            if (!only || d->up == only)
                dest_end(d, reason, 0);
            l = next;
        }
    }
}

static void upstream_end(struct upstream *u, uint32_t reason, int err)
{
    struct assoc *a = u->a;
    struct uloop *L = a->L;
    uint32_t dreason = reason == SW_UDP_END_IDLE || reason == SW_UDP_END_ASSOC ||
                               reason == SW_UDP_END_SHUTDOWN
                           ? reason
                           : SW_UDP_END_UPSTREAM;
    dests_end_where(a, u, dreason);
    sw_udp_record r;
    rec_init(L, &r, SW_UDP_REC_UPSTREAM_ENDED, a->id);
    r.upstream = u->id;
    r.reason = reason;
    r.err = err;
    r.counters = u->c;
    r.drops = u->drops;
    rec_must(L, &r);
    timer_disarm(L, &u->t);
    epoll_ctl(L->epfd, EPOLL_CTL_DEL, u->fd, NULL);
    close(u->fd);
    u->fd = -1;
    for (struct upstream **pp = &a->ups; *pp; pp = &(*pp)->next) {
        if (*pp == u) {
            *pp = u->next;
            break;
        }
    }
    u->dead = true;
    u->next_dead = L->dead_ups;
    L->dead_ups = u;
    L->st.active_associations--;
    L->st.closed_associations++;
    if (reason == SW_UDP_END_IDLE)
        L->st.idle_timeouts++;
    else if (reason == SW_UDP_END_ERROR)
        L->st.upstream_errors++;
}

static void assoc_end(struct assoc *a, uint32_t reason, int err)
{
    struct uloop *L = a->L;
    sw_udp *udp = L->udp;
    uint32_t sub = reason == SW_UDP_END_SHUTDOWN ? SW_UDP_END_SHUTDOWN : SW_UDP_END_ASSOC;
    dests_end_where(a, NULL, sub);
    while (a->ups)
        upstream_end(a->ups, sub, 0);
    sw_udp_record r;
    rec_init(L, &r, SW_UDP_REC_ASSOC_ENDED, a->id);
    r.reason = reason;
    r.err = err;
    r.counters = a->ended;
    r.drops = a->drops;
    rec_must(L, &r);
    epoll_ctl(L->epfd, EPOLL_CTL_DEL, a->fd, NULL);
    close(a->fd);
    a->fd = -1;
    udp->slots[a->slot] = NULL;
    udp->gens[a->slot]++;
    L->free_slots[L->nfree++] = a->slot / (uint32_t)udp->nloops;
    a->dead = true;
    a->next_dead = L->dead_assocs;
    L->dead_assocs = a;
    L->st.assocs_active--;
    L->st.assocs_ended++;
}

static void free_dead(struct uloop *L)
{
    while (L->dead_ups) {
        struct upstream *u = L->dead_ups;
        L->dead_ups = u->next_dead;
        free(u->addrs.b);
        free(u);
    }
    while (L->dead_assocs) {
        struct assoc *a = L->dead_assocs;
        L->dead_assocs = a->next_dead;
        free(a->by_key.b);
        free(a->by_id.b);
        free(a);
    }
}

/* ---- lookups ------------------------------------------------------------------------ */

static struct dest *dest_by_id(struct assoc *a, uint32_t id)
{
    uint64_t h = id_hash(a->L->udp, id);
    for (struct hlink *l = a->by_id.b[h & a->by_id.mask]; l; l = l->next) {
        struct dest *d = CONTAINER(l, struct dest, by_id);
        if (l->hash == h && d->id == id)
            return d;
    }
    return NULL;
}

static struct dest *dest_by_key(struct assoc *a, const uint8_t *key, size_t n, uint64_t h)
{
    for (struct hlink *l = a->by_key.b[h & a->by_key.mask]; l; l = l->next) {
        struct dest *d = CONTAINER(l, struct dest, by_key);
        if (l->hash == h && d->hdr_len == n + 3 && !memcmp(d->hdr + 3, key, n))
            return d;
    }
    return NULL;
}

/* Of the DIRECT destinations on u sending to `from`, the one C sent for last. */
static struct dest *dest_by_addr(struct upstream *u, const struct addr16 *from)
{
    uint64_t h = addr_hash(u->a->L->udp, from);
    struct dest *best = NULL;
    for (struct hlink *l = u->addrs.b[h & u->addrs.mask]; l; l = l->next) {
        struct dest *d = CONTAINER(l, struct dest, by_addr);
        if (l->hash == h && d->res.port == from->port && !memcmp(d->res.ip, from->ip, 16) &&
            (!best || d->last_up > best->last_up))
            best = d;
    }
    return best;
}

static struct upstream *upstream_by_id(struct assoc *a, uint32_t id)
{
    for (struct upstream *u = a->ups; u; u = u->next)
        if (u->id == id)
            return u;
    return NULL;
}

/* ---- the data path ------------------------------------------------------------------- */

static void touch(struct uloop *L, struct dest *d)
{
    d->t.last = L->now;
    d->c.last_activity_unix_ms = L->now_unix;
}

static void touch_up(struct uloop *L, struct upstream *u)
{
    u->t.last = L->now;
    u->c.last_activity_unix_ms = L->now_unix;
}

static bool transient(int e)
{
    return e == EAGAIN || e == EWOULDBLOCK || e == EINTR;
}

/* The outcome of L->tx[i]: to an upstream (up) or to the client. */
static void tx_done(struct uloop *L, unsigned i, bool up, bool ok)
{
    struct dest *d = L->tx_dest[i];
    size_t len = L->tx[i].msg_len;
    if (up) {
        struct upstream *u = d->up;
        if (ok) {
            d->c.upstream_tx_packets++;
            d->c.upstream_tx_bytes += len;
            d->c.bytes_up += len;
            u->c.upstream_tx_packets++;
            u->c.upstream_tx_bytes += len;
            u->c.bytes_up += len;
            L->st.packets_sent++;
        } else {
            d->c.send_failures++;
            u->c.send_failures++;
            L->st.send_failures++;
        }
    } else if (ok) {
        d->c.client_tx_packets++;
        d->c.client_tx_bytes += len;
        d->c.bytes_down += len - d->hdr_len;
        L->st.client_packets_sent++;
    } else {
        d->c.client_send_failures++;
        L->st.client_send_failures++;
        L->st.send_failures++;
    }
}

/* Sends L->tx[from, to), all for one fd.  A refused datagram is dropped and
 * counted; after EAGAIN (the socket buffer is full) so is the rest of the
 * run: UDP drops rather than queues. */
static void tx_run(struct uloop *L, unsigned from, unsigned to, bool up)
{
    int fd = L->tx_fd[from];
    unsigned i = from;
    while (i < to) {
        int r = sendmmsg(fd, L->tx + i, to - i, MSG_DONTWAIT);
        if (r > 0) {
            for (unsigned k = i; k < i + (unsigned)r; k++)
                tx_done(L, k, up, true);
            i += (unsigned)r;
            continue;
        }
        int e = r < 0 ? errno : EIO;
        if (e == EINTR)
            continue;
        tx_done(L, i++, up, false);
        if (e == EAGAIN || e == EWOULDBLOCK || e == ENOBUFS)
            while (i < to)
                tx_done(L, i++, up, false);
    }
}

static void tx_flush(struct uloop *L, bool up)
{
    unsigned start = 0;
    for (unsigned i = 1; i <= L->ntx; i++) {
        if (i == L->ntx || L->tx_fd[i] != L->tx_fd[start]) {
            tx_run(L, start, i, up);
            start = i;
        }
    }
    L->ntx = 0;
}

static void tx_add(struct uloop *L, int fd, struct dest *d, const struct sockaddr *to,
                   socklen_t to_len, const uint8_t *hdr, size_t hdr_len, const uint8_t *p,
                   size_t n)
{
    unsigned i = L->ntx++;
    struct msghdr *m = &L->tx[i].msg_hdr;
    m->msg_name = (void *)to;
    m->msg_namelen = to_len;
    m->msg_control = NULL;
    m->msg_controllen = 0;
    m->msg_flags = 0;
    if (hdr_len) {
        L->tx_iov[i][0] = (struct iovec){(void *)hdr, hdr_len};
        L->tx_iov[i][1] = (struct iovec){(void *)p, n};
        m->msg_iovlen = 2;
    } else {
        L->tx_iov[i][0] = (struct iovec){(void *)p, n};
        m->msg_iovlen = 1;
    }
    m->msg_iov = L->tx_iov[i];
    L->tx_fd[i] = fd;
    L->tx_dest[i] = d;
}

static struct pkt *pkt_new(const uint8_t *p, size_t n)
{
    struct pkt *k = malloc(sizeof *k + n);
    if (k) {
        k->next = NULL;
        k->len = (uint32_t)n;
        memcpy(k->data, p, n);
    }
    return k;
}

/* A PYTHON destination's datagram -> a DATAGRAM record (takes k, also on failure). */
static void to_python(struct uloop *L, struct dest *d, struct pkt *k)
{
    uint64_t budget = L->udp->o.python_bytes_max;
    if (k && atomic_load_explicit(&L->python_bytes, memory_order_relaxed) + k->len <= budget) {
        sw_udp_record r;
        rec_init(L, &r, SW_UDP_REC_DATAGRAM, d->a->id);
        r.dest = d->id;
        r.payload_len = k->len;
        if (rec_try(L, &r, k)) {
            atomic_fetch_add_explicit(&L->python_bytes, k->len, memory_order_relaxed);
            d->c.python_packets++;
            d->c.python_bytes += k->len;
            return;
        }
    }
    free(k);
    d->c.dropped_python++;
    L->st.dropped_python++;
}

static struct dest *dest_new(struct assoc *a, const uint8_t *buf, size_t len,
                             const sw_s5_udp *h, uint64_t hash)
{
    struct uloop *L = a->L;
    sw_udp *udp = L->udp;
    if (a->ndests >= udp->o.max_dests || !ring_room(L) || atomic_load(&L->ovf_n))
        return NULL;
    struct dest *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->a = a;
    d->id = ++a->next_dest;
    d->t.kind = T_DEST;
    d->t.idx = SIZE_MAX;
    d->t.timeout = a->idle_ms;
    d->t.last = L->now;
    d->action = SW_UDP_PENDING;
    d->hdr_len = (uint16_t)h->header_len;
    memcpy(d->hdr + 3, buf + 3, h->header_len - 3);
    d->c.last_activity_unix_ms = L->now_unix;
    if (timer_arm(L, &d->t) < 0) {
        free(d);
        return NULL;
    }
    sw_udp_record r;
    rec_init(L, &r, SW_UDP_REC_NEW_DEST, a->id);
    r.dest = d->id;
    r.port = h->port;
    r.atyp = h->atyp;
    if (h->atyp != 3)
        memcpy(r.ip, buf + h->addr_off, h->addr_len);
    sw_s5_udp full;
    sw_parse_s5_udp(buf, len, &full); /* the same bytes: OK again, now with text */
    memcpy(r.host, full.host, full.host_len + 1u);
    r.host_len = full.host_len;
    r.client_family = ip_from16(a->client.ip, r.client_ip);
    r.client_port = a->client.port;
    ring_put(L, &r, NULL); /* room checked above */
    htab_insert(&a->by_key, &d->by_key, hash);
    htab_insert(&a->by_id, &d->by_id, id_hash(udp, d->id));
    a->ndests++;
    a->drops.destinations++;
    L->st.dests_active++;
    L->st.dests_created++;
    return d;
}

static bool client_source_ok(struct assoc *a, const struct sockaddr_storage *ss)
{
    struct addr16 from;
    if (!sa_to_addr16(ss, &from))
        return false;
    if (a->learned)
        return from.port == a->client.port && !memcmp(from.ip, a->client.ip, 16);
    if (!a->any_ip && memcmp(from.ip, a->want_ip, 16))
        return false;
    if (a->want_port && from.port != a->want_port)
        return false;
    a->client = from;
    memcpy(&a->client_sa, ss, sizeof *ss);
    a->client_salen = ss->ss_family == AF_INET ? sizeof(struct sockaddr_in)
                                               : sizeof(struct sockaddr_in6);
    a->learned = true;
    return true;
}

static void client_datagram(struct assoc *a, uint8_t *buf, size_t len, int flags,
                            const struct sockaddr_storage *from)
{
    struct uloop *L = a->L;
    if (!client_source_ok(a, from)) {
        a->drops.dropped_foreign++;
        L->st.dropped_foreign++;
        return;
    }
    sw_s5_udp h;
    if ((flags & MSG_TRUNC) || sw_parse_s5_udp_fields(buf, len, &h) != SW_PARSE_OK) {
        a->drops.dropped_malformed++;
        L->st.dropped_malformed++;
        return;
    }
    if (h.frag) {
        a->drops.dropped_fragment++;
        L->st.dropped_fragment++;
        return;
    }
    const uint8_t *key = buf + 3;
    size_t klen = h.header_len - 3;
    uint64_t hash = hash_bytes(L->udp->seed, key, klen);
    struct dest *d = dest_by_key(a, key, klen, hash);
    if (!d && !(d = dest_new(a, buf, len, &h, hash))) {
        a->drops.dropped_no_dest++;
        L->st.dropped_no_dest++;
        return;
    }
    touch(L, d);
    d->c.client_rx_packets++;
    d->c.client_rx_bytes += len;
    const uint8_t *payload = buf + h.header_len;
    size_t n = len - h.header_len;
    switch (d->action) {
    case SW_UDP_DIRECT: {
        struct upstream *u = d->up;
        d->last_up = ++L->send_seq;
        touch_up(L, u);
        tx_add(L, u->fd, d, &d->to.sa, d->to_len, NULL, 0, payload, n);
        break;
    }
    case SW_UDP_DROP:
        d->c.dropped_blocked++;
        L->st.dropped_blocked++;
        break;
    case SW_UDP_PYTHON:
        to_python(L, d, pkt_new(payload, n));
        break;
    default: {
        struct pkt *k = NULL;
        if (d->npend < L->udp->o.pending_max &&
            L->pending_bytes + n <= L->udp->o.pending_bytes_max)
            k = pkt_new(payload, n);
        if (!k) {
            d->c.dropped_pending++;
            L->st.dropped_pending++;
            break;
        }
        if (d->pend_tail)
            d->pend_tail->next = k;
        else
            d->pend_head = k;
        d->pend_tail = k;
        d->npend++;
        L->pending_bytes += n;
    }
    }
}

static void rx_prepare(struct uloop *L)
{
    for (int i = 0; i < BATCH; i++) {
        L->rx_iov[i] = (struct iovec){L->rx_buf + (size_t)i * RX_BUF, RX_BUF};
        struct msghdr *m = &L->rx[i].msg_hdr;
        m->msg_name = &L->rx_sa[i];
        m->msg_namelen = sizeof L->rx_sa[i];
        m->msg_iov = &L->rx_iov[i];
        m->msg_iovlen = 1;
        m->msg_control = NULL;
        m->msg_controllen = 0;
        m->msg_flags = 0;
    }
}

/* recvmmsg into the loop's buffers: the count, 0 when nothing is waiting,
 * -errno on a real error. */
static int rx_batch(struct uloop *L, int fd)
{
    rx_prepare(L);
    for (;;) {
        int n = recvmmsg(fd, L->rx, BATCH, MSG_DONTWAIT, NULL);
        if (n >= 0)
            return n;
        if (errno == EINTR)
            continue;
        return transient(errno) ? 0 : -errno;
    }
}

static void client_readable(struct assoc *a)
{
    struct uloop *L = a->L;
    for (int round = 0; round < ROUNDS; round++) {
        int n = rx_batch(L, a->fd);
        if (n < 0) {
            a->drops.recv_failures++;
            L->st.client_recv_failures++;
            L->st.recv_failures++;
            if (++a->fails >= FAIL_LIMIT)
                assoc_end(a, SW_UDP_END_ERROR, -n);
            return;
        }
        if (n == 0)
            return;
        a->fails = 0;
        L->st.client_packets_received += (uint64_t)n;
        for (int i = 0; i < n; i++)
            client_datagram(a, L->rx_iov[i].iov_base, L->rx[i].msg_len, L->rx[i].msg_hdr.msg_flags,
                            &L->rx_sa[i]);
        tx_flush(L, true);
        if (n < BATCH)
            return;
    }
}

static void upstream_readable(struct upstream *u)
{
    struct assoc *a = u->a;
    struct uloop *L = a->L;
    for (int round = 0; round < ROUNDS; round++) {
        int n = rx_batch(L, u->fd);
        if (n < 0) {
            u->drops.recv_failures++;
            L->st.recv_failures++;
            L->st.upstream_recv_failures++;
            if (++u->fails >= FAIL_LIMIT)
                upstream_end(u, SW_UDP_END_ERROR, -n);
            return;
        }
        if (n == 0)
            return;
        u->fails = 0;
        touch_up(L, u);
        for (int i = 0; i < n; i++) {
            size_t len = L->rx[i].msg_len;
            u->c.upstream_rx_packets++;
            u->c.upstream_rx_bytes += len;
            struct addr16 from;
            struct dest *d = NULL;
            if (!(L->rx[i].msg_hdr.msg_flags & MSG_TRUNC) && sa_to_addr16(&L->rx_sa[i], &from))
                d = dest_by_addr(u, &from);
            if (!d || !a->learned) {
                u->drops.dropped_unsolicited++;
                a->drops.dropped_unsolicited++;
                L->st.dropped_unsolicited++;
                continue;
            }
            touch(L, d);
            L->st.packets_received++;
            d->c.upstream_rx_packets++;
            d->c.upstream_rx_bytes += len;
            tx_add(L, a->fd, d, (const struct sockaddr *)&a->client_sa, a->client_salen, d->hdr,
                   d->hdr_len, L->rx_iov[i].iov_base, len);
        }
        tx_flush(L, false);
        if (n < BATCH)
            return;
    }
}

static void timers_run(struct uloop *L)
{
    while (L->heap_len && L->heap[0]->deadline <= L->now) {
        struct timer *t = L->heap[0];
        uint64_t due = t->last + t->timeout;
        if (due > L->now) {
            /* active since armed: move it, the cheap way to be lazy */
            t->deadline = due;
            heap_down(L, 0);
            continue;
        }
        if (t->kind == T_DEST)
            dest_end(CONTAINER(t, struct dest, t), SW_UDP_END_IDLE, 0);
        else
            upstream_end(CONTAINER(t, struct upstream, t), SW_UDP_END_IDLE, 0);
    }
}

static int sleep_ms(struct uloop *L)
{
    if (!L->heap_len)
        return -1;
    uint64_t now = sw_mono_ms(), first = L->heap[0]->deadline;
    if (first <= now)
        return 0;
    return (int)(first - now > 60000 ? 60000 : first - now);
}

static void client_error(struct assoc *a)
{
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(a->fd, SOL_SOCKET, SO_ERROR, &err, &len); /* clears it */
}

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void *loop_main(void *arg)
{
    struct uloop *L = arg;
    struct epoll_event events[EVENTS_MAX];
    uint64_t busy_us = L->udp->o.busy_poll_us, spin_until = 0;
    pthread_mutex_lock(&L->lock);
    while (!atomic_load(&L->stop)) {
        int timeout = sleep_ms(L);
        /* Busy polling: a thread that sleeps must be woken by the sender of
         * the next datagram, and in a ping-pong (a game, a DNS exchange, the
         * window-1 benchmark) that wake-up, two per round trip, costs more
         * than the relaying itself (an IPI, a VM exit under virtualisation). */
        if (spin_until && timeout != 0) {
            if (mono_us() < spin_until)
                timeout = 0;
            else
                spin_until = 0;
        }
        pthread_mutex_unlock(&L->lock);
        int n = epoll_wait(L->epfd, events, EVENTS_MAX, timeout);
        pthread_mutex_lock(&L->lock);
        if (n < 0 && errno != EINTR)
            break;
        if (n <= 0 && spin_until) {
            /* polling: nothing to do, and timers are not due; let a thread
             * this CPU woke (the peer we just sent to) run first */
            pthread_mutex_unlock(&L->lock);
            sched_yield();
            pthread_mutex_lock(&L->lock);
            continue;
        }
        now_update(L);
        if (busy_us && n > 0)
            spin_until = mono_us() + busy_us;
        for (int i = 0; i < n; i++) {
            struct ep *ep = events[i].data.ptr;
            uint32_t ev = events[i].events;
            if (ep->type == EP_WAKE) {
                efd_clear(L->wakefd);
            } else if (ep->type == EP_CLIENT) {
                struct assoc *a = CONTAINER(ep, struct assoc, ep);
                if (!a->dead && (ev & EPOLLERR))
                    client_error(a);
                if (!a->dead && (ev & EPOLLIN))
                    client_readable(a);
            } else if (ep->type == EP_UPSTREAM) {
                struct upstream *u = CONTAINER(ep, struct upstream, ep);
                if (!u->dead && (ev & (EPOLLIN | EPOLLERR)))
                    upstream_readable(u);
            }
        }
        timers_run(L);
        free_dead(L);
        flush_signal(L);
    }
    pthread_mutex_unlock(&L->lock);
    return NULL;
}

/* ---- public API ----------------------------------------------------------------------- */

int sw_udp_abi_version(void) { return SW_UDP_ABI_VERSION; }

static void loop_destroy(struct uloop *L)
{
    struct ovf *o = L->ovf_head;
    while (o) {
        struct ovf *next = o->next;
        free(o);
        o = next;
    }
    if (L->slots) {
        uint32_t tail = atomic_load(&L->tail), head = atomic_load(&L->head);
        for (; tail != head; tail++)
            free(L->slots[tail & L->mask].payload);
    }
    free(L->slots);
    free(L->heap);
    free(L->free_slots);
    free(L->rx_buf);
    if (L->epfd >= 0)
        close(L->epfd);
    if (L->wakefd >= 0)
        close(L->wakefd);
    pthread_mutex_destroy(&L->lock);
}

static void udp_destroy(sw_udp *udp)
{
    if (udp->loops)
        for (int i = 0; i < udp->nloops; i++)
            loop_destroy(&udp->loops[i]);
    free(udp->loops);
    free(udp->slots);
    free(udp->gens);
    if (udp->efd >= 0)
        close(udp->efd);
    pthread_mutex_destroy(&udp->drain_lock);
    pthread_mutex_destroy(&udp->shut_lock);
    free(udp);
}

static void stop_loops(sw_udp *udp)
{
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        if (!L->started)
            continue;
        atomic_store(&L->stop, 1);
        efd_signal(L->wakefd);
        pthread_join(L->thread, NULL);
        L->started = false;
    }
}

int sw_udp_new(const sw_udp_opts *opts, sw_udp **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    sw_udp_opts o = {0};
    if (opts)
        o = *opts;
    if (!o.loops)
        o.loops = 1;
    if (o.loops > MAX_LOOPS)
        return -EINVAL;
    o.max_assocs = o.max_assocs ? o.max_assocs : DEFAULT_ASSOCS;
    o.ring_records = sw_pow2_at_least(o.ring_records ? o.ring_records : DEFAULT_RING, 1u << 24);
    o.max_dests = o.max_dests ? o.max_dests : DEFAULT_DESTS;
    o.pending_max = o.pending_max ? o.pending_max : DEFAULT_PENDING;
    o.pending_bytes_max = o.pending_bytes_max ? o.pending_bytes_max : DEFAULT_PENDING_BYTES;
    o.python_bytes_max = o.python_bytes_max ? o.python_bytes_max : DEFAULT_PYTHON_BYTES;
    if (o.max_assocs > (1u << 30) || o.ring_records < 2)
        return -EINVAL;

    sw_udp *udp = calloc(1, sizeof *udp);
    if (!udp)
        return -ENOMEM;
    udp->o = o;
    udp->efd = -1;
    pthread_mutex_init(&udp->drain_lock, NULL);
    pthread_mutex_init(&udp->shut_lock, NULL);
    int rc = 0;
    if (getrandom(&udp->seed, sizeof udp->seed, GRND_NONBLOCK) != sizeof udp->seed)
        udp->seed = sw_real_ms() ^ (uint64_t)(uintptr_t)udp;
    udp->nloops = (int)o.loops;
    /* whole rounds of slots, so each loop holds the same number */
    uint32_t per_loop = (o.max_assocs + o.loops - 1) / o.loops;
    udp->nslots = per_loop * o.loops;
    udp->slots = calloc(udp->nslots, sizeof *udp->slots);
    udp->gens = malloc(udp->nslots * sizeof *udp->gens);
    udp->loops = calloc(o.loops, sizeof *udp->loops);
    udp->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!udp->slots || !udp->gens || !udp->loops || udp->efd < 0) {
        rc = udp->efd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    for (uint32_t s = 0; s < udp->nslots; s++)
        udp->gens[s] = 1;
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        L->udp = udp;
        L->index = i;
        L->epfd = L->wakefd = -1;
        L->wake_ep.type = EP_WAKE;
        pthread_mutex_init(&L->lock, NULL);
    }
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        L->mask = o.ring_records - 1;
        L->slots = calloc(o.ring_records, sizeof *L->slots);
        L->free_slots = malloc(per_loop * sizeof *L->free_slots);
        L->rx_buf = malloc((size_t)BATCH * RX_BUF);
        L->epfd = epoll_create1(EPOLL_CLOEXEC);
        L->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (!L->slots || !L->free_slots || !L->rx_buf || L->epfd < 0 || L->wakefd < 0) {
            rc = (L->epfd < 0 || L->wakefd < 0) ? -errno : -ENOMEM;
            goto fail;
        }
        /* popped from the end: lowest slot first */
        for (uint32_t k = 0; k < per_loop; k++)
            L->free_slots[k] = per_loop - 1 - k;
        L->nfree = per_loop;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &L->wake_ep};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, L->wakefd, &ev) < 0) {
            rc = -errno;
            goto fail;
        }
        now_update(L);
    }
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        /* i < MAX_LOOPS already; the modulo tells gcc the name fits */
        rc = loop_thread_start(&L->thread, loop_main, L, "sw-udp", i % MAX_LOOPS);
        if (rc < 0)
            goto fail;
        L->started = true;
    }
    *out = udp;
    return 0;
fail:
    stop_loops(udp);
    udp_destroy(udp);
    return rc;
}

int sw_udp_shutdown(sw_udp *udp)
{
    if (!udp)
        return -EINVAL;
    pthread_mutex_lock(&udp->shut_lock);
    if (atomic_load(&udp->shut)) {
        pthread_mutex_unlock(&udp->shut_lock);
        return 0;
    }
    atomic_store(&udp->shut, 1);
    stop_loops(udp);
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        pthread_mutex_lock(&L->lock);
        now_update(L);
        for (uint32_t s = (uint32_t)i; s < udp->nslots; s += (uint32_t)udp->nloops)
            if (udp->slots[s])
                assoc_end(udp->slots[s], SW_UDP_END_SHUTDOWN, 0);
        free_dead(L);
        flush_signal(L);
        pthread_mutex_unlock(&L->lock);
    }
    efd_signal(udp->efd); /* a waiter sees the end even with no record */
    pthread_mutex_unlock(&udp->shut_lock);
    return 0;
}

void sw_udp_free(sw_udp *udp)
{
    if (!udp)
        return;
    sw_udp_shutdown(udp);
    udp_destroy(udp);
}

int sw_udp_fd(sw_udp *udp) { return udp ? udp->efd : -EINVAL; }

int sw_udp_drain(sw_udp *udp, sw_udp_record *out, size_t max, uint8_t *payload, size_t cap,
                 size_t *payload_used)
{
    if (!udp || (!out && max) || (!payload && cap))
        return -EINVAL;
    pthread_mutex_lock(&udp->drain_lock);
    efd_clear(udp->efd);
    size_t n = 0, used = 0;
    bool more = false;
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        uint32_t tail = sw_ring_tail(&L->tail);
        uint32_t head = sw_ring_ready(&L->head);
        bool stuck = false;
        while (tail != head && n < max) {
            struct rslot *s = &L->slots[tail & L->mask];
            sw_udp_record *r = &out[n];
            if (s->payload) {
                size_t len = s->payload->len;
                if (len > cap - used) {
                    stuck = true;
                    break;
                }
                memcpy(r, &s->rec, sizeof *r);
                memcpy(payload + used, s->payload->data, len);
                r->payload_off = (uint32_t)used;
                used += len;
                free(s->payload);
                s->payload = NULL;
                atomic_fetch_sub_explicit(&L->python_bytes, len, memory_order_relaxed);
            } else {
                memcpy(r, &s->rec, sizeof *r);
            }
            n++;
            tail++;
        }
        sw_ring_release(&L->tail, tail);
        if (tail != head || stuck) {
            more = true;
            continue;
        }
        if (!atomic_load_explicit(&L->ovf_n, memory_order_relaxed))
            continue;
        /* The ring is empty as of `head`; under the lock nothing can be put
         * in it, so if it is still empty the overflow list comes next. */
        pthread_mutex_lock(&L->lock);
        if (atomic_load_explicit(&L->head, memory_order_relaxed) == tail) {
            while (L->ovf_head && n < max) {
                struct ovf *o = L->ovf_head;
                L->ovf_head = o->next;
                if (!L->ovf_head)
                    L->ovf_tail = NULL;
                atomic_fetch_sub_explicit(&L->ovf_n, 1, memory_order_relaxed);
                memcpy(&out[n++], &o->s.rec, sizeof o->s.rec);
                free(o);
            }
        }
        if (L->ovf_head || atomic_load_explicit(&L->head, memory_order_relaxed) != tail)
            more = true;
        pthread_mutex_unlock(&L->lock);
    }
    if (payload_used)
        *payload_used = used;
    if (more)
        efd_signal(udp->efd);
    pthread_mutex_unlock(&udp->drain_lock);
    return (int)n;
}

/* Locks the loop of `id` and returns the live association, or NULL
 * (unlocked) with *rc set. */
static struct assoc *assoc_lock(sw_udp *udp, uint64_t id, int *rc)
{
    if (!udp) {
        *rc = -EINVAL;
        return NULL;
    }
    if (atomic_load(&udp->shut)) {
        *rc = -ESHUTDOWN;
        return NULL;
    }
    uint32_t slot = (uint32_t)id, gen = (uint32_t)(id >> 32);
    if (slot >= udp->nslots) {
        *rc = -ENOENT;
        return NULL;
    }
    struct uloop *L = &udp->loops[slot % (uint32_t)udp->nloops];
    pthread_mutex_lock(&L->lock);
    struct assoc *a = udp->slots[slot];
    if (!a || udp->gens[slot] != gen || a->dead) {
        pthread_mutex_unlock(&L->lock);
        *rc = atomic_load(&udp->shut) ? -ESHUTDOWN : -ENOENT;
        return NULL;
    }
    now_update(L);
    return a;
}

static void assoc_unlock(struct assoc *a)
{
    struct uloop *L = a->L;
    flush_signal(L);
    pthread_mutex_unlock(&L->lock);
}

int sw_udp_assoc_add(sw_udp *udp, const sw_udp_assoc_opts *opts, uint64_t *assoc_out)
{
    if (!udp || !opts || !assoc_out)
        return -EINVAL;
    if (opts->client_family != 0 && opts->client_family != 4 && opts->client_family != 6)
        return -EINVAL;
    int family, rc = sock_info(opts->client_fd, &family);
    if (rc < 0)
        return rc;
    struct assoc *a = calloc(1, sizeof *a);
    if (!a)
        return -ENOMEM;
    if (htab_init(&a->by_key, 16) < 0 || htab_init(&a->by_id, 16) < 0) {
        free(a->by_key.b);
        free(a);
        return -ENOMEM;
    }
    a->ep.type = EP_CLIENT;
    a->fd = opts->client_fd;
    a->any_ip = opts->client_family == 0;
    a->want_port = opts->client_port;
    if (!a->any_ip)
        ip_to16(opts->client_family, opts->client_ip, a->want_ip);
    a->idle_ms = opts->dest_idle_timeout_ms;

    uint32_t start = atomic_fetch_add(&udp->rr, 1);
    for (int k = 0; k < udp->nloops; k++) {
        struct uloop *L = &udp->loops[(start + (uint32_t)k) % (uint32_t)udp->nloops];
        pthread_mutex_lock(&L->lock);
        if (atomic_load(&udp->shut)) {
            pthread_mutex_unlock(&L->lock);
            rc = -ESHUTDOWN;
            break;
        }
        if (!L->nfree) {
            pthread_mutex_unlock(&L->lock);
            rc = -ENOSPC;
            continue;
        }
        uint32_t local = L->free_slots[--L->nfree];
        uint32_t slot = local * (uint32_t)udp->nloops + (uint32_t)L->index;
        a->L = L;
        a->slot = slot;
        a->id = (uint64_t)udp->gens[slot] << 32 | slot;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &a->ep};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, a->fd, &ev) < 0) {
            rc = -errno;
            L->free_slots[L->nfree++] = local;
            pthread_mutex_unlock(&L->lock);
            break;
        }
        udp->slots[slot] = a;
        L->st.assocs_active++;
        L->st.assocs_added++;
        *assoc_out = a->id;
        pthread_mutex_unlock(&L->lock);
        return 0;
    }
    free(a->by_key.b);
    free(a->by_id.b);
    free(a);
    return rc;
}

int sw_udp_assoc_close(sw_udp *udp, uint64_t assoc)
{
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct uloop *L = a->L;
    assoc_end(a, SW_UDP_END_CLOSED, 0);
    efd_signal(L->wakefd); /* let the loop free it soon */
    flush_signal(L);
    pthread_mutex_unlock(&L->lock);
    return 0;
}

int sw_udp_assoc_counters(sw_udp *udp, uint64_t assoc, sw_udp_counters *total,
                          sw_udp_drops *drops)
{
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    if (total) {
        *total = a->ended;
        for (uint32_t i = 0; i <= a->by_id.mask; i++)
            for (struct hlink *l = a->by_id.b[i]; l; l = l->next)
                counters_add(total, &CONTAINER(l, struct dest, by_id)->c);
    }
    if (drops)
        *drops = a->drops;
    assoc_unlock(a);
    return 0;
}

int sw_udp_assoc_dests(sw_udp *udp, uint64_t assoc, uint32_t *ids, sw_udp_counters *out,
                       size_t max)
{
    int rc;
    if (!ids && max)
        return -EINVAL;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    size_t n = 0;
    for (uint32_t i = 0; i <= a->by_id.mask; i++) {
        for (struct hlink *l = a->by_id.b[i]; l; l = l->next, n++) {
            if (n >= max)
                continue;
            struct dest *d = CONTAINER(l, struct dest, by_id);
            ids[n] = d->id;
            if (out)
                out[n] = d->c;
        }
    }
    assoc_unlock(a);
    return (int)n;
}

int sw_udp_upstream_add(sw_udp *udp, uint64_t assoc, int fd, uint32_t idle_timeout_ms,
                        uint32_t *upstream_out)
{
    int rc;
    if (!upstream_out)
        return -EINVAL;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct uloop *L = a->L;
    int family;
    struct upstream *u = NULL;
    rc = sock_info(fd, &family);
    if (rc < 0)
        goto fail;
    rc = -ENOMEM;
    u = calloc(1, sizeof *u);
    if (!u || htab_init(&u->addrs, 4) < 0)
        goto fail;
    u->ep.type = EP_UPSTREAM;
    u->a = a;
    u->fd = fd;
    u->family = family;
    if (family == AF_INET6) {
        int v6only = 0;
        socklen_t len = sizeof v6only;
        if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &len) == 0)
            u->v6only = v6only != 0;
    }
    u->t.kind = T_UPSTREAM;
    u->t.idx = SIZE_MAX;
    u->t.timeout = idle_timeout_ms;
    u->t.last = L->now;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &u->ep};
    if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    rc = timer_arm(L, &u->t);
    if (rc < 0) {
        epoll_ctl(L->epfd, EPOLL_CTL_DEL, fd, NULL);
        goto fail;
    }
    if (u->t.idx == 0)
        efd_signal(L->wakefd); /* the loop may be asleep past this deadline */
    u->id = ++a->next_up;
    u->next = a->ups;
    a->ups = u;
    L->st.created_associations++;
    L->st.active_associations++;
    *upstream_out = u->id;
    assoc_unlock(a);
    return 0;
fail:
    if (u)
        free(u->addrs.b);
    free(u);
    L->st.failed_association_attempts++;
    assoc_unlock(a);
    return rc;
}

int sw_udp_upstream_close(sw_udp *udp, uint64_t assoc, uint32_t upstream)
{
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct upstream *u = upstream_by_id(a, upstream);
    if (!u) {
        assoc_unlock(a);
        return -ENOENT;
    }
    upstream_end(u, SW_UDP_END_CLOSED, 0);
    efd_signal(a->L->wakefd);
    assoc_unlock(a);
    return 0;
}

/* Builds d->to for u's family from the verdict; -EAFNOSUPPORT if it cannot. */
static int dest_address(struct dest *d, struct upstream *u, const sw_udp_verdict *v)
{
    uint8_t ip16[16];
    ip_to16(v->family, v->ip, ip16);
    bool v4 = ip16_is_v4(ip16);
    memset(&d->to, 0, sizeof d->to);
    if (u->family == AF_INET) {
        if (!v4)
            return -EAFNOSUPPORT;
        d->to.v4.sin_family = AF_INET;
        d->to.v4.sin_port = htons(v->port);
        memcpy(&d->to.v4.sin_addr, ip16 + 12, 4);
        d->to_len = sizeof d->to.v4;
    } else {
        if (v4 && u->v6only)
            return -EAFNOSUPPORT;
        d->to.v6.sin6_family = AF_INET6;
        d->to.v6.sin6_port = htons(v->port);
        memcpy(&d->to.v6.sin6_addr, ip16, 16);
        d->to_len = sizeof d->to.v6;
    }
    memcpy(d->res.ip, ip16, 16);
    d->res.port = v->port;
    return 0;
}

int sw_udp_dest_set(sw_udp *udp, uint64_t assoc, uint32_t dest, const sw_udp_verdict *verdict)
{
    if (!verdict || verdict->action < SW_UDP_DIRECT || verdict->action > SW_UDP_PYTHON)
        return -EINVAL;
    if (verdict->action == SW_UDP_DIRECT && verdict->family != 4 && verdict->family != 6)
        return -EINVAL;
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct uloop *L = a->L;
    struct dest *d = dest_by_id(a, dest);
    if (!d) {
        assoc_unlock(a);
        return -ENOENT;
    }
    struct upstream *u = NULL;
    if (verdict->action == SW_UDP_DIRECT) {
        u = upstream_by_id(a, verdict->upstream);
        if (!u) {
            assoc_unlock(a);
            return -ENXIO;
        }
        struct dest probe = *d; /* validate before changing anything */
        rc = dest_address(&probe, u, verdict);
        if (rc < 0) {
            assoc_unlock(a);
            return rc;
        }
    }
    if (d->up != u || verdict->action != SW_UDP_DIRECT)
        dest_detach(d);
    d->action = (uint8_t)verdict->action;
    if (u) {
        if (d->in_addr)
            htab_remove(&u->addrs, &d->by_addr);
        else if (d->up != u && u->ever++ > 0)
            L->st.reused_associations++;
        dest_address(d, u, verdict);
        d->up = u;
        htab_insert(&u->addrs, &d->by_addr, addr_hash(udp, &d->res));
        d->in_addr = true;
    }
    /* What waited for the verdict follows it, in order. */
    struct pkt *p = d->pend_head, *sent = NULL;
    d->pend_head = d->pend_tail = NULL;
    d->npend = 0;
    while (p) {
        struct pkt *next = p->next;
        p->next = NULL;
        L->pending_bytes -= p->len;
        if (d->action == SW_UDP_DIRECT) {
            d->last_up = ++L->send_seq;
            touch_up(L, u);
            /* sent from p itself: freed after the flush (the list is kept) */
            tx_add(L, u->fd, d, &d->to.sa, d->to_len, NULL, 0, p->data, p->len);
            p->next = sent;
            sent = p;
            if (L->ntx == BATCH)
                tx_flush(L, true);
        } else if (d->action == SW_UDP_DROP) {
            d->c.dropped_blocked++;
            L->st.dropped_blocked++;
            free(p);
        } else {
            to_python(L, d, p);
        }
        p = next;
    }
    tx_flush(L, true);
    while (sent) {
        struct pkt *next = sent->next;
        free(sent);
        sent = next;
    }
    assoc_unlock(a);
    return 0;
}

int sw_udp_dest_close(sw_udp *udp, uint64_t assoc, uint32_t dest)
{
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct dest *d = dest_by_id(a, dest);
    if (d)
        dest_end(d, SW_UDP_END_CLOSED, 0);
    assoc_unlock(a);
    return d ? 0 : -ENOENT;
}

int sw_udp_dest_counters(sw_udp *udp, uint64_t assoc, uint32_t dest, sw_udp_counters *out)
{
    int rc;
    if (!out)
        return -EINVAL;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct dest *d = dest_by_id(a, dest);
    if (d)
        *out = d->c;
    assoc_unlock(a);
    return d ? 0 : -ENOENT;
}

int sw_udp_send_to_client(sw_udp *udp, uint64_t assoc, uint32_t dest, uint8_t src_family,
                          const uint8_t *src_ip, uint16_t src_port, const uint8_t *payload,
                          size_t len)
{
    if ((src_family && src_family != 4 && src_family != 6) || (src_family && !src_ip) ||
        (!payload && len))
        return -EINVAL;
    if (len > RX_BUF)
        return -EMSGSIZE;
    int rc;
    struct assoc *a = assoc_lock(udp, assoc, &rc);
    if (!a)
        return rc;
    struct uloop *L = a->L;
    struct dest *d = dest_by_id(a, dest);
    if (!d || !a->learned) {
        assoc_unlock(a);
        return d ? -ENOTCONN : -ENOENT;
    }
    uint8_t own[3 + 1 + 16 + 2] = {0};
    const uint8_t *hdr = d->hdr;
    size_t hdr_len = d->hdr_len;
    if (src_family) {
        size_t alen = src_family == 4 ? 4 : 16;
        own[3] = src_family == 4 ? 1 : 4;
        memcpy(own + 4, src_ip, alen);
        own[4 + alen] = (uint8_t)(src_port >> 8);
        own[5 + alen] = (uint8_t)src_port;
        hdr = own;
        hdr_len = 6 + alen;
    }
    struct iovec iov[2] = {{(void *)hdr, hdr_len}, {(void *)payload, len}};
    struct msghdr m = {.msg_name = &a->client_sa, .msg_namelen = a->client_salen,
                       .msg_iov = iov, .msg_iovlen = 2};
    ssize_t n;
    do
        n = sendmsg(a->fd, &m, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        rc = -errno;
        d->c.client_send_failures++;
        L->st.client_send_failures++;
    } else {
        rc = (int)n;
        touch(L, d);
        d->c.client_tx_packets++;
        d->c.client_tx_bytes += (uint64_t)n;
        d->c.bytes_down += (uint64_t)n - hdr_len;
        L->st.client_packets_sent++;
    }
    assoc_unlock(a);
    return rc;
}

int sw_udp_stats_get(sw_udp *udp, sw_udp_stats *out)
{
    if (!udp || !out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    for (int i = 0; i < udp->nloops; i++) {
        struct uloop *L = &udp->loops[i];
        pthread_mutex_lock(&L->lock);
        uint64_t *t = (uint64_t *)out;
        const uint64_t *f = (const uint64_t *)&L->st;
        for (size_t k = 0; k < sizeof *out / sizeof(uint64_t); k++)
            t[k] += f[k];
        pthread_mutex_unlock(&L->lock);
    }
    return 0;
}
