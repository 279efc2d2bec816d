/*
 * fuzz_route: a standalone fuzz driver for the compiled route tables
 * (csrc/route.c, with csrc/iplit.c for the host literals), meant to be built
 * with -fsanitize=address,undefined (benchmarks/fuzz_slice.py builds and runs
 * it; tests/csrc/test_route_diff.py holds the same code to Python's answers).
 *
 *   fuzz_route [-n TABLES] [-t SECONDS] [-s SEED] [-o ITERATION]
 *
 * Each iteration builds one table from a seeded PRNG (seed ^ iteration):
 * random targets of every kind, a mode, rules with any mix of domain, cidr,
 * port, network, inbound, principal, opaque and process conditions, set
 * conditions (shared sets of names, wildcards, keywords, networks, ports,
 * networks, flags: csrc/route_set.c, some left unsealed, several per rule,
 * inverted, on the source) and rule flags (no_resolve, invert, resolves,
 * grouped), local addresses, fake-ip networks and deferred inbounds, some
 * builder calls with arguments out of range.  The sets are released by the
 * driver before the table is used: the table's references keep them.  Then it routes queries whose hosts and sniffed
 * hosts are names (mixed case, trailing dots, non-ASCII and odd bytes), IP
 * literals (dotted, inet_aton spellings, IPv6, mapped, scoped, bracketed)
 * or raw bytes, each in a malloc() block of exactly its length, so ASan sees
 * any read past it.
 *
 * Invariants (a failure prints the seed and iteration, which -o replays):
 *   - a builder answers 0 or a negative errno, never anything else;
 *   - sw_table_decide answers 0 on a sealed table, -EINVAL on an unsealed
 *     one; its action is ROUTE (with a target below ntargets), BLOCK or
 *     DEFER (target -1 both), its rule -1 or below the rule count;
 *   - the same query gives the same answer twice (a table is immutable);
 *   - host_deferred, source_deferred, inbound_deferred answer 0 or 1, and
 *     first_domain_rule / first_ip_rule lie in [0, nrules];
 *   - a sealed set answers sw_set_has_name / sw_set_has_addr with 0 or 1 (the
 *     same twice), an unsealed one -EINVAL, and its info counts what it holds.
 */
#define _GNU_SOURCE
#include "route.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t rng_state;
static uint64_t base_seed, iteration;

static uint64_t next(void)
{
    /* splitmix64: cheap, and any seed gives a full-period stream */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t below(uint32_t n) { return n ? (uint32_t)(next() % n) : 0; }
static bool chance(uint32_t n) { return below(n) == 0; }

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "fuzz_route: ");                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n  replay: fuzz_route -s %llu -o %llu\n", (unsigned long long)base_seed, \
                (unsigned long long)iteration);                                                    \
        abort();                                                                                   \
    } while (0)

static void check_rc(const char *what, int rc)
{
    if (rc != 0 && rc != -EINVAL && rc != -ERANGE && rc != -ENOSPC && rc != -ENOMEM)
        FAIL("%s answered %d", what, rc);
}

/* ---- generated text ------------------------------------------------------ */

static const char *const LABELS[] = {"a",
                                     "b",
                                     "ex",
                                     "cdn",
                                     "api",
                                     "ads",
                                     "x1",
                                     "com",
                                     "org",
                                     "k",
                                     "1",
                                     "0",
                                     "xn--bcher-kva",
                                     "EXAMPLE",
                                     "Com",
                                     "b\xc3\xbc"
                                     "cher",
                                     "-",
                                     "_x",
                                     "localhost",
                                     "255",
                                     "0x7f",
                                     "00"};
static const char ODD[] = ".%:[]@/\\ \t\x7f\x80\xff\0";

/* A name: labels, random case, now and then a trailing dot or an odd byte. */
static size_t gen_name(char *out, size_t cap)
{
    size_t n = 0;
    uint32_t labels = 1 + below(4);
    for (uint32_t i = 0; i < labels; i++) {
        const char *l = LABELS[below(sizeof LABELS / sizeof *LABELS)];
        size_t m = strlen(l);
        if (n + m + 2 >= cap)
            break;
        if (i)
            out[n++] = '.';
        for (size_t k = 0; k < m; k++)
            out[n++] = chance(3) && l[k] >= 'a' && l[k] <= 'z' ? (char)(l[k] - 32) : l[k];
    }
    if (chance(6) && n + 1 < cap)
        out[n++] = '.';
    if (chance(8) && n)
        out[below((uint32_t)n)] = ODD[below(sizeof ODD)];
    return n;
}

