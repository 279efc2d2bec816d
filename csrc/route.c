/*
 * spliceway compiled route tables.  See route.h for the contract and
 * spliceway/routing/rules.py for the reference semantics; this file explains the
 * structures and where C gives up (SW_ROUTE_DEFER).
 *
 * Building
 *   The builders only record items, tagged with their rule, and set one bit
 *   per condition kind in the rule.  sw_table_seal turns them into per-rule
 *   slices (merged CIDR intervals per family, merged port ranges, sorted
 *   inbound/principal values, keyword ids) and into the indexes below.  From
 *   then on nothing is written: decide only reads, so any number of threads
 *   may call it, and it allocates nothing (a few hundred bytes of stack).
 *
 * Anchors
 *   Each rule is filed under one "anchor", the most selective indexed kind it
 *   has: domain > domain_suffix > domain_keyword > ip_cidr > source_ip_cidr >
 *   a set condition > principal_key > inbound_tag.  Rules with none of them
 *   (port, network, opaque conditions only, or no condition) and inverted
 *   rules (they match where their conditions fail) form the scan list; a
 *   no_resolve rule never anchors on ip_cidr (before the first resolving rule
 *   it does not see the resolved address the CIDR index looks at).  A rule can
 *   match only if its anchor condition holds, and every index answers, per
 *   item the flow satisfies, the sorted ids of the rules anchored on that
 *   item.  decide walks each such list in rule order, verifying the rule's
 *   other conditions from its own slices, and stops at the first rule that is
 *   not false or at the best rule found so far.  The rule that decides (the
 *   first one, in rule order, that is not false) is the minimum over all
 *   lists of each list's first such rule, so no list is merged and no
 *   candidate set is materialised: the work is the index lookups plus the
 *   candidates below the answer.
 *
 * Indexes
 *   domain and domain_suffix: one open-addressing hash table of the distinct
 *   normalised strings.  Strings are hashed from their last byte to their
 *   first, so one right-to-left pass over a host yields the hash of every
 *   dot-suffix routing.py considers (host[i+1:] at each '.', then the whole
 *   host), each looked up in O(1): O(host length) whatever the number of
 *   items, like the reversed-label tries of other proxies, without the
 *   pointer chasing.  An entry lists the rules with that `domain` item, the
 *   rules with that `domain_suffix` item and, of those, the ones anchored on
 *   domain_suffix.
 *   domain_keyword: an Aho-Corasick automaton over the distinct keywords of
 *   keyword-anchored rules (sorted edge arrays, failure and dictionary
 *   links): one pass over the host reports every keyword it contains.
 *   ip_cidr / source_ip_cidr: per field and family, the distinct prefix
 *   lengths, each with its sorted networks: the address is masked once per
 *   length and bisected (at most 33 or 129 probes, usually a handful).
 *   principal_key / inbound_tag: sorted distinct values with their rules.
 *   Set conditions: per distinct (set, which address its networks look at),
 *   the rules whose first condition that is not inverted names that set,
 *   ordered by their first rule.  decide evaluates a set (route_set.c: its
 *   own hashed names, keyword automaton and network intervals; O(host
 *   length + log networks) whatever its size) only while its first rule
 *   ranks below the best rule found, last, after the cheaper indexes; a set
 *   that holds walks its rules with that condition known true, an unknown one
 *   walks them in full.  Set results are memoised per decide (the first
 *   MEMO_SETS sets of a table).
 *
 * Three-valued matching, and what defers
 *   A condition is false, true or unknown; a rule is false when one of its
 *   conditions is, else unknown when one is, else true.  The first rule that
 *   is not false decides: true gives its action, unknown SW_ROUTE_DEFER (with
 *   `rule` naming the rule Python must look at).  Unknown comes from:
 *   - opaque conditions (domain_regex);
 *   - process conditions (process_name) for a source on this host: loopback
 *     or an address sw_table_local_addr named (any other source has no
 *     process: false; and false everywhere with SW_PROCESS_OFF);
 *   - a host (target or sniffed) with a byte >= 0x80: Python lowercases with
 *     str.lower, which is Unicode-aware (the Kelvin sign becomes 'k'), so its
 *     domain conditions are unknown unless another, ASCII, host matches.  As
 *     a target its ip_cidr conditions are unknown too: its IDNA form may be
 *     an address (fullwidth digits are; hostnorm.target_address);
 *   - a host with a '%': ipaddress accepts IPv6 scope ids ("fe80::1%eth0"),
 *     so whether it is an address (ip_cidr) or a name (domain conditions) is
 *     left to Python;
 *   - a set's SW_SET_F_DOMAIN_OPAQUE (regexes: for a flow with a name),
 *     SW_SET_F_PROCESS (as process conditions) and SW_SET_F_OPAQUE.
 *   Kleene's logic combines them: a set (an OR) holds when an item does,
 *   else is unknown when one is; an inverted rule or set condition swaps true
 *   and false.  The indexes only know true and false, so a flow with such a
 *   host, in a table that has plain conditions of the affected kind, is
 *   decided by a linear three-valued scan of the rules instead (rare; still
 *   exact).  The rules of one SW_RULE_GROUPED run are the alternatives of
 *   one configured rule: when the first of them that is not false is
 *   unknown, a later one that holds decides instead.
 *
 * Facts with no value
 *   inbound UINT32_MAX and principal SW_NO_PRINCIPAL mean none: conditions
 *   on them are false (an item with that value never matches).  source_family
 *   0 means the source is unknown: source_ip_cidr and source_port are false.
 *   An IPv4-mapped IPv6 source is unmapped here too, as routing._parse_ip
 *   does.
 *
 * Domain targets and resolving rules (routing.needs_address)
 *   ip_cidr (and a set's networks) look at the target's address; a domain
 *   target has one only when the query carries resolved_family/resolved_ip
 *   (routing.FlowFacts.resolved_ip: conn.c passes what its DNS cache holds
 *   for the name).  The first rule that resolves (SW_RULE_RESOLVES, or an
 *   ip_cidr condition without SW_RULE_NO_RESOLVE) is first_net_dst: the
 *   rules before it see only an address the client sent (V_LIT), the rules
 *   from it on a resolved one too.  Without the address, a decision at or
 *   after it (or the final) defers, `rule` naming it: the address could
 *   change the decision, and Python resolves the name first.
 *
 * IP literals
 *   A target or sniffed host is an address when sw_host_addr (iplit.c, the
 *   twin of spliceway/routing/hostnorm.py, which routing._parse_target uses) says so:
 *   every spelling a browser, inet_aton/getaddrinfo or IDNA reads as one
 *   ("2130706433", "127.1", "0x7f.0.0.1", "127.0.0.1."), IPv4-mapped IPv6 as
 *   IPv4, 0.0.0.0 and :: as the loopback addresses Linux connects them to.
 *   Configured ::ffff:a.b.c.d/n networks (n >= 96) also cover
 *   a.b.c.d/(n-96) as IPv4, as routing._IpSet does.
 */
#define _GNU_SOURCE
#include "route_int.h"
#include "iplit.h"

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Condition kinds, one bit each in struct rule.kinds. */
enum {
    K_EXACT = 1u << 0,
    K_SUFFIX = 1u << 1,
    K_KEYWORD = 1u << 2,
    K_NET_DST = 1u << 3,
    K_NET_SRC = 1u << 4,
    K_PORT_DST = 1u << 5,
    K_PORT_SRC = 1u << 6,
    K_NETWORK = 1u << 7,
    K_INBOUND = 1u << 8,
    K_PRINCIPAL = 1u << 9,
    K_OPAQUE = 1u << 10,
    K_PROCESS = 1u << 11,
    K_SET = 1u << 12,       /* set conditions (sw_table_cond_sets) */
    K_SETANCHOR = 1u << 13, /* in a walk's `skip` only: the anchor set condition holds */
    K_SETPOS = 1u << 14,    /* a set condition that is not inverted (one can anchor) */
    K_DOMAIN = K_EXACT | K_SUFFIX | K_KEYWORD,
};

enum { A_SCAN, A_EXACT, A_SUFFIX, A_KEYWORD, A_NET_DST, A_NET_SRC, A_SET, A_PRINCIPAL, A_INBOUND };

/* Which address ip_cidr items look at (a memo row each): the target's, the
 * source's, or the target's unless a domain target's resolved address (a
 * rule before the first resolving one). */
enum { V_DST, V_SRC, V_LIT, V_COUNT };
/* Set results memoised per decide, for the first MEMO_SETS sets of a table. */
#define MEMO_SETS 128

/* Per-rule slices of the sealed arrays. */
enum {
    S_NET4_DST, /* t->ivals */
    S_NET6_DST,
    S_NET4_SRC,
    S_NET6_SRC,
    S_PORT_DST, /* t->ports */
    S_PORT_SRC,
    S_INBOUND,  /* t->vals */
    S_PRINCIPAL,
    S_KEYWORD,  /* t->rule_kws: keyword ids */
    S_SETCOND,  /* t->setconds, in call order */
    S_COUNT
};

#define NO_INBOUND UINT32_MAX
/* Results are int32_t. */
#define MAX_RULES ((uint32_t)INT32_MAX - 1)
#define MAX_TARGETS ((uint32_t)INT32_MAX - 1)
/* Keywords reported once per host; past this many distinct hits per host a
 * keyword's rules may be walked again (slower, still right). */
#define AC_SEEN 64

/* ---- builder items ------------------------------------------------------ */

struct b_dom {
    uint32_t rule;
    uint8_t kind; /* enum sw_domain_kind */
    uint32_t len;
    char *s;      /* normalised, NUL-terminated; owned */
};

struct b_net {
    uint32_t rule;
    uint8_t field, family, plen;
    u128 lo, hi; /* IPv4 in the low 32 bits */
};

struct b_port {
    uint32_t rule;
    uint8_t field;
    uint16_t lo, hi;
};

struct b_val {
    uint32_t rule, value;
};

struct b_setc {
    uint32_t rule, seq, flags;
    struct slice sets; /* in t->b_setptrs */
};

