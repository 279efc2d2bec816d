/*
 * IPv6 address text exactly as CPython 3.11's str(IPv6Address) writes it,
 * for parse.c, iplit.c and conn.c (each had its own copy).  Internal (static
 * inline), not part of the cffi cdef.
 */
#ifndef SW_IP6TEXT_H
#define SW_IP6TEXT_H

#include <stddef.h>
#include <stdint.h>

/* The longest text: eight 4-digit hextets and seven colons. */
#define SW_IP6_TEXT_MAX 39

/* ipaddress.IPv6Address(packed).compressed (_compress_hextets): lowercase
 * hex without leading zeros, the leftmost longest run of two or more zero
 * hextets replaced by "::".  Never mixed IPv4 notation: that is the caller's
 * decision (glibc's inet_ntop writes "::a.b.c.d" for IPv4-compatible
 * addresses, Python does not, which is why this is not inet_ntop).  Writes
 * the text and a NUL into `out` (SW_IP6_TEXT_MAX + 1 bytes); returns the
 * text's length. */
static inline size_t sw_ip6_text(const uint8_t a[16], char *out)
{
    static const char digits[] = "0123456789abcdef";
    unsigned h[8];
    int best = -1, best_len = 0, run = -1, run_len = 0;
    for (int i = 0; i < 8; i++) {
        h[i] = (unsigned)a[2 * i] << 8 | a[2 * i + 1];
        if (h[i] == 0) {
            if (run < 0)
                run = i;
            /* strictly longer: the first of equal runs wins */
            if (++run_len > best_len) {
                best_len = run_len;
                best = run;
            }
        } else {
            run = -1;
            run_len = 0;
        }
    }
    if (best_len < 2)
        best = -1;
    size_t n = 0;
    for (int i = 0; i < 8; i++) {
        if (i == best) {
            out[n++] = ':';
            out[n++] = ':';
            i += best_len - 1;
            continue;
        }
        if (i && i != best + best_len)
            out[n++] = ':';
        int started = 0;
        for (int shift = 12; shift >= 0; shift -= 4) {
            unsigned d = (h[i] >> shift) & 0xF;
            if (d || started || shift == 0) {
                out[n++] = digits[d];
                started = 1;
            }
        }
    }
    out[n] = '\0';
    return n;
}

#endif /* SW_IP6TEXT_H */
