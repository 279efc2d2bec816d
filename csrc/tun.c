/*
 * spliceway TUN system stack.  See tun.h for the contract; this file
 * explains the choices behind it.
 *
 * The loop
 *   read() up to `batch` packets from the non-blocking TUN fd into their own
 *   buffers (no lock held), then under the mutex classify and rewrite them
 *   all in place, then write() the ones that go back (no lock held).  A TUN
 *   fd has no recvmmsg/sendmmsg, so batching saves lock round trips and
 *   keeps lookups (sw_tun_nat_lookup from conn.c's loops) from waiting more
 *   than one batch, not system calls.  epoll wakes the loop for the device,
 *   for the stop eventfd, and at the earliest timeout (at most every second).
 *
 * Offloads
 *   With vnet_hdr each batch slot holds a header and the largest IP packet
 *   there is (40 + 65535 bytes), so one read takes a whole GSO burst; the
 *   header stays in front of the packet in the slot and goes back out with
 *   it, so a rewritten packet is written with one write() as before.  The
 *   loop never cuts segments or finishes checksums itself: that is the
 *   kernel's work on the way back in, where it costs least (often nothing:
 *   a locally delivered CHECKSUM_PARTIAL segment is never summed).  Packets
 *   the loop builds get a zeroed header written in front of them.
 *
 * NAT entries
 *   Indexed twice: by NAT port (an array of 65536 pointers: the reverse
 *   path is one load) and by (version, source, destination) in a chained
 *   hash with a random seed (local applications choose the tuples).  Each
 *   entry sits on one of three FIFO lists by state (half-open, open,
 *   closed), each with one timeout, ordered by the time of the last packet:
 *   moving an entry to its list's tail on activity keeps every list sorted,
 *   so expiry only ever looks at heads.  Activity moves an entry at most
 *   once a second (sing-tun refreshes as rarely), which keeps the list
 *   pointers out of the per-packet path.
 *
 *   Each entry keeps the listener port it was made for (lport): the DNS
 *   listener's for a connection to port 53 when dns_port is set, else the
 *   main one.  The reverse path checks it, so one listener's packets never
 *   translate for another's connection.
 *
 * UDP sessions
 *   A fixed array of max_udp slots with a free list; a session id is
 *   generation << 32 | slot + 1, so sw_tun_udp_send finds its slot in O(1)
 *   and an id of an ended session never matches a later one.  One list
 *   ordered by activity, one idle timeout.
 *
 * Records
 *   A ring of sw_tun_record slots, the loop the only producer (sw_tun_udp_close
 *   produces too, under the same mutex); consumers serialize on their own
 *   mutex.  A datagram's payload is malloc'ed and owned by its slot until
 *   drained; ring_bytes bounds what waits.  The eventfd is written only when
 *   the `signalled` flag goes from 0 to 1, and the consumer clears the flag
 *   before it looks at the ring, so a record is never left unannounced.
 */
#define _GNU_SOURCE
#include "tun.h"
#include "clock.h"
#include "evloop.h"
#include "pkt.h"
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

enum {
    NAT_PORT_MIN = 10000,
    NAT_PORTS = 65536 - NAT_PORT_MIN,
    MAX_TCP_LIMIT = NAT_PORTS - 1,
    DEFAULT_MAX_TCP = 16384,
    DEFAULT_MAX_UDP = 4096,
    DEFAULT_MTU = 1500,
    DEFAULT_BATCH = 64,
    MAX_BATCH = 1024,
    DEFAULT_RING = 4096,
    /* The loop wakes at least this often to expire entries. */
    TICK_MS = 1000,
    /* Activity moves an entry to its list's tail at most this often. */
    REFRESH_MS = 1000,
    RST_MAX = 60,
    /* With vnet_hdr: the largest packet a read may bring (IPv6 with a full
     * payload length; IPv4 stays under it), GSO or not. */
    VNET_PKT_MAX = 40 + 65535,
    /* A connection to this port goes to the DNS listener when there is one. */
    DNS_PORT = 53,
};

#define DEFAULT_RING_BYTES (8u << 20)

enum nat_list { L_SYN, L_OPEN, L_CLOSED, L_COUNT };

struct nat {
    struct nat *hnext;        /* hash chain */
    struct nat *prev, *next;  /* its state's list */
    uint64_t last_ms;         /* monotonic: the last packet that moved it */
    uint64_t created_unix_ms;
    uint64_t packets_out, packets_in;
    uint32_t hash;
    uint16_t natport;
    uint16_t sport, dport;
    uint16_t lport;           /* the listener it goes to: port4/6 or dns_port4/6 */
    uint8_t version;
    uint8_t state;            /* enum sw_tun_tcp_state */
    uint8_t list;             /* enum nat_list */
    bool fin_out, fin_in;     /* FIN seen from the client / from the listener */
    uint8_t src[16], dst[16];
};

struct nat_list_head {
    struct nat *head, *tail;
};

struct usess {
    struct usess *prev, *next; /* the activity list, or the free list (next) */
    uint32_t hnext;           /* hash chain: slot + 1, 0 ends it */
    uint32_t hash;
    uint32_t gen;
    bool live;
    uint8_t version;
    uint16_t sport, dport;
    uint8_t src[16], dst[16];
    uint64_t last_ms;
    uint32_t end_reason;      /* set by sw_tun_udp_close: ends at the next pass */
    uint64_t packets_in, bytes_in, packets_out, bytes_out;
};

struct slot {
    sw_tun_record rec;
    uint8_t *payload;         /* UDP: malloc'ed, owned until drained */
};

struct sw_tun {
    sw_tun_opts o;
    int fd;
    size_t hl;                /* SW_VNET_HDR_LEN with vnet_hdr, else 0 */
    int epfd;
    int stopfd;
    int efd;                  /* records pending */
    pthread_t thread;
    bool started;
    _Atomic int stop;
    bool shut;