/* ---- sealed structures -------------------------------------------------- */

struct ival {
    u128 lo, hi;
};

struct prange {
    uint16_t lo, hi;
};

struct rule {
    int32_t action, target;
    uint32_t kinds;
    uint8_t anchor;
    uint8_t netmask; /* bit 1 << network */
    uint8_t flags;   /* enum sw_rule_flag */
    uint32_t anchor_cond; /* A_SET: which of its set conditions (in call order) */
    struct slice s[S_COUNT];
};

/* One set condition: true when any of its sets is. */
struct setcond {
    uint8_t variant;   /* V_*: the address its ip_cidr items look at */
    bool invert;
    uint32_t kinds;    /* SK_*: union of its sets' */
    struct slice sets; /* table set ids in t->setids */
};

/* The rules anchored on one set (in a condition with one variant). */
struct skey {
    uint32_t tid;
    uint32_t variant;
    struct slice rules; /* in t->ids */
};

struct dentry {
    uint64_t hash;
    const char *s;
    uint32_t len;
    struct slice exact;   /* rules with this `domain` item */
    struct slice suffix;  /* rules with this `domain_suffix` item */
    struct slice sanchor; /* those of `suffix` anchored on domain_suffix */
};

struct kword {
    const char *s;
    uint32_t len;
    struct slice anchor; /* keyword-anchored rules with this keyword */
};

struct cnet {
    u128 addr;
    struct slice anchor;
};

struct cgroup {
    uint32_t plen;
    struct slice nets; /* t->cnets, sorted by addr */
};

struct vkey {
    uint32_t value;
    struct slice rules;
};

struct sw_table {
    uint64_t epoch;
    uint32_t nrules, ntargets;
    bool sealed;
    int mode;
    int32_t mode_target, final_target;
    int32_t first_domain;
    uint32_t first_net_dst; /* the first rule with an ip_cidr condition (nrules: none) */
    uint32_t kinds; /* union of the rules' kinds */
    uint32_t setkinds; /* union of the sets' kinds (SK_*) */
    struct rule *rules;
    sw_target_info *targets;

    /* Recorded by the builders (b_dom strings live as long as the table). */
    struct vec b_dom, b_net, b_port, b_inb, b_pri;
    /* struct b_setc, and the sets they name: one reference each, dropped
     * when the table is freed. */
    struct vec b_setc, b_setptrs;

    /* Built by sw_table_seal. */
    struct vec ids;      /* uint32_t rule ids, sliced by everything below */
    struct vec ivals;    /* struct ival */
    struct vec ports;    /* struct prange */
    struct vec vals;     /* uint32_t */
    struct vec rule_kws; /* uint32_t keyword ids */
    struct vec dents;    /* struct dentry */
    uint32_t *dslots;    /* entry index + 1, 0 = empty */
    uint32_t dmask;
    struct vec kws;      /* struct kword */
    struct acm acm;      /* over the keywords that anchor a rule */
    struct vec cnets;    /* struct cnet */
    struct vec cgroups;  /* struct cgroup */
    struct slice cgroup_of[2][2]; /* [field][family 4: 0, 6: 1] */
    struct vec inb_keys, pri_keys; /* struct vkey, sorted by value */
    struct slice scan;   /* in ids: the rules anchored nowhere */
    sw_set **tsets;      /* the distinct sets (by address), borrowed from b_setptrs */
    uint32_t ntsets;
    struct vec setconds; /* struct setcond */
    struct vec setids;   /* uint32_t table set ids */
    struct vec skeys;    /* struct skey, by first anchored rule */

    /* Listener slots whose flows Python takes before routing (the flow hook):
     * bit i of defer_inb for slot i; defer_any spares every other table the
     * lookup. */
    bool defer_any;
    uint64_t defer_inb[SW_TABLE_INBOUND_SLOTS / 64];

    /* Networks whose IP-literal targets Python takes before routing (fake-ip
     * ranges: Python maps the address back to its domain). */
    uint32_t ndefer_nets;
    struct {
        int family;
        unsigned prefix;
        u128 net;
    } defer_nets[SW_TABLE_DEFER_NETS];

    /* process_name conditions (enum sw_process_mode), and this host's
     * addresses: sorted and unique per family once sealed (bisected). */
    int process_mode;
    struct vec local[2]; /* u128: [0] IPv4, [1] IPv6 */
};

/* ---- small helpers ------------------------------------------------------ */

static int push_id(struct vec *v, uint32_t id)
{
    uint32_t *p = sw_vec_push(v, sizeof *p);
    if (!p)
        return -ENOMEM;
    *p = id;
    return 0;
}

/* Is `r` in the sorted ids[s]? */
static bool has_id(const uint32_t *ids, struct slice s, uint32_t r)
{
    uint32_t lo = s.off, hi = s.off + s.n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < r)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s.off + s.n && ids[lo] == r;
}

static u128 host_mask(int family, unsigned plen)
{
    return (family == 4 ? (u128)0xffffffffu : ~(u128)0) & ~net_mask(family, plen);
}

/* ---- addresses, as routing._parse_target --------------------------------- */

struct ipaddr {
    int family; /* 4 or 6; IPv4-mapped IPv6 is 4 */
    u128 v;
};

static void unmap(struct ipaddr *ip)
{
    if (ip->family == 6 && (ip->v >> 32) == 0xffff) {
        ip->family = 4;
        ip->v &= 0xffffffffu;
    }
}

/* What a host text is to routing._view (classify()). */
enum { H_NONE, H_NAME, H_IP, H_NONASCII, H_PERCENT };

/* An address as routing._parse_target reads it: IPv4-mapped as IPv4, the
 * unspecified addresses as loopback (hostnorm). */
static void ip_from_bytes(int family, const uint8_t *a, struct ipaddr *out)
{
    out->family = family;
    out->v = 0;
    for (int i = 0; i < (family == 4 ? 4 : 16); i++)
        out->v = out->v << 8 | a[i];
    unmap(out);
    if (out->v == 0)
        out->v = out->family == 4 ? 0x7f000001u : 1;
}

/* ---- life --------------------------------------------------------------- */

int sw_table_new(uint32_t nrules, uint32_t ntargets, uint64_t epoch, sw_table **out)
{
    if (!out || nrules > MAX_RULES || ntargets > MAX_TARGETS)
        return -EINVAL;
    sw_table *t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->epoch = epoch;
    t->nrules = nrules;
    t->ntargets = ntargets;
    t->mode_target = t->final_target = -1;
    t->process_mode = SW_PROCESS_RULES;
    t->rules = calloc(nrules ? nrules : 1, sizeof *t->rules);
    t->targets = calloc(ntargets ? ntargets : 1, sizeof *t->targets);
    if (!t->rules || !t->targets) {
        sw_table_free(t);
        return -ENOMEM;
    }
    *out = t;
    return 0;
}

static void free_index(sw_table *t)
{
    sw_vec_free(&t->ids);
    sw_vec_free(&t->ivals);
    sw_vec_free(&t->ports);
    sw_vec_free(&t->vals);
    sw_vec_free(&t->rule_kws);
    sw_vec_free(&t->dents);
    free(t->dslots);
    t->dslots = NULL;
    t->dmask = 0;
    sw_vec_free(&t->kws);
    sw_acm_free(&t->acm);
    sw_vec_free(&t->cnets);
    sw_vec_free(&t->cgroups);
    memset(t->cgroup_of, 0, sizeof t->cgroup_of);
    sw_vec_free(&t->inb_keys);
    sw_vec_free(&t->pri_keys);
    free(t->tsets);
    t->tsets = NULL;
    t->ntsets = 0;
    sw_vec_free(&t->setconds);
    sw_vec_free(&t->setids);
    sw_vec_free(&t->skeys);
    t->scan = (struct slice){0, 0};
    for (uint32_t r = 0; r < t->nrules; r++)
        memset(t->rules[r].s, 0, sizeof t->rules[r].s);
}

static void target_clear(sw_target_info *ti)
{
    free((char *)ti->server);
    free((char *)ti->user);
    free((char *)ti->pass);
    free((char *)ti->tag);
    memset(ti, 0, sizeof *ti);
}

void sw_table_free(sw_table *t)
{
    if (!t)
        return;
    free_index(t);
    for (size_t i = 0; i < t->b_dom.n; i++)
        free(VEC_AT(t->b_dom, struct b_dom, i).s);
    sw_vec_free(&t->b_dom);
    sw_vec_free(&t->b_net);
    sw_vec_free(&t->b_port);
    sw_vec_free(&t->b_inb);
    sw_vec_free(&t->b_pri);
    for (size_t i = 0; i < t->b_setptrs.n; i++)
        sw_set_free(VEC_AT(t->b_setptrs, sw_set *, i));
    sw_vec_free(&t->b_setptrs);
    sw_vec_free(&t->b_setc);
    sw_vec_free(&t->local[0]);
    sw_vec_free(&t->local[1]);
    if (t->targets)
        for (uint32_t i = 0; i < t->ntargets; i++)
            target_clear(&t->targets[i]);
    free(t->targets);
    free(t->rules);
    free(t);
}

uint64_t sw_table_epoch(const sw_table *t)
{
    return t ? t->epoch : 0;
}

/* ---- builders ----------------------------------------------------------- */

static bool target_ok(const sw_table *t, int32_t target)
{
    return target >= 0 && (uint32_t)target < t->ntargets;
}

/* The rule `rule` of an unsealed table, or NULL. */
static struct rule *building(sw_table *t, uint32_t rule)
{
    if (!t || t->sealed || rule >= t->nrules)
        return NULL;
    return &t->rules[rule];
}

int sw_table_defer_inbound(sw_table *t, uint32_t inbound)
{
    if (!t || t->sealed)
        return -EINVAL;
    if (inbound >= SW_TABLE_INBOUND_SLOTS)
        return -ERANGE;
    t->defer_inb[inbound / 64] |= UINT64_C(1) << (inbound % 64);
    t->defer_any = true;
    return 0;
}