/* An IP literal in one of the spellings the classifiers meet. */
static size_t gen_ip(char *out, size_t cap)
{
    uint32_t r = (uint32_t)next();
    int n;
    switch (below(8)) {
    case 0:
        n = snprintf(out, cap, "%u.%u.%u.%u", r & 255, r >> 8 & 255, r >> 16 & 255, r >> 24);
        break;
    case 1: /* inet_aton: fewer parts, hex, octal */
        n = snprintf(out, cap, chance(2) ? "0x%x.%o" : "%u.%u", r >> 24, r & 0xffffff);
        break;
    case 2:
        n = snprintf(out, cap, "%x:%x::%x", r & 0xffff, r >> 16, below(65536));
        break;
    case 3:
        n = snprintf(out, cap, "::ffff:%u.%u.%u.%u", r & 255, r >> 8 & 255, r >> 16 & 255, r >> 24);
        break;
    case 4:
        n = snprintf(out, cap, "fe80::%x%%eth%u", r & 0xffff, below(3));
        break;
    case 5:
        n = snprintf(out, cap, "[2001:db8::%x]", r & 0xffff);
        break;
    case 6:
        n = snprintf(out, cap, "%u.%u.%u.%u.", 10u, r & 255, r >> 8 & 255, r >> 16 & 255);
        break;
    default:
        n = snprintf(out, cap, "::%u.%u.%u.%u", r & 255, r >> 8 & 255, r >> 16 & 255, r >> 24);
        break;
    }
    return n < 0 ? 0 : (size_t)n >= cap ? cap - 1 : (size_t)n;
}

static size_t gen_host(char *out, size_t cap)
{
    switch (below(5)) {
    case 0:
    case 1:
        return gen_name(out, cap);
    case 2:
    case 3:
        return gen_ip(out, cap);
    default: {
        size_t n = below(cap < 300 ? (uint32_t)cap : 300);
        for (size_t i = 0; i < n; i++)
            out[i] = chance(2) ? ODD[below(sizeof ODD)] : (char)next();
        return n;
    }
    }
}

/* An address of `family` (4 or 16 bytes), biased toward the interesting ones. */
static void gen_addr(int family, uint8_t *a)
{
    size_t n = family == 4 ? 4 : 16;
    for (size_t i = 0; i < n; i++)
        a[i] = (uint8_t)next();
    if (chance(3)) {
        memset(a, 0, n);
        if (family == 4) {
            a[0] = chance(2) ? 127 : 10;
            a[3] = (uint8_t)below(4);
        } else if (chance(2)) {
            a[10] = a[11] = 0xff; /* IPv4-mapped */
            a[12] = 127;
            a[15] = 1;
        } else {
            a[15] = 1;
        }
    }
}

/* ---- shared sets ----------------------------------------------------------- */

#define MAX_SETS 6
static sw_set *sets[MAX_SETS];
static bool set_sealed[MAX_SETS];
static uint32_t nsets;

/* A name item: a generated host, now and then a wildcard pattern. */
static size_t gen_item(char *out, size_t cap)
{
    size_t n = gen_host(out, cap - 4);
    if (chance(4)) { /* a '*' label somewhere, maybe a leading '.' */
        size_t at = below((uint32_t)n + 1);
        while (at > 0 && out[at - 1] != '.')
            at--;
        memmove(out + at + 2, out + at, n - at);
        out[at] = '*';
        out[at + 1] = '.';
        n += 2;
        if (chance(3)) {
            memmove(out + 1, out, n);
            out[0] = '.';
            n++;
        }
    }
    return n;
}