    pthread_mutex_t lock;     /* everything below, and the ring's producer side */
    sw_tun_stats st;
    uint32_t seed;
    struct nat *by_port[65536];
    struct nat **tcp_hash;
    uint32_t tcp_hmask;
    struct nat_list_head lists[L_COUNT];
    uint32_t timeouts[L_COUNT];
    uint32_t next_port;       /* the cycle's position, NAT_PORT_MIN..65535 */

    struct usess *sess;       /* max_udp slots */
    uint32_t *udp_hash;       /* slot + 1, 0 empty */
    uint32_t udp_hmask;
    struct usess *ufree;
    struct usess *uhead, *utail; /* activity order */

    struct slot *ring;
    uint32_t rmask;
    _Atomic uint32_t head;    /* producer */
    _Atomic uint32_t tail;    /* consumer */
    _Atomic uint64_t ring_bytes;
    _Atomic int signalled;
    pthread_mutex_t drain_lock;
};

/* Session expiry needs no better than a tick: the coarse clock is a vDSO
 * read without the hardware counter. */
static uint64_t mono_ms(void) { return sw_clock_ms(CLOCK_MONOTONIC_COARSE); }

static uint32_t pow2_at_least(uint32_t n) { return sw_pow2_at_least(n, 1u << 30); }

/* FNV-1a over the tuple, seeded: cheap, and a local application cannot aim
 * its tuples at one chain without knowing the seed. */
static uint32_t tuple_hash(uint32_t seed, uint8_t version, const uint8_t *src, uint16_t sport,
                           const uint8_t *dst, uint16_t dport)
{
    uint32_t h = 2166136261u ^ seed;
    size_t alen = version == 4 ? 4 : 16;
#define MIX(b) (h = (h ^ (uint8_t)(b)) * 16777619u)
    MIX(version);
    for (size_t i = 0; i < alen; i++)
        MIX(src[i]);
    for (size_t i = 0; i < alen; i++)
        MIX(dst[i]);
    MIX(sport >> 8);
    MIX(sport);
    MIX(dport >> 8);
    MIX(dport);
#undef MIX
    return h ^ (h >> 15);
}

static size_t alen_of(uint8_t version) { return version == 4 ? 4 : 16; }

/* ---------------------------------------------------------------------------
 * Records
 */

static bool ring_room(sw_tun *t, size_t payload)
{
    return sw_ring_has_room(&t->head, &t->tail, t->rmask) &&
           atomic_load_explicit(&t->ring_bytes, memory_order_relaxed) + payload <= t->o.ring_bytes;
}

/* Puts a record (room checked by the caller); payload ownership passes. */
static void ring_put(sw_tun *t, const sw_tun_record *r, uint8_t *payload)
{
    uint32_t h = sw_ring_head(&t->head);
    struct slot *s = &t->ring[h & t->rmask];
    s->rec = *r;
    s->payload = payload;
    if (payload)
        atomic_fetch_add_explicit(&t->ring_bytes, r->payload_len, memory_order_relaxed);
    sw_ring_publish(&t->head, h);
}

static void ring_announce(sw_tun *t)
{
    if (!atomic_exchange(&t->signalled, 1))
        efd_signal(t->efd);
}

/* ---------------------------------------------------------------------------
 * TCP NAT
 */

static void list_unlink(sw_tun *t, struct nat *n)
{
    struct nat_list_head *l = &t->lists[n->list];
    if (n->prev)
        n->prev->next = n->next;
    else
        l->head = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        l->tail = n->prev;
    n->prev = n->next = NULL;
}

static void list_append(sw_tun *t, struct nat *n, int list)
{
    struct nat_list_head *l = &t->lists[list];
    n->list = (uint8_t)list;
    n->prev = l->tail;
    n->next = NULL;
    if (l->tail)
        l->tail->next = n;
    else
        l->head = n;
    l->tail = n;
}

static void nat_touch(sw_tun *t, struct nat *n, uint64_t now, int list)
{
    if (list == n->list && now - n->last_ms < REFRESH_MS)
        return;
    list_unlink(t, n);
    n->last_ms = now;
    list_append(t, n, list);
}

static struct nat *nat_find(sw_tun *t, uint8_t version, const uint8_t *src, uint16_t sport,
                            const uint8_t *dst, uint16_t dport, uint32_t *hash_out)
{
    uint32_t h = tuple_hash(t->seed, version, src, sport, dst, dport);
    *hash_out = h;
    size_t alen = alen_of(version);
    for (struct nat *n = t->tcp_hash[h & t->tcp_hmask]; n; n = n->hnext)
        if (n->hash == h && n->version == version && n->sport == sport && n->dport == dport &&
            !memcmp(n->src, src, alen) && !memcmp(n->dst, dst, alen))
            return n;
    return NULL;
}

static void nat_remove(sw_tun *t, struct nat *n)
{
    struct nat **pp = &t->tcp_hash[n->hash & t->tcp_hmask];
    while (*pp != n)
        pp = &(*pp)->hnext;
    *pp = n->hnext;
    list_unlink(t, n);
    t->by_port[n->natport] = NULL;
    t->st.tcp_active--;
    free(n);
}

/* The next free NAT port after the last one handed out (one exists: the
 * caller checked tcp_active < max_tcp <= NAT_PORTS - 1). */
static uint16_t nat_port_alloc(sw_tun *t)
{
    for (;;) {
        uint32_t p = t->next_port++;
        if (t->next_port > 65535)
            t->next_port = NAT_PORT_MIN;
        if (!t->by_port[p])
            return (uint16_t)p;
    }
}