int sw_table_inbound_deferred(const sw_table *t, uint32_t inbound)
{
    if (!t || !t->defer_any || inbound >= SW_TABLE_INBOUND_SLOTS)
        return 0;
    return (t->defer_inb[inbound / 64] >> (inbound % 64)) & 1;
}

int sw_table_defer_cidr(sw_table *t, int family, const uint8_t *addr, int prefix)
{
    if (!t || t->sealed || !addr)
        return -EINVAL;
    int bytes = family == 4 ? 4 : family == 6 ? 16 : 0;
    if (!bytes || prefix < 0 || prefix > bytes * 8)
        return -EINVAL;
    if (t->ndefer_nets == SW_TABLE_DEFER_NETS)
        return -ENOSPC;
    u128 a = 0;
    for (int i = 0; i < bytes; i++)
        a = (a << 8) | addr[i];
    unsigned bits = (unsigned)bytes * 8;
    /* Host bits cleared, so the lookup compares the prefix only. */
    if (prefix == 0)
        a = 0;
    else if ((unsigned)prefix < bits)
        a = a >> (bits - (unsigned)prefix) << (bits - (unsigned)prefix);
    t->defer_nets[t->ndefer_nets].family = family;
    t->defer_nets[t->ndefer_nets].prefix = (unsigned)prefix;
    t->defer_nets[t->ndefer_nets].net = a;
    t->ndefer_nets++;
    return 0;
}

int sw_table_host_deferred(const sw_table *t, const char *host, uint32_t host_len)
{
    if (!t || !t->ndefer_nets || !host)
        return 0;
    struct ipaddr ip;
    if (host_len && memchr(host, '%', host_len))
        return 1; /* a scoped IPv6 literal: only Python reads it */
    /* The address as given: an unspecified one is not the loopback one here
     * (the pool maps neither; conn.c canonicalizes hosts before anyway). */
    uint8_t a[16];
    switch (sw_host_addr_as_given((const uint8_t *)host, host_len, a)) {
    case SW_HOST_IP4:
        ip.family = 4;
        ip.v = (u128)a[0] << 24 | (u128)a[1] << 16 | (u128)a[2] << 8 | a[3];
        break;
    case SW_HOST_IP6:
        ip.family = 6;
        ip.v = 0;
        for (int i = 0; i < 16; i++)
            ip.v = ip.v << 8 | a[i];
        break;
    default:
        return 0;
    }
    for (uint32_t i = 0; i < t->ndefer_nets; i++) {
        unsigned bits = t->defer_nets[i].family == 4 ? 32 : 128;
        unsigned prefix = t->defer_nets[i].prefix;
        if (ip.family != t->defer_nets[i].family)
            continue;
        if (prefix == 0 || ip.v >> (bits - prefix) == t->defer_nets[i].net >> (bits - prefix))
            return 1;
    }
    return 0;
}

int sw_table_set_mode(sw_table *t, int kind, int32_t mode_target, int32_t final_target)
{
    if (!t || t->sealed)
        return -EINVAL;
    switch (kind) {
    case SW_MODE_RULE:
        if (!target_ok(t, final_target) || (mode_target != -1 && !target_ok(t, mode_target)))
            return -EINVAL;
        break;
    case SW_MODE_GLOBAL:
    case SW_MODE_DIRECT:
        if (!target_ok(t, mode_target) || (final_target != -1 && !target_ok(t, final_target)))
            return -EINVAL;
        break;
    default:
        return -EINVAL;
    }
    t->mode = kind;
    t->mode_target = mode_target;
    t->final_target = final_target;
    return 0;
}

int sw_table_rule(sw_table *t, uint32_t rule, int action, int32_t target)
{
    struct rule *r = building(t, rule);
    if (!r)
        return -EINVAL;
    if (action == SW_ROUTE_ROUTE) {
        if (!target_ok(t, target))
            return -EINVAL;
    } else if (action != SW_ROUTE_BLOCK || target != -1) {
        return -EINVAL;
    }
    r->action = action;
    r->target = target;
    return 0;
}

int sw_table_cond_domain(sw_table *t, uint32_t rule, int kind, const char *value)
{
    struct rule *r = building(t, rule);
    if (!r || !value)
        return -EINVAL;
    uint32_t bit;
    switch (kind) {
    case SW_DOMAIN_EXACT: bit = K_EXACT; break;
    case SW_DOMAIN_SUFFIX: bit = K_SUFFIX; break;
    case SW_DOMAIN_KEYWORD: bit = K_KEYWORD; break;
    default: return -EINVAL;
    }
    size_t n = strlen(value);
    if (n > UINT32_MAX - 1)
        return -EINVAL;
    /* routing._norm_host for names (lowercase, one trailing dot dropped);
     * keywords are only lowercased.  Non-ASCII bytes stay as given: Python
     * passes str.sw_lower()'s UTF-8, and no ASCII host can equal or contain a
     * string with such a byte. */
    if (kind != SW_DOMAIN_KEYWORD && n > 0 && value[n - 1] == '.')
        n--;
    char *s = malloc(n + 1);
    if (!s)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        s[i] = (char)sw_lower((unsigned char)value[i]);
    s[n] = '\0';
    struct b_dom *d = sw_vec_push(&t->b_dom, sizeof *d);
    if (!d) {
        free(s);
        return -ENOMEM;
    }
    *d = (struct b_dom){.rule = rule, .kind = (uint8_t)kind, .len = (uint32_t)n, .s = s};
    r->kinds |= bit;
    return 0;
}

static int push_net(sw_table *t, uint32_t rule, int field, int family, u128 addr, unsigned plen)
{
    struct b_net *b = sw_vec_push(&t->b_net, sizeof *b);
    if (!b)
        return -ENOMEM;
    u128 lo = addr & net_mask(family, plen);
    *b = (struct b_net){.rule = rule, .field = (uint8_t)field, .family = (uint8_t)family,
                        .plen = (uint8_t)plen, .lo = lo, .hi = lo | host_mask(family, plen)};
    return 0;
}

int sw_table_cond_cidr(sw_table *t, uint32_t rule, int field, int family, const uint8_t *addr,
                       int prefix)
{
    struct rule *r = building(t, rule);
    if (!r || !addr || (field != SW_COND_DST && field != SW_COND_SRC))
        return -EINVAL;
    int bytes = family == 4 ? 4 : family == 6 ? 16 : 0;
    if (!bytes || prefix < 0 || prefix > bytes * 8)
        return -EINVAL;
    u128 a = 0;
    for (int i = 0; i < bytes; i++)
        a = (a << 8) | addr[i];
    int rc = push_net(t, rule, field, family, a, (unsigned)prefix);
    /* routing._IpSet: ::ffff:a.b.c.d/n (n >= 96) also covers a.b.c.d/(n-96). */
    if (!rc && family == 6 && prefix >= 96 && (a >> 32) == 0xffff)
        rc = push_net(t, rule, field, 4, a & 0xffffffffu, (unsigned)prefix - 96);
    if (rc)
        return rc;
    r->kinds |= field == SW_COND_DST ? K_NET_DST : K_NET_SRC;
    return 0;
}

int sw_table_cond_port(sw_table *t, uint32_t rule, int field, uint16_t lo, uint16_t hi)
{
    struct rule *r = building(t, rule);
    if (!r || (field != SW_COND_DST && field != SW_COND_SRC) || lo > hi)
        return -EINVAL;
    struct b_port *b = sw_vec_push(&t->b_port, sizeof *b);
    if (!b)
        return -ENOMEM;
    *b = (struct b_port){.rule = rule, .field = (uint8_t)field, .lo = lo, .hi = hi};
    r->kinds |= field == SW_COND_DST ? K_PORT_DST : K_PORT_SRC;
    return 0;
}

int sw_table_cond_network(sw_table *t, uint32_t rule, int network)
{
    struct rule *r = building(t, rule);
    if (!r || (network != SW_NET_TCP && network != SW_NET_UDP))
        return -EINVAL;
    r->netmask |= (uint8_t)(1u << network);
    r->kinds |= K_NETWORK;
    return 0;
}

static int cond_value(sw_table *t, uint32_t rule, struct vec *v, uint32_t bit, uint32_t value)
{
    struct rule *r = building(t, rule);
    if (!r)
        return -EINVAL;
    struct b_val *b = sw_vec_push(v, sizeof *b);
    if (!b)
        return -ENOMEM;
    *b = (struct b_val){.rule = rule, .value = value};
    r->kinds |= bit;
    return 0;
}

int sw_table_cond_inbound(sw_table *t, uint32_t rule, uint32_t inbound)
{
    return t ? cond_value(t, rule, &t->b_inb, K_INBOUND, inbound) : -EINVAL;
}

int sw_table_cond_principal(sw_table *t, uint32_t rule, uint32_t principal)
{
    return t ? cond_value(t, rule, &t->b_pri, K_PRINCIPAL, principal) : -EINVAL;
}

int sw_table_cond_opaque(sw_table *t, uint32_t rule)
{
    struct rule *r = building(t, rule);
    if (!r)
        return -EINVAL;
    r->kinds |= K_OPAQUE;
    return 0;
}

int sw_table_cond_process(sw_table *t, uint32_t rule)
{
    struct rule *r = building(t, rule);
    if (!r)
        return -EINVAL;
    r->kinds |= K_PROCESS;
    return 0;
}

int sw_table_cond_sets(sw_table *t, uint32_t rule, uint32_t flags, sw_set *const *sets,
                       uint32_t n)
{
    struct rule *r = building(t, rule);
    if (!r || (flags & ~(uint32_t)(SW_SETCOND_SOURCE | SW_SETCOND_INVERT)) || (n && !sets))
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (!sets[i] || !sw_set_sealed(sets[i]))
            return -EINVAL;
    if (sw_vec_reserve(&t->b_setptrs, sizeof(sw_set *), n))
        return -ENOMEM;
    struct b_setc *c = sw_vec_push(&t->b_setc, sizeof *c);
    if (!c)
        return -ENOMEM;
    *c = (struct b_setc){.rule = rule,
                         .seq = (uint32_t)t->b_setc.n,
                         .flags = flags,
                         .sets = {(uint32_t)t->b_setptrs.n, n}};
    for (uint32_t i = 0; i < n; i++) {
        sw_set_ref(sets[i]);
        *(sw_set **)sw_vec_push(&t->b_setptrs, sizeof(sw_set *)) = sets[i];
    }
    r->kinds |= K_SET | ((flags & SW_SETCOND_INVERT) ? 0 : K_SETPOS);
    return 0;
}