static void build_sets(void)
{
    char buf[4096], item[310];
    uint8_t addrs[16 * 8], prefixes[8];
    nsets = below(MAX_SETS + 1);
    for (uint32_t i = 0; i < nsets; i++) {
        set_sealed[i] = false;
        if (sw_set_new(&sets[i]))
            FAIL("sw_set_new failed");
        for (uint32_t k = below(6); k; k--) {
            size_t len = 0;
            for (uint32_t j = below(12); j; j--) {
                size_t n = gen_item(item, sizeof item);
                if (len + n + 1 > sizeof buf)
                    break;
                memcpy(buf + len, item, n);
                len += n;
                buf[len++] = '\0'; /* a NUL inside an item just splits it */
            }
            if (chance(10) && len)
                len--; /* no final NUL: refused */
            int kind = 1 + (int)below(5) + (chance(16) ? 5 : 0);
            int rc = sw_set_domains(sets[i], kind, len || chance(2) ? buf : NULL, len);
            check_rc("set_domains", rc);
        }
        for (uint32_t k = below(3); k; k--) {
            int family = chance(2) ? 4 : 6;
            uint32_t n = below(9);
            for (uint32_t j = 0; j < n; j++) {
                gen_addr(family, addrs + j * (family == 4 ? 4 : 16));
                prefixes[j] = (uint8_t)below(family == 4 ? 34 : 130);
            }
            check_rc("set_cidrs", sw_set_cidrs(sets[i], (int)below(3), chance(16) ? 5 : family,
                                               addrs, prefixes, n));
        }
        for (uint32_t k = below(3); k; k--) {
            uint16_t lo = (uint16_t)below(2000), hi = (uint16_t)(lo + below(3000) - 100);
            check_rc("set_port", sw_set_port(sets[i], (int)below(3), lo, hi));
        }
        if (chance(3))
            check_rc("set_network", sw_set_network(sets[i], (int)below(4)));
        if (chance(3))
            check_rc("set_flags", sw_set_flags(sets[i], below(10)));
        /* Unsealed sets answer lookups with -EINVAL. */
        if (sw_set_has_name(sets[i], "a", 1) != -EINVAL)
            FAIL("has_name on an unsealed set");
        if (!chance(6)) {
            int rc = sw_set_seal(sets[i]);
            check_rc("set_seal", rc);
            set_sealed[i] = rc == 0;
            if (set_sealed[i] && sw_set_seal(sets[i]) != -EINVAL)
                FAIL("a set sealed twice");
        }
        sw_set_info info;
        if (sw_set_info_get(sets[i], &info) || info.bytes < sizeof(sw_set_info))
            FAIL("set info");
    }
}

static void query_sets(void)
{
    char text[300];
    uint8_t a[16];
    for (uint32_t i = 0; i < nsets; i++) {
        for (uint32_t q = 0; q < 16; q++) {
            size_t n = gen_item(text, sizeof text);
            char *h = malloc(n ? n : 1); /* exactly n bytes: ASan sees any overread */
            if (!h)
                FAIL("out of memory");
            memcpy(h, text, n);
            int r1 = sw_set_has_name(sets[i], h, (uint32_t)n);
            int r2 = sw_set_has_name(sets[i], h, (uint32_t)n);
            free(h);
            if (set_sealed[i] ? (r1 != 0 && r1 != 1) || r1 != r2 : r1 != -EINVAL)
                FAIL("has_name answered %d then %d", r1, r2);
            int family = chance(2) ? 4 : 6;
            gen_addr(family, a);
            r1 = sw_set_has_addr(sets[i], (int)below(2), family, a);
            if (set_sealed[i] ? r1 != 0 && r1 != 1 : r1 != -EINVAL)
                FAIL("has_addr answered %d", r1);
        }
    }
}

static void release_sets(void)
{
    for (uint32_t i = 0; i < nsets; i++)
        sw_set_free(sets[i]);
    nsets = 0;
}

/* ---- one table ----------------------------------------------------------- */

static uint32_t nrules, ntargets;
/* What the run reached, for its report: sealed tables, answers by action. */
static unsigned long long sealed_tables, actions[4];

static int32_t a_target(void)
{
    return chance(16) ? (int32_t)below(ntargets + 2) - 1 : (int32_t)below(ntargets);
}

