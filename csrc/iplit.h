/*
 * IP literal parsing shared by the C modules (parse.c for CONNECT authorities
 * and sniffed hosts, route.c for rule matching, conn.c for dialling), with
 * the verdicts of CPython 3.11's ipaddress.IPv4Address / IPv6Address: the
 * Python code they stand in for decides with those, so C must not use
 * inet_pton, whose corner cases differ.
 *
 * And target hosts in canonical form (sw_host_canon, sw_host_addr), exactly
 * as spliceway/routing/hostnorm.py writes them: every spelling of an IP address that
 * a browser's URL parser, glibc's inet_aton/getaddrinfo or the resolver's
 * IDNA step reads as an address is that address (tests/csrc/
 * test_hostnorm_diff.py holds the two to it).  Only those two are in the
 * cffi cdef (for the differential tests).
 */
#ifndef SW_IPLIT_H
#define SW_IPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Dotted decimal: four octets of 1..3 digits, no leading zero, <= 255. */
bool sw_ip4_parse(const uint8_t *s, size_t n, uint8_t out[4]);
/* IPv6 text without a scope id (callers refuse '%' first); an IPv4 tail is
 * allowed.  out is in network order. */
bool sw_ip6_parse(const uint8_t *s, size_t n, uint8_t out[16]);
/* sw_host_addr without reading 0.0.0.0 and :: as the loopback addresses. */
int sw_host_addr_as_given(const uint8_t *s, size_t n, uint8_t out[16]);

/* SW_CDEF_BEGIN */

/* What a target host is (hostnorm.target_address). */
enum sw_host_kind {
    SW_HOST_NAME = 1,   /* a domain name */
    SW_HOST_UNSURE = 2, /* non-ASCII (an address only if its IDNA form is
                           one) or with a '%' (a scoped IPv6 address, maybe):
                           Python decides */
    SW_HOST_IP4 = 4,
    SW_HOST_IP6 = 6
};

/* The longest address text sw_host_canon writes, with its NUL. */
#define SW_HOST_ADDR_MAX 48

/* The address s[0..n) reads as: IPv4 (out[0..4]) in any spelling hostnorm
 * knows, IPv6 (out[0..16]); IPv4-mapped IPv6 is IPv4, 0.0.0.0 is 127.0.0.1
 * and :: is ::1.  Else SW_HOST_NAME or SW_HOST_UNSURE (out undefined). */
int sw_host_addr(const uint8_t *s, size_t n, uint8_t out[16]);

/* hostnorm.canonical_host: the address text (dotted quad, RFC 5952 IPv6 as
 * ipaddress writes it) for SW_HOST_IP4/6; for a name, s without one trailing
 * dot (kept when it is the only byte, follows another dot, or s without it
 * would be an address); for SW_HOST_UNSURE the same as for a name, except
 * that a host with a '%' is given unchanged (Python may still find an
 * address, and for a non-ASCII name may keep a dot C drops).  Writes a NUL
 * after *out_len bytes; -ENOSPC when cap is too small for the text and its
 * NUL (never with cap > max(n, SW_HOST_ADDR_MAX - 1)), -EINVAL for NULL
 * pointers.  Returns enum sw_host_kind. */
int sw_host_canon(const uint8_t *s, size_t n, char *out, size_t cap, size_t *out_len);

/* SW_CDEF_END */

#endif /* SW_IPLIT_H */