int sw_table_rule_flags(sw_table *t, uint32_t rule, uint32_t flags)
{
    struct rule *r = building(t, rule);
    const uint32_t all = SW_RULE_NO_RESOLVE | SW_RULE_INVERT | SW_RULE_RESOLVES | SW_RULE_GROUPED;
    if (!r || (flags & ~all) || ((flags & SW_RULE_GROUPED) && rule == 0))
        return -EINVAL;
    r->flags |= (uint8_t)flags;
    return 0;
}

int sw_table_set_process(sw_table *t, int mode)
{
    if (!t || t->sealed ||
        (mode != SW_PROCESS_OFF && mode != SW_PROCESS_RULES && mode != SW_PROCESS_ALL))
        return -EINVAL;
    t->process_mode = mode;
    return 0;
}

static u128 addr_value(int family, const uint8_t *addr)
{
    u128 v = 0;
    for (int i = 0; i < (family == 4 ? 4 : 16); i++)
        v = (v << 8) | addr[i];
    return v;
}

int sw_table_local_addr(sw_table *t, int family, const uint8_t *addr)
{
    if (!t || t->sealed || !addr || (family != 4 && family != 6))
        return -EINVAL;
    struct ipaddr ip = {.family = family, .v = addr_value(family, addr)};
    unmap(&ip);
    u128 *p = sw_vec_push(&t->local[ip.family == 4 ? 0 : 1], sizeof *p);
    if (!p)
        return -ENOMEM;
    *p = ip.v;
    return 0;
}

static int cmp_local(const void *a, const void *b)
{
    u128 x = *(const u128 *)a, y = *(const u128 *)b;
    return x < y ? -1 : x > y;
}

/* An unmapped source on this host: loopback, or one of the table's addresses. */
static bool source_local(const sw_table *t, int family, u128 v)
{
    if (family == 4 ? (v >> 24) == 127 : family == 6 && v == 1)
        return true;
    const struct vec *set = &t->local[family == 4 ? 0 : 1];
    const u128 *a = set->p;
    size_t lo = 0, hi = set->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (a[mid] < v)
            lo = mid + 1;
        else if (a[mid] > v)
            hi = mid;
        else
            return true;
    }
    return false;
}

int sw_table_source_deferred(const sw_table *t, int family, const uint8_t *ip)
{
    if (!t || !t->sealed || t->process_mode != SW_PROCESS_ALL || !ip ||
        (family != 4 && family != 6))
        return 0;
    struct ipaddr src = {.family = family, .v = addr_value(family, ip)};
    unmap(&src);
    return source_local(t, src.family, src.v);
}

static int dup_opt(const char *s, const char **out)
{
    *out = NULL;
    if (!s)
        return 0;
    *out = strdup(s);
    return *out ? 0 : -ENOMEM;
}

int sw_table_target(sw_table *t, uint32_t index, int kind, const char *server, uint16_t port,
                    const char *user, const char *pass, uint32_t connect_timeout_ms)
{
    if (!t || t->sealed || index >= t->ntargets)
        return -EINVAL;
    bool proxy = kind == SW_OUT_SOCKS5 || kind == SW_OUT_HTTP;
    if (kind < SW_OUT_DEFER || kind > SW_OUT_HTTP || (proxy && !server))
        return -EINVAL;
    sw_target_info ti = {.kind = kind, .port = port, .connect_timeout_ms = connect_timeout_ms};
    if (proxy) {
        int rc = dup_opt(server, &ti.server);
        if (!rc && user) {
            rc = dup_opt(user, &ti.user);
            if (!rc)
                rc = dup_opt(pass ? pass : "", &ti.pass);
        }
        if (rc) {
            target_clear(&ti);
            return rc;
        }
    }
    target_clear(&t->targets[index]);
    t->targets[index] = ti;
    return 0;
}

int sw_table_target_tag(sw_table *t, uint32_t index, const char *tag)
{
    if (!t || t->sealed || index >= t->ntargets || !tag)
        return -EINVAL;
    const char *copy;
    int rc = dup_opt(tag, &copy);
    if (rc)
        return rc;
    free((char *)t->targets[index].tag);
    t->targets[index].tag = copy;
    return 0;
}

/* ---- seal --------------------------------------------------------------- */

static int cmp_u32(uint32_t a, uint32_t b) { return (a > b) - (a < b); }
static int cmp_u128(u128 a, u128 b) { return (a > b) - (a < b); }

static int cmp_net_rule(const void *pa, const void *pb)
{
    const struct b_net *a = pa, *b = pb;
    int c = cmp_u32(a->rule, b->rule);
    if (!c)
        c = cmp_u32(a->field, b->field);
    if (!c)
        c = cmp_u32(a->family, b->family);
    return c ? c : cmp_u128(a->lo, b->lo);
}

static int cmp_net_index(const void *pa, const void *pb)
{
    const struct b_net *a = pa, *b = pb;
    int c = cmp_u32(a->field, b->field);
    if (!c)
        c = cmp_u32(a->family, b->family);
    if (!c)
        c = cmp_u32(a->plen, b->plen);
    if (!c)
        c = cmp_u128(a->lo, b->lo);
    return c ? c : cmp_u32(a->rule, b->rule);
}

static int cmp_port(const void *pa, const void *pb)
{
    const struct b_port *a = pa, *b = pb;
    int c = cmp_u32(a->rule, b->rule);
    if (!c)
        c = cmp_u32(a->field, b->field);
    return c ? c : cmp_u32(a->lo, b->lo);
}

static int cmp_val_rule(const void *pa, const void *pb)
{
    const struct b_val *a = pa, *b = pb;
    int c = cmp_u32(a->rule, b->rule);
    return c ? c : cmp_u32(a->value, b->value);
}

static int cmp_val_value(const void *pa, const void *pb)
{
    const struct b_val *a = pa, *b = pb;
    int c = cmp_u32(a->value, b->value);
    return c ? c : cmp_u32(a->rule, b->rule);
}

static int cmp_str(const char *a, uint32_t an, const char *b, uint32_t bn)
{
    int c = memcmp(a, b, an < bn ? an : bn);
    return c ? c : cmp_u32(an, bn);
}

static int cmp_dom(const void *pa, const void *pb)
{
    const struct b_dom *a = pa, *b = pb;
    int c = cmp_str(a->s, a->len, b->s, b->len);
    if (!c)
        c = cmp_u32(a->kind, b->kind);
    return c ? c : cmp_u32(a->rule, b->rule);
}

static void sort_vec(struct vec *v, size_t size, int (*cmp)(const void *, const void *))
{
    if (v->n > 1)
        qsort(v->p, v->n, size, cmp);
}

/* The most selective indexed condition of a rule.  An inverted rule matches
 * where its conditions fail, so no index can find it; a no_resolve rule
 * before the first resolving one does not see a resolved address, which the
 * CIDR index looks at. */
static uint8_t pick_anchor(const struct rule *ru)
{
    uint32_t k = ru->kinds;
    if (ru->flags & SW_RULE_INVERT)
        return A_SCAN;
    if (ru->flags & SW_RULE_NO_RESOLVE)
        k &= ~(uint32_t)K_NET_DST;
    if (k & K_EXACT)
        return A_EXACT;
    if (k & K_SUFFIX)
        return A_SUFFIX;
    if (k & K_KEYWORD)
        return A_KEYWORD;
    if (k & K_NET_DST)
        return A_NET_DST;
    if (k & K_NET_SRC)
        return A_NET_SRC;
    if (k & K_SETPOS)
        return A_SET;
    if (k & K_PRINCIPAL)
        return A_PRINCIPAL;
    if (k & K_INBOUND)
        return A_INBOUND;
    return A_SCAN;
}

/* Per-rule merged CIDR intervals (per field and family). */
static int seal_rule_nets(sw_table *t)
{
    sort_vec(&t->b_net, sizeof(struct b_net), cmp_net_rule);
    for (size_t i = 0; i < t->b_net.n;) {
        const struct b_net *g = &VEC_AT(t->b_net, struct b_net, i);
        struct slice *s = &t->rules[g->rule].s[(g->field == SW_COND_SRC ? 2 : 0) +
                                               (g->family == 6)];
        s->off = (uint32_t)t->ivals.n;
        size_t j = i;
        for (; j < t->b_net.n; j++) {
            const struct b_net *b = &VEC_AT(t->b_net, struct b_net, j);
            if (b->rule != g->rule || b->field != g->field || b->family != g->family)
                break;
            struct ival *last = s->n ? &VEC_AT(t->ivals, struct ival, t->ivals.n - 1) : NULL;
            if (last && (last->hi == ~(u128)0 || b->lo <= last->hi + 1)) {
                if (b->hi > last->hi)
                    last->hi = b->hi;
                continue;
            }
            struct ival *iv = sw_vec_push(&t->ivals, sizeof *iv);
            if (!iv)
                return -ENOMEM;
            *iv = (struct ival){b->lo, b->hi};
            s->n++;
        }
        i = j;
    }
    return 0;
}