static struct nat *nat_create(sw_tun *t, const sw_pkt *pk, uint32_t hash, uint16_t lport,
                              uint64_t now)
{
    if (t->st.tcp_active >= t->o.max_tcp) {
        struct nat *victim = t->lists[L_CLOSED].head ? t->lists[L_CLOSED].head
                                                     : t->lists[L_SYN].head;
        if (!victim)
            return NULL;
        nat_remove(t, victim);
        t->st.tcp_evicted++;
    }
    struct nat *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    size_t alen = alen_of(pk->version);
    n->version = pk->version;
    memcpy(n->src, pk->src, alen);
    memcpy(n->dst, pk->dst, alen);
    n->sport = pk->sport;
    n->dport = pk->dport;
    n->lport = lport;
    n->hash = hash;
    n->natport = nat_port_alloc(t);
    n->state = SW_TUN_TCP_SYN;
    n->last_ms = now;
    n->created_unix_ms = sw_real_ms();
    n->hnext = t->tcp_hash[hash & t->tcp_hmask];
    t->tcp_hash[hash & t->tcp_hmask] = n;
    t->by_port[n->natport] = n;
    list_append(t, n, L_SYN);
    t->st.tcp_active++;
    t->st.tcp_created++;
    return n;
}

/* Follows FIN and RST both ways into the entry's state and list. */
static void nat_track(sw_tun *t, struct nat *n, uint8_t flags, bool from_client, uint64_t now)
{
    if (flags & SW_TCP_RST) {
        n->state = SW_TUN_TCP_CLOSED;
    } else if (n->state != SW_TUN_TCP_CLOSED) {
        if (flags & SW_TCP_FIN) {
            if (from_client)
                n->fin_out = true;
            else
                n->fin_in = true;
        }
        if (n->fin_out && n->fin_in)
            n->state = SW_TUN_TCP_CLOSED;
        else if (n->fin_out || n->fin_in)
            n->state = SW_TUN_TCP_FIN;
        else if (n->state == SW_TUN_TCP_SYN && from_client && (flags & SW_TCP_ACK) &&
                 !(flags & SW_TCP_SYN))
            n->state = SW_TUN_TCP_ESTABLISHED;
    }
    int list = n->state == SW_TUN_TCP_CLOSED ? L_CLOSED
               : n->state == SW_TUN_TCP_SYN  ? L_SYN
                                             : L_OPEN;
    nat_touch(t, n, now, list);
}

static void nat_expire(sw_tun *t, uint64_t now)
{
    for (int l = 0; l < L_COUNT; l++) {
        struct nat *n;
        while ((n = t->lists[l].head) && now - n->last_ms >= t->timeouts[l]) {
            nat_remove(t, n);
            t->st.tcp_expired++;
        }
    }
}

/* ---------------------------------------------------------------------------
 * UDP sessions
 */

static uint64_t sess_id(sw_tun *t, struct usess *s)
{
    return (uint64_t)s->gen << 32 | (uint64_t)(s - t->sess + 1);
}

static struct usess *sess_by_id(sw_tun *t, uint64_t id)
{
    uint64_t slot = (id & 0xffffffffu);
    if (slot == 0 || slot > t->o.max_udp)
        return NULL;
    struct usess *s = &t->sess[slot - 1];
    return s->live && s->gen == (uint32_t)(id >> 32) ? s : NULL;
}

static void ulist_unlink(sw_tun *t, struct usess *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        t->uhead = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        t->utail = s->prev;
    s->prev = s->next = NULL;
}

static void ulist_append(sw_tun *t, struct usess *s)
{
    s->prev = t->utail;
    s->next = NULL;
    if (t->utail)
        t->utail->next = s;
    else
        t->uhead = s;
    t->utail = s;
}

static void ulist_prepend(sw_tun *t, struct usess *s)
{
    s->prev = NULL;
    s->next = t->uhead;
    if (t->uhead)
        t->uhead->prev = s;
    else
        t->utail = s;
    t->uhead = s;
}

/* As nat_touch: last_ms moves only with the list position, so the list stays
 * sorted and a session may end up to REFRESH_MS before its true idle time.
 * A closed session stays at the head for the next expiry pass. */
static void sess_touch(sw_tun *t, struct usess *s, uint64_t now)
{
    if (s->end_reason || now - s->last_ms < REFRESH_MS)
        return;
    ulist_unlink(t, s);
    s->last_ms = now;
    ulist_append(t, s);
}

static struct usess *sess_find(sw_tun *t, const sw_pkt *pk, uint32_t *hash_out)
{
    uint32_t h = tuple_hash(t->seed, pk->version, pk->src, pk->sport, pk->dst, pk->dport);
    *hash_out = h;
    size_t alen = alen_of(pk->version);
    for (uint32_t i = t->udp_hash[h & t->udp_hmask]; i; i = t->sess[i - 1].hnext) {
        struct usess *s = &t->sess[i - 1];
        if (s->hash == h && s->version == pk->version && s->sport == pk->sport &&
            s->dport == pk->dport && !memcmp(s->src, pk->src, alen) &&
            !memcmp(s->dst, pk->dst, alen))
            return s;
    }
    return NULL;
}

static struct usess *sess_create(sw_tun *t, const sw_pkt *pk, uint32_t hash, uint64_t now)
{
    struct usess *s = t->ufree;
    if (!s)
        return NULL;
    t->ufree = s->next;
    uint32_t gen = s->gen + 1;
    memset(s, 0, sizeof *s);
    s->gen = gen ? gen : 1;
    s->live = true;
    s->version = pk->version;
    memcpy(s->src, pk->src, 16);
    memcpy(s->dst, pk->dst, 16);
    s->sport = pk->sport;
    s->dport = pk->dport;
    s->hash = hash;
    s->last_ms = now;
    s->hnext = t->udp_hash[hash & t->udp_hmask];
    t->udp_hash[hash & t->udp_hmask] = (uint32_t)(s - t->sess + 1);
    ulist_append(t, s);
    t->st.udp_active++;
    t->st.udp_created++;
    return s;
}

