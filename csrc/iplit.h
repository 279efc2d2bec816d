/*
 * IP literal parsing shared by the C modules (parse.c for CONNECT authorities
 * and sniffed hosts, route.c for rule matching, conn.c for dialling), with
 * the verdicts of CPython 3.11's ipaddress.IPv4Address / IPv6Address: the
 * Python code they stand in for decides with those, so C must not use
 * inet_pton, whose corner cases differ.  Internal: not part of the cffi cdef.
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

#endif /* SW_IPLIT_H */