static int seal_rule_ports(sw_table *t)
{
    sort_vec(&t->b_port, sizeof(struct b_port), cmp_port);
    for (size_t i = 0; i < t->b_port.n;) {
        const struct b_port *g = &VEC_AT(t->b_port, struct b_port, i);
        struct slice *s = &t->rules[g->rule].s[g->field == SW_COND_SRC ? S_PORT_SRC : S_PORT_DST];
        s->off = (uint32_t)t->ports.n;
        size_t j = i;
        for (; j < t->b_port.n; j++) {
            const struct b_port *b = &VEC_AT(t->b_port, struct b_port, j);
            if (b->rule != g->rule || b->field != g->field)
                break;
            struct prange *last = s->n ? &VEC_AT(t->ports, struct prange, t->ports.n - 1) : NULL;
            if (last && (uint32_t)b->lo <= (uint32_t)last->hi + 1) {
                if (b->hi > last->hi)
                    last->hi = b->hi;
                continue;
            }
            struct prange *p = sw_vec_push(&t->ports, sizeof *p);
            if (!p)
                return -ENOMEM;
            *p = (struct prange){b->lo, b->hi};
            s->n++;
        }
        i = j;
    }
    return 0;
}

/* Per-rule sorted values (slice `which`) and the index of the rules anchored
 * on this kind: distinct values with their rules. */
static int seal_values(sw_table *t, struct vec *items, int which, uint8_t anchor,
                       struct vec *keys)
{
    sort_vec(items, sizeof(struct b_val), cmp_val_rule);
    for (size_t i = 0; i < items->n; i++) {
        const struct b_val *b = &VEC_AT(*items, struct b_val, i);
        struct slice *s = &t->rules[b->rule].s[which];
        if (s->n && VEC_AT(t->vals, uint32_t, t->vals.n - 1) == b->value)
            continue;
        if (!s->n)
            s->off = (uint32_t)t->vals.n;
        if (push_id(&t->vals, b->value))
            return -ENOMEM;
        s->n++;
    }
    sort_vec(items, sizeof(struct b_val), cmp_val_value);
    struct vkey *k = NULL;
    for (size_t i = 0; i < items->n; i++) {
        const struct b_val *b = &VEC_AT(*items, struct b_val, i);
        if (t->rules[b->rule].anchor != anchor)
            continue;
        if (!k || k->value != b->value) {
            k = sw_vec_push(keys, sizeof *k);
            if (!k)
                return -ENOMEM;
            *k = (struct vkey){.value = b->value, .rules = {(uint32_t)t->ids.n, 0}};
        } else if (VEC_AT(t->ids, uint32_t, t->ids.n - 1) == b->rule) {
            continue;
        }
        if (push_id(&t->ids, b->rule))
            return -ENOMEM;
        k->rules.n++;
    }
    return 0;
}

/* Appends the distinct rules of items [i, j) of b_dom with kind `kind` (and,
 * if anchor, anchored there) to ids. */
static int dom_rules(sw_table *t, size_t i, size_t j, int kind, int anchor, struct slice *out)
{
    out->off = (uint32_t)t->ids.n;
    out->n = 0;
    for (size_t k = i; k < j; k++) {
        const struct b_dom *b = &VEC_AT(t->b_dom, struct b_dom, k);
        if (b->kind != kind || (anchor >= 0 && t->rules[b->rule].anchor != anchor))
            continue;
        if (out->n && VEC_AT(t->ids, uint32_t, t->ids.n - 1) == b->rule)
            continue;
        if (push_id(&t->ids, b->rule))
            return -ENOMEM;
        out->n++;
    }
    return 0;
}

static int dslot_insert(sw_table *t, uint32_t index)
{
    const struct dentry *e = &VEC_AT(t->dents, struct dentry, index);
    for (uint32_t s = sw_slot_of(e->hash, t->dmask);; s = (s + 1) & t->dmask) {
        if (!t->dslots[s]) {
            t->dslots[s] = index + 1;
            return 0;
        }
    }
}

/* Domain entries, the hash table, keyword entries and per-rule keyword ids. */
static int seal_domains(sw_table *t)
{
    struct vec pairs = {0}; /* (rule, keyword id) */
    int rc = 0;
    sort_vec(&t->b_dom, sizeof(struct b_dom), cmp_dom);
    for (size_t i = 0; i < t->b_dom.n && !rc;) {
        const struct b_dom *g = &VEC_AT(t->b_dom, struct b_dom, i);
        size_t j = i;
        bool names = false, keyword = false;
        for (; j < t->b_dom.n; j++) {
            const struct b_dom *b = &VEC_AT(t->b_dom, struct b_dom, j);
            if (cmp_str(b->s, b->len, g->s, g->len))
                break;
            if (b->kind == SW_DOMAIN_KEYWORD)
                keyword = true;
            else
                names = true;
        }
        if (names) {
            struct dentry *e = sw_vec_push(&t->dents, sizeof *e);
            if (!e)
                rc = -ENOMEM;
            else {
                *e = (struct dentry){.hash = sw_hash_rev(g->s, g->len), .s = g->s, .len = g->len};
                struct slice ex, sf, sa;
                rc = dom_rules(t, i, j, SW_DOMAIN_EXACT, -1, &ex);
                if (!rc)
                    rc = dom_rules(t, i, j, SW_DOMAIN_SUFFIX, -1, &sf);
                if (!rc)
                    rc = dom_rules(t, i, j, SW_DOMAIN_SUFFIX, A_SUFFIX, &sa);
                /* ids may have moved, entries hold offsets: fill them in last. */
                e = &VEC_AT(t->dents, struct dentry, t->dents.n - 1);
                e->exact = ex;
                e->suffix = sf;
                e->sanchor = sa;
            }
        }
        if (keyword && !rc) {
            uint32_t id = (uint32_t)t->kws.n;
            struct kword *kw = sw_vec_push(&t->kws, sizeof *kw);
            if (!kw)
                rc = -ENOMEM;
            else {
                *kw = (struct kword){.s = g->s, .len = g->len};
                struct slice an;
                rc = dom_rules(t, i, j, SW_DOMAIN_KEYWORD, A_KEYWORD, &an);
                VEC_AT(t->kws, struct kword, id).anchor = an;
            }
            for (size_t k = i; k < j && !rc; k++) {
                const struct b_dom *b = &VEC_AT(t->b_dom, struct b_dom, k);
                if (b->kind != SW_DOMAIN_KEYWORD)
                    continue;
                struct b_val *p = sw_vec_push(&pairs, sizeof *p);
                if (!p)
                    rc = -ENOMEM;
                else
                    *p = (struct b_val){.rule = b->rule, .value = id};
            }
        }
        i = j;
    }
    if (!rc) {
        sort_vec(&pairs, sizeof(struct b_val), cmp_val_rule);
        for (size_t i = 0; i < pairs.n && !rc; i++) {
            const struct b_val *p = &VEC_AT(pairs, struct b_val, i);
            struct slice *s = &t->rules[p->rule].s[S_KEYWORD];
            if (s->n && VEC_AT(t->rule_kws, uint32_t, t->rule_kws.n - 1) == p->value)
                continue;
            if (!s->n)
                s->off = (uint32_t)t->rule_kws.n;
            rc = push_id(&t->rule_kws, p->value);
            s->n++;
        }
    }
    sw_vec_free(&pairs);
    if (rc)
        return rc;
    uint32_t cap = 16;
    while (cap < 2 * t->dents.n)
        cap *= 2;
    t->dslots = calloc(cap, sizeof *t->dslots);
    if (!t->dslots)
        return -ENOMEM;
    t->dmask = cap - 1;
    for (uint32_t i = 0; i < t->dents.n; i++)
        dslot_insert(t, i);
    return 0;
}

/* Aho-Corasick over the keywords that anchor a rule (kws is sorted). */
static int seal_keywords(sw_table *t)
{
    uint32_t n = 0;
    for (size_t i = 0; i < t->kws.n; i++)
        n += VEC_AT(t->kws, struct kword, i).anchor.n > 0;
    if (!n)
        return 0;
    struct acword *w = calloc(n, sizeof *w);
    if (!w)
        return -ENOMEM;
    n = 0;
    for (uint32_t k = 0; k < t->kws.n; k++) {
        const struct kword *kw = &VEC_AT(t->kws, struct kword, k);
        if (kw->anchor.n)
            w[n++] = (struct acword){.s = kw->s, .len = kw->len, .id = k};
    }
    int rc = sw_acm_build(&t->acm, w, n);
    free(w);
    return rc;
}

/* Networks of CIDR-anchored rules, grouped by field, family and length. */
static int seal_net_index(sw_table *t)
{
    sort_vec(&t->b_net, sizeof(struct b_net), cmp_net_index);
    struct cgroup *grp = NULL;
    struct cnet *net = NULL;
    for (size_t i = 0; i < t->b_net.n; i++) {
        const struct b_net *b = &VEC_AT(t->b_net, struct b_net, i);
        uint8_t anchor = t->rules[b->rule].anchor;
        if (anchor != (b->field == SW_COND_SRC ? A_NET_SRC : A_NET_DST))
            continue;
        struct slice *groups = &t->cgroup_of[b->field == SW_COND_SRC][b->family == 6];
        if (!groups->n)
            groups->off = (uint32_t)t->cgroups.n;
        bool new_group = !groups->n || grp->plen != b->plen;
        if (new_group) {
            grp = sw_vec_push(&t->cgroups, sizeof *grp);
            if (!grp)
                return -ENOMEM;
            *grp = (struct cgroup){.plen = b->plen, .nets = {(uint32_t)t->cnets.n, 0}};
            groups->n++;
        }
        if (new_group || net->addr != b->lo) {
            net = sw_vec_push(&t->cnets, sizeof *net);
            if (!net)
                return -ENOMEM;
            *net = (struct cnet){.addr = b->lo, .anchor = {(uint32_t)t->ids.n, 0}};
            grp->nets.n++;
        } else if (VEC_AT(t->ids, uint32_t, t->ids.n - 1) == b->rule) {
            continue;
        }
        if (push_id(&t->ids, b->rule))
            return -ENOMEM;
        net->anchor.n++;
    }
    return 0;
}

static int cmp_ptr(const void *pa, const void *pb)
{
    uintptr_t a = (uintptr_t)*(sw_set *const *)pa, b = (uintptr_t)*(sw_set *const *)pb;
    return (a > b) - (a < b);
}