static void sess_fill(sw_tun *t, struct usess *s, sw_tun_record *r, uint32_t kind)
{
    memset(r, 0, sizeof *r);
    r->session = sess_id(t, s);
    r->at_unix_ms = sw_real_ms();
    r->kind = kind;
    r->version = s->version;
    r->sport = s->sport;
    r->dport = s->dport;
    memcpy(r->src, s->src, 16);
    memcpy(r->dst, s->dst, 16);
}

/* Ends a session with its UDP_ENDED record; false (nothing done) when the
 * ring has no room for it. */
static bool sess_end(sw_tun *t, struct usess *s, uint32_t reason)
{
    if (!ring_room(t, 0))
        return false;
    sw_tun_record r;
    sess_fill(t, s, &r, SW_TUN_REC_UDP_ENDED);
    r.reason = reason;
    r.packets_in = s->packets_in;
    r.bytes_in = s->bytes_in;
    r.packets_out = s->packets_out;
    r.bytes_out = s->bytes_out;
    ring_put(t, &r, NULL);
    uint32_t *pp = &t->udp_hash[s->hash & t->udp_hmask];
    uint32_t me = (uint32_t)(s - t->sess + 1);
    while (*pp != me)
        pp = &t->sess[*pp - 1].hnext;
    *pp = s->hnext;
    ulist_unlink(t, s);
    s->live = false;
    s->next = t->ufree;
    t->ufree = s;
    t->st.udp_active--;
    t->st.udp_ended++;
    return true;
}

/* Closed sessions sit at the list's head (last_ms 0), then idle ones. */
static bool sess_expire(sw_tun *t, uint64_t now)
{
    bool any = false;
    struct usess *s;
    while ((s = t->uhead) && (s->end_reason || now - s->last_ms >= t->o.udp_idle_ms)) {
        if (!sess_end(t, s, s->end_reason ? s->end_reason : SW_TUN_END_IDLE))
            break;
        any = true;
    }
    return any;
}

/* ---------------------------------------------------------------------------
 * Classifying one packet (under the lock)
 */

enum verdict { V_DROP, V_WRITE, V_REPLACE };

/* One packet of a batch. */
struct pbuf {
    uint8_t *frame;           /* what one read fills: the vnet header (hl bytes,
                                 none without vnet_hdr), then the packet */
    uint8_t *data;            /* the packet, frame + hl: mtu + 1 bytes (with
                                 vnet_hdr VNET_PKT_MAX + 1): a longer read
                                 shows as too big */
    size_t len;               /* the packet's bytes as read */
    size_t wlen;              /* V_WRITE: the IP length (trailing bytes stay) */
    int verdict;
    uint8_t rst[SW_VNET_HDR_LEN + RST_MAX]; /* V_REPLACE: a zeroed header (with
                                 vnet_hdr), then the reset that answers it */
    size_t rst_len;           /* header included */
};

static bool not_unicast(const sw_pkt *pk)
{
    const uint8_t *d = pk->dst;
    if (pk->version == 4)
        return d[0] == 0 || d[0] == 127 || d[0] >= 224 || (d[0] == 169 && d[1] == 254);
    static const uint8_t zero[16];
    if (d[0] == 0xff || (d[0] == 0xfe && (d[1] & 0xc0) == 0x80))
        return true;
    if (!memcmp(d, zero, 15))
        return d[15] <= 1; /* :: and ::1 */
    return false;
}

static void count_parse_drop(sw_tun *t, int status)
{
    switch (status) {
    case SW_PKT_SHORT: t->st.drop_short++; break;
    case SW_PKT_BAD_VERSION: t->st.drop_bad_version++; break;
    case SW_PKT_BAD_HEADER: t->st.drop_bad_header++; break;
    case SW_PKT_BAD_CHECKSUM: t->st.drop_bad_checksum++; break;
    case SW_PKT_FRAGMENT: t->st.drop_fragment++; break;
    case SW_PKT_EXT_HEADER: t->st.drop_ext_header++; break;
    default: t->st.drop_bad_l4++; break;
    }
}

/* A TCP packet with no NAT entry: counted, and answered with a reset built
 * into `out` (V_REPLACE) unless no_rst or it is a reset itself. */
static int no_session(sw_tun *t, const sw_pkt *pk, struct pbuf *b)
{
    t->st.drop_no_session++;
    if (t->o.no_rst)
        return V_DROP;
    memset(b->rst, 0, t->hl);
    int n = sw_pkt_build_tcp_rst(b->rst + t->hl, RST_MAX, pk);
    if (n <= 0)
        return V_DROP;
    b->rst_len = t->hl + (size_t)n;
    t->st.tcp_resets_sent++;
    return V_REPLACE;
}

/* The NAT rewrite, as a partial sum when the checksum is one (NEEDS_CSUM). */
static void tcp_rewrite(uint8_t *p, sw_pkt *pk, bool partial, const uint8_t *src,
                        uint16_t sport, const uint8_t *dst, uint16_t dport)
{
    if (partial)
        sw_pkt_rewrite_partial(p, pk, src, sport, dst, dport);
    else
        sw_pkt_rewrite(p, pk, src, sport, dst, dport);
}

