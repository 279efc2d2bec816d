/*
 * What route.c (the tables) and route_set.c (the shared sets) share: growable
 * vectors, the reversed host hash, the keyword automaton, the per-flow view
 * and the set evaluator.  Not part of the cdef.
 */
#ifndef SW_ROUTE_INT_H
#define SW_ROUTE_INT_H

#include "route.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef unsigned __int128 u128;

/* The network mask of a /plen in family 4 or 6 (route.c and route_set.c). */
static inline u128 net_mask(int family, unsigned plen)
{
    if (plen == 0)
        return 0;
    if (family == 4)
        return (u128)((0xffffffffu << (32 - plen)) & 0xffffffffu);
    return ~(u128)0 << (128 - plen);
}

enum { TV_FALSE, TV_TRUE, TV_UNKNOWN };

#define NONE32 UINT32_MAX

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

struct slice {
    uint32_t off, n;
};

struct vec {
    void *p;
    size_t n, cap;
};

#define VEC_AT(v, type, i) (((type *)(v).p)[i])

void *sw_vec_push(struct vec *v, size_t size);
/* Room for `more` further items of `size` (one allocation), or -ENOMEM. */
int sw_vec_reserve(struct vec *v, size_t size, size_t more);
void sw_vec_free(struct vec *v);

static inline unsigned char sw_lower(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + ('a' - 'A')) : c;
}

static inline uint64_t sw_hmix(uint64_t h, unsigned char c)
{
    return (h ^ c) * FNV_PRIME;
}

/* Right to left, so that the dot-suffixes of a host hash incrementally. */
static inline uint64_t sw_hash_rev(const char *s, uint32_t n)
{
    uint64_t h = FNV_OFFSET;
    for (uint32_t i = n; i-- > 0;)
        h = sw_hmix(h, sw_lower((unsigned char)s[i]));
    return h;
}

static inline uint32_t sw_slot_of(uint64_t h, uint32_t mask)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (uint32_t)h & mask;
}

/* ---- keyword automaton (Aho-Corasick) ------------------------------------ */

struct acnode {
    uint32_t edge_off, nedge;
    uint32_t fail;
    uint32_t dict; /* nearest node on the failure chain with a keyword */
    uint32_t kw;   /* id of the keyword ending here, NONE32 if none */
};

struct acm {
    struct vec nodes; /* struct acnode; node 0 is the root */
    struct vec edge_byte, edge_to;
};

struct acword {
    const char *s; /* lowercased */
    uint32_t len;
    uint32_t id;
};

/* Builds the automaton over `n` words sorted by bytes and distinct (an empty
 * word makes the root a keyword node).  0 or -ENOMEM (then sw_acm_free). */
int sw_acm_build(struct acm *a, const struct acword *w, uint32_t n);
void sw_acm_free(struct acm *a);
uint32_t sw_acm_goto(const struct acm *a, uint32_t node, unsigned char c);

/* ---- the flow, as routing._view derives it -------------------------------- */

struct view {
    const char *host[2]; /* known domain names, as given (compared lowercased) */
    uint32_t len[2];     /* trailing dot dropped */
    const struct dentry *whole[2]; /* the table entry equal to the host, if any */
    int nhosts;
    bool dom_unknown;    /* a host whose domain conditions only Python knows */
    bool name_target;    /* the target is a domain name without a resolved address */
    bool dst_resolved;   /* dst is a domain target's resolved address */
    bool src_local;      /* a process condition is unknown (else false) */
    int dst;             /* 0 none, 4, 6, -1 unknown */
    u128 dst_ip;
    int src;             /* 0 none, 4, 6 */
    u128 src_ip;
    uint16_t port, sport;
    uint8_t netmask;
    uint32_t inbound, principal;
    /* Set results of this decide, [variant][table set id] for the first
     * sets: 0 not yet known, else the three-valued result + 1. */
    uint8_t *memo;
};

/* What a set holds (sw_set_kinds), for the tables' summaries. */
enum {
    SK_NAMES = 1u << 0,   /* exact, suffix, subdomain, wildcard items */
    SK_KEYWORD = 1u << 1,
    SK_NET_DST = 1u << 2,
    SK_NET_SRC = 1u << 3,
    SK_PORT_DST = 1u << 4,
    SK_PORT_SRC = 1u << 5,
    SK_NETWORK = 1u << 6,
    SK_REGEX = 1u << 7,   /* SW_SET_F_DOMAIN_OPAQUE */
    SK_OPAQUE = 1u << 8,  /* SW_SET_F_OPAQUE */
    SK_PROCESS = 1u << 9, /* SW_SET_F_PROCESS */
    SK_DOMAIN = SK_NAMES | SK_KEYWORD | SK_REGEX,
};

uint32_t sw_set_kinds(const sw_set *s);
/* The set against a flow, three-valued.  `dst` / `dst_ip` is the address the
 * set's ip_cidr items are tested against (the target's, the source's for a
 * condition with SW_SETCOND_SOURCE, 0 for none, -1 unknown). */
int sw_set_eval(const sw_set *s, const struct view *v, int dst, u128 dst_ip);
/* One more reference (a table holds one per set it names). */
void sw_set_ref(sw_set *s);
bool sw_set_sealed(const sw_set *s);

#endif /* SW_ROUTE_INT_H */