static int cmp_setc(const void *pa, const void *pb)
{
    const struct b_setc *a = pa, *b = pb;
    int c = cmp_u32(a->rule, b->rule);
    return c ? c : cmp_u32(a->seq, b->seq);
}

static uint32_t tset_id(const sw_table *t, const sw_set *s)
{
    uint32_t lo = 0, hi = t->ntsets;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)t->tsets[mid] < (uintptr_t)s)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo; /* every set named is there */
}

/* (table set, variant, rule) of the set-anchored rules. */
struct b_skey {
    uint32_t tid, variant, rule;
};

static int cmp_bskey(const void *pa, const void *pb)
{
    const struct b_skey *a = pa, *b = pb;
    int c = cmp_u32(a->tid, b->tid);
    if (!c)
        c = cmp_u32(a->variant, b->variant);
    return c ? c : cmp_u32(a->rule, b->rule);
}

static int cmp_skey_first(const void *pa, const void *pb, void *ctx)
{
    const sw_table *t = ctx;
    const struct skey *a = pa, *b = pb;
    return cmp_u32(VEC_AT(t->ids, uint32_t, a->rules.off), VEC_AT(t->ids, uint32_t, b->rules.off));
}

/* The distinct sets, the rules' set conditions, and the index of the rules
 * anchored on a set: per (set, variant), the rules whose first set
 * condition names it, ordered by their first rule so that decide can stop
 * at the best rule found. */
static int seal_sets(sw_table *t)
{
    size_t n = t->b_setptrs.n;
    if (!t->b_setc.n)
        return 0;
    t->tsets = malloc((n ? n : 1) * sizeof *t->tsets);
    if (!t->tsets)
        return -ENOMEM;
    if (n)
        memcpy(t->tsets, t->b_setptrs.p, n * sizeof *t->tsets);
    if (n > 1)
        qsort(t->tsets, n, sizeof *t->tsets, cmp_ptr);
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!m || t->tsets[m - 1] != t->tsets[i])
            t->tsets[m++] = t->tsets[i];
    t->ntsets = m;
    for (uint32_t i = 0; i < m; i++)
        t->setkinds |= sw_set_kinds(t->tsets[i]);

    sort_vec(&t->b_setc, sizeof(struct b_setc), cmp_setc);
    struct vec pairs = {0}; /* struct b_skey */
    int rc = 0;
    for (size_t i = 0; i < t->b_setc.n && !rc; i++) {
        const struct b_setc *b = &VEC_AT(t->b_setc, struct b_setc, i);
        struct rule *ru = &t->rules[b->rule];
        struct slice *rs = &ru->s[S_SETCOND];
        if (!rs->n)
            rs->off = (uint32_t)t->setconds.n;
        struct setcond *c = sw_vec_push(&t->setconds, sizeof *c);
        if (!c) {
            rc = -ENOMEM;
            break;
        }
        uint8_t variant = (b->flags & SW_SETCOND_SOURCE) ? V_SRC
                          : b->rule < t->first_net_dst                ? V_LIT
                                                                      : V_DST;
        bool invert = (b->flags & SW_SETCOND_INVERT) != 0;
        *c = (struct setcond){
            .variant = variant, .invert = invert, .sets = {(uint32_t)t->setids.n, b->sets.n}};
        /* The first condition that is not inverted anchors an A_SET rule. */
        bool anchor = ru->anchor == A_SET && !invert && ru->anchor_cond == NONE32;
        if (anchor)
            ru->anchor_cond = rs->n;
        rs->n++;
        for (uint32_t k = 0; k < b->sets.n && !rc; k++) {
            sw_set *set = VEC_AT(t->b_setptrs, sw_set *, b->sets.off + k);
            uint32_t tid = tset_id(t, set);
            c = &VEC_AT(t->setconds, struct setcond, t->setconds.n - 1);
            c->kinds |= sw_set_kinds(set);
            rc = push_id(&t->setids, tid);
            if (!rc && anchor) {
                struct b_skey *p = sw_vec_push(&pairs, sizeof *p);
                if (!p)
                    rc = -ENOMEM;
                else
                    *p = (struct b_skey){tid, variant, b->rule};
            }
        }
    }
    sort_vec(&pairs, sizeof(struct b_skey), cmp_bskey);
    struct skey *k = NULL;
    for (size_t i = 0; i < pairs.n && !rc; i++) {
        const struct b_skey *b = &VEC_AT(pairs, struct b_skey, i);
        if (!k || k->tid != b->tid || k->variant != b->variant) {
            k = sw_vec_push(&t->skeys, sizeof *k);
            if (!k) {
                rc = -ENOMEM;
                break;
            }
            *k = (struct skey){b->tid, b->variant, {(uint32_t)t->ids.n, 0}};
        } else if (VEC_AT(t->ids, uint32_t, t->ids.n - 1) == b->rule) {
            continue;
        }
        rc = push_id(&t->ids, b->rule);
        k->rules.n++;
    }
    sw_vec_free(&pairs);
    if (!rc && t->skeys.n > 1)
        qsort_r(t->skeys.p, t->skeys.n, sizeof(struct skey), cmp_skey_first, t);
    return rc;
}

/* Whether rule `ru` resolves (enum sw_rule_flag). */
static bool resolves(const struct rule *ru)
{
    return (ru->flags & SW_RULE_RESOLVES) ||
           (!(ru->flags & SW_RULE_NO_RESOLVE) && (ru->kinds & K_NET_DST));
}

/* Whether a domain name can change rule `ru`'s answer (opaque items count:
 * see sw_table_first_domain_rule). */
static bool looks_at_names(const sw_table *t, const struct rule *ru)
{
    if (ru->kinds & (K_DOMAIN | K_OPAQUE))
        return true;
    const struct setcond *c = t->setconds.p;
    for (uint32_t i = ru->s[S_SETCOND].off; i < ru->s[S_SETCOND].off + ru->s[S_SETCOND].n; i++)
        if (c[i].kinds & (SK_DOMAIN | SK_OPAQUE))
            return true;
    return false;
}

int sw_table_seal(sw_table *t)
{
    if (!t || t->sealed || !t->mode)
        return -EINVAL;
    t->first_domain = (int32_t)t->nrules;
    t->first_net_dst = t->nrules;
    t->kinds = t->setkinds = 0;
    for (uint32_t r = 0; r < t->nrules; r++) {
        struct rule *ru = &t->rules[r];
        if (!ru->action)
            return -EINVAL;
        ru->anchor = pick_anchor(ru);
        ru->anchor_cond = NONE32;
        t->kinds |= ru->kinds;
        if (t->first_net_dst == t->nrules && resolves(ru))
            t->first_net_dst = r;
    }
    /* Bisected by source_local: sorted, duplicates dropped. */
    for (int f = 0; f < 2; f++) {
        struct vec *set = &t->local[f];
        sort_vec(set, sizeof(u128), cmp_local);
        u128 *a = set->p;
        size_t n = 0;
        for (size_t i = 0; i < set->n; i++)
            if (!n || a[n - 1] != a[i])
                a[n++] = a[i];
        set->n = n;
    }
    int rc = seal_sets(t);
    for (uint32_t r = 0; r < t->nrules && !rc; r++) {
        const struct rule *ru = &t->rules[r];
        /* Opaque may be a domain_regex (see sw_table_first_domain_rule). */
        if (t->first_domain == (int32_t)t->nrules && looks_at_names(t, ru))
            t->first_domain = (int32_t)r;
    }
    if (!rc)
        rc = seal_rule_nets(t);
    if (!rc)
        rc = seal_rule_ports(t);
    if (!rc)
        rc = seal_values(t, &t->b_inb, S_INBOUND, A_INBOUND, &t->inb_keys);
    if (!rc)
        rc = seal_values(t, &t->b_pri, S_PRINCIPAL, A_PRINCIPAL, &t->pri_keys);
    if (!rc)
        rc = seal_domains(t);
    if (!rc)
        rc = seal_keywords(t);
    if (!rc)
        rc = seal_net_index(t);
    t->scan = (struct slice){(uint32_t)t->ids.n, 0};
    for (uint32_t r = 0; r < t->nrules && !rc; r++)
        if (t->rules[r].anchor == A_SCAN && !(rc = push_id(&t->ids, r)))
            t->scan.n++;
    if (rc) {
        free_index(t);
        return rc;
    }
    t->sealed = true;
    return 0;
}

/* ---- decide ------------------------------------------------------------- */

/* What a host text is to routing._view (see the top for the unsure ones):
 * an address in any spelling hostnorm.target_address knows is H_IP. */
static int classify(const char *s, uint32_t n, struct ipaddr *ip)
{
    if (n == 0)
        return H_NONE;
    if (memchr(s, '%', n))
        return H_PERCENT;
    uint8_t a[16];
    switch (sw_host_addr((const uint8_t *)s, n, a)) {
    case SW_HOST_IP4:
        ip_from_bytes(4, a, ip);
        return H_IP;
    case SW_HOST_IP6:
        ip_from_bytes(6, a, ip);
        return H_IP;
    case SW_HOST_UNSURE:
        return H_NONASCII;
    default:
        return H_NAME;
    }
}

struct best {
    uint32_t rule;
    int tv;
};

static const struct dentry *dlookup(const sw_table *t, const char *s, uint32_t n, uint64_t h)
{
    const struct dentry *dents = t->dents.p;
    for (uint32_t i = sw_slot_of(h, t->dmask);; i = (i + 1) & t->dmask) {
        uint32_t e = t->dslots[i];
        if (!e)
            return NULL;
        const struct dentry *d = &dents[e - 1];
        if (d->hash != h || d->len != n)
            continue;
        uint32_t k = 0;
        while (k < n && sw_lower((unsigned char)s[k]) == (unsigned char)d->s[k])
            k++;
        if (k == n)
            return d;
    }
}

/* Walks the table's entries for the dot-suffixes of one host, right to left:
 * host[i+1:] at each '.', then the whole host (is_whole set). */
struct sfx_iter {
    const char *s;
    uint32_t n, i;
    uint64_t h;
    bool done;
};