static int on_tcp(sw_tun *t, sw_pkt *pk, struct pbuf *buf, bool partial, uint64_t now)
{
    uint8_t *p = buf->data;
    bool v4 = pk->version == 4;
    const uint8_t *a = v4 ? t->o.addr4 : t->o.addr6, *b = v4 ? t->o.next4 : t->o.next6;
    uint16_t port = v4 ? t->o.port4 : t->o.port6;
    uint16_t dns_port = v4 ? t->o.dns_port4 : t->o.dns_port6;
    size_t alen = alen_of(pk->version);

    if ((pk->sport == port || (dns_port && pk->sport == dns_port)) &&
        !memcmp(pk->src, a, alen)) {
        /* A listener's side: back to (original destination -> client), for an
         * entry made for that listener only. */
        struct nat *n = t->by_port[pk->dport];
        if (!n || n->version != pk->version || n->lport != pk->sport ||
            memcmp(pk->dst, b, alen))
            return no_session(t, pk, buf);
        n->packets_in++;
        nat_track(t, n, pk->tcp_flags, false, now);
        tcp_rewrite(p, pk, partial, n->dst, n->dport, n->src, n->sport);
        return V_WRITE;
    }
    if (not_unicast(pk)) {
        t->st.drop_not_unicast++;
        return V_DROP;
    }
    uint32_t hash;
    struct nat *n = nat_find(t, pk->version, pk->src, pk->sport, pk->dst, pk->dport, &hash);
    bool syn = (pk->tcp_flags & (SW_TCP_SYN | SW_TCP_ACK | SW_TCP_RST)) == SW_TCP_SYN;
    if (n && syn && n->state == SW_TUN_TCP_CLOSED) {
        /* The client reuses a closed pair: a fresh NAT port, so the SYN does
         * not land on the old connection's TIME_WAIT. */
        nat_remove(t, n);
        t->st.tcp_replaced++;
        n = NULL;
    }
    if (!n) {
        if (!syn)
            return no_session(t, pk, buf);
        n = nat_create(t, pk, hash, dns_port && pk->dport == DNS_PORT ? dns_port : port, now);
        if (!n) {
            t->st.drop_nat_full++;
            return V_DROP;
        }
    }
    n->packets_out++;
    nat_track(t, n, pk->tcp_flags, true, now);
    tcp_rewrite(p, pk, partial, b, n->natport, a, n->lport);
    return V_WRITE;
}

static int on_udp(sw_tun *t, const uint8_t *p, sw_pkt *pk, bool partial, uint64_t now,
                  bool *announce)
{
    if (not_unicast(pk)) {
        t->st.drop_not_unicast++;
        return V_DROP;
    }
    /* A partial checksum is the sender's to finish: nothing to verify. */
    if (!partial && !sw_pkt_l4_csum_ok(p, pk)) {
        t->st.drop_udp_checksum++;
        return V_DROP;
    }
    uint32_t hash;
    struct usess *s = sess_find(t, pk, &hash);
    if (!ring_room(t, pk->payload_len)) {
        t->st.drop_udp_ring++;
        return V_DROP;
    }
    bool fresh = false;
    if (!s) {
        s = sess_create(t, pk, hash, now);
        if (!s) {
            t->st.drop_udp_full++;
            return V_DROP;
        }
        fresh = true;
    }
    uint8_t *copy = NULL;
    if (pk->payload_len) {
        copy = malloc(pk->payload_len);
        if (!copy) {
            t->st.drop_udp_ring++;
            return V_DROP; /* a fresh session stays, with no record yet: new_session
                              then goes with its next datagram */
        }
        memcpy(copy, p + pk->payload_off, pk->payload_len);
    }
    sw_tun_record r;
    sess_fill(t, s, &r, SW_TUN_REC_UDP);
    r.new_session = fresh || (s->packets_in == 0);
    r.payload_len = pk->payload_len;
    ring_put(t, &r, copy);
    s->packets_in++;
    s->bytes_in += pk->payload_len;
    sess_touch(t, s, now);
    t->st.udp_datagrams_in++;
    *announce = true;
    return V_DROP; /* handed over: nothing goes back to the TUN */
}

static int classify_one(sw_tun *t, struct pbuf *b, sw_pkt *pkp, uint64_t now, bool *announce)
{
    sw_pkt pk;
    uint8_t *p = b->data;
    sw_vnet_hdr vh = {0};
    if (t->hl) {
        memcpy(&vh, b->frame, sizeof vh);
        /* A packet that is not GSO is still held to the MTU. */
        if (vh.gso_type == SW_VNET_GSO_NONE && b->len > t->o.mtu) {
            t->st.drop_too_big++;
            return V_DROP;
        }
    }
    int st = sw_pkt_parse(p, b->len, &pk);
    if (st != SW_PKT_OK) {
        count_parse_drop(t, st);
        return V_DROP;
    }
    bool partial = false;
    if (t->hl) {
        if (sw_pkt_vnet_check(&vh, &pk) < 0) {
            t->st.drop_bad_vnet++;
            return V_DROP;
        }
        partial = vh.flags & SW_VNET_F_NEEDS_CSUM;
        t->st.csum_partial_in += partial;
        if (vh.gso_type != SW_VNET_GSO_NONE) {
            t->st.gso_packets_in++;
            t->st.gso_bytes_in += b->len;
        }
    }
    if ((pk.version == 4 && !t->o.has4) || (pk.version == 6 && !t->o.has6)) {
        t->st.drop_family++;
        return V_DROP;
    }
    switch (pk.proto) {
    case SW_PROTO_TCP:
        *pkp = pk;
        /* Written back with the header it came with: same lengths, same
         * offsets, the checksum still partial when it was. */
        return on_tcp(t, pkp, b, partial, now);
    case SW_PROTO_UDP:
        return on_udp(t, p, &pk, partial, now, announce);
    case SW_PROTO_ICMP:
    case SW_PROTO_ICMPV6:
        if (not_unicast(&pk)) {
            t->st.drop_not_unicast++;
            return V_DROP;
        }
        if (sw_pkt_echo_reply(p, &pk) == 0) {
            t->st.icmp_echo_replies++;
            memset(b->frame, 0, t->hl); /* a packet of the loop's own */
            *pkp = pk;
            return V_WRITE;
        }
        t->st.drop_unsupported++;
        return V_DROP;
    default:
        t->st.drop_unsupported++;
        return V_DROP;
    }
}

