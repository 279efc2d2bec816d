/*
 * spliceway shared sets: the rule sets, GEOIP countries and GEOSITE lists a
 * route table's rules name (route.h, "shared sets"), plus the helpers
 * route.c shares with them (vectors, the keyword automaton).
 *
 * Names
 *   One open-addressing hash table (linear probing, load <= 0.7) of the
 *   distinct names.  A slot is 8 bytes: the name's offset in one arena of
 *   NUL-terminated strings and 32 bits of its hash; the byte before each
 *   string says how it matches (exact, suffix, subdomain, or "*." + it: a
 *   one-label wildcard).  Hashes are taken right to left (route_int.h), so a
 *   host's dot-suffixes hash in one pass and each is one probe: O(host
 *   length) per lookup, whatever the set's size.  About 20 bytes of slots
 *   plus the string and 2 bytes per name: 100,000 names of 20 characters
 *   cost about 4.5 MB.
 *   Other wildcard patterns ("a.*.com") are compared label by label, one by
 *   one (rare in practice).
 * Keywords
 *   An Aho-Corasick automaton over the distinct keywords: one pass over the
 *   host finds whether any is in it.
 * Networks, ports
 *   Per field (ip_cidr / source_ip_cidr) and family, merged sorted intervals
 *   (IPv4 as 32-bit pairs), bisected; ports likewise.
 *
 * A set is built by one thread and sealed; from then on it is only read, by
 * any number of threads, and freed by whichever drops the last reference.
 */
#define _GNU_SOURCE
#include "route_int.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- vectors -------------------------------------------------------------- */

void *sw_vec_push(struct vec *v, size_t size)
{
    if (v->n == v->cap) {
        size_t ncap = v->cap ? v->cap * 2 : 16;
        void *np = realloc(v->p, ncap * size);
        if (!np)
            return NULL;
        v->p = np;
        v->cap = ncap;
    }
    return (char *)v->p + v->n++ * size;
}

int sw_vec_reserve(struct vec *v, size_t size, size_t more)
{
    if (more > SIZE_MAX / size - v->n)
        return -ENOMEM;
    if (v->n + more <= v->cap)
        return 0;
    size_t ncap = v->n + more;
    void *np = realloc(v->p, ncap * size);
    if (!np)
        return -ENOMEM;
    v->p = np;
    v->cap = ncap;
    return 0;
}