static const struct dentry *sfx_next(const sw_table *t, struct sfx_iter *it, bool *is_whole)
{
    while (!it->done) {
        if (it->i == 0) {
            it->done = true;
            *is_whole = true;
            return dlookup(t, it->s, it->n, it->h);
        }
        uint32_t i = --it->i;
        unsigned char c = (unsigned char)it->s[i];
        const struct dentry *d = NULL;
        if (c == '.')
            d = dlookup(t, it->s + i + 1, it->n - i - 1, it->h);
        it->h = sw_hmix(it->h, sw_lower(c));
        if (d) {
            *is_whole = false;
            return d;
        }
    }
    return NULL;
}

static void sfx_init(struct sfx_iter *it, const char *s, uint32_t n)
{
    *it = (struct sfx_iter){.s = s, .n = n, .i = n, .h = FNV_OFFSET};
}

static bool in_ivals(const struct ival *iv, struct slice s, u128 x)
{
    uint32_t lo = s.off, hi = s.off + s.n; /* first interval with lo > x */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (iv[mid].lo <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > s.off && x <= iv[lo - 1].hi;
}

static bool in_ports(const struct prange *p, struct slice s, uint16_t x)
{
    uint32_t lo = s.off, hi = s.off + s.n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (p[mid].lo <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > s.off && x <= p[lo - 1].hi;
}

static bool ci_contains(const char *h, uint32_t hn, const char *k, uint32_t kn)
{
    if (kn > hn)
        return false;
    for (uint32_t i = 0; i + kn <= hn; i++) {
        uint32_t j = 0;
        while (j < kn && sw_lower((unsigned char)h[i + j]) == (unsigned char)k[j])
            j++;
        if (j == kn)
            return true;
    }
    return false;
}

static int domain_tv(const struct view *v, bool hit)
{
    return hit ? TV_TRUE : v->dom_unknown ? TV_UNKNOWN : TV_FALSE;
}

static bool exact_hit(const sw_table *t, const struct view *v, uint32_t r)
{
    for (int i = 0; i < v->nhosts; i++)
        if (v->whole[i] && has_id(t->ids.p, v->whole[i]->exact, r))
            return true;
    return false;
}

static bool suffix_hit(const sw_table *t, const struct view *v, uint32_t r)
{
    for (int i = 0; i < v->nhosts; i++) {
        struct sfx_iter it;
        const struct dentry *d;
        bool whole;
        sfx_init(&it, v->host[i], v->len[i]);
        while ((d = sfx_next(t, &it, &whole)))
            if (has_id(t->ids.p, d->suffix, r))
                return true;
    }
    return false;
}

static bool keyword_hit(const sw_table *t, const struct view *v, const struct rule *ru)
{
    const uint32_t *ids = t->rule_kws.p;
    const struct kword *kws = t->kws.p;
    for (uint32_t k = 0; k < ru->s[S_KEYWORD].n; k++) {
        const struct kword *kw = &kws[ids[ru->s[S_KEYWORD].off + k]];
        for (int i = 0; i < v->nhosts; i++)
            if (ci_contains(v->host[i], v->len[i], kw->s, kw->len))
                return true;
    }
    return false;
}

static int net_tv(const sw_table *t, const struct rule *ru, int slice4, int family, u128 ip)
{
    if (family < 0)
        return TV_UNKNOWN;
    if (family == 0)
        return TV_FALSE;
    return in_ivals(t->ivals.p, ru->s[slice4 + (family == 6)], ip) ? TV_TRUE : TV_FALSE;
}

/* The address a rule's ip_cidr conditions look at: a domain target's
 * resolved address only from the first resolving rule on. */
static int dst_of(const struct view *v, int variant, u128 *ip)
{
    if (variant == V_SRC) {
        *ip = v->src_ip;
        return v->src;
    }
    *ip = v->dst_ip;
    return variant == V_LIT && v->dst_resolved ? 0 : v->dst;
}

/* Table set `tid` against the flow, for ip_cidr items on `variant`'s address. */
static int set_tv(const sw_table *t, const struct view *v, uint32_t tid, int variant)
{
    uint8_t *m = tid < MEMO_SETS ? &v->memo[variant * MEMO_SETS + tid] : NULL;
    if (m && *m)
        return *m - 1;
    u128 ip;
    int family = dst_of(v, variant, &ip);
    int tv = sw_set_eval(t->tsets[tid], v, family, ip);
    if (m)
        *m = (uint8_t)(tv + 1);
    return tv;
}

/* The rule's set conditions but the anchor one when skip has K_SETANCHOR:
 * false as soon as one is, else unknown when one is. */
static int setconds_tv(const sw_table *t, const struct view *v, const struct rule *ru,
                       uint32_t skip)
{
    const struct setcond *c = t->setconds.p;
    const uint32_t *ids = t->setids.p;
    bool unknown = false;
    uint32_t skipped = (skip & K_SETANCHOR) ? ru->s[S_SETCOND].off + ru->anchor_cond : NONE32;
    for (uint32_t i = ru->s[S_SETCOND].off; i < ru->s[S_SETCOND].off + ru->s[S_SETCOND].n; i++) {
        if (i == skipped)
            continue;
        int tv = TV_FALSE;
        for (uint32_t k = c[i].sets.off; k < c[i].sets.off + c[i].sets.n && tv != TV_TRUE; k++) {
            int one = set_tv(t, v, ids[k], c[i].variant);
            if (one != TV_FALSE)
                tv = one;
        }
        if (c[i].invert)
            tv = tv == TV_TRUE ? TV_FALSE : tv == TV_FALSE ? TV_TRUE : TV_UNKNOWN;
        if (tv == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    return unknown ? TV_UNKNOWN : TV_TRUE;
}

/* Rule r's conditions against the flow, except the kinds in `skip` (known
 * true), before any inversion. */
static int conds_tv(const sw_table *t, const struct view *v, uint32_t r, uint32_t skip)
{
    const struct rule *ru = &t->rules[r];
    uint32_t k = ru->kinds & ~skip;
    bool unknown = false;
    int tv;
    /* A client elsewhere has no process (one here only Python knows: unknown). */
    if ((k & K_PROCESS) && !v->src_local)
        return TV_FALSE;
    if ((k & K_NETWORK) && !(ru->netmask & v->netmask))
        return TV_FALSE;
    if ((k & K_PORT_DST) && !in_ports(t->ports.p, ru->s[S_PORT_DST], v->port))
        return TV_FALSE;
    if ((k & K_PORT_SRC) && (!v->src || !in_ports(t->ports.p, ru->s[S_PORT_SRC], v->sport)))
        return TV_FALSE;
    if ((k & K_INBOUND) &&
        (v->inbound == NO_INBOUND || !has_id(t->vals.p, ru->s[S_INBOUND], v->inbound)))
        return TV_FALSE;
    if ((k & K_PRINCIPAL) && (v->principal == SW_NO_PRINCIPAL ||
                              !has_id(t->vals.p, ru->s[S_PRINCIPAL], v->principal)))
        return TV_FALSE;
    if (k & K_NET_DST) {
        u128 ip;
        int family = dst_of(v, r < t->first_net_dst ? V_LIT : V_DST, &ip);
        if ((tv = net_tv(t, ru, S_NET4_DST, family, ip)) == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    if ((k & K_NET_SRC) && net_tv(t, ru, S_NET4_SRC, v->src, v->src_ip) == TV_FALSE)
        return TV_FALSE;
    if (k & K_EXACT) {
        if ((tv = domain_tv(v, exact_hit(t, v, r))) == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    if (k & K_SUFFIX) {
        if ((tv = domain_tv(v, suffix_hit(t, v, r))) == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    if (k & K_KEYWORD) {
        if ((tv = domain_tv(v, keyword_hit(t, v, ru))) == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    if (k & K_SET) {
        if ((tv = setconds_tv(t, v, ru, skip)) == TV_FALSE)
            return TV_FALSE;
        unknown |= tv == TV_UNKNOWN;
    }
    if (k & (K_OPAQUE | K_PROCESS))
        unknown = true;
    return unknown ? TV_UNKNOWN : TV_TRUE;
}

/* Rule r against the flow (an inverted rule is never walked with a skip). */
static int rule_eval(const sw_table *t, const struct view *v, uint32_t r, uint32_t skip)
{
    int tv = conds_tv(t, v, r, skip);
    if (t->rules[r].flags & SW_RULE_INVERT)
        tv = tv == TV_TRUE ? TV_FALSE : tv == TV_FALSE ? TV_TRUE : TV_UNKNOWN;
    return tv;
}


/* ids[s] in rule order: the first rule below b->rule that is not false. */
static void walk(const sw_table *t, const struct view *v, struct slice s, uint32_t skip,
                 struct best *b)
{
    const uint32_t *ids = t->ids.p;
    for (uint32_t i = s.off; i < s.off + s.n; i++) {
        uint32_t r = ids[i];
        if (r >= b->rule)
            return;
        int tv = rule_eval(t, v, r, skip);
        if (tv != TV_FALSE) {
            b->rule = r;
            b->tv = tv;
            return;
        }
    }
}

static void ac_report(const sw_table *t, const struct view *v, uint32_t node, uint32_t *seen,
                      uint32_t *nseen, struct best *b)
{
    const struct acnode *ac = t->acm.nodes.p;
    const struct kword *kws = t->kws.p;
    for (uint32_t o = ac[node].kw != NONE32 ? node : ac[node].dict; o != NONE32; o = ac[o].dict) {
        uint32_t kw = ac[o].kw, i = 0;
        while (i < *nseen && seen[i] != kw)
            i++;
        if (i < *nseen)
            continue;
        if (*nseen < AC_SEEN)
            seen[(*nseen)++] = kw;
        walk(t, v, kws[kw].anchor, K_KEYWORD, b);
    }
}

static void ac_walk(const sw_table *t, const struct view *v, const char *s, uint32_t n,
                    struct best *b)
{
    uint32_t seen[AC_SEEN], nseen = 0, node = 0;
    const struct acnode *ac = t->acm.nodes.p;
    ac_report(t, v, 0, seen, &nseen, b); /* an empty keyword */
    for (uint32_t i = 0; i < n; i++) {
        unsigned char c = sw_lower((unsigned char)s[i]);
        uint32_t nx;
        for (;;) {
            nx = sw_acm_goto(&t->acm, node, c);
            if (nx != NONE32 || node == 0)
                break;
            node = ac[node].fail;
        }
        node = nx != NONE32 ? nx : 0;
        if (ac[node].kw != NONE32 || ac[node].dict != NONE32)
            ac_report(t, v, node, seen, &nseen, b);
    }
}

static void net_walk(const sw_table *t, const struct view *v, int field, int family, u128 ip,
                     uint32_t skip, struct best *b)
{
    struct slice g = t->cgroup_of[field][family == 6];
    const struct cgroup *groups = t->cgroups.p;
    const struct cnet *nets = t->cnets.p;
    for (uint32_t k = g.off; k < g.off + g.n; k++) {
        u128 x = ip & net_mask(family, groups[k].plen);
        uint32_t lo = groups[k].nets.off, hi = lo + groups[k].nets.n;
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (nets[mid].addr < x)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < groups[k].nets.off + groups[k].nets.n && nets[lo].addr == x)
            walk(t, v, nets[lo].anchor, skip, b);
    }
}

static void value_walk(const sw_table *t, const struct view *v, const struct vec *keys,
                       uint32_t value, uint32_t skip, struct best *b)
{
    const struct vkey *k = keys->p;
    uint32_t lo = 0, hi = (uint32_t)keys->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (k[mid].value < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < keys->n && k[lo].value == value)
        walk(t, v, k[lo].rules, skip, b);
}

static void add_host(const sw_table *t, struct view *v, const char *s, uint32_t n)
{
    if (n && s[n - 1] == '.')
        n--;
    v->host[v->nhosts] = s;
    v->len[v->nhosts] = n;
    v->whole[v->nhosts] = t->dents.n ? dlookup(t, s, n, sw_hash_rev(s, n)) : NULL;
    v->nhosts++;
}

static void make_view(const sw_table *t, const sw_route_query *q, struct view *v)
{
    struct ipaddr ip;
    memset(v, 0, sizeof *v);
    switch (classify(q->host, q->host_len, &ip)) {
    case H_NAME:
        add_host(t, v, q->host, q->host_len);
        /* resolved_ip is what the name resolved to, as for no host. */
        v->name_target = !q->resolved_family;
        /* fall through */
    case H_NONE:
        if (q->resolved_family) {
            ip_from_bytes(q->resolved_family, q->resolved_ip, &ip);
            v->dst = ip.family;
            v->dst_ip = ip.v;
            /* Not an address the client sent: rules before the first
             * resolving one do not see it. */
            v->dst_resolved = true;
        }
        break;
    case H_IP:
        v->dst = ip.family;
        v->dst_ip = ip.v;
        break;
    case H_NONASCII:
        /* Its IDNA form may be an address (hostnorm), else it is a name
         * whose address may matter: either way only Python knows. */
        v->dom_unknown = true;
        v->dst = -1;
        break;
    case H_PERCENT:
        v->dom_unknown = true;
        v->dst = -1;
        break;
    }
    if (q->sniffed) {
        switch (classify(q->sniffed, q->sniffed_len, &ip)) {
        case H_NAME:
            add_host(t, v, q->sniffed, q->sniffed_len);
            break;
        case H_NONASCII:
        case H_PERCENT:
            v->dom_unknown = true;
            break;
        default: /* an IP literal sniffed host is ignored */
            break;
        }
    }
    if (q->source_family) {
        struct ipaddr src = {.family = q->source_family, .v = 0};
        for (int i = 0; i < (src.family == 4 ? 4 : 16); i++)
            src.v = (src.v << 8) | q->source_ip[i];
        unmap(&src);
        v->src = src.family;
        v->src_ip = src.v;
        v->sport = q->source_port;
        /* Only tables with process rules pay for the lookup. */
        v->src_local = ((t->kinds & K_PROCESS) || (t->setkinds & SK_PROCESS)) &&
                       t->process_mode != SW_PROCESS_OFF && source_local(t, src.family, src.v);
    }
    v->port = q->port;
    v->netmask = (q->network == SW_NET_TCP || q->network == SW_NET_UDP)
                     ? (uint8_t)(1u << q->network) : 0;
    v->inbound = q->inbound;
    v->principal = q->principal;
}

static void decide_indexed(const sw_table *t, const struct view *v, struct best *b)
{
    walk(t, v, t->scan, 0, b);
    for (int i = 0; i < v->nhosts; i++) {
        if (t->dents.n) {
            struct sfx_iter it;
            const struct dentry *d;
            bool whole;
            sfx_init(&it, v->host[i], v->len[i]);
            while ((d = sfx_next(t, &it, &whole))) {
                if (whole)
                    walk(t, v, d->exact, K_EXACT, b);
                walk(t, v, d->sanchor, K_SUFFIX, b);
            }
        }
        if (t->acm.nodes.n)
            ac_walk(t, v, v->host[i], v->len[i], b);
    }
    if (v->dst > 0)
        net_walk(t, v, 0, v->dst, v->dst_ip, K_NET_DST, b);
    if (v->src > 0)
        net_walk(t, v, 1, v->src, v->src_ip, K_NET_SRC, b);
    if (v->principal != SW_NO_PRINCIPAL)
        value_walk(t, v, &t->pri_keys, v->principal, K_PRINCIPAL, b);
    if (v->inbound != NO_INBOUND)
        value_walk(t, v, &t->inb_keys, v->inbound, K_INBOUND, b);
    /* Last: a set costs a few probes per host label, and the rules found so
     * far spare every set whose rules all rank below them. */
    const struct skey *keys = t->skeys.p;
    const uint32_t *ids = t->ids.p;
    for (size_t k = 0; k < t->skeys.n; k++) {
        if (ids[keys[k].rules.off] >= b->rule)
            break;
        int tv = set_tv(t, v, keys[k].tid, (int)keys[k].variant);
        if (tv != TV_FALSE)
            walk(t, v, keys[k].rules, tv == TV_TRUE ? K_SETANCHOR : 0, b);
    }
}

int sw_table_decide(const sw_table *t, const sw_route_query *q, sw_route_result *out)
{
    if (!t || !q || !out || !t->sealed || (q->host_len && !q->host) ||
        (q->source_family != 0 && q->source_family != 4 && q->source_family != 6) ||
        (q->resolved_family != 0 && q->resolved_family != 4 && q->resolved_family != 6))
        return -EINVAL;
    *out = (sw_route_result){.action = SW_ROUTE_ROUTE, .rule = -1, .target = -1, .reserved = 0};
    if (t->mode != SW_MODE_RULE) {
        out->target = t->mode_target;
        return 0;
    }
    struct view v;
    make_view(t, q, &v);
    uint8_t memo[V_COUNT * MEMO_SETS];
    if (t->ntsets) {
        memset(memo, 0, sizeof memo);
        v.memo = memo;
    }
    struct best b = {t->nrules, TV_FALSE};
    if ((v.dom_unknown && (t->kinds & K_DOMAIN)) || (v.dst < 0 && (t->kinds & K_NET_DST))) {
        /* Facts the indexes cannot express: every rule, three-valued. */
        for (uint32_t r = 0; r < t->nrules; r++) {
            int tv = rule_eval(t, &v, r, 0);
            if (tv != TV_FALSE) {
                b = (struct best){r, tv};
                break;
            }
        }
    } else {
        decide_indexed(t, &v, &b);
    }
    /* An unknown alternative of a configured rule: a later one that holds
     * makes the whole rule hold (its alternatives share the action). */
    for (uint32_t r = b.rule + 1; b.tv == TV_UNKNOWN && r < t->nrules &&
                                  (t->rules[r].flags & SW_RULE_GROUPED);
         r++)
        if (rule_eval(t, &v, r, 0) == TV_TRUE)
            b = (struct best){r, TV_TRUE};
    if (v.name_target && t->first_net_dst <= b.rule && t->first_net_dst < t->nrules) {
        /* A resolving rule ranks at or before the match (an inverted one can
         * match a name without its address): the name's address may change
         * the route (routing.needs_address).  Python resolves it, or conn.c
         * passes the address its cache has in resolved_ip. */
        out->action = SW_ROUTE_DEFER;
        out->rule = (int32_t)t->first_net_dst;
    } else if (b.rule == t->nrules) {
        out->target = t->final_target;
    } else if (b.tv == TV_UNKNOWN) {
        out->action = SW_ROUTE_DEFER;
        out->rule = (int32_t)b.rule;
    } else {
        const struct rule *ru = &t->rules[b.rule];
        out->action = ru->action;
        out->rule = (int32_t)b.rule;
        out->target = ru->target;
    }
    return 0;
}

/* The first rule with a domain condition, counting opaque conditions too:
 * C cannot tell a domain_regex from a process_name, and a smaller answer only
 * makes conn.c wait for a sniffed host it did not need. */
uint32_t sw_table_rule_count(const sw_table *t)
{
    return t ? t->nrules : 0;
}

uint32_t sw_table_first_ip_rule(const sw_table *t)
{
    return t && t->sealed ? t->first_net_dst : 0;
}

int32_t sw_table_first_domain_rule(const sw_table *t)
{
    if (!t)
        return -EINVAL;
    if (t->sealed)
        return t->first_domain;
    for (uint32_t r = 0; r < t->nrules; r++)
        if (t->rules[r].kinds & (K_DOMAIN | K_OPAQUE | K_SET))
            return (int32_t)r;
    return (int32_t)t->nrules;
}

const sw_target_info *sw_table_target_info(const sw_table *t, uint32_t index)
{
    if (!t || index >= t->ntargets)
        return NULL;
    return &t->targets[index];
}

int sw_table_mode(const sw_table *t)
{
    return t ? t->mode : -EINVAL;
}
