/*
 * IP literals exactly as CPython 3.11's ipaddress reads them.  See iplit.h.
 */
#include "iplit.h"

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
