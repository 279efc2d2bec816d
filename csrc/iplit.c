/*
 * IP literals exactly as CPython 3.11's ipaddress reads them.  See iplit.h.
 */
#include "iplit.h"
#include "ip6text.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static int hex_value(uint8_t c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* ipaddress.IPv4Address(text) (_BaseV4._parse_octet): four dot-separated
 * decimal octets, 1..3 ASCII digits, no leading zero, at most 255. */
bool sw_ip4_parse(const uint8_t *s, size_t n, uint8_t out[4])
{
    size_t i = 0;
    for (int octet = 0; octet < 4; octet++) {
        if (octet) {
            if (i >= n || s[i] != '.')
                return false;
            i++;
        }
        size_t start = i;
        unsigned v = 0;
        while (i < n && s[i] >= '0' && s[i] <= '9' && i - start < 4) {
            v = v * 10 + (unsigned)(s[i] - '0');
            i++;
        }
        size_t digits = i - start;
        if (digits == 0 || digits > 3 || (digits > 1 && s[start] == '0') || v > 255)
            return false;
        out[octet] = (uint8_t)v;
    }
    return i == n;
}

/* ipaddress.IPv6Address(text) without a scope id (every caller refuses '%'
 * first), following _BaseV6._ip_int_from_string step by step: split at
 * every ':', an IPv4 tail when the last part holds a '.', at most 9 parts,
 * at most one empty inner part ("::"), empty ends only as part of "::", 1..4
 * hex digits per parsed part.  Python 3.11.7 has no separate length cap; the
 * later 45-character one changes no verdict (no valid text is longer). */
bool sw_ip6_parse(const uint8_t *s, size_t n, uint8_t out[16])
{
    enum { EMPTY = -1, BAD = -2, MAX_PARTS = 9 };
    if (n == 0)
        return false;
    size_t start[MAX_PARTS], plen[MAX_PARTS];
    int parts = 0;
    size_t from = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && s[i] != ':')
            continue;
        /* A tenth part means nine colons: more than 9 parts whatever the
         * tail is (an IPv4 tail only adds one), which Python refuses. */
        if (parts == MAX_PARTS)
            return false;
        start[parts] = from;
        plen[parts] = i - from;
        parts++;
        from = i + 1;
    }
    if (parts < 3)
        return false;

    long val[MAX_PARTS + 1];
    int count = 0;
    for (int p = 0; p < parts; p++) {
        const uint8_t *t = s + start[p];
        size_t m = plen[p];
        if (p == parts - 1 && memchr(t, '.', m)) {
            uint8_t v4[4];
            if (!sw_ip4_parse(t, m, v4))
                return false;
            val[count++] = (long)v4[0] << 8 | v4[1];
            val[count++] = (long)v4[2] << 8 | v4[3];
            continue;
        }
        long v = 0;
        if (m == 0) {
            v = EMPTY;
        } else if (m > 4) {
            v = BAD;
        } else {
            for (size_t k = 0; k < m; k++) {
                int d = hex_value(t[k]);
                if (d < 0) {
                    v = BAD;
                    break;
                }
                v = v << 4 | d;
            }
        }
        val[count++] = v;
    }
    if (count > MAX_PARTS)
        return false;

    int skip = -1;
    for (int i = 1; i < count - 1; i++) {
        if (val[i] == EMPTY) {
            if (skip >= 0)
                return false;
            skip = i;
        }
    }
    int hi, lo, skipped;
    if (skip >= 0) {
        hi = skip;
        lo = count - skip - 1;
        if (val[0] == EMPTY && --hi)
            return false;
        if (val[count - 1] == EMPTY && --lo)
            return false;
        skipped = 8 - (hi + lo);
        if (skipped < 1)
            return false;
    } else {
        if (count != 8 || val[0] == EMPTY || val[count - 1] == EMPTY)
            return false;
        hi = 8;
        lo = 0;
        skipped = 0;
    }
    int o = 0;
    for (int i = 0; i < hi; i++, o++) {
        if (val[i] < 0)
            return false;
        out[2 * o] = (uint8_t)(val[i] >> 8);
        out[2 * o + 1] = (uint8_t)val[i];
    }
    for (int i = 0; i < skipped; i++, o++)
        out[2 * o] = out[2 * o + 1] = 0;
    for (int i = count - lo; i < count; i++, o++) {
        if (val[i] < 0)
            return false;
        out[2 * o] = (uint8_t)(val[i] >> 8);
        out[2 * o + 1] = (uint8_t)val[i];
    }
    return true;
}

/* ---- target hosts in canonical form (spliceway/routing/hostnorm.py) ------------- */

static bool is_space(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* hostnorm._whatwg_number: the value saturated at 2^32 (every caller refuses
 * that much), or -1 on failure. */
static int64_t whatwg_number(const uint8_t *s, size_t n)
{
    const int64_t BIG = (int64_t)1 << 32;
    if (n == 0)
        return -1;
    unsigned base = 10;
    if (n >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        s += 2;
        n -= 2;
        base = 16;
    } else if (n >= 2 && s[0] == '0') {
        s++;
        n--;
        base = 8;
    }
    int64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        int d = hex_value(s[i]);
        if (d < 0 || (unsigned)d >= base)
            return -1;
        if (v < BIG)
            v = v * base + d;
        if (v > BIG)
            v = BIG;
    }
    return v;
}