static void classify(sw_tun *t, struct pbuf *b, uint64_t now, bool *announce)
{
    sw_pkt pk = {0};
    b->verdict = classify_one(t, b, &pk, now, announce);
    b->wlen = pk.ip_len;
}

/* ---------------------------------------------------------------------------
 * The loop
 */

/* Writes one frame (with vnet_hdr: header and packet); counts the packet's
 * bytes without the header. */
static void write_out(sw_tun *t, const uint8_t *p, size_t len, uint64_t *pk, uint64_t *by,
                      uint64_t *err)
{
    for (;;) {
        ssize_t n = write(t->fd, p, len);
        if (n >= 0) {
            (*pk)++;
            *by += (size_t)n > t->hl ? (uint64_t)n - t->hl : 0;
            return;
        }
        if (errno != EINTR) {
            (*err)++;
            return;
        }
    }
}

static void *loop_main(void *arg)
{
    sw_tun *t = arg;
    uint32_t batch = t->o.batch;
    size_t hl = t->hl;
    /* The packet's room: one byte more than the largest accepted, so a
     * longer read shows (without vnet_hdr, longer than the MTU). */
    size_t pktmax = hl ? VNET_PKT_MAX : t->o.mtu;
    size_t bufsize = hl + pktmax + 1;
    struct pbuf *bufs = calloc(batch, sizeof *bufs);
    uint8_t *mem = malloc(bufsize * batch);
    if (!bufs || !mem) {
        free(bufs);
        free(mem);
        return NULL;
    }
    for (uint32_t i = 0; i < batch; i++) {
        bufs[i].frame = mem + bufsize * i;
        bufs[i].data = bufs[i].frame + hl;
    }

    while (!atomic_load(&t->stop)) {
        struct epoll_event evs[4];
        int ne = epoll_wait(t->epfd, evs, 4, TICK_MS);
        if (ne < 0 && errno != EINTR)
            break;
        bool readable = false;
        for (int i = 0; i < ne; i++)
            if (evs[i].data.fd == t->fd)
                readable = true;
        if (atomic_load(&t->stop))
            break;

        /* Keep reading while the device has packets: each round is one batch
         * under the lock, so timers and lookups still get their turn. */
        for (bool more = readable; more;) {
            uint32_t n = 0;
            uint64_t rerr = 0, rbytes = 0, big = 0, badv = 0;
            more = false;
            while (n < batch) {
                ssize_t r = read(t->fd, bufs[n].frame, bufsize);
                if (r < 0) {
                    if (errno == EINTR)
                        continue;
                    if (errno != EAGAIN)
                        rerr++;
                    break;
                }
                if ((size_t)r < hl) {
                    badv++;
                    continue;
                }
                if ((size_t)r - hl > pktmax) {
                    big++;
                    continue;
                }
                rbytes += (uint64_t)r - hl;
                bufs[n++].len = (size_t)r - hl;
            }
            if (n == batch)
                more = true;

            bool announce = false;
            uint64_t now = mono_ms();
            pthread_mutex_lock(&t->lock);
            t->st.packets_in += n + big + badv;
            t->st.bytes_in += rbytes;
            t->st.drop_too_big += big;
            t->st.drop_bad_vnet += badv;
            t->st.read_errors += rerr;
            for (uint32_t i = 0; i < n; i++)
                classify(t, &bufs[i], now, &announce);
            pthread_mutex_unlock(&t->lock);
            if (announce)
                ring_announce(t);

            uint64_t wpk = 0, wby = 0, werr = 0;
            for (uint32_t i = 0; i < n; i++) {
                if (bufs[i].verdict == V_WRITE)
                    write_out(t, bufs[i].frame, hl + bufs[i].wlen, &wpk, &wby, &werr);
                else if (bufs[i].verdict == V_REPLACE) {
                    write_out(t, bufs[i].rst, bufs[i].rst_len, &wpk, &wby, &werr);
                }
            }
            if (wpk || werr) {
                pthread_mutex_lock(&t->lock);
                t->st.packets_out += wpk;
                t->st.bytes_out += wby;
                t->st.write_errors += werr;
                pthread_mutex_unlock(&t->lock);
            }
        }

        uint64_t now = mono_ms();
        pthread_mutex_lock(&t->lock);
        nat_expire(t, now);
        bool ended = sess_expire(t, now);
        pthread_mutex_unlock(&t->lock);
        if (ended)
            ring_announce(t);
    }
    free(mem);
    free(bufs);
    return NULL;
}

/* ---------------------------------------------------------------------------
 * API
 */

int sw_tun_abi_version(void) { return SW_TUN_ABI_VERSION; }