static void add_condition(sw_table *t, uint32_t r)
{
    char text[300];
    uint8_t a[16];
    if (nsets && chance(5)) {
        sw_set *pick[MAX_SETS];
        uint32_t n = below(nsets + 1);
        for (uint32_t i = 0; i < n; i++)
            pick[i] = sets[below(nsets)];
        check_rc("cond_sets", sw_table_cond_sets(t, r, below(5), n ? pick : NULL, n));
        return;
    }
    switch (below(9)) {
    case 0: {
        size_t n = gen_host(text, sizeof text);
        text[n] = '\0';
        check_rc("cond_domain", sw_table_cond_domain(t, r, 1 + (int)below(4), text));
        break;
    }
    case 1: {
        int family = chance(2) ? 4 : 6;
        gen_addr(family, a);
        int prefix = (int)below(family == 4 ? 34 : 130) - (chance(16) ? 1 : 0);
        check_rc("cond_cidr",
                 sw_table_cond_cidr(t, r, (int)below(3), chance(16) ? 5 : family, a, prefix));
        break;
    }
    case 2: {
        uint16_t lo = (uint16_t)(chance(2) ? below(1024) : next());
        uint16_t hi = (uint16_t)(chance(4) ? lo : lo + below(2000));
        check_rc("cond_port", sw_table_cond_port(t, r, (int)below(3), lo, hi));
        break;
    }
    case 3:
        check_rc("cond_network", sw_table_cond_network(t, r, (int)below(4)));
        break;
    case 4:
        check_rc("cond_inbound", sw_table_cond_inbound(t, r, below(5)));
        break;
    case 5:
        check_rc("cond_principal",
                 sw_table_cond_principal(t, r, chance(4) ? SW_NO_PRINCIPAL : below(4)));
        break;
    case 6:
        check_rc("cond_opaque", sw_table_cond_opaque(t, r));
        break;
    case 7:
        check_rc("cond_process", sw_table_cond_process(t, r));
        break;
    default: /* a rule index past the end */
        check_rc("cond_network", sw_table_cond_network(t, nrules + below(3), 1));
        break;
    }
}

static sw_table *build_table(bool *sealed)
{
    nrules = below(13);
    ntargets = 1 + below(5);
    sw_table *t = NULL;
    int rc = sw_table_new(nrules, ntargets, next(), &t);
    if (rc)
        FAIL("sw_table_new answered %d", rc);
    char server[300];
    for (uint32_t i = 0; i < ntargets; i++) {
        size_t n = chance(2) ? gen_name(server, sizeof server) : gen_ip(server, sizeof server);
        server[n] = '\0';
        int kind = (int)below(6);
        check_rc("target",
                 sw_table_target(t, i, kind, chance(8) ? NULL : server, (uint16_t)next(),
                                 chance(2) ? "u" : NULL, chance(2) ? "pw" : "", below(20000)));
        if (chance(2))
            check_rc("target_tag", sw_table_target_tag(t, i, chance(8) ? "" : "tag"));
    }
    uint32_t mode = chance(6) ? 2 + below(2) : 1;
    check_rc("set_mode", sw_table_set_mode(t, (int)mode, mode == 1 ? -1 : a_target(),
                                           mode == 1 ? a_target() : -1));
    for (uint32_t r = 0; r < nrules; r++) {
        if (!chance(32)) { /* now and then a rule left without an action */
            bool block = chance(5);
            check_rc("rule", sw_table_rule(t, r, block ? SW_ROUTE_BLOCK : SW_ROUTE_ROUTE,
                                           block ? -1 : a_target()));
        }
        for (uint32_t k = below(5); k; k--)
            add_condition(t, r);
        if (chance(3))
            check_rc("rule_flags", sw_table_rule_flags(t, r, below(20)));
    }
    check_rc("set_process", sw_table_set_process(t, (int)below(4)));
    uint8_t a[16];
    for (uint32_t k = below(3); k; k--) {
        int family = chance(2) ? 4 : 6;
        gen_addr(family, a);
        check_rc("local_addr", sw_table_local_addr(t, family, a));
    }
    for (uint32_t k = below(4); k; k--) {
        int family = chance(2) ? 4 : 6;
        gen_addr(family, a);
        check_rc("defer_cidr",
                 sw_table_defer_cidr(t, family, a, (int)below(family == 4 ? 33 : 129)));
    }
    for (uint32_t k = below(3); k; k--)
        check_rc("defer_inbound", sw_table_defer_inbound(t, below(SW_TABLE_INBOUND_SLOTS + 2)));
    rc = sw_table_seal(t);
    check_rc("seal", rc);
    *sealed = rc == 0;
    return t;
}

/* A copy of n bytes in a block of exactly n (NULL for n == 0 now and then). */
static char *exact(const char *s, size_t n)
{
    if (!n && chance(2))
        return NULL;
    char *p = malloc(n ? n : 1);
    if (!p)
        FAIL("out of memory");
    memcpy(p, s, n);
    return p;
}