/* hostnorm._whatwg_ipv4: the WHATWG IPv4 parser, one trailing dot allowed. */
static bool whatwg_ipv4(const uint8_t *s, size_t n, uint32_t *out)
{
    if (n > 1 && s[n - 1] == '.')
        n--; /* a last empty part goes, unless it is the only one */
    int64_t num[4];
    int parts = 0;
    size_t from = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && s[i] != '.')
            continue;
        if (parts == 4)
            return false;
        num[parts] = whatwg_number(s + from, i - from);
        if (num[parts] < 0)
            return false;
        parts++;
        from = i + 1;
    }
    for (int i = 0; i < parts - 1; i++)
        if (num[i] > 255)
            return false;
    if (num[parts - 1] >= (int64_t)1 << (8 * (5 - parts)))
        return false;
    uint64_t v = (uint64_t)num[parts - 1];
    for (int i = 0; i < parts - 1; i++)
        v += (uint64_t)num[i] << (8 * (3 - i));
    *out = (uint32_t)v;
    return true;
}

/* hostnorm._aton_prefix: glibc inet_aton's address, then whitespace and
 * anything. */
static bool aton_prefix(const uint8_t *s, size_t n, uint32_t *out)
{
    size_t cut = 0;
    while (cut < n && !is_space(s[cut]))
        cut++;
    if (cut == 0 || cut == n || s[cut - 1] == '.')
        return false;
    size_t from = 0;
    for (size_t i = 0; i <= cut; i++) {
        if (i < cut && s[i] != '.')
            continue;
        size_t m = i - from;
        const uint8_t *p = s + from;
        if (m == 0 || p[0] < '0' || p[0] > '9' ||
            (m == 2 && p[0] == '0' && (p[1] == 'x' || p[1] == 'X')))
            return false;
        from = i + 1;
    }
    return whatwg_ipv4(s, cut, out);
}

static int v4_result(uint32_t v, uint8_t out[16], bool loop)
{
    if (v == 0 && loop)
        v = 0x7f000001u; /* Linux connects to 0.0.0.0 as to 127.0.0.1 */
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
    return SW_HOST_IP4;
}

/* hostnorm._v6_text's address: IPv4-mapped as IPv4, :: as ::1. */
static int v6_result(const uint8_t *s, size_t n, uint8_t out[16], bool loop)
{
    if (!sw_ip6_parse(s, n, out))
        return SW_HOST_NAME;
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (!memcmp(out, mapped, 12)) {
        uint32_t v = (uint32_t)out[12] << 24 | (uint32_t)out[13] << 16 |
                     (uint32_t)out[14] << 8 | out[15];
        return v4_result(v, out, loop);
    }
    bool zero = loop;
    for (int i = 0; i < 16; i++)
        zero &= out[i] == 0;
    if (zero)
        out[15] = 1; /* and :: as ::1 */
    return SW_HOST_IP6;
}

static int host_addr(const uint8_t *s, size_t n, uint8_t out[16], bool loop)
{
    /* A C string ends at a NUL: all getaddrinfo or inet_aton would read. */
    const uint8_t *nul = n ? memchr(s, 0, n) : NULL;
    if (nul)
        n = (size_t)(nul - s);
    if (n == 0)
        return SW_HOST_NAME;
    if (memchr(s, '%', n))
        return SW_HOST_UNSURE; /* a scoped IPv6 address, maybe: Python's */
    for (size_t i = 0; i < n; i++)
        if (s[i] >= 0x80)
            return SW_HOST_UNSURE; /* IDNA first: Python's */
    if (n >= 2 && s[0] == '[' && s[n - 1] == ']') {
        if (memchr(s + 1, ':', n - 2))
            return v6_result(s + 1, n - 2, out, loop);
        uint8_t a[4];
        if (!sw_ip4_parse(s + 1, n - 2, a))
            return SW_HOST_NAME;
        return v4_result((uint32_t)a[0] << 24 | (uint32_t)a[1] << 16 | (uint32_t)a[2] << 8 | a[3],
                         out, loop);
    }
    if (memchr(s, ':', n)) {
        int k = v6_result(s, n, out, loop);
        if (k != SW_HOST_NAME)
            return k; /* else maybe inet_aton's, before whitespace ("0 :") */
    }
    uint32_t v;
    if (whatwg_ipv4(s, n, &v) || aton_prefix(s, n, &v))
        return v4_result(v, out, loop);
    return SW_HOST_NAME;
}

int sw_host_addr(const uint8_t *s, size_t n, uint8_t out[16])
{
    return host_addr(s, n, out, true);
}

int sw_host_addr_as_given(const uint8_t *s, size_t n, uint8_t out[16])
{
    return host_addr(s, n, out, false);
}

int sw_host_canon(const uint8_t *s, size_t n, char *out, size_t cap, size_t *out_len)
{
    if (!out || !out_len || (n && !s))
        return -EINVAL;
    uint8_t a[16];
    char text[SW_HOST_ADDR_MAX];
    size_t m;
    int kind = sw_host_addr(s, n, a);
    if (kind == SW_HOST_IP4) {
        m = (size_t)sprintf(text, "%u.%u.%u.%u", a[0], a[1], a[2], a[3]);
    } else if (kind == SW_HOST_IP6) {
        m = sw_ip6_text(a, text);
    } else {
        /* A name: one trailing dot dropped (not the only byte, nor one of
         * two), unless it has a '%', which Python leaves as given. */
        m = n;
        if (n > 1 && s[n - 1] == '.' && s[n - 2] != '.' && !memchr(s, '%', n)) {
            /* "::1." is no address, but "::1" would be: such a name keeps its
             * dot (idempotence).  UNSURE stays so: Python decides either way. */
            int k = sw_host_addr(s, n - 1, a);
            if (k != SW_HOST_IP4 && k != SW_HOST_IP6)
                m = n - 1;
        }
        if (m + 1 > cap)
            return -ENOSPC;
        if (m)
            memcpy(out, s, m);
        out[m] = 0;
        *out_len = m;
        return kind;
    }
    if (m + 1 > cap)
        return -ENOSPC;
    memcpy(out, text, m + 1);
    *out_len = m;
    return kind;
}