static int check_opts(sw_tun_opts *o)
{
    if (o->fd < 0 || (!o->has4 && !o->has6))
        return -EINVAL;
    if (!o->mtu)
        o->mtu = DEFAULT_MTU;
    if (o->mtu > 65535 || o->mtu < (o->has6 ? 1280u : 576u))
        return -EINVAL;
    if (!o->max_tcp)
        o->max_tcp = DEFAULT_MAX_TCP;
    if (o->max_tcp > MAX_TCP_LIMIT)
        return -EINVAL;
    if (!o->max_udp)
        o->max_udp = DEFAULT_MAX_UDP;
    if (o->max_udp > (1u << 24))
        return -EINVAL;
    if (!o->syn_timeout_ms)
        o->syn_timeout_ms = 30000;
    if (!o->tcp_idle_ms)
        o->tcp_idle_ms = 7200000;
    if (!o->tcp_closed_ms)
        o->tcp_closed_ms = 10000;
    if (!o->udp_idle_ms)
        o->udp_idle_ms = 60000;
    o->ring_records = pow2_at_least(o->ring_records ? o->ring_records : DEFAULT_RING);
    if (o->ring_records < 2)
        o->ring_records = 2;
    if (!o->ring_bytes)
        o->ring_bytes = DEFAULT_RING_BYTES;
    if (!o->batch)
        o->batch = DEFAULT_BATCH;
    if (o->batch > MAX_BATCH)
        return -EINVAL;
    if (o->vnet_hdr > 1)
        return -EINVAL;
    if (o->has4 && (!memcmp(o->addr4, o->next4, 4) || !o->port4))
        return -EINVAL;
    if (o->has6 && (!memcmp(o->addr6, o->next6, 16) || !o->port6))
        return -EINVAL;
    if ((o->has4 && o->dns_port4 == o->port4) || (o->has6 && o->dns_port6 == o->port6))
        return -EINVAL;
    return 0;
}

int sw_tun_new(const sw_tun_opts *opts, sw_tun **out)
{
    sw_tun_opts o = *opts;
    int rc = check_opts(&o);
    if (rc)
        return rc;
    int fl = fcntl(o.fd, F_GETFL);
    if (fl < 0)
        return -EBADF;
    if (!(fl & O_NONBLOCK) && fcntl(o.fd, F_SETFL, fl | O_NONBLOCK) < 0)
        return -errno;

    sw_tun *t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->o = o;
    t->fd = o.fd;
    t->hl = o.vnet_hdr ? SW_VNET_HDR_LEN : 0;
    t->epfd = t->stopfd = t->efd = -1;
    pthread_mutex_init(&t->lock, NULL);
    pthread_mutex_init(&t->drain_lock, NULL);
    if (getrandom(&t->seed, sizeof t->seed, GRND_NONBLOCK) != sizeof t->seed)
        t->seed = (uint32_t)sw_real_ms() ^ (uint32_t)(uintptr_t)t;
    t->next_port = NAT_PORT_MIN;
    t->timeouts[L_SYN] = o.syn_timeout_ms;
    t->timeouts[L_OPEN] = o.tcp_idle_ms;
    t->timeouts[L_CLOSED] = o.tcp_closed_ms;
    uint32_t tb = pow2_at_least(o.max_tcp * 2);
    uint32_t ub = pow2_at_least(o.max_udp * 2);
    t->tcp_hash = calloc(tb, sizeof *t->tcp_hash);
    t->tcp_hmask = tb - 1;
    t->udp_hash = calloc(ub, sizeof *t->udp_hash);
    t->udp_hmask = ub - 1;
    t->sess = calloc(o.max_udp, sizeof *t->sess);
    t->ring = calloc(o.ring_records, sizeof *t->ring);
    t->rmask = o.ring_records - 1;
    rc = -ENOMEM;
    if (!t->tcp_hash || !t->udp_hash || !t->sess || !t->ring)
        goto fail;
    for (uint32_t i = o.max_udp; i-- > 0;) {
        t->sess[i].next = t->ufree;
        t->ufree = &t->sess[i];
    }
    t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t->stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (t->efd < 0 || t->stopfd < 0 || t->epfd < 0) {
        rc = -errno;
        goto fail;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = t->fd};
    if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->fd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    ev.data.fd = t->stopfd;
    if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->stopfd, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    rc = loop_thread_start(&t->thread, loop_main, t, "sw-tun", 0);
    if (rc)
        goto fail;
    t->started = true;
    *out = t;
    return 0;
fail:
    sw_tun_free(t);
    return rc;
}

int sw_tun_shutdown(sw_tun *t)
{
    if (t->started) {
        atomic_store(&t->stop, 1);
        efd_signal(t->stopfd);
        pthread_join(t->thread, NULL);
        t->started = false;
    }
    pthread_mutex_lock(&t->lock);
    if (!t->shut) {
        t->shut = true;
        /* Every live session gets its ENDED record while the ring has room;
         * with the loop gone nothing else would make room, so the rest end
         * without one (still counted in udp_ended). */
        while (t->uhead) {
            struct usess *s = t->uhead;
            if (!sess_end(t, s, SW_TUN_END_SHUTDOWN)) {
                ulist_unlink(t, s);
                s->live = false;
                t->st.udp_active--;
                t->st.udp_ended++;
            }
        }
        for (uint32_t p = 0; p < 65536; p++)
            if (t->by_port[p])
                nat_remove(t, t->by_port[p]);
    }
    pthread_mutex_unlock(&t->lock);
    ring_announce(t);
    return 0;
}

void sw_tun_free(sw_tun *t)
{
    if (!t)
        return;
    if (t->tcp_hash && t->udp_hash && t->sess && t->ring)
        sw_tun_shutdown(t);
    if (t->ring) {
        for (uint32_t i = atomic_load(&t->tail); i != atomic_load(&t->head); i++)
            free(t->ring[i & t->rmask].payload);
    }
    if (t->epfd >= 0)
        close(t->epfd);
    if (t->stopfd >= 0)
        close(t->stopfd);
    if (t->efd >= 0)
        close(t->efd);
    free(t->tcp_hash);
    free(t->udp_hash);
    free(t->sess);
    free(t->ring);
    pthread_mutex_destroy(&t->lock);
    pthread_mutex_destroy(&t->drain_lock);
    free(t);
}