static void route_queries(const sw_table *t, bool sealed)
{
    char text[300];
    for (uint32_t q = 0; q < 64; q++) {
        sw_route_query query;
        memset(&query, 0, sizeof query);
        size_t hn = gen_host(text, sizeof text);
        char *host = exact(text, hn);
        char *sniffed = NULL;
        query.host = host;
        query.host_len = host ? (uint32_t)hn : 0;
        if (chance(3)) {
            size_t sn = gen_host(text, sizeof text);
            sniffed = exact(text, sn);
            query.sniffed = sniffed;
            query.sniffed_len = sniffed ? (uint32_t)sn : 0;
        }
        query.port = (uint16_t)(chance(2) ? below(1024) : next());
        query.source_port = (uint16_t)next();
        query.source_family = (uint8_t)(chance(8) ? 0 : chance(2) ? 4 : 6);
        if (query.source_family)
            gen_addr(query.source_family, query.source_ip);
        query.network = (uint8_t)(1 + below(2));
        query.inbound = below(5);
        query.principal = chance(2) ? SW_NO_PRINCIPAL : below(4);
        if (chance(3)) {
            query.resolved_family = (uint8_t)(chance(2) ? 4 : 6);
            gen_addr(query.resolved_family, query.resolved_ip);
        }
        sw_route_result out, again;
        int rc = sw_table_decide(t, &query, &out);
        if (!sealed) {
            if (rc != -EINVAL)
                FAIL("decide on an unsealed table answered %d", rc);
        } else {
            if (rc != 0)
                FAIL("decide answered %d", rc);
            bool route = out.action == SW_ROUTE_ROUTE;
            if (out.action < SW_ROUTE_ROUTE || out.action > SW_ROUTE_DEFER)
                FAIL("action %d", out.action);
            if (route ? out.target < 0 || (uint32_t)out.target >= ntargets : out.target != -1)
                FAIL("action %d with target %d of %u", out.action, out.target, ntargets);
            if (out.rule < -1 || (out.rule >= 0 && (uint32_t)out.rule >= nrules))
                FAIL("rule %d of %u", out.rule, nrules);
            if (sw_table_decide(t, &query, &again) != 0 || memcmp(&out, &again, sizeof out))
                FAIL("the same query answered twice differently");
            actions[out.action]++;
        }
        int d = sw_table_host_deferred(t, host, query.host_len);
        if (d != 0 && d != 1 && d != -EINVAL)
            FAIL("host_deferred answered %d", d);
        d = sw_table_source_deferred(t, query.source_family, query.source_ip);
        if (d != 0 && d != 1 && d != -EINVAL)
            FAIL("source_deferred answered %d", d);
        d = sw_table_inbound_deferred(t, query.inbound);
        if (d != 0 && d != 1)
            FAIL("inbound_deferred answered %d", d);
        free(host);
        free(sniffed);
    }
    if (sealed) {
        int32_t fd = sw_table_first_domain_rule(t);
        uint32_t fi = sw_table_first_ip_rule(t);
        if (fd < 0 || (uint32_t)fd > nrules || fi > nrules)
            FAIL("first rules %d, %u of %u", fd, fi, nrules);
    }
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    unsigned long long count = 1000000, only = 0;
    double seconds = 60;
    bool replay = false;
    int opt;
    base_seed = 1;
    while ((opt = getopt(argc, argv, "n:t:s:o:")) != -1) {
        switch (opt) {
        case 'n':
            count = strtoull(optarg, NULL, 10);
            break;
        case 't':
            seconds = strtod(optarg, NULL);
            break;
        case 's':
            base_seed = strtoull(optarg, NULL, 10);
            break;
        case 'o':
            only = strtoull(optarg, NULL, 10);
            replay = true;
            break;
        default:
            fprintf(stderr, "usage: fuzz_route [-n TABLES] [-t SECONDS] [-s SEED] [-o ITER]\n");
            return 2;
        }
    }
    double start = now();
    unsigned long long done = 0;
    for (iteration = replay ? only : 0; replay ? iteration == only : iteration < count;
         iteration++) {
        if (!replay && (iteration & 63) == 0 && now() - start > seconds)
            break;
        rng_state = base_seed ^ (iteration * 0xD1B54A32D192ED03ull);
        bool sealed;
        build_sets();
        query_sets();
        sw_table *t = build_table(&sealed);
        release_sets(); /* the table holds its own references */
        route_queries(t, sealed);
        sealed_tables += sealed;
        sw_table_free(t);
        done++;
    }
    printf("fuzz_route: %llu tables (%llu sealed), %llu queries in %.1f s, seed %llu; "
           "route %llu, block %llu, defer %llu\n",
           done, sealed_tables, done * 64, now() - start, (unsigned long long)base_seed,
           actions[SW_ROUTE_ROUTE], actions[SW_ROUTE_BLOCK], actions[SW_ROUTE_DEFER]);
    return 0;
}