void sw_vec_free(struct vec *v)
{
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

static int push_u32(struct vec *v, uint32_t x)
{
    uint32_t *p = sw_vec_push(v, sizeof *p);
    if (!p)
        return -ENOMEM;
    *p = x;
    return 0;
}

/* ---- keyword automaton ----------------------------------------------------- */

uint32_t sw_acm_goto(const struct acm *a, uint32_t node, unsigned char c)
{
    const struct acnode *n = &VEC_AT(a->nodes, struct acnode, node);
    const uint8_t *bytes = a->edge_byte.p;
    uint32_t lo = n->edge_off, hi = n->edge_off + n->nedge;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (bytes[mid] < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < n->edge_off + n->nedge && bytes[lo] == c)
        return VEC_AT(a->edge_to, uint32_t, lo);
    return NONE32;
}

void sw_acm_free(struct acm *a)
{
    sw_vec_free(&a->nodes);
    sw_vec_free(&a->edge_byte);
    sw_vec_free(&a->edge_to);
}

/* The words are sorted, so the children of every trie node are created in
 * increasing byte order and a prefix shared with the previous word is always
 * its node's last child. */
int sw_acm_build(struct acm *a, const struct acword *w, uint32_t n)
{
    struct tnode {
        uint32_t first, last, next; /* children and sibling, NONE32 = none */
        uint8_t byte;
    };
    struct vec tn = {0}, queue = {0};
    int rc = -ENOMEM;
    struct tnode *root = sw_vec_push(&tn, sizeof *root);
    struct acnode *aroot = sw_vec_push(&a->nodes, sizeof *aroot);
    if (!root || !aroot)
        goto out;
    *root = (struct tnode){NONE32, NONE32, NONE32, 0};
    *aroot = (struct acnode){.fail = 0, .dict = NONE32, .kw = NONE32};
    for (uint32_t k = 0; k < n; k++) {
        uint32_t node = 0;
        for (uint32_t i = 0; i < w[k].len; i++) {
            uint8_t c = (uint8_t)w[k].s[i];
            uint32_t last = VEC_AT(tn, struct tnode, node).last;
            if (last != NONE32 && VEC_AT(tn, struct tnode, last).byte == c) {
                node = last;
                continue;
            }
            uint32_t id = (uint32_t)tn.n;
            struct tnode *t = sw_vec_push(&tn, sizeof *t);
            struct acnode *an = sw_vec_push(&a->nodes, sizeof *an);
            if (!t || !an)
                goto out;
            *t = (struct tnode){NONE32, NONE32, NONE32, c};
            *an = (struct acnode){.dict = NONE32, .kw = NONE32};
            struct tnode *p = &VEC_AT(tn, struct tnode, node);
            if (p->last == NONE32)
                p->first = id;
            else
                VEC_AT(tn, struct tnode, p->last).next = id;
            p->last = id;
            node = id;
        }
        VEC_AT(a->nodes, struct acnode, node).kw = w[k].id;
    }
    /* Flatten the children into sorted edge arrays. */
    for (uint32_t u = 0; u < tn.n; u++) {
        struct acnode *an = &VEC_AT(a->nodes, struct acnode, u);
        an->edge_off = (uint32_t)a->edge_to.n;
        for (uint32_t c = VEC_AT(tn, struct tnode, u).first; c != NONE32;
             c = VEC_AT(tn, struct tnode, c).next) {
            uint8_t *b = sw_vec_push(&a->edge_byte, 1);
            if (!b || push_u32(&a->edge_to, c))
                goto out;
            *b = VEC_AT(tn, struct tnode, c).byte;
            an->nedge++;
        }
    }
    /* Failure and dictionary links, breadth first. */
    if (push_u32(&queue, 0))
        goto out;
    for (size_t qi = 0; qi < queue.n; qi++) {
        uint32_t u = VEC_AT(queue, uint32_t, qi);
        const struct acnode au = VEC_AT(a->nodes, struct acnode, u);
        for (uint32_t e = au.edge_off; e < au.edge_off + au.nedge; e++) {
            uint32_t v = VEC_AT(a->edge_to, uint32_t, e);
            uint8_t c = VEC_AT(a->edge_byte, uint8_t, e);
            uint32_t f = 0;
            if (u != 0) {
                uint32_t g = au.fail;
                for (;;) {
                    uint32_t nx = sw_acm_goto(a, g, c);
                    if (nx != NONE32) {
                        f = nx;
                        break;
                    }
                    if (g == 0)
                        break;
                    g = VEC_AT(a->nodes, struct acnode, g).fail;
                }
            }
            struct acnode *av = &VEC_AT(a->nodes, struct acnode, v);
            const struct acnode *af = &VEC_AT(a->nodes, struct acnode, f);
            av->fail = f;
            av->dict = af->kw != NONE32 ? f : af->dict;
            if (push_u32(&queue, v))
                goto out;
        }
    }
    rc = 0;
out:
    sw_vec_free(&tn);
    sw_vec_free(&queue);
    return rc;
}

/* Whether any word of `a` occurs in s[0..n) (lowercased). */
static bool acm_any(const struct acm *a, const char *s, uint32_t n)
{
    const struct acnode *nodes = a->nodes.p;
    if (nodes[0].kw != NONE32)
        return true; /* the empty word */
    uint32_t node = 0;
    for (uint32_t i = 0; i < n; i++) {
        unsigned char c = sw_lower((unsigned char)s[i]);
        uint32_t nx;
        for (;;) {
            nx = sw_acm_goto(a, node, c);
            if (nx != NONE32 || node == 0)
                break;
            node = nodes[node].fail;
        }
        node = nx != NONE32 ? nx : 0;
        if (nodes[node].kw != NONE32 || nodes[node].dict != NONE32)
            return true;
    }
    return false;
}

/* ---- the set ---------------------------------------------------------------- */

/* How a name matches: the byte before its string in the arena. */
enum { N_EXACT = 1, N_SUFFIX = 2, N_SUB = 4, N_WILD1 = 8 };

struct nslot {
    uint32_t off; /* of the string in the arena; 0 = empty (offset 0 is a kind byte) */
    uint32_t tag; /* the hash's high half */
};

struct ival4 {
    uint32_t lo, hi;
};

struct ival6 {
    u128 lo, hi;
};

struct prange {
    uint16_t lo, hi;
};

struct bnet {
    u128 lo, hi;
};

struct sw_set {
    atomic_uint refs;
    bool sealed;
    uint32_t flags; /* enum sw_set_flag */
    uint32_t kinds; /* SK_* */
    struct vec arena;    /* char: [kind byte][string][NUL] per name, keyword, pattern */
    struct nslot *slots;
    uint32_t mask;       /* slots - 1, 0 while there are none */
    uint32_t used;
    struct vec kw;       /* uint32_t arena offsets of keywords (sorted, distinct once sealed) */
    struct vec wild;     /* uint32_t arena offsets of general wildcard patterns */
    struct acm ac;
    struct vec bnets[2][2]; /* struct bnet per [field][family 4: 0, 6: 1], while building */
    struct ival4 *v4[2];    /* per field, sorted and merged once sealed */
    struct ival6 *v6[2];
    uint32_t n4[2], n6[2];
    struct vec ports[2]; /* struct prange, merged once sealed */
    uint8_t netmask;     /* bit 1 << network */
};

int sw_set_new(sw_set **out)
{
    if (!out)
        return -EINVAL;
    sw_set *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    atomic_init(&s->refs, 1);
    /* Offset 0 is never a string: an empty slot holds 0. */
    char *z = sw_vec_push(&s->arena, 1);
    if (!z) {
        free(s);
        return -ENOMEM;
    }
    *z = 0;
    *out = s;
    return 0;
}

void sw_set_ref(sw_set *s)
{
    atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
}

void sw_set_free(sw_set *s)
{
    if (!s || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
        return;
    sw_vec_free(&s->arena);
    free(s->slots);
    sw_vec_free(&s->kw);
    sw_vec_free(&s->wild);
    sw_acm_free(&s->ac);
    for (int f = 0; f < 2; f++) {
        sw_vec_free(&s->bnets[f][0]);
        sw_vec_free(&s->bnets[f][1]);
        free(s->v4[f]);
        free(s->v6[f]);
        sw_vec_free(&s->ports[f]);
    }
    free(s);
}

bool sw_set_sealed(const sw_set *s)
{
    return s->sealed;
}

uint32_t sw_set_kinds(const sw_set *s)
{
    return s->kinds;
}

static const char *arena_at(const sw_set *s, uint32_t off)
{
    return (const char *)s->arena.p + off;
}

/* Does host h[0..n) (any case) equal the arena string at off? */
static bool name_eq(const sw_set *s, uint32_t off, const char *h, uint32_t n)
{
    const unsigned char *a = (const unsigned char *)arena_at(s, off);
    uint32_t k = 0;
    /* A stored string has no NUL: a host byte 0 never matches its end. */
    while (k < n && a[k] && sw_lower((unsigned char)h[k]) == a[k])
        k++;
    return k == n && a[n] == 0;
}

/* The name's slot, or NULL. */
static const struct nslot *name_find(const sw_set *s, const char *h, uint32_t n, uint64_t hash)
{
    if (!s->slots)
        return NULL;
    uint32_t tag = (uint32_t)(hash >> 32);
    for (uint32_t i = sw_slot_of(hash, s->mask);; i = (i + 1) & s->mask) {
        const struct nslot *sl = &s->slots[i];
        if (!sl->off)
            return NULL;
        if (sl->tag == tag && name_eq(s, sl->off, h, n))
            return sl;
    }
}

static uint8_t name_kinds(const sw_set *s, const struct nslot *sl)
{
    return (uint8_t)arena_at(s, sl->off)[-1];
}

static int slots_grow(sw_set *s, uint32_t want)
{
    uint64_t cap = 16;
    while (cap * 7 < (uint64_t)want * 10)
        cap *= 2;
    if (cap > (1ull << 31))
        return -ENOMEM;
    if (s->slots && cap <= (uint64_t)s->mask + 1)
        return 0;
    struct nslot *ns = calloc((size_t)cap, sizeof *ns);
    if (!ns)
        return -ENOMEM;
    uint32_t mask = (uint32_t)cap - 1;
    if (s->slots) {
        for (uint32_t i = 0; i <= s->mask; i++) {
            const struct nslot *sl = &s->slots[i];
            if (!sl->off)
                continue;
            const char *str = arena_at(s, sl->off);
            uint64_t h = sw_hash_rev(str, (uint32_t)strlen(str));
            uint32_t j = sw_slot_of(h, mask);
            while (ns[j].off)
                j = (j + 1) & mask;
            ns[j] = *sl;
        }
        free(s->slots);
    }
    s->slots = ns;
    s->mask = mask;
    return 0;
}

/* Appends [kind][lowercased str][NUL] to the arena; the string's offset. */
static int arena_add(sw_set *s, uint8_t kind, const char *str, uint32_t n, uint32_t *off)
{
    if (s->arena.n + n + 2 > UINT32_MAX)
        return -ENOMEM;
    if (sw_vec_reserve(&s->arena, 1, (size_t)n + 2))
        return -ENOMEM;
    char *a = (char *)s->arena.p + s->arena.n;
    a[0] = (char)kind;
    for (uint32_t i = 0; i < n; i++)
        a[1 + i] = (char)sw_lower((unsigned char)str[i]);
    a[1 + n] = 0;
    *off = (uint32_t)s->arena.n + 1;
    s->arena.n += (size_t)n + 2;
    return 0;
}

static int name_add(sw_set *s, const char *str, uint32_t n, uint8_t kind)
{
    uint64_t h = sw_hash_rev(str, n);
    struct nslot *sl = (struct nslot *)name_find(s, str, n, h);
    if (sl) {
        ((char *)s->arena.p)[sl->off - 1] |= (char)kind;
        return 0;
    }
    int rc = slots_grow(s, s->used + 1);
    uint32_t off;
    if (rc || (rc = arena_add(s, kind, str, n, &off)))
        return rc;
    uint32_t i = sw_slot_of(h, s->mask);
    while (s->slots[i].off)
        i = (i + 1) & s->mask;
    s->slots[i] = (struct nslot){.off = off, .tag = (uint32_t)(h >> 32)};
    s->used++;
    return 0;
}

/* A pattern whose only '*' is its whole first label: "*." + rest (no
 * leading "."). */
static bool wild1(const char *p, uint32_t n)
{
    return n >= 2 && p[0] == '*' && p[1] == '.' && !memchr(p + 2, '*', n - 2);
}

static int item_add(sw_set *s, int kind, const char *str, uint32_t n)
{
    uint32_t off;
    int rc;
    switch (kind) {
    case SW_SET_EXACT:
        return name_add(s, str, n, N_EXACT);
    case SW_SET_SUFFIX:
        return name_add(s, str, n, N_SUFFIX);
    case SW_SET_SUBDOMAIN:
        return name_add(s, str, n, N_SUB);
    case SW_SET_WILDCARD:
        if (!memchr(str, '*', n))
            return name_add(s, str, n, N_EXACT);
        if (wild1(str, n))
            return name_add(s, str + 2, n - 2, N_WILD1);
        if ((rc = arena_add(s, 0, str, n, &off)))
            return rc;
        return push_u32(&s->wild, off);
    default: /* SW_SET_KEYWORD */
        if ((rc = arena_add(s, 0, str, n, &off)))
            return rc;
        return push_u32(&s->kw, off);
    }
}

int sw_set_domains(sw_set *s, int kind, const char *buf, size_t len)
{
    if (!s || s->sealed || (len && !buf) || kind < SW_SET_EXACT || kind > SW_SET_KEYWORD)
        return -EINVAL;
    if (len && buf[len - 1] != '\0')
        return -EINVAL;
    /* One growth of the slots and the arena for the whole batch. */
    size_t count = 0;
    for (const char *p = buf, *end = buf + len; p < end; p++) {
        p = memchr(p, '\0', (size_t)(end - p));
        count++;
    }
    if (count > UINT32_MAX - s->used || len > UINT32_MAX)
        return -ENOMEM;
    int rc = 0;
    if (kind <= SW_SET_WILDCARD)
        rc = slots_grow(s, s->used + (uint32_t)count);
    if (!rc)
        rc = sw_vec_reserve(&s->arena, 1, len + count);
    for (size_t i = 0; i < len && !rc;) {
        size_t n = strlen(buf + i);
        rc = item_add(s, kind, buf + i, (uint32_t)n);
        i += n + 1;
    }
    if (!rc && count)
        s->kinds |= kind == SW_SET_KEYWORD ? SK_KEYWORD : SK_NAMES;
    return rc;
}

static int net_add(sw_set *s, int field, int family, u128 a, unsigned plen)
{
    struct bnet *b = sw_vec_push(&s->bnets[field][family == 6], sizeof *b);
    if (!b)
        return -ENOMEM;
    u128 all = family == 4 ? (u128)0xffffffffu : ~(u128)0;
    b->lo = a & net_mask(family, plen);
    b->hi = b->lo | (all & ~net_mask(family, plen));
    return 0;
}

int sw_set_cidrs(sw_set *s, int field, int family, const uint8_t *addrs, const uint8_t *prefixes,
                 size_t n)
{
    if (!s || s->sealed || (field != SW_COND_DST && field != SW_COND_SRC) ||
        (n && (!addrs || !prefixes)))
        return -EINVAL;
    int bytes = family == 4 ? 4 : family == 6 ? 16 : 0;
    if (!bytes)
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (prefixes[i] > bytes * 8)
            return -EINVAL;
    if (sw_vec_reserve(&s->bnets[field][family == 6], sizeof(struct bnet), n))
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        u128 a = 0;
        for (int k = 0; k < bytes; k++)
            a = (a << 8) | addrs[i * (size_t)bytes + (size_t)k];
        int rc = net_add(s, field, family, a, prefixes[i]);
        /* routing._IpSet: ::ffff:a.b.c.d/m (m >= 96) also covers a.b.c.d/(m-96). */
        if (!rc && family == 6 && prefixes[i] >= 96 && (a >> 32) == 0xffff)
            rc = net_add(s, field, 4, a & 0xffffffffu, prefixes[i] - 96u);
        if (rc)
            return rc;
    }
    if (n)
        s->kinds |= field == SW_COND_DST ? SK_NET_DST : SK_NET_SRC;
    return 0;
}

int sw_set_port(sw_set *s, int field, uint16_t lo, uint16_t hi)
{
    if (!s || s->sealed || (field != SW_COND_DST && field != SW_COND_SRC) || lo > hi)
        return -EINVAL;
    struct prange *p = sw_vec_push(&s->ports[field], sizeof *p);
    if (!p)
        return -ENOMEM;
    *p = (struct prange){lo, hi};
    s->kinds |= field == SW_COND_DST ? SK_PORT_DST : SK_PORT_SRC;
    return 0;
}

int sw_set_network(sw_set *s, int network)
{
    if (!s || s->sealed || (network != SW_NET_TCP && network != SW_NET_UDP))
        return -EINVAL;
    s->netmask |= (uint8_t)(1u << network);
    s->kinds |= SK_NETWORK;
    return 0;
}

int sw_set_flags(sw_set *s, uint32_t flags)
{
    const uint32_t all = SW_SET_F_DOMAIN_OPAQUE | SW_SET_F_OPAQUE | SW_SET_F_PROCESS;
    if (!s || s->sealed || (flags & ~all))
        return -EINVAL;
    s->flags |= flags;
    if (flags & SW_SET_F_DOMAIN_OPAQUE)
        s->kinds |= SK_REGEX;
    if (flags & SW_SET_F_OPAQUE)
        s->kinds |= SK_OPAQUE;
    if (flags & SW_SET_F_PROCESS)
        s->kinds |= SK_PROCESS;
    return 0;
}

/* ---- seal ---------------------------------------------------------------------- */

static int cmp_bnet(const void *pa, const void *pb)
{
    const struct bnet *a = pa, *b = pb;
    return (a->lo > b->lo) - (a->lo < b->lo);
}

static int cmp_prange(const void *pa, const void *pb)
{
    const struct prange *a = pa, *b = pb;
    return (a->lo > b->lo) - (a->lo < b->lo);
}

/* The building networks of one field sorted and merged into the sealed
 * arrays (IPv4 narrowed to 32-bit pairs); the building ones freed. */
static int seal_nets(sw_set *s, int field)
{
    for (int fam = 0; fam < 2; fam++) {
        struct vec *v = &s->bnets[field][fam];
        if (!v->n)
            continue;
        qsort(v->p, v->n, sizeof(struct bnet), cmp_bnet);
        struct bnet *b = v->p;
        size_t m = 0;
        for (size_t i = 0; i < v->n; i++) {
            if (m && (b[m - 1].hi == ~(u128)0 || b[i].lo <= b[m - 1].hi + 1)) {
                if (b[i].hi > b[m - 1].hi)
                    b[m - 1].hi = b[i].hi;
            } else {
                b[m++] = b[i];
            }
        }
        if (fam == 0) {
            struct ival4 *o = malloc(m * sizeof *o);
            if (!o)
                return -ENOMEM;
            for (size_t i = 0; i < m; i++)
                o[i] = (struct ival4){(uint32_t)b[i].lo, (uint32_t)b[i].hi};
            s->v4[field] = o;
            s->n4[field] = (uint32_t)m;
        } else {
            struct ival6 *o = malloc(m * sizeof *o);
            if (!o)
                return -ENOMEM;
            for (size_t i = 0; i < m; i++)
                o[i] = (struct ival6){b[i].lo, b[i].hi};
            s->v6[field] = o;
            s->n6[field] = (uint32_t)m;
        }
        sw_vec_free(v);
    }
    return 0;
}

static void seal_ports(struct vec *v)
{
    if (v->n > 1)
        qsort(v->p, v->n, sizeof(struct prange), cmp_prange);
    struct prange *p = v->p;
    size_t m = 0;
    for (size_t i = 0; i < v->n; i++) {
        if (m && (uint32_t)p[i].lo <= (uint32_t)p[m - 1].hi + 1) {
            if (p[i].hi > p[m - 1].hi)
                p[m - 1].hi = p[i].hi;
        } else {
            p[m++] = p[i];
        }
    }
    v->n = m;
}

static int cmp_kw(const void *pa, const void *pb, void *ctx)
{
    const sw_set *s = ctx;
    return strcmp(arena_at(s, *(const uint32_t *)pa), arena_at(s, *(const uint32_t *)pb));
}

/* Keywords sorted and distinct, then the automaton over them. */
static int seal_keywords(sw_set *s)
{
    if (!s->kw.n)
        return 0;
    uint32_t *off = s->kw.p;
    qsort_r(off, s->kw.n, sizeof *off, cmp_kw, s);
    size_t m = 0;
    for (size_t i = 0; i < s->kw.n; i++)
        if (!m || strcmp(arena_at(s, off[m - 1]), arena_at(s, off[i])))
            off[m++] = off[i];
    s->kw.n = m;
    struct acword *w = calloc(m, sizeof *w);
    if (!w)
        return -ENOMEM;
    for (size_t i = 0; i < m; i++) {
        const char *k = arena_at(s, off[i]);
        w[i] = (struct acword){.s = k, .len = (uint32_t)strlen(k), .id = (uint32_t)i};
    }
    int rc = sw_acm_build(&s->ac, w, (uint32_t)m);
    free(w);
    return rc;
}

int sw_set_seal(sw_set *s)
{
    if (!s || s->sealed)
        return -EINVAL;
    int rc = seal_keywords(s);
    for (int f = 0; f < 2 && !rc; f++) {
        rc = seal_nets(s, f);
        seal_ports(&s->ports[f]);
    }
    if (rc) {
        /* Nothing half-built is read: the set stays unsealed (and unusable). */
        sw_acm_free(&s->ac);
        return rc;
    }
    /* The arena was reserved per batch: give back the rest. */
    if (s->arena.cap > s->arena.n) {
        char *np = realloc(s->arena.p, s->arena.n);
        if (np) {
            s->arena.p = np;
            s->arena.cap = s->arena.n;
        }
    }
    s->sealed = true;
    return 0;
}

/* ---- lookups ---------------------------------------------------------------------- */

/* Does wildcard pattern p (lowercase) match host h[0..n)?  Label by label
 * from the right, a "*" label matching any one non-empty label; a pattern
 * with a leading "." wants one or more non-empty labels in front of the rest
 * (routing._wildcard_regex). */
static bool wild_match(const char *p, const char *h, uint32_t n)
{
    bool below = p[0] == '.';
    if (below)
        p++;
    size_t i = strlen(p), j = n; /* ends of the current labels */
    size_t pi, hj;                /* their starts */
    for (;;) {
        pi = i;
        hj = j;
        while (pi > 0 && p[pi - 1] != '.')
            pi--;
        while (hj > 0 && h[hj - 1] != '.')
            hj--;
        if (i - pi == 1 && p[pi] == '*') {
            if (j == hj)
                return false;
        } else {
            if (i - pi != j - hj)
                return false;
            for (size_t k = 0; k < i - pi; k++)
                if (sw_lower((unsigned char)h[hj + k]) != (unsigned char)p[pi + k])
                    return false;
        }
        if (pi == 0)
            break;
        if (hj == 0)
            return false; /* the host has fewer labels */
        i = pi - 1;
        j = hj - 1;
    }
    if (!below)
        return hj == 0;
    /* h[0..hj-1) must be one or more non-empty labels. */
    if (hj < 2)
        return false;
    for (size_t k = 0; k + 1 < hj; k++)
        if (h[k] == '.' && (k == 0 || h[k - 1] == '.'))
            return false;
    return h[hj - 2] != '.';
}

/* Whether a domain item matches the name h[0..n) (trailing dot dropped). */
static bool names_hit(const sw_set *s, const char *h, uint32_t n)
{
    if (s->used) {
        const char *dot = memchr(h, '.', n);
        uint32_t first = dot ? (uint32_t)(dot - h) : n;
        uint64_t hash = FNV_OFFSET;
        for (uint32_t i = n; i-- > 0;) {
            unsigned char c = (unsigned char)h[i];
            if (c == '.') {
                const struct nslot *sl = name_find(s, h + i + 1, n - i - 1, hash);
                if (sl) {
                    uint8_t k = name_kinds(s, sl);
                    /* "*." + name: one non-empty label in front. */
                    if ((k & (N_SUFFIX | N_SUB)) || ((k & N_WILD1) && i == first && i > 0))
                        return true;
                }
            }
            hash = sw_hmix(hash, sw_lower(c));
        }
        const struct nslot *sl = name_find(s, h, n, hash);
        if (sl && (name_kinds(s, sl) & (N_EXACT | N_SUFFIX)))
            return true;
    }
    for (size_t i = 0; i < s->wild.n; i++)
        if (wild_match(arena_at(s, VEC_AT(s->wild, uint32_t, i)), h, n))
            return true;
    return s->kw.n && acm_any(&s->ac, h, n);
}

static bool in4(const struct ival4 *iv, uint32_t n, uint32_t x)
{
    uint32_t lo = 0, hi = n; /* first interval with lo > x */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (iv[mid].lo <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && x <= iv[lo - 1].hi;
}

static bool in6(const struct ival6 *iv, uint32_t n, u128 x)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (iv[mid].lo <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && x <= iv[lo - 1].hi;
}

static bool net_hit(const sw_set *s, int field, int family, u128 ip)
{
    if (family == 4)
        return s->n4[field] && in4(s->v4[field], s->n4[field], (uint32_t)ip);
    return family == 6 && s->n6[field] && in6(s->v6[field], s->n6[field], ip);
}

static bool port_hit(const sw_set *s, int field, uint16_t x)
{
    const struct prange *p = s->ports[field].p;
    size_t lo = 0, hi = s->ports[field].n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p[mid].lo <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && x <= p[lo - 1].hi;
}

int sw_set_eval(const sw_set *s, const struct view *v, int dst, u128 dst_ip)
{
    uint32_t k = s->kinds;
    int tv = TV_FALSE;
    if (k & (SK_NAMES | SK_KEYWORD)) {
        for (int i = 0; i < v->nhosts; i++)
            if (names_hit(s, v->host[i], v->len[i]))
                return TV_TRUE;
        if (v->dom_unknown)
            tv = TV_UNKNOWN;
    }
    if ((k & SK_REGEX) && (v->nhosts || v->dom_unknown))
        tv = TV_UNKNOWN;
    if (k & SK_NET_DST) {
        if (dst < 0)
            tv = TV_UNKNOWN;
        else if (net_hit(s, SW_COND_DST, dst, dst_ip))
            return TV_TRUE;
    }
    if ((k & SK_NET_SRC) && net_hit(s, SW_COND_SRC, v->src, v->src_ip))
        return TV_TRUE;
    if ((k & SK_PORT_DST) && port_hit(s, SW_COND_DST, v->port))
        return TV_TRUE;
    if ((k & SK_PORT_SRC) && v->src && port_hit(s, SW_COND_SRC, v->sport))
        return TV_TRUE;
    if ((k & SK_NETWORK) && (s->netmask & v->netmask))
        return TV_TRUE;
    if ((k & SK_PROCESS) && v->src_local)
        tv = TV_UNKNOWN;
    if (k & SK_OPAQUE)
        tv = TV_UNKNOWN;
    return tv;
}

int sw_set_has_name(const sw_set *s, const char *host, uint32_t len)
{
    if (!s || !s->sealed || (len && !host))
        return -EINVAL;
    if (len && host[len - 1] == '.')
        len--;
    return names_hit(s, host, len);
}

int sw_set_has_addr(const sw_set *s, int field, int family, const uint8_t *addr)
{
    if (!s || !s->sealed || !addr || (field != SW_COND_DST && field != SW_COND_SRC) ||
        (family != 4 && family != 6))
        return -EINVAL;
    u128 v = 0;
    for (int i = 0; i < (family == 4 ? 4 : 16); i++)
        v = (v << 8) | addr[i];
    if (family == 6 && (v >> 32) == 0xffff) {
        family = 4;
        v &= 0xffffffffu;
    }
    return net_hit(s, field, family, v);
}

int sw_set_info_get(const sw_set *s, sw_set_info *out)
{
    if (!s || !out)
        return -EINVAL;
    uint64_t bytes = sizeof *s + s->arena.cap + s->kw.cap * 4 + s->wild.cap * 4;
    if (s->slots)
        bytes += ((uint64_t)s->mask + 1) * sizeof(struct nslot);
    bytes += s->ac.nodes.cap * sizeof(struct acnode) + s->ac.edge_byte.cap + s->ac.edge_to.cap * 4;
    uint32_t nets4 = 0, nets6 = 0, ports = 0;
    for (int f = 0; f < 2; f++) {
        bytes += (s->bnets[f][0].cap + s->bnets[f][1].cap) * sizeof(struct bnet);
        bytes += (uint64_t)s->n4[f] * sizeof(struct ival4) + (uint64_t)s->n6[f] * sizeof(struct ival6);
        bytes += s->ports[f].cap * sizeof(struct prange);
        nets4 += s->sealed ? s->n4[f] : (uint32_t)s->bnets[f][0].n;
        nets6 += s->sealed ? s->n6[f] : (uint32_t)s->bnets[f][1].n;
        ports += (uint32_t)s->ports[f].n;
    }
    *out = (sw_set_info){.bytes = bytes,
                         .names = s->used,
                         .keywords = (uint32_t)s->kw.n,
                         .wildcards = (uint32_t)s->wild.n,
                         .nets4 = nets4,
                         .nets6 = nets6,
                         .ports = ports,
                         .flags = s->flags};
    return 0;
}