int sw_tun_nat_lookup(sw_tun *t, uint8_t version, uint16_t natport, sw_tun_flow *out)
{
    int rc = -ENOENT;
    pthread_mutex_lock(&t->lock);
    struct nat *n = t->by_port[natport];
    if (n && n->version == version) {
        memset(out, 0, sizeof *out);
        out->version = n->version;
        out->state = n->state;
        out->sport = n->sport;
        out->dport = n->dport;
        out->natport = n->natport;
        memcpy(out->src, n->src, 16);
        memcpy(out->dst, n->dst, 16);
        out->created_unix_ms = n->created_unix_ms;
        out->packets_out = n->packets_out;
        out->packets_in = n->packets_in;
        rc = 0;
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int sw_tun_peer_lookup(sw_tun *t, uint8_t version, const uint8_t *peer_ip, uint16_t peer_port,
                       sw_tun_flow *out)
{
    if (version == 4 ? !t->o.has4 || memcmp(peer_ip, t->o.next4, 4)
                     : version != 6 || !t->o.has6 || memcmp(peer_ip, t->o.next6, 16))
        return -ENOENT;
    return sw_tun_nat_lookup(t, version, peer_port, out);
}

int sw_tun_fd(sw_tun *t) { return t->efd; }

int sw_tun_drain(sw_tun *t, sw_tun_record *out, size_t max, uint8_t *payload, size_t cap,
                 size_t *payload_used)
{
    size_t n = 0, used = 0;
    pthread_mutex_lock(&t->drain_lock);
    /* Clear the flag first: a record put after this is announced again. */
    atomic_store(&t->signalled, 0);
    efd_clear(t->efd);
    uint32_t tail = sw_ring_tail(&t->tail);
    uint32_t head = sw_ring_ready(&t->head);
    while (n < max && tail != head) {
        struct slot *s = &t->ring[tail & t->rmask];
        uint32_t plen = s->rec.payload_len;
        if (s->payload && used + plen > cap)
            break;
        out[n] = s->rec;
        if (s->payload) {
            memcpy(payload + used, s->payload, plen);
            out[n].payload_off = (uint32_t)used;
            used += plen;
            free(s->payload);
            s->payload = NULL;
            atomic_fetch_sub_explicit(&t->ring_bytes, plen, memory_order_relaxed);
        } else {
            out[n].payload_off = (uint32_t)used;
        }
        n++;
        tail++;
    }
    sw_ring_release(&t->tail, tail);
    if (tail != atomic_load(&t->head))
        ring_announce(t);
    pthread_mutex_unlock(&t->drain_lock);
    if (payload_used)
        *payload_used = used;
    return (int)n;
}

/* Builds and writes one UDP packet (behind a zeroed header with vnet_hdr);
 * counts it.  Called with the lock held (the session's counters), which the
 * write is short enough to keep. */
static int udp_write(sw_tun *t, uint8_t version, const uint8_t *src, uint16_t sport,
                     const uint8_t *dst, uint16_t dport, const uint8_t *payload, size_t len)
{
    size_t need = (version == 4 ? 20 : 40) + 8 + len;
    if (need > t->o.mtu)
        return -EMSGSIZE;
    uint8_t stackbuf[2048];
    size_t hl = t->hl;
    uint8_t *buf = hl + need <= sizeof stackbuf ? stackbuf : malloc(hl + need);
    if (!buf)
        return -ENOMEM;
    memset(buf, 0, hl);
    int n = sw_pkt_build_udp(buf + hl, need, version, src, sport, dst, dport, payload, len);
    if (n > 0) {
        ssize_t w;
        do
            w = write(t->fd, buf, hl + (size_t)n);
        while (w < 0 && errno == EINTR);
        if (w < 0) {
            n = -errno;
            t->st.write_errors++;
        } else {
            t->st.packets_out++;
            t->st.bytes_out += (size_t)w > hl ? (uint64_t)w - hl : 0;
            t->st.udp_datagrams_out++;
        }
    }
    if (buf != stackbuf)
        free(buf);
    return n;
}

int sw_tun_udp_send(sw_tun *t, uint64_t session, const uint8_t *src, uint16_t sport,
                    const uint8_t *payload, size_t len)
{
    pthread_mutex_lock(&t->lock);
    int rc = -ESHUTDOWN;
    if (t->shut)
        goto out;
    struct usess *s = sess_by_id(t, session);
    rc = -ENOENT;
    if (!s)
        goto out;
    rc = udp_write(t, s->version, src ? src : s->dst, src ? sport : s->dport, s->src, s->sport,
                   payload, len);
    if (rc > 0) {
        s->packets_out++;
        s->bytes_out += len;
        /* A reply keeps the session alive as a datagram from the client does. */
        sess_touch(t, s, mono_ms());
    }
out:
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int sw_tun_udp_close(sw_tun *t, uint64_t session)
{
    pthread_mutex_lock(&t->lock);
    int rc = -ESHUTDOWN;
    if (!t->shut) {
        struct usess *s = sess_by_id(t, session);
        rc = -ENOENT;
        if (s && !s->end_reason) {
            s->end_reason = SW_TUN_END_CLOSED;
            s->last_ms = 0;
            ulist_unlink(t, s);
            ulist_prepend(t, s);
            rc = 0;
        }
    }
    bool ended = rc == 0 && sess_expire(t, mono_ms());
    pthread_mutex_unlock(&t->lock);
    if (ended)
        ring_announce(t);
    return rc;
}

int sw_tun_inject_udp(sw_tun *t, uint8_t version, const uint8_t *src, uint16_t sport,
                      const uint8_t *dst, uint16_t dport, const uint8_t *payload, size_t len)
{
    if (version != 4 && version != 6)
        return -EINVAL;
    pthread_mutex_lock(&t->lock);
    int rc = t->shut ? -ESHUTDOWN : udp_write(t, version, src, sport, dst, dport, payload, len);
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int sw_tun_stats_get(sw_tun *t, sw_tun_stats *out)
{
    pthread_mutex_lock(&t->lock);
    *out = t->st;
    pthread_mutex_unlock(&t->lock);
    return 0;
}
