/*
 * fuzz_parse: a standalone fuzz driver for the C handshake and sniff parsers
 * (csrc/parse.c), the target host normalizer (csrc/iplit.c) and the TUN
 * packet parser and rewriter (csrc/pkt.c),
 * meant to be built with -fsanitize=address,undefined (see
 * benchmarks/fuzz_parse.py, which builds and runs it).
 *
 *   fuzz_parse [-n COUNT] [-t SECONDS] [-s SEED] [-p EVERY] [SEEDFILE...]
 *
 * Inputs come from a seeded PRNG: valid messages generated here (SOCKS5
 * greetings, username/password and requests with IPv4/IPv6/UTF-8 domain
 * addresses; SOCKS5 UDP ASSOCIATE datagrams with any RSV and FRAG; HTTP CONNECT heads with headers and Basic credentials; HTTP
 * requests with a Host; TLS ClientHellos with SNI, sometimes cut into several
 * records; upstream proxy response heads with obs-fold, sometimes with odd
 * bytes in the version or a field name; IPv4/IPv6 packets with TCP, UDP,
 * ICMP or other payloads, options and extension headers; "host\0user\0pass"
 * arguments for the CONNECT request builder; IPv4 addresses in inet_aton and
 * WHATWG spellings, 1..4 parts of decimal, octal and hex, with trailing dots,
 * whitespace and junk) and any SEEDFILEs (raw
 * messages, e.g. genuine ClientHellos), then
 * mutated: bit flips, interesting bytes, inserted/deleted/duplicated runs,
 * truncation, splices of two seeds, and 8/16-bit length-field edits.  Some
 * inputs are plain random bytes, a few are grown past SNIFF_LIMIT or
 * http.MAX_HEAD_SIZE.  Every input goes through every parser in a malloc()
 * block of exactly its length, so ASan sees any over-read; one input in EVERY
 * (default 64) is also run at every prefix length.  The response parser gets
 * a max_size per input: mostly http.MAX_HEAD_SIZE, sometimes one near or
 * below the input's length.  Every input is also read as builder arguments
 * (see run_builder), with output blocks of exactly the capacity passed.
 *
 * Invariants checked (a failure prints the input, writes it to
 * fuzz-parse-failure.bin and aborts):
 *   - status is one of the four; SOCKS5, sniffing and the response parser
 *     never defer, HTTP CONNECT never answers ERROR, the UDP datagram
 *     parser answers only OK or ERROR, sw_parse_s5_udp_fields exactly as
 *     sw_parse_s5_udp without the host text; reply_len <=
 *     SW_PARSE_REPLY_MAX and 0 unless ERROR;
 *   - on OK: 0 < consumed <= len; offsets inside the message; every host,
 *     user and password NUL-terminated with its length == strlen; hosts are
 *     non-empty and made of the characters their parser can produce; a
 *     response head starts "HTTP/1.<d> <status>", ends at the first
 *     "\n\r?\n" (within max_size), holds no NUL, and 100 <= status <= 999;
 *   - over the prefixes of an input every parser answers NEED_MORE until it
 *     reaches a final verdict (OK, ERROR or DEFER) that every longer prefix
 *     repeats with identical fields: Python's parsers decide on the bytes
 *     seen, never on how many follow (SOCKS5, HTTP, sniffing alike); a
 *     datagram is whole, so the UDP parser instead answers ERROR until its
 *     first OK, and every longer prefix the same header fields (the rest is
 *     payload);
 *   - sw_http_response_error answers -EINVAL (msg "") unless the response
 *     parser answered ERROR, else a length: msg is one of
 *     parse_response_head's messages, NUL-terminated, nothing written past
 *     the NUL, under SW_HTTP_RESPONSE_ERROR_MAX for max_size <=
 *     http.MAX_HEAD_SIZE; a quoted version or header name is exactly what
 *     repr() writes for a latin-1 str (quote choice, escapes, \xNN only
 *     for what is not printable, printable non-ASCII in UTF-8) and undoes
 *     to the status line's version or a field line's name (invalid for
 *     "invalid header name", a token for "invalid character in header");
 *     the same at cap == length + 1, -ENOSPC below it (cap == length, a
 *     random one, 0) with the longest prefix that splits no UTF-8 sequence;
 *   - packets (sw_pkt_parse and the rewrite and builders after it): a status
 *     of enum sw_pkt_status, out zeroed unless OK; on OK the lengths and
 *     offsets nest inside the input and the addresses are the header's; the
 *     NAT rewrite of TCP/UDP parses back with exactly the new endpoints,
 *     touches no payload or trailing byte, keeps a verified checksum
 *     verified, and reversed restores every byte but the two forms of a
 *     zero checksum (other protocols: -EINVAL, untouched); an echo reply
 *     parses back swapped with the checksum verdict unchanged; a reset and
 *     a UDP datagram built into exact-size blocks parse back, verify, and
 *     -EMSGSIZE one byte short; a prefix of an input parses OK only with the
 *     whole input's fields;
 *   - offloads: every input of at least SW_VNET_HDR_LEN bytes is also read
 *     as [virtio-net header][packet] (what a TUN with IFF_VNET_HDR reads;
 *     gen_vnet_frame makes plausible ones, GSO and partial checksums with
 *     now and then a field off by one): sw_pkt_vnet_check agrees with the
 *     driver's own statement of the rules (vnet_expect) and touches
 *     nothing; for an accepted NEEDS_CSUM packet sw_pkt_rewrite_partial
 *     parses back with exactly the new endpoints, touches no payload, moves
 *     a field that held the old addresses' pseudo-header sum to exactly the
 *     new ones' (which then finishes into a checksum that verifies), and
 *     reversed restores every byte but a field of 0 (back as 0xffff);
 *   - the host normalizer (sw_host_canon, sw_host_addr) answers one kind of
 *     enum sw_host_kind, the same from both, with a NUL-terminated text of
 *     at most max(len, SW_HOST_ADDR_MAX - 1) bytes; a name is the input or
 *     the input less one trailing dot; an address is a dotted quad or IPv6
 *     text that sw_ip4_parse / sw_ip6_parse read back as sw_host_addr's
 *     bytes, and canonicalizes to itself; -ENOSPC at cap == length, the same
 *     answer at cap == length + 1;
 *   - the builder answers -EINVAL, -ENOSPC or a length <= cap; the same
 *     length again with cap == length (same bytes), -ENOSPC below it, and
 *     -EINVAL whatever the cap; a request is ASCII, "CONNECT <a> HTTP/1.1",
 *     "Host: <a>", an optional "Proxy-Authorization: Basic <base64>", and a
 *     blank line.
 *
 * Stops after COUNT inputs (default 5,000,000) or SECONDS (default 600),
 * whichever comes first, and prints the counts of inputs and outcomes per
 * parser.  Built with -DSW_FUZZ_LIBFUZZER it instead exports
 * LLVMFuzzerTestOneInput for clang -fsanitize=fuzzer.
 */
#define _GNU_SOURCE
#include "iplit.h"
#include "parse.h"
#include "pkt.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    MAX_INPUT = 70000, /* room for heads past http.MAX_HEAD_SIZE (65536) */
    SNIFF_LIMIT = 16384 + 5,
    HTTP_MAX_HEAD = 65536,
    MAX_SEEDS = 4096,
    SEED_MAX = 20000, /* generated seeds stay under this */
    PREFIX_SWEEP_MAX = 4096, /* longer inputs get sampled prefix lengths */
};

enum {
    P_GREETING,
    P_USERPASS,
    P_REQUEST,
    P_HTTP,
    P_SNIFF,
    P_RESPONSE,
    P_S5_UDP,
    P_FORWARD,
    P_FWD_RESPONSE,
    P_COUNT
};
static const char *const parser_name[P_COUNT] = {"s5_greeting", "s5_userpass", "s5_request",
                                                 "http_connect", "sniff", "http_response",
                                                 "s5_udp", "http_forward", "http_fwd_response"};
/* sw_parse_http_forward's wire buffer: small, so its overflow (a deferral) is met too. */
enum { FWD_WIRE_CAP = 2048 };
/* The libFuzzer entry point reports nothing itself. */
#define MAYBE_UNUSED __attribute__((unused))
static MAYBE_UNUSED const char *const status_name[4] = {"ok", "need_more", "error", "defer"};

/* Outcomes per parser: [0] whole inputs, [1] calls of the prefix sweeps. */
static uint64_t outcomes[2][P_COUNT][4];
static MAYBE_UNUSED uint64_t inputs, input_bytes;
static uint64_t prefix_sweeps;
/* sw_http_connect_request outcomes: built, -EINVAL. */
static MAYBE_UNUSED uint64_t builder_built, builder_einval;
static MAYBE_UNUSED uint64_t host_kinds[7];

/* ---------------------------------------------------------------------------
 * PRNG (splitmix64: tiny, seedable, good enough to drive mutations)
 */

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, n); n > 0. */
static size_t below(size_t n) { return (size_t)(rnd() % n); }
static MAYBE_UNUSED bool chance(unsigned one_in) { return below(one_in) == 0; }

#ifndef SW_FUZZ_LIBFUZZER
/* ---------------------------------------------------------------------------
 * Byte buffers
 */

struct buf {
    uint8_t *p;
    size_t len, cap;
};

static void put(struct buf *b, const void *data, size_t n)
{
    if (b->len + n > b->cap)
        n = b->cap - b->len; /* generators never need more; clip rather than grow */
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void put_str(struct buf *b, const char *s) { put(b, s, strlen(s)); }
static void put_u8(struct buf *b, unsigned v) { uint8_t c = (uint8_t)v; put(b, &c, 1); }
static void put_u16(struct buf *b, unsigned v) { put_u8(b, v >> 8); put_u8(b, v); }

static void put_fmt(struct buf *b, const char *fmt, unsigned v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, fmt, v);
    put(b, tmp, (size_t)n);
}

/* ---------------------------------------------------------------------------
 * Generators of valid (or nearly valid) messages
 */

/* A random host name: DNS-ish labels, sometimes upper case, underscores,
 * UTF-8 letters (for SOCKS5 domains), a trailing dot. */
static void gen_name(struct buf *b, bool unicode)
{
    static const char alnum[] = "abcdefghijklmnopqrstuvwxyz0123456789";
    static const char *const utf8[] = {"\xc3\xa9", "\xc3\xbc", "\xe6\x97\xa5", "\xf0\x9f\x98\x80",
                                       "\xd0\xb6", "\xc2\x85"};
    size_t labels = 1 + below(4);
    for (size_t l = 0; l < labels; l++) {
        if (l)
            put_u8(b, '.');
        size_t n = 1 + below(chance(20) ? 70 : 12);
        for (size_t i = 0; i < n; i++) {
            if (unicode && chance(8)) {
                put_str(b, utf8[below(sizeof utf8 / sizeof utf8[0])]);
                continue;
            }
            char c = alnum[below(sizeof alnum - 1)];
            if (chance(10))
                c = (char)(c >= 'a' && c <= 'z' ? c - 32 : c);
            if (i && i + 1 < n && chance(12))
                c = chance(2) ? '-' : '_';
            put_u8(b, (uint8_t)c);
        }
    }
    if (chance(10))
        put_u8(b, '.');
}

static void gen_utf8_text(struct buf *b, size_t max)
{
    static const char *const bits[] = {"a", "Z", "0", ":", " ", "\xc3\xa9", "\xe2\x82\xac",
                                       "\xf0\x9f\x98\x80", "\xed\x9f\xbf", "\xef\xbf\xbf",
                                       "\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\x80"};
    size_t n = below(max + 1), start = b->len;
    for (size_t i = 0; i < n && b->len - start < max; i++) {
        /* mostly valid pieces; the last four are invalid UTF-8 */
        size_t k = below(sizeof bits / sizeof bits[0] - (chance(16) ? 0 : 4));
        put_str(b, bits[k]);
    }
}

static void gen_ipv6_text(struct buf *b)
{
    unsigned h[8];
    for (int i = 0; i < 8; i++)
        h[i] = chance(3) ? 0 : (chance(2) ? (unsigned)below(0x10000) : (unsigned)below(16));
    switch (below(4)) {
    case 0: /* full */
        for (int i = 0; i < 8; i++)
            put_fmt(b, i ? ":%x" : "%x", h[i]);
        break;
    case 1: { /* '::' somewhere */
        int at = (int)below(8), len = 1 + (int)below((size_t)(8 - at));
        for (int i = 0; i < at; i++)
            put_fmt(b, i ? ":%x" : "%x", h[i]);
        put_str(b, "::");
        for (int i = at + len; i < 8; i++)
            put_fmt(b, i > at + len ? ":%x" : "%x", h[i]);
        break;
    }
    case 2: /* IPv4 tail, sometimes mapped */
        put_str(b, chance(2) ? "::ffff:" : "::");
        put_fmt(b, "%u", (unsigned)below(256));
        for (int i = 0; i < 3; i++)
            put_fmt(b, ".%u", (unsigned)below(chance(8) ? 300 : 256));
        break;
    default: /* zero-padded, upper case */
        for (int i = 0; i < 8; i++)
            put_fmt(b, i ? ":%04X" : "%04X", h[i]);
    }
}

static void gen_s5_greeting(struct buf *b)
{
    size_t n = chance(10) ? below(256) : 1 + below(4);
    put_u8(b, 5);
    put_u8(b, (unsigned)n);
    for (size_t i = 0; i < n; i++)
        put_u8(b, chance(2) ? (unsigned)below(3) : (unsigned)below(256));
}

static void gen_s5_userpass(struct buf *b)
{
    uint8_t tmp[600];
    struct buf t = {tmp, 0, sizeof tmp};
    put_u8(b, 1);
    for (int field = 0; field < 2; field++) {
        t.len = 0;
        gen_utf8_text(&t, 255);
        if (t.len > 255)
            t.len = 255;
        put_u8(b, (unsigned)t.len);
        put(b, tmp, t.len);
    }
}

static void gen_s5_request(struct buf *b)
{
    put_u8(b, 5);
    put_u8(b, chance(4) ? (unsigned)below(256) : 1);
    put_u8(b, 0);
    switch (below(3)) {
    case 0:
        put_u8(b, 1);
        for (int i = 0; i < 4; i++)
            put_u8(b, (unsigned)below(256));
        break;
    case 1: {
        put_u8(b, 4);
        int kind = (int)below(4);
        for (int i = 0; i < 16; i++) {
            unsigned v = (unsigned)below(256);
            if (kind == 0 && i < 12)
                v = i >= 10 ? 0xFF : 0; /* IPv4-mapped */
            else if (kind == 1 && i < 12)
                v = 0; /* IPv4-compatible */
            else if (kind == 2 && chance(2))
                v = 0; /* zero runs */
            put_u8(b, v);
        }
        break;
    }
    default: {
        uint8_t tmp[400];
        struct buf t = {tmp, 0, sizeof tmp};
        gen_name(&t, true);
        if (t.len > 255)
            t.len = 255;
        put_u8(b, 3);
        put_u8(b, (unsigned)t.len);
        put(b, tmp, t.len);
    }
    }
    put_u16(b, (unsigned)below(0x10000));
}

/* RSV(2) FRAG ATYP DST.ADDR DST.PORT DATA: a request's address, odd RSV and
 * FRAG now and then, a short payload. */
static void gen_s5_udp(struct buf *b)
{
    put_u16(b, chance(8) ? (unsigned)below(0x10000) : 0);
    put_u8(b, chance(8) ? (unsigned)below(256) : 0);
    uint8_t tmp[400];
    struct buf r = {tmp, 0, sizeof tmp};
    gen_s5_request(&r); /* VER CMD RSV ATYP ADDR PORT: keep from ATYP on */
    put(b, tmp + 3, r.len - 3);
    size_t n = below(chance(16) ? 1500 : 32);
    for (size_t i = 0; i < n; i++)
        put_u8(b, (unsigned)below(256));
}

static void b64_encode(struct buf *b, const uint8_t *s, size_t n)
{
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n)
            v |= (uint32_t)s[i + 1] << 8;
        if (i + 2 < n)
            v |= s[i + 2];
        put_u8(b, (uint8_t)a[v >> 18 & 63]);
        put_u8(b, (uint8_t)a[v >> 12 & 63]);
        put_u8(b, i + 1 < n ? (uint8_t)a[v >> 6 & 63] : '=');
        put_u8(b, i + 2 < n ? (uint8_t)a[v & 63] : '=');
    }
}

static const char *eol(void) { return chance(4) ? "\n" : "\r\n"; }

static void gen_http_connect(struct buf *b)
{
    if (chance(10))
        put_str(b, chance(2) ? "\r\n" : "\n");
    put_str(b, "CONNECT ");
    if (chance(4)) {
        put_u8(b, '[');
        gen_ipv6_text(b);
        put_u8(b, ']');
    } else {
        gen_name(b, false);
    }
    put_fmt(b, ":%u", chance(8) ? (unsigned)below(70000) : 1 + (unsigned)below(0xFFFF));
    put_str(b, chance(3) ? " HTTP/1.0" : " HTTP/1.1");
    put_str(b, eol());
    static const char *const names[] = {"Host", "User-Agent", "Proxy-Connection", "Accept",
                                        "X-Forwarded-For", "Content-Length", "Transfer-Encoding"};
    size_t fields = below(5);
    for (size_t i = 0; i < fields; i++) {
        put_str(b, names[below(sizeof names / sizeof names[0] - (chance(8) ? 0 : 2))]);
        put_str(b, chance(4) ? ":" : ": ");
        size_t n = below(30);
        for (size_t k = 0; k < n; k++)
            put_u8(b, chance(30) ? 0x80 + (unsigned)below(128) : 0x20 + (unsigned)below(95));
        put_str(b, eol());
    }
    if (chance(2)) {
        uint8_t creds[600];
        struct buf c = {creds, 0, sizeof creds};
        gen_utf8_text(&c, chance(16) ? 300 : 40);
        put_u8(&c, ':');
        gen_utf8_text(&c, 40);
        put_str(b, chance(4) ? "Proxy-Authorization: basic " : "Proxy-Authorization: Basic ");
        b64_encode(b, creds, c.len);
        put_str(b, eol());
    }
    put_str(b, eol());
}

/* An absolute-URI request: mostly what sw_parse_http_forward forwards itself,
 * sometimes with what it leaves to Python (a body, an Upgrade, IPv6, userinfo). */
static void gen_http_forward(struct buf *b)
{
    static const char *const methods[] = {"GET", "HEAD", "POST", "DELETE", "get", "CONNECT"};
    static const char *const names[] = {"Host",       "User-Agent",     "Connection",
                                        "Keep-Alive", "Proxy-Connection", "TE",
                                        "X-A",        "Accept",         "Proxy-Authorization",
                                        "Upgrade",    "Content-Length", "Transfer-Encoding"};
    static const char *const tokens[] = {"close", "keep-alive", "X-A", "te", "Host", "", "Accept"};
    if (chance(10))
        put_str(b, chance(2) ? "\r\n" : "\n");
    put_str(b, methods[chance(4) ? below(sizeof methods / sizeof methods[0]) : 0]);
    put_str(b, chance(8) ? " HTTP://" : " http://");
    if (chance(8)) {
        put_u8(b, '[');
        gen_ipv6_text(b);
        put_u8(b, ']');
    } else {
        gen_name(b, false);
    }
    if (chance(3))
        put_fmt(b, ":%u", chance(8) ? (unsigned)below(70000) : 1 + (unsigned)below(0xFFFF));
    size_t path = below(4);
    for (size_t k = 0; k < path; k++) {
        put_u8(b, "/?#/"[below(4)]);
        size_t n = below(12);
        for (size_t j = 0; j < n; j++)
            put_u8(b, chance(30) ? 0x80 + (unsigned)below(128) : 0x21 + (unsigned)below(94));
    }
    put_str(b, chance(6) ? " HTTP/1.0" : " HTTP/1.1");
    put_str(b, eol());
    size_t fields = below(7);
    for (size_t i = 0; i < fields; i++) {
        size_t which = below(sizeof names / sizeof names[0] - (chance(6) ? 0 : 3));
        put_str(b, names[which]);
        put_str(b, chance(4) ? ":" : ": ");
        if (which == 2 || which == 4) {
            size_t n = 1 + below(3);
            for (size_t k = 0; k < n; k++) {
                if (k)
                    put_str(b, chance(2) ? ", " : ",");
                put_str(b, tokens[below(sizeof tokens / sizeof tokens[0])]);
            }
        } else {
            size_t n = below(30);
            for (size_t k = 0; k < n; k++)
                put_u8(b, chance(30) ? 0x80 + (unsigned)below(128) : 0x20 + (unsigned)below(95));
        }
        if (chance(4))
            put_str(b, " \t");
        put_str(b, eol());
    }
    put_str(b, eol());
}

static void gen_sniff_http(struct buf *b)
{
    static const char *const methods[] = {"GET", "POST", "HEAD", "PUT", "DELETE",
                                          "OPTIONS", "PATCH", "TRACE", "CONNECT"};
    put_str(b, methods[below(sizeof methods / sizeof methods[0])]);
    put_str(b, chance(4) ? " http://x/y HTTP/1.0" : " / HTTP/1.1");
    put_str(b, eol());
    if (chance(3))
        put_str(b, "Accept: */*\r\n");
    put_str(b, chance(4) ? "host: " : "Host: ");
    if (chance(5)) {
        put_u8(b, '[');
        gen_ipv6_text(b);
        put_u8(b, ']');
    } else {
        gen_name(b, false);
    }
    if (chance(3))
        put_fmt(b, ":%u", (unsigned)below(100000));
    put_str(b, eol());
    put_str(b, eol());
}

/* A ClientHello with an SNI extension among others, in one or more records. */
static void gen_client_hello(struct buf *b)
{
    uint8_t body[4096];
    struct buf h = {body, 0, sizeof body};
    put_u16(&h, 0x0303);
    for (int i = 0; i < 32; i++)
        put_u8(&h, (unsigned)below(256));
    size_t sid = chance(2) ? 32 : below(33);
    put_u8(&h, (unsigned)sid);
    for (size_t i = 0; i < sid; i++)
        put_u8(&h, (unsigned)below(256));
    size_t suites = 1 + below(20);
    put_u16(&h, (unsigned)(2 * suites));
    for (size_t i = 0; i < suites; i++)
        put_u16(&h, (unsigned)below(0x10000));
    put_u8(&h, 1);
    put_u8(&h, 0);
    if (!chance(30)) {
        uint8_t ext[2048];
        struct buf e = {ext, 0, sizeof ext};
        size_t before = below(4);
        for (size_t i = 0; i < before; i++) {
            size_t n = below(40);
            put_u16(&e, 1 + (unsigned)below(60));
            put_u16(&e, (unsigned)n);
            for (size_t k = 0; k < n; k++)
                put_u8(&e, (unsigned)below(256));
        }
        if (!chance(10)) {
            uint8_t name[400];
            struct buf nb = {name, 0, sizeof name};
            gen_name(&nb, chance(20));
            put_u16(&e, 0);                        /* server_name */
            put_u16(&e, (unsigned)(nb.len + 5));   /* extension length */
            put_u16(&e, (unsigned)(nb.len + 3));   /* ServerNameList length */
            put_u8(&e, chance(10) ? 1 : 0);        /* name_type */
            put_u16(&e, (unsigned)nb.len);
            put(&e, name, nb.len);
        }
        put_u16(&e, 43); /* supported_versions */
        put_u16(&e, 3);
        put_u8(&e, 2);
        put_u16(&e, 0x0304);
        put_u16(&h, (unsigned)e.len);
        put(&h, ext, e.len);
    }
    /* handshake header, then records */
    uint8_t hs[4100];
    struct buf m = {hs, 0, sizeof hs};
    put_u8(&m, 1);
    put_u8(&m, (unsigned)(h.len >> 16));
    put_u16(&m, (unsigned)h.len);
    put(&m, body, h.len);
    size_t pos = 0;
    while (pos < m.len) {
        size_t n = chance(4) ? 1 + below(m.len - pos < 300 ? m.len - pos : 300) : m.len - pos;
        put_u8(b, 22);
        put_u16(b, chance(4) ? 0x0303 : 0x0301);
        put_u16(b, (unsigned)n);
        put(b, hs + pos, n);
        pos += n;
    }
}

/* An upstream proxy's answer to CONNECT: a status line (sometimes without a
 * reason), header fields, obs-fold continuation lines, CRLF or LF. */
/* Bytes repr() treats specially: quotes, backslash, its escapes, C0 and C1
 * controls, DEL, U+00A0 and U+00AD (not printable) and printable latin-1
 * neighbours, and the bytes a head's structure rests on. */
static const uint8_t repr_bytes[] = {'\'', '"', '\\', '\t', '\r', 0,    1,    0x0B, 0x1B, 0x1F,
                                     0x7F, 0x80, 0x85, 0x9F, 0xA0, 0xA1, 0xAC, 0xAD, 0xAE, 0xC3,
                                     0xE9, 0xFF, ' ',  ':',  '/',  '.',  '1',  'H',  'x'};

static void put_odd_bytes(struct buf *b, size_t max)
{
    size_t n = below(max + 1);
    for (size_t k = 0; k < n; k++)
        put_u8(b, chance(3) ? (unsigned)below(256) : repr_bytes[below(sizeof repr_bytes)]);
}

static void gen_http_response(struct buf *b)
{
    static const unsigned codes[] = {200, 200, 407, 403, 502, 100, 999, 204};
    if (chance(6)) { /* a version sw_http_response_error quotes */
        put_str(b, chance(2) ? "HTTP/" : "HTTP/1.");
        put_odd_bytes(b, 10);
        put_u8(b, ' ');
    } else {
        put_str(b, chance(8) ? "HTTP/1.0 " : "HTTP/1.1 ");
    }
    unsigned code = codes[below(sizeof codes / sizeof codes[0])];
    put_fmt(b, "%03u", chance(10) ? (unsigned)below(1000) : code);
    if (!chance(5)) {
        put_u8(b, ' ');
        size_t n = below(25);
        for (size_t k = 0; k < n; k++)
            put_u8(b, chance(20) ? 0x80 + (unsigned)below(128) : 0x20 + (unsigned)below(95));
    }
    put_str(b, eol());
    static const char *const names[] = {"Proxy-Authenticate", "Content-Length", "Via", "Server",
                                        "X-A", "Connection"};
    if (chance(12)) /* obs-fold with no field to continue */
        put_str(b, chance(2) ? " x\r\n" : "\tx\n");
    size_t fields = below(6);
    for (size_t i = 0; i < fields; i++) {
        put_str(b, names[below(sizeof names / sizeof names[0])]);
        if (chance(8)) /* a name sw_http_response_error quotes */
            put_odd_bytes(b, 6);
        put_str(b, chance(4) ? ":" : ": ");
        size_t n = below(30);
        for (size_t k = 0; k < n; k++)
            put_u8(b, chance(30) ? 0x80 + (unsigned)below(128) : 0x20 + (unsigned)below(95));
        if (chance(12)) /* a control _BAD_VALUE_CHAR_RE refuses */
            put_u8(b, chance(2) ? 0x7F : 1 + (unsigned)below(31));
        put_str(b, eol());
        while (chance(5)) { /* obs-fold: anything but NUL, CR, LF after SP/HTAB */
            put_u8(b, chance(2) ? ' ' : '\t');
            size_t m = below(12);
            for (size_t k = 0; k < m; k++) {
                uint8_t c = (uint8_t)(1 + below(255));
                put_u8(b, c == '\r' || c == '\n' ? 'x' : c);
            }
            put_str(b, eol());
        }
    }
    put_str(b, eol());
}

/* Builder arguments, "host\0user\0pass" (see run_builder): names, IPv4 and
 * IPv6 literals with or without brackets and zone ids, UTF-8 credentials. */
static void gen_connect_request_args(struct buf *b)
{
    bool bracket = chance(2);
    if (bracket)
        put_u8(b, '[');
    switch (below(4)) {
    case 0:
        gen_name(b, chance(10));
        break;
    case 1:
        put_fmt(b, "%u", (unsigned)below(chance(8) ? 300 : 256));
        for (int i = 0; i < 3; i++)
            put_fmt(b, ".%u", (unsigned)below(256));
        break;
    default:
        gen_ipv6_text(b);
        if (chance(4)) {
            static const char *const zones[] = {"%eth0", "%1", "%", "%%", "%a b", "%\xc3\xa9",
                                                "%a/b", "%\r\nX: y"};
            put_str(b, zones[below(sizeof zones / sizeof zones[0])]);
        }
    }
    if (bracket)
        put_u8(b, ']');
    if (chance(3))
        return; /* no credentials */
    put_u8(b, 0);
    gen_utf8_text(b, chance(16) ? 200 : 20);
    put_u8(b, 0);
    gen_utf8_text(b, chance(16) ? 200 : 20);
}

/* An IPv4 or IPv6 packet as a TUN device carries it (csrc/pkt.h): TCP with
 * options, UDP, ICMP/ICMPv6 echo or another protocol; IPv4 options or IPv6
 * hop-by-hop / destination options headers now and then, sometimes a routing
 * or fragment header, an IPv4 fragment, a wrong checksum, or trailing bytes.
 * Checksums are right otherwise, so the rewrite's checksum property is
 * exercised too. */
static uint16_t pseudo_csum(uint8_t version, uint8_t proto, const uint8_t *src,
                            const uint8_t *dst, const uint8_t *l4, size_t n)
{
    static uint8_t tmp[40 + 70000];
    size_t alen = version == 4 ? 4 : 16, k = 0;
    memcpy(tmp, src, alen);
    memcpy(tmp + alen, dst, alen);
    k = 2 * alen;
    uint8_t len32[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    memcpy(tmp + k, len32, 4);
    tmp[k + 4] = tmp[k + 5] = tmp[k + 6] = 0;
    tmp[k + 7] = proto;
    k += 8;
    memcpy(tmp + k, l4, n);
    return sw_pkt_checksum(tmp, k + n);
}

static void gen_ip_packet(struct buf *b)
{
    uint8_t version = chance(2) ? 4 : 6, proto;
    size_t alen = version == 4 ? 4 : 16;
    uint8_t src[16], dst[16], l4[1600];
    for (size_t i = 0; i < 16; i++)
        src[i] = (uint8_t)rnd(), dst[i] = (uint8_t)rnd();
    size_t n = 0, payload = below(chance(16) ? 1400 : 40), csum_at = SIZE_MAX;
    switch (below(4)) {
    case 0: {
        proto = SW_PROTO_TCP;
        size_t opts = below(11) * 4;
        for (size_t i = 0; i < 20 + opts; i++)
            l4[i] = (uint8_t)rnd();
        l4[12] = (uint8_t)(((20 + opts) / 4) << 4);
        n = 20 + opts;
        csum_at = 16;
        break;
    }
    case 1:
        proto = SW_PROTO_UDP;
        for (size_t i = 0; i < 4; i++)
            l4[i] = (uint8_t)rnd();
        l4[4] = (uint8_t)((8 + payload) >> 8), l4[5] = (uint8_t)(8 + payload);
        n = 8;
        csum_at = 6;
        break;
    case 2:
        proto = version == 4 ? SW_PROTO_ICMP : SW_PROTO_ICMPV6;
        l4[0] = chance(4) ? (uint8_t)rnd() : version == 4 ? 8 : 128;
        l4[1] = chance(4) ? 1 : 0;
        for (size_t i = 2; i < 8; i++)
            l4[i] = (uint8_t)rnd();
        n = 8;
        csum_at = 2;
        break;
    default:
        proto = (uint8_t)rnd();
    }
    for (size_t i = 0; i < payload; i++)
        l4[n + i] = (uint8_t)rnd();
    n += payload;
    if (csum_at != SIZE_MAX) {
        l4[csum_at] = l4[csum_at + 1] = 0;
        uint16_t c = proto == SW_PROTO_ICMP ? sw_pkt_checksum(l4, n)
                                            : pseudo_csum(version, proto, src, dst, l4, n);
        if (proto == SW_PROTO_UDP && c == 0)
            c = 0xffff;
        if (proto == SW_PROTO_UDP && version == 4 && chance(8))
            c = 0;
        if (chance(16))
            c ^= (uint16_t)(1 + below(0xfffe));
        l4[csum_at] = (uint8_t)(c >> 8), l4[csum_at + 1] = (uint8_t)c;
    }
    if (version == 4) {
        size_t opts = chance(4) ? below(11) * 4 : 0;
        uint8_t h[60] = {0};
        h[0] = (uint8_t)(0x40 | (20 + opts) / 4);
        size_t total = 20 + opts + n;
        h[2] = (uint8_t)(total >> 8), h[3] = (uint8_t)total;
        h[6] = chance(8) ? (uint8_t)rnd() : 0x40;
        h[8] = (uint8_t)rnd(), h[9] = proto;
        memcpy(h + 12, src, 4);
        memcpy(h + 16, dst, 4);
        for (size_t i = 20; i < 20 + opts; i++)
            h[i] = (uint8_t)rnd();
        uint16_t c = sw_pkt_checksum(h, 20 + opts);
        if (chance(32))
            c ^= 1;
        h[10] = (uint8_t)(c >> 8), h[11] = (uint8_t)c;
        put(b, h, 20 + opts);
    } else {
        uint8_t ext[8 * 40];
        size_t elen = 0, count = chance(4) ? below(4) : 0;
        uint8_t first = proto;
        uint8_t *prev_next = &first;
        for (size_t k = 0; k < count; k++) {
            static const uint8_t kinds[] = {0, 60, 60, 60, 43, 44};
            uint8_t code = kinds[below(sizeof kinds)];
            size_t len = 8 * (1 + below(3));
            *prev_next = code;
            ext[elen] = proto;
            ext[elen + 1] = (uint8_t)(len / 8 - 1);
            for (size_t i = 2; i < len; i++)
                ext[elen + i] = (uint8_t)rnd();
            prev_next = &ext[elen];
            elen += len;
        }
        *prev_next = proto;
        uint8_t h[40] = {0x60};
        size_t plen = elen + n;
        h[4] = (uint8_t)(plen >> 8), h[5] = (uint8_t)plen;
        h[6] = first, h[7] = (uint8_t)rnd();
        memcpy(h + 8, src, 16);
        memcpy(h + 24, dst, 16);
        put(b, h, 40);
        put(b, ext, elen);
    }
    (void)alen;
    put(b, l4, n);
    if (chance(8))
        put_u16(b, (unsigned)rnd());
}

/* The pseudo-header's sum as Linux leaves it in a CHECKSUM_PARTIAL packet's
 * field (folded, not complemented) for a transport length of n. */
static uint16_t pseudo_psum(const sw_pkt *pk, uint32_t n)
{
    uint8_t tmp[40];
    size_t alen = pk->version == 4 ? 4 : 16;
    memcpy(tmp, pk->src, alen);
    memcpy(tmp + alen, pk->dst, alen);
    size_t k = 2 * alen;
    tmp[k] = (uint8_t)(n >> 24), tmp[k + 1] = (uint8_t)(n >> 16);
    tmp[k + 2] = (uint8_t)(n >> 8), tmp[k + 3] = (uint8_t)n;
    tmp[k + 4] = tmp[k + 5] = tmp[k + 6] = 0;
    tmp[k + 7] = pk->proto;
    return (uint16_t)~sw_pkt_checksum(tmp, k + 8);
}

/* The transport length a partial sum covers, and where its field is (0: no
 * such field). */
static uint32_t partial_len(const sw_pkt *pk)
{
    return pk->proto == SW_PROTO_TCP ? pk->l4_len : pk->payload_len + 8;
}
static size_t partial_at(const sw_pkt *pk)
{
    return pk->proto == SW_PROTO_TCP ? pk->l4_off + 16
           : pk->proto == SW_PROTO_UDP ? pk->l4_off + 6
                                       : 0;
}

/* [virtio-net header][packet] as a TUN with IFF_VNET_HDR reads it: mostly
 * the header Linux would send (NEEDS_CSUM with the field partial, GSO for
 * TCP), sometimes one field moved off, sometimes random. */
static void gen_vnet_frame(struct buf *b)
{
    uint8_t tmp[4096];
    struct buf pb = {tmp, 0, sizeof tmp};
    gen_ip_packet(&pb);
    sw_pkt pk;
    sw_vnet_hdr h = {0};
    if (sw_pkt_parse(tmp, pb.len, &pk) == SW_PKT_OK) {
        size_t at = partial_at(&pk);
        if (at && !chance(4)) {
            uint16_t ps = pseudo_psum(&pk, partial_len(&pk));
            tmp[at] = (uint8_t)(ps >> 8), tmp[at + 1] = (uint8_t)ps;
            h.flags = SW_VNET_F_NEEDS_CSUM;
            h.csum_start = (uint16_t)pk.l4_off;
            h.csum_offset = (uint16_t)(at - pk.l4_off);
            if (pk.proto == SW_PROTO_TCP && chance(2)) {
                h.gso_type = pk.version == 4 ? SW_VNET_GSO_TCPV4 : SW_VNET_GSO_TCPV6;
                if (chance(8))
                    h.gso_type |= SW_VNET_GSO_ECN;
                h.gso_size = (uint16_t)(1 + below(1500));
                h.hdr_len = (uint16_t)(chance(2) ? pk.payload_off : pk.ip_len);
            }
        } else if (chance(4)) {
            h.flags = SW_VNET_F_DATA_VALID;
        }
    }
    switch (below(12)) { /* one field moved, now and then */
    case 0: h.hdr_len = (uint16_t)(h.hdr_len + 1 + below(3)); break;
    case 1: h.csum_start = (uint16_t)(h.csum_start + (chance(2) ? 1 : -1)); break;
    case 2: h.csum_offset = (uint16_t)below(20); break;
    case 3: h.gso_type = (uint8_t)rnd(); break;
    case 4: h.flags = (uint8_t)rnd(); break;
    case 5: h.gso_size = chance(2) ? 0 : 0xffff; break;
    case 6: memcpy(&h, (uint64_t[2]){rnd(), rnd()}, sizeof h); break;
    default: break;
    }
    put(b, &h, sizeof h);
    put(b, tmp, pb.len);
}

/* An IPv4 address as inet_aton or a browser would read it: 1..4 parts in
 * decimal, octal or hex (leading zeros, an empty "0x"), now and then a part
 * out of range, a trailing dot, whitespace and junk after it. */
static void gen_ipv4_spelling(struct buf *b)
{
    uint32_t a = (uint32_t)rnd();
    int parts = 1 + (int)below(4);
    for (int i = 0; i < parts; i++) {
        uint64_t v = i < parts - 1 ? (a >> (8 * (3 - i))) & 255
                                   : a & (uint32_t)((1ull << (8 * (5 - parts))) - 1);
        if (chance(12))
            v += chance(2) ? 256 : (uint64_t)1 << 32;
        if (i)
            put_u8(b, '.');
        switch (below(4)) {
        case 0:
            put_fmt(b, "0%o", (unsigned)v);
            break;
        case 1:
            put_str(b, chance(2) ? "0x" : "0X");
            for (size_t z = below(3); z; z--)
                put_u8(b, '0');
            if (v || chance(2))
                put_fmt(b, "%x", (unsigned)v);
            break;
        default:
            if (v >> 32)
                put_str(b, "4294967296");
            else
                put_fmt(b, "%u", (unsigned)v);
        }
    }
    if (chance(4))
        put_u8(b, '.');
    if (chance(5)) {
        put_u8(b, " \t\n\v\f\r"[below(6)]);
        put_str(b, chance(2) ? "junk" : ".1");
    }
    if (chance(8)) {
        put_str(b, chance(2) ? "[" : "::ffff:");
        gen_ipv6_text(b);
    }
}

static void gen_valid(struct buf *b)
{
    switch (below(13)) {
    case 11:
    case 12:
        gen_ipv4_spelling(b);
        break;
    case 10:
        gen_http_forward(b);
        break;
    case 8:
        gen_ip_packet(b);
        break;
    case 9:
        gen_vnet_frame(b);
        break;
    case 0:
        gen_s5_greeting(b);
        break;
    case 7:
        gen_s5_udp(b);
        break;
    case 1:
        gen_s5_userpass(b);
        break;
    case 2:
        gen_s5_request(b);
        break;
    case 3:
        gen_http_connect(b);
        break;
    case 4:
        gen_sniff_http(b);
        break;
    case 5:
        gen_http_response(b);
        break;
    case 6:
        gen_connect_request_args(b);
        break;
    default:
        gen_client_hello(b);
    }
}

/* ---------------------------------------------------------------------------
 * Seeds and mutation
 */

static uint8_t *seed_data[MAX_SEEDS];
static size_t seed_len[MAX_SEEDS];
static size_t seeds;

static void add_seed(const uint8_t *p, size_t n)
{
    if (n > SEED_MAX)
        n = SEED_MAX;
    size_t slot = seeds < MAX_SEEDS ? seeds++ : below(MAX_SEEDS);
    free(seed_data[slot]);
    seed_data[slot] = malloc(n ? n : 1);
    if (!seed_data[slot]) {
        perror("malloc");
        exit(2);
    }
    memcpy(seed_data[slot], p, n);
    seed_len[slot] = n;
}

static void load_seed_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_parse: %s: %s\n", path, strerror(errno));
        exit(2);
    }
    static uint8_t tmp[SEED_MAX];
    size_t n = fread(tmp, 1, sizeof tmp, f);
    fclose(f);
    add_seed(tmp, n);
}

static const uint8_t interesting[] = {0,    1,    2,   3,   4,   5,   9,   10,  13,  22,  32,
                                      '.',  ':',  '=', '[', ']', '%', '/', 'A', 'a', '0', 0x7F,
                                      0x80, 0xBF, 0xC0, 0xC2, 0xE0, 0xED, 0xF0, 0xF4, 0xFF};

static void mutate(struct buf *b)
{
    size_t ops = 1 + below(chance(4) ? 16 : 4);
    for (size_t o = 0; o < ops; o++) {
        size_t at = b->len ? below(b->len) : 0;
        switch (below(10)) {
        case 0: /* bit flip */
            if (b->len)
                b->p[at] ^= (uint8_t)(1u << below(8));
            break;
        case 1: /* interesting byte */
            if (b->len)
                b->p[at] = interesting[below(sizeof interesting)];
            break;
        case 2: { /* insert random or interesting bytes */
            size_t n = 1 + below(8);
            if (b->len + n > b->cap)
                break;
            memmove(b->p + at + n, b->p + at, b->len - at);
            for (size_t i = 0; i < n; i++)
                b->p[at + i] =
                    chance(2) ? (uint8_t)below(256) : interesting[below(sizeof interesting)];
            b->len += n;
            break;
        }
        case 3: { /* delete a run */
            size_t n = 1 + below(8);
            if (at + n > b->len)
                n = b->len - at;
            memmove(b->p + at, b->p + at + n, b->len - at - n);
            b->len -= n;
            break;
        }
        case 4: { /* duplicate a run in place */
            size_t n = 1 + below(16);
            if (at + n > b->len || b->len + n > b->cap)
                break;
            memmove(b->p + at + n, b->p + at, b->len - at);
            b->len += n;
            break;
        }
        case 5: /* truncate */
            b->len = at;
            break;
        case 6: { /* splice: the tail of another seed */
            if (!seeds)
                break;
            size_t s = below(seeds);
            size_t from = seed_len[s] ? below(seed_len[s]) : 0;
            size_t n = seed_len[s] - from;
            if (at + n > b->cap)
                n = b->cap - at;
            memcpy(b->p + at, seed_data[s] + from, n);
            b->len = at + n;
            break;
        }
        case 7: /* 8-bit length edit */
            if (b->len)
                b->p[at] = (uint8_t)(b->p[at] + (chance(2) ? 1 : -1) * (int)(1 + below(4)));
            break;
        case 8: { /* 16-bit big-endian length edit */
            if (b->len < 2)
                break;
            at = below(b->len - 1);
            unsigned v = (unsigned)b->p[at] << 8 | b->p[at + 1];
            switch (below(4)) {
            case 0:
                v += 1 + (unsigned)below(4);
                break;
            case 1:
                v -= 1 + (unsigned)below(4);
                break;
            case 2:
                v = 0;
                break;
            default:
                v = chance(2) ? 0xFFFF : 0x4000;
            }
            b->p[at] = (uint8_t)(v >> 8);
            b->p[at + 1] = (uint8_t)v;
            break;
        }
        default: /* swap two bytes */
            if (b->len) {
                size_t j = below(b->len);
                uint8_t t = b->p[at];
                b->p[at] = b->p[j];
                b->p[j] = t;
            }
        }
    }
}

/* Grow an input past a size limit the parsers must honour exactly. */
static void grow(struct buf *b)
{
    static const size_t targets[] = {SNIFF_LIMIT - 1, SNIFF_LIMIT, SNIFF_LIMIT + 1,
                                     HTTP_MAX_HEAD - 1, HTTP_MAX_HEAD, HTTP_MAX_HEAD + 1};
    size_t want = targets[below(sizeof targets / sizeof targets[0])] - 1 + below(3);
    if (want > b->cap)
        want = b->cap;
    uint8_t fill = chance(2) ? 'a' : interesting[below(sizeof interesting)];
    /* keep a head open: fill a header value, end with CRLF CRLF sometimes */
    while (b->len < want)
        b->p[b->len++] = fill;
    if (chance(2) && b->len >= 4)
        memcpy(b->p + b->len - 4, "\r\n\r\n", 4);
}

#endif /* !SW_FUZZ_LIBFUZZER */

/* ---------------------------------------------------------------------------
 * Running the parsers and checking invariants
 */

static const uint8_t *cur_input;
static size_t cur_len;

static void fail(const char *parser, size_t len, const char *why)
{
    fprintf(stderr, "\nfuzz_parse: INVARIANT FAILED in %s at length %zu of %zu: %s\ninput:", parser,
            len, cur_len, why);
    for (size_t i = 0; i < cur_len; i++)
        fprintf(stderr, "%s%02x", i % 32 ? "" : "\n  ", cur_input[i]);
    fputc('\n', stderr);
    FILE *f = fopen("fuzz-parse-failure.bin", "wb");
    if (f) {
        fwrite(cur_input, 1, cur_len, f);
        fclose(f);
        fprintf(stderr, "(written to fuzz-parse-failure.bin)\n");
    }
    abort();
}

#define CHECK(cond, parser, len, why)                                                              \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fail(parser, len, why);                                                                \
    } while (0)

static bool nul_terminated(const char *s, size_t cap, size_t len)
{
    return len < cap && s[len] == '\0' && strlen(s) == len;
}

/* Everything one call answered, to compare verdicts across prefixes. */
struct verdict {
    int status;
    size_t reply_len;
    uint8_t reply[SW_PARSE_REPLY_MAX];
    union {
        sw_s5_greeting g;
        sw_s5_userpass u;
        sw_s5_request r;
        sw_http_connect h;
        sw_sniffed s;
        sw_http_response resp;
        sw_s5_udp d;
        sw_http_forward f;
        sw_http_fwd_response fr;
    } out;
    uint8_t wire[FWD_WIRE_CAP];
};

/* The response parser's max_size for the current input (every prefix of it
 * gets the same, so its verdicts must be monotonic as the others' are). */
static size_t cur_max_size = HTTP_MAX_HEAD;
/* sw_parse_http_fwd_response's request flags for the current input (bit 0 HEAD,
 * bit 1 close): one pair per input, so its prefixes are judged alike. */
static int cur_fwd_flags;

/* The fields of an OK verdict, byte-comparable (structs have padding). */
static bool same_fields(int parser, const struct verdict *a, const struct verdict *b)
{
    switch (parser) {
    case P_GREETING:
        return a->out.g.consumed == b->out.g.consumed && a->out.g.no_auth == b->out.g.no_auth &&
               a->out.g.userpass == b->out.g.userpass;
    case P_USERPASS:
        return a->out.u.consumed == b->out.u.consumed && a->out.u.user_off == b->out.u.user_off &&
               a->out.u.user_len == b->out.u.user_len && a->out.u.pass_off == b->out.u.pass_off &&
               a->out.u.pass_len == b->out.u.pass_len;
    case P_REQUEST:
        return a->out.r.consumed == b->out.r.consumed && a->out.r.command == b->out.r.command &&
               a->out.r.atyp == b->out.r.atyp && a->out.r.port == b->out.r.port &&
               a->out.r.host_len == b->out.r.host_len && !strcmp(a->out.r.host, b->out.r.host);
    case P_HTTP:
        return a->out.h.consumed == b->out.h.consumed && a->out.h.port == b->out.h.port &&
               a->out.h.host_len == b->out.h.host_len && !strcmp(a->out.h.host, b->out.h.host) &&
               a->out.h.has_creds == b->out.h.has_creds &&
               a->out.h.user_len == b->out.h.user_len && !strcmp(a->out.h.user, b->out.h.user) &&
               a->out.h.pass_len == b->out.h.pass_len && !strcmp(a->out.h.pass, b->out.h.pass);
    case P_FWD_RESPONSE:
        return a->out.fr.consumed == b->out.fr.consumed && a->out.fr.status == b->out.fr.status &&
               a->out.fr.length == b->out.fr.length && a->out.fr.wire_len == b->out.fr.wire_len &&
               !memcmp(a->wire, b->wire, a->out.fr.wire_len);
    case P_FORWARD:
        return a->out.f.consumed == b->out.f.consumed && a->out.f.port == b->out.f.port &&
               a->out.f.host_len == b->out.f.host_len && !strcmp(a->out.f.host, b->out.f.host) &&
               a->out.f.keep_alive == b->out.f.keep_alive && a->out.f.head == b->out.f.head &&
               a->out.f.wire_len == b->out.f.wire_len &&
               !memcmp(a->wire, b->wire, a->out.f.wire_len);
    case P_RESPONSE:
        return a->out.resp.consumed == b->out.resp.consumed &&
               a->out.resp.status == b->out.resp.status;
    case P_S5_UDP:
        return a->out.d.header_len == b->out.d.header_len && a->out.d.frag == b->out.d.frag &&
               a->out.d.atyp == b->out.d.atyp && a->out.d.port == b->out.d.port &&
               a->out.d.addr_off == b->out.d.addr_off && a->out.d.addr_len == b->out.d.addr_len &&
               a->out.d.host_len == b->out.d.host_len && !strcmp(a->out.d.host, b->out.d.host);
    default:
        return a->out.s.host_len == b->out.s.host_len && !strcmp(a->out.s.host, b->out.s.host);
    }
}

static bool host_chars(const char *s, const char *extra)
{
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || strchr(extra, *s)))
            return false;
    return true;
}

/* ---------------------------------------------------------------------------
 * sw_http_response_error, on every input the response parser rejects
 */

/* Its texts, in parse.c's order; the last three end in a repr(). */
static const char *const resp_texts[] = {
    "response head too large",
    "not an HTTP response",
    "malformed status code",
    "invalid reason phrase",
    "malformed response head: NUL in head",
    "malformed response head: bare CR in head",
    "malformed response head: obsolete line folding",
    "malformed response head: header line without a colon",
    "unsupported response version ",
    "malformed response head: invalid header name ",
    "malformed response head: invalid character in header ",
};
enum { RT_COUNT = sizeof resp_texts / sizeof resp_texts[0], RT_VERSION = 8, RT_NAME, RT_VALUE };
/* [kind][text], kind as in outcomes */
static uint64_t resp_text_count[2][RT_COUNT];
static MAYBE_UNUSED uint64_t resp_einval, resp_repr_bytes, resp_escapes, resp_non_ascii;

/* A block of exactly n bytes (malloc(0) for none) filled with 0xA5. */
static char *msg_block(size_t n)
{
    char *m = malloc(n);
    if (!m && n) {
        perror("malloc");
        exit(2);
    }
    if (n)
        memset(m, 0xA5, n);
    return m;
}

static bool tchar(uint8_t c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* What repr() shows as itself: printable ASCII, and the printable latin-1
 * code points above it (str.isprintable(): not U+0080..U+00A0, U+00AD). */
static bool shown_raw(unsigned c) { return (c >= 0x20 && c < 0x7F) || (c > 0xA0 && c != 0xAD); }

/* Undo repr(): msg[0..n) must be one quoted string in exactly the form
 * CPython's unicode_repr writes for a latin-1 str; its code points go to
 * out (room for n bytes).  The length, or -1 where any byte of it is not
 * what repr() writes. */
static long unrepr(const uint8_t *m, size_t n, uint8_t *out)
{
    if (n < 2 || (m[0] != '\'' && m[0] != '"') || m[n - 1] != m[0])
        return -1;
    const uint8_t q = m[0];
    size_t k = 0;
    bool squote = false, dquote = false;
    for (size_t i = 1; i < n - 1; i++) {
        unsigned c = m[i];
        if (c == '\\') {
            if (++i >= n - 1)
                return -1;
            resp_escapes++;
            c = m[i];
            if (c == '\\' || c == q)
                out[k] = (uint8_t)c;
            else if (c == 't' || c == 'n' || c == 'r')
                out[k] = c == 't' ? '\t' : c == 'n' ? '\n' : '\r';
            else if (c == 'x' && i + 2 < n - 1) {
                unsigned v = 0;
                for (int d = 0; d < 2; d++) {
                    unsigned h = m[++i];
                    if (!((h >= '0' && h <= '9') || (h >= 'a' && h <= 'f')))
                        return -1; /* lower-case hex only */
                    v = v * 16 + (h <= '9' ? h - '0' : h - 'a' + 10);
                }
                /* only what has no shorter spelling and is not shown */
                if (shown_raw(v) || v == '\t' || v == '\n' || v == '\r')
                    return -1;
                out[k] = (uint8_t)v;
            } else {
                return -1; /* the other quote is never escaped */
            }
        } else if (c >= 0xC2 && c <= 0xC3 && i + 1 < n - 1 && (m[i + 1] & 0xC0) == 0x80) {
            unsigned v = (c & 0x1F) << 6 | (m[++i] & 0x3F);
            if (!shown_raw(v))
                return -1;
            resp_non_ascii++;
            out[k] = (uint8_t)v;
        } else {
            if (!shown_raw(c) || c >= 0x80 || c == q)
                return -1;
            out[k] = (uint8_t)c;
        }
        squote |= out[k] == '\'';
        dquote |= out[k] == '"';
        k++;
    }
    /* the quote: ' unless the text holds ' and no " */
    if ((q == '"') != (squote && !dquote))
        return -1;
    return (long)k;
}

/* The message for buf[0..len) (status: the response parser's verdict on
 * it): -EINVAL unless ERROR; else one of the texts, a repr() of the piece
 * of the input it names, and the cap contract. */
static void check_response_error(const uint8_t *buf, size_t len, int status, int kind)
{
    const char *name = "http_response_error";
    const size_t max_size = cur_max_size;
    if (status != SW_PARSE_ERROR) {
        char *one = msg_block(1);
        CHECK(sw_http_response_error(buf, len, max_size, one, 1) == -EINVAL && one[0] == '\0',
              name, len, "no error, yet not -EINVAL and \"\"");
        CHECK(sw_http_response_error(buf, len, max_size, NULL, 0) == -EINVAL, name, len,
              "no error, yet not -EINVAL (cap 0)");
        free(one);
        resp_einval++;
        return;
    }
    /* 4 bytes per input byte for a repr(), the longest text, quotes, NUL */
    const size_t room = 4 * len + 64;
    char *m = msg_block(room);
    const int rc = sw_http_response_error(buf, len, max_size, m, room);
    CHECK(rc > 0 && (size_t)rc < room, name, len, "return value");
    const size_t n = (size_t)rc;
    CHECK(m[n] == '\0' && strlen(m) == n, name, len, "length is not strlen(msg)");
    for (size_t i = n + 1; i < room; i++)
        CHECK((uint8_t)m[i] == 0xA5, name, len, "wrote past the NUL");
    CHECK(max_size > HTTP_MAX_HEAD || n < SW_HTTP_RESPONSE_ERROR_MAX, name, len,
          "longer than SW_HTTP_RESPONSE_ERROR_MAX allows");

    size_t t = 0;
    while (t < RT_COUNT) {
        size_t tl = strlen(resp_texts[t]);
        if (t < RT_VERSION ? !strcmp(m, resp_texts[t]) : n > tl && !memcmp(m, resp_texts[t], tl))
            break;
        t++;
    }
    CHECK(t < RT_COUNT, name, len, "not one of parse_response_head's messages");
    resp_text_count[kind][t]++;
    if (t >= RT_VERSION) {
        /* the quoted piece, and where the input holds it */
        size_t tl = strlen(resp_texts[t]);
        uint8_t *d = (uint8_t *)msg_block(n - tl);
        long dl = unrepr((const uint8_t *)m + tl, n - tl, d);
        CHECK(dl >= 0, name, len, "not a repr() of a latin-1 str");
        resp_repr_bytes += (uint64_t)dl;
        const size_t k = (size_t)dl;
        if (t == RT_VERSION) {
            /* line.partition(" ")[0] of the status line: the input's start,
             * ending at a space or the line's end, and not HTTP/1.<digit> */
            CHECK(k < len && !memcmp(buf, d, k) && !memchr(d, ' ', k) && !memchr(d, '\n', k) &&
                      (buf[k] == ' ' || buf[k] == '\r' || buf[k] == '\n'),
                  name, len, "the version quoted is not the status line's");
            CHECK(!(k == 8 && !memcmp(d, "HTTP/1.", 7) && d[7] >= '0' && d[7] <= '9'), name, len,
                  "a valid version called unsupported");
        } else {
            /* a field name: the start of a line after the first, up to its
             * first colon; invalid (empty or a non-tchar) for RT_NAME, a
             * token for RT_VALUE */
            bool token = k > 0;
            for (size_t i = 0; i < k; i++)
                token = token && tchar(d[i]);
            CHECK(token == (t == RT_VALUE), name, len, "the name's verdict");
            CHECK(!memchr(d, ':', k) && !memchr(d, '\n', k) && !memchr(d, '\r', k) &&
                      !memchr(d, '\0', k),
                  name, len, "a name holding ':', LF, CR or NUL");
            bool found = false;
            const size_t span = len < max_size ? len : max_size;
            for (size_t at = 1; at + k < span && !found; at++)
                found = buf[at - 1] == '\n' && !memcmp(buf + at, d, k) && buf[at + k] == ':';
            CHECK(found, name, len, "the name quoted starts no line of the head");
        }
        free(d);
    }

    /* cap: n + 1 is enough (same text); any less is -ENOSPC with the
     * longest prefix that does not split a UTF-8 sequence, NUL-terminated */
    char *exact = msg_block(n + 1);
    CHECK(sw_http_response_error(buf, len, max_size, exact, n + 1) == rc && !memcmp(exact, m, n + 1),
          name, len, "cap == length + 1 gives another answer");
    free(exact);
    size_t caps[2] = {n, below(n + 1)};
    for (int c = 0; c < 2; c++) {
        size_t cap = caps[c];
        char *s = msg_block(cap);
        CHECK(sw_http_response_error(buf, len, max_size, s, cap) == -ENOSPC, name, len,
              "a short cap is not -ENOSPC");
        if (cap) {
            size_t sl = strnlen(s, cap);
            CHECK(sl < cap && !memcmp(s, m, sl), name, len, "truncated msg is not a prefix");
            /* (a message's only multi-byte characters are 2-byte ones) */
            CHECK(sl == cap - 1 || (sl + 2 == cap && ((uint8_t)m[sl] & 0xE0) == 0xC0), name, len,
                  "truncated msg is not the longest whole-character prefix");
            CHECK(sl == 0 || ((uint8_t)s[sl - 1] & 0xE0) != 0xC0, name, len,
                  "truncated msg ends inside a UTF-8 sequence");
        }
        free(s);
    }
    CHECK(sw_http_response_error(buf, len, max_size, NULL, 0) == -ENOSPC, name, len,
          "cap 0 is not -ENOSPC");
    free(m);
}

/* One parser on buf[0..len) (an exact-size block); checks the per-call
 * invariants, fills *v and counts the outcome under `kind` (0 whole, 1 prefix). */
static void run_one(int parser, const uint8_t *buf, size_t len, struct verdict *v, int kind)
{
    const char *name = parser_name[parser];
    memset(v, 0xA5, sizeof *v); /* garbage in, so unset fields are noticed */
    v->reply_len = 12345;
    switch (parser) {
    case P_GREETING:
        v->status = sw_parse_s5_greeting(buf, len, &v->out.g, v->reply, &v->reply_len);
        break;
    case P_USERPASS:
        v->status = sw_parse_s5_userpass(buf, len, &v->out.u, v->reply, &v->reply_len);
        break;
    case P_REQUEST:
        v->status = sw_parse_s5_request(buf, len, &v->out.r, v->reply, &v->reply_len);
        break;
    case P_HTTP:
        v->status = sw_parse_http_connect(buf, len, &v->out.h);
        v->reply_len = 0;
        break;
    case P_FORWARD:
        v->status = sw_parse_http_forward(buf, len, &v->out.f, v->wire, sizeof v->wire);
        v->reply_len = 0;
        break;
    case P_FWD_RESPONSE: {
        int flags = cur_fwd_flags;
        v->status = sw_parse_http_fwd_response(buf, len, flags & 1, (flags >> 1) & 1, &v->out.fr,
                                               v->wire, sizeof v->wire);
        v->reply_len = 0;
        sw_http_response plain;
        int ps = sw_parse_http_response(buf, len, HTTP_MAX_HEAD, &plain);
        CHECK(v->status != SW_PARSE_NEED_MORE || ps == SW_PARSE_NEED_MORE, name, len,
              "NEED_MORE where the response parser has a verdict");
        CHECK(v->status != SW_PARSE_OK ||
                  (ps == SW_PARSE_OK && plain.consumed == v->out.fr.consumed &&
                   plain.status == v->out.fr.status),
              name, len, "OK with another head than the response parser's");
        break;
    }
    case P_RESPONSE:
        v->status = sw_parse_http_response(buf, len, cur_max_size, &v->out.resp);
        v->reply_len = 0;
        check_response_error(buf, len, v->status, kind);
        break;
    case P_S5_UDP: {
        v->status = sw_parse_s5_udp(buf, len, &v->out.d);
        v->reply_len = 0;
        sw_s5_udp f;
        memset(&f, 0x5A, sizeof f);
        int fs = sw_parse_s5_udp_fields(buf, len, &f);
        CHECK(fs == v->status, name, len, "sw_parse_s5_udp_fields: another verdict");
        CHECK(v->status != SW_PARSE_OK ||
                  (f.header_len == v->out.d.header_len && f.frag == v->out.d.frag &&
                   f.atyp == v->out.d.atyp && f.port == v->out.d.port &&
                   f.addr_off == v->out.d.addr_off && f.addr_len == v->out.d.addr_len &&
                   f.host_len == 0 && f.host[0] == '\0'),
              name, len, "sw_parse_s5_udp_fields: other fields");
        CHECK(v->status == SW_PARSE_OK || v->status == SW_PARSE_ERROR, name, len,
              "UDP datagram: neither OK nor ERROR");
        break;
    }
    default:
        v->status = sw_sniff(buf, len, &v->out.s);
        v->reply_len = 0;
    }
    CHECK(v->status >= SW_PARSE_OK && v->status <= SW_PARSE_DEFER, name, len,
          "status out of range");
    outcomes[kind][parser][v->status]++;
    CHECK(v->reply_len <= SW_PARSE_REPLY_MAX, name, len, "reply_len > SW_PARSE_REPLY_MAX");
    CHECK(v->status == SW_PARSE_ERROR || v->reply_len == 0, name, len, "reply without an error");
    if (parser == P_HTTP || parser == P_FORWARD || parser == P_FWD_RESPONSE)
        CHECK(v->status != SW_PARSE_ERROR, name, len, "HTTP answered ERROR (C never does)");
    else
        CHECK(v->status != SW_PARSE_DEFER, name, len,
              "deferred (SOCKS5, sniffing and the response parser never do)");
    if (v->status != SW_PARSE_OK)
        return;

    switch (parser) {
    case P_GREETING:
        CHECK(v->out.g.consumed >= 3 && v->out.g.consumed <= len, name, len, "consumed");
        CHECK(v->out.g.consumed == 2u + buf[1], name, len, "consumed != 2 + NMETHODS");
        CHECK(v->out.g.no_auth <= 1 && v->out.g.userpass <= 1, name, len, "flags");
        break;
    case P_USERPASS: {
        const sw_s5_userpass *u = &v->out.u;
        CHECK(u->consumed >= 3 && u->consumed <= len, name, len, "consumed");
        CHECK(u->user_off == 2 && u->user_off + u->user_len < u->consumed, name, len, "user span");
        CHECK(u->pass_off == u->user_off + u->user_len + 1u, name, len, "pass offset");
        CHECK(u->pass_off + u->pass_len == u->consumed, name, len, "pass span");
        break;
    }
    case P_REQUEST: {
        const sw_s5_request *r = &v->out.r;
        CHECK(r->consumed >= 7 && r->consumed <= len, name, len, "consumed");
        CHECK(nul_terminated(r->host, sizeof r->host, r->host_len), name, len, "host string");
        CHECK(r->host_len > 0, name, len, "empty host");
        CHECK(r->atyp == 1 || r->atyp == 3 || r->atyp == 4, name, len, "atyp");
        CHECK(r->command == buf[1], name, len, "command");
        CHECK(r->port == ((unsigned)buf[r->consumed - 2] << 8 | buf[r->consumed - 1]), name, len,
              "port");
        if (r->atyp == 1)
            CHECK(r->host_len >= 7 && r->host_len <= 15 && host_chars(r->host, "."), name, len,
                  "IPv4 text");
        if (r->atyp == 4)
            CHECK(r->host_len >= 2 && r->host_len <= 39 && host_chars(r->host, ":."), name, len,
                  "IPv6 text");
        if (r->atyp == 3)
            CHECK(r->host_len == buf[4] && !memcmp(r->host, buf + 5, r->host_len), name, len,
                  "domain text");
        break;
    }
    case P_HTTP: {
        const sw_http_connect *h = &v->out.h;
        CHECK(h->consumed > 0 && h->consumed <= len && h->consumed <= HTTP_MAX_HEAD, name, len,
              "consumed");
        CHECK(buf[h->consumed - 1] == '\n', name, len, "head does not end in LF");
        CHECK(nul_terminated(h->host, sizeof h->host, h->host_len), name, len, "host string");
        CHECK(h->host_len > 0 && host_chars(h->host, ".-_:"), name, len, "host text");
        CHECK(h->port > 0, name, len, "port 0");
        CHECK(h->has_creds <= 1, name, len, "has_creds");
        CHECK(nul_terminated(h->user, sizeof h->user, h->user_len), name, len, "user string");
        CHECK(nul_terminated(h->pass, sizeof h->pass, h->pass_len), name, len, "pass string");
        CHECK(h->has_creds || (h->user_len == 0 && h->pass_len == 0), name, len, "stray creds");
        break;
    }
    case P_FWD_RESPONSE: {
        const sw_http_fwd_response *r = &v->out.fr;
        CHECK(r->consumed >= 14 && r->consumed <= len, name, len, "consumed");
        CHECK(r->status >= 200 && r->status <= 999, name, len, "status");
        CHECK(r->wire_len >= 17 && !memcmp(v->wire, "HTTP/1.1 ", 9) &&
                  !memcmp(v->wire + r->wire_len - 4, "\r\n\r\n", 4),
              name, len, "wire shape");
        CHECK(r->length == 0 || ((cur_fwd_flags & 1) == 0 && r->status != 204 && r->status != 304),
              name, len, "a body after HEAD, 204 or 304");
        break;
    }
    case P_FORWARD: {
        const sw_http_forward *f = &v->out.f;
        CHECK(f->consumed > 0 && f->consumed <= len && f->consumed <= HTTP_MAX_HEAD, name, len,
              "consumed");
        CHECK(buf[f->consumed - 1] == '\n', name, len, "head does not end in LF");
        CHECK(nul_terminated(f->host, sizeof f->host, f->host_len), name, len, "host string");
        CHECK(f->host_len > 0 && host_chars(f->host, ".-_"), name, len, "host text");
        CHECK(f->port > 0 && f->keep_alive <= 1 && f->head <= 1, name, len, "fields");
        CHECK(f->wire_len >= 18 && f->wire_len <= FWD_WIRE_CAP, name, len, "wire_len");
        CHECK(!memcmp(v->wire + f->wire_len - 4, "\r\n\r\n", 4), name, len,
              "wire does not end in an empty line");
        CHECK(memmem(v->wire, f->wire_len, " HTTP/1.1\r\n", 11) != NULL, name, len,
              "wire has no request line");
        break;
    }
    case P_RESPONSE: {
        const sw_http_response *r = &v->out.resp;
        size_t c = r->consumed;
        CHECK(c >= 14 && c <= len && c <= cur_max_size, name, len, "consumed");
        CHECK(r->status >= 100 && r->status <= 999, name, len, "status out of range");
        CHECK(!memcmp(buf, "HTTP/1.", 7) && buf[7] >= '0' && buf[7] <= '9' && buf[8] == ' ',
              name, len, "status line start");
        CHECK((buf[9] - '0') * 100 + (buf[10] - '0') * 10 + (buf[11] - '0') == r->status, name,
              len, "status is not the status line's");
        CHECK(buf[c - 1] == '\n' &&
                  (buf[c - 2] == '\n' || (buf[c - 2] == '\r' && buf[c - 3] == '\n')),
              name, len, "head does not end in an empty line");
        CHECK(!memchr(buf, '\0', c), name, len, "NUL in an accepted head");
        /* where the terminator starts; none may start before it */
        size_t t = buf[c - 2] == '\n' ? c - 2 : c - 3;
        for (size_t i = 0; i < t; i++)
            CHECK(!(buf[i] == '\n' &&
                    (buf[i + 1] == '\n' || (buf[i + 1] == '\r' && buf[i + 2] == '\n'))),
                  name, len, "an earlier end of head was passed over");
        break;
    }
    case P_S5_UDP: {
        const sw_s5_udp *d = &v->out.d;
        CHECK(d->header_len >= 7 && d->header_len <= len, name, len, "header_len");
        CHECK(nul_terminated(d->host, sizeof d->host, d->host_len), name, len, "host string");
        CHECK(d->host_len > 0, name, len, "empty host");
        CHECK(d->frag == buf[2] && d->atyp == buf[3], name, len, "frag/atyp");
        CHECK(d->addr_off + d->addr_len + 2u == d->header_len, name, len, "address span");
        CHECK(d->port == ((unsigned)buf[d->header_len - 2] << 8 | buf[d->header_len - 1]), name,
              len, "port");
        if (d->atyp == 1)
            CHECK(d->addr_off == 4 && d->addr_len == 4 && d->host_len >= 7 && d->host_len <= 15 &&
                      host_chars(d->host, "."),
                  name, len, "IPv4");
        else if (d->atyp == 4)
            CHECK(d->addr_off == 4 && d->addr_len == 16 && d->host_len >= 2 &&
                      d->host_len <= 39 && host_chars(d->host, ":."),
                  name, len, "IPv6");
        else
            CHECK(d->atyp == 3 && d->addr_off == 5 && d->addr_len == buf[4] &&
                      d->host_len == d->addr_len && !memcmp(d->host, buf + 5, d->host_len),
                  name, len, "domain");
        break;
    }
    default: {
        const sw_sniffed *s = &v->out.s;
        CHECK(nul_terminated(s->host, sizeof s->host, s->host_len), name, len, "host string");
        CHECK(s->host_len > 0 && s->host_len <= 253, name, len, "host length");
        CHECK(host_chars(s->host, strchr(s->host, ':') ? ":" : ".-_"), name, len, "host text");
        CHECK(s->host[s->host_len - 1] != '.', name, len, "trailing dot kept");
    }
    }
}

/* A malloc() block of exactly n bytes (malloc(0) for an empty input, which
 * ASan knows holds nothing), so any read past the input is caught. */
static uint8_t *exact_copy(const uint8_t *p, size_t n)
{
    uint8_t *c = malloc(n);
    if (!c && n) {
        perror("malloc");
        exit(2);
    }
    if (n)
        memcpy(c, p, n);
    return c;
}

/* A NUL-terminated copy of p[0..n) in a block of exactly n + 1 bytes. */
static char *exact_string(const uint8_t *p, size_t n)
{
    char *c = malloc(n + 1);
    if (!c) {
        perror("malloc");
        exit(2);
    }
    memcpy(c, p, n);
    c[n] = '\0';
    return c;
}

static int b64_digit(uint8_t c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* The token is the padded base64 of user ":" pass: decoded here, by a
 * decoder that shares nothing with the encoder in parse.c. */
static bool basic_token_ok(const uint8_t *t, size_t n, const char *user, const char *pass)
{
    size_t ulen = strlen(user), plen = strlen(pass), total = ulen + 1 + plen;
    if (n != (total + 2) / 3 * 4)
        return false;
    size_t at = 0;
    for (size_t q = 0; q < n; q += 4) {
        uint32_t v = 0;
        int pads = 0;
        for (int k = 0; k < 4; k++) {
            int d = b64_digit(t[q + k]);
            if (d < 0) {
                if (t[q + k] != '=' || q + 4 != n || k < 2)
                    return false;
                pads++;
                d = 0;
            } else if (pads) {
                return false;
            }
            v = v << 6 | (uint32_t)d;
        }
        for (int k = 0; k < 3 - pads; k++, at++) {
            if (at >= total)
                return false;
            uint8_t want = at < ulen    ? (uint8_t)user[at]
                           : at == ulen ? ':'
                                        : (uint8_t)pass[at - ulen - 1];
            if ((uint8_t)(v >> (16 - 8 * k)) != want)
                return false;
        }
        if (pads != (int)(q + 4 == n ? (3 - total % 3) % 3 : 0))
            return false;
    }
    return at == total;
}

/* The input as sw_http_connect_request arguments: the host up to the first
 * NUL; if there is one, the user up to the next NUL, then the password up to
 * the one after that (no second NUL: pass NULL).  The port is derived from
 * the length (0 included).  Strings and output buffers are blocks of
 * exactly their size, so ASan catches a read or write past either. */
static void run_builder(const uint8_t *input, size_t len)
{
    const char *name = "connect_request";
    const uint8_t *nul = memchr(input, 0, len);
    size_t hlen = nul ? (size_t)(nul - input) : len, ulen = 0, plen = 0;
    char *host = exact_string(input, hlen), *user = NULL, *pass = NULL;
    if (nul) {
        const uint8_t *u = nul + 1, *end = input + len;
        const uint8_t *nul2 = memchr(u, 0, (size_t)(end - u));
        ulen = nul2 ? (size_t)(nul2 - u) : (size_t)(end - u);
        user = exact_string(u, ulen);
        if (nul2) {
            const uint8_t *p = nul2 + 1;
            const uint8_t *nul3 = memchr(p, 0, (size_t)(end - p));
            plen = nul3 ? (size_t)(nul3 - p) : (size_t)(end - p);
            pass = exact_string(p, plen);
        }
    }
    uint16_t port = (uint16_t)(len * 40503u >> 3);
    /* IPv6 text may outgrow its input ("::" is "[::]"); base64 is 4/3. */
    size_t cap = 2 * hlen + 2 * (ulen + plen) + 256;
    uint8_t *out = malloc(cap);
    if (!out) {
        perror("malloc");
        exit(2);
    }
    int rc = sw_http_connect_request(host, port, user, pass, out, cap);
    CHECK(rc == -EINVAL || (rc > 0 && (size_t)rc <= cap), name, len, "return value");
    CHECK(sw_http_connect_request(host, port, user, pass, NULL, 0) ==
              (rc == -EINVAL ? -EINVAL : -ENOSPC),
          name, len, "verdict depends on the room");
    if (rc == -EINVAL) {
        builder_einval++;
    } else {
        builder_built++;
        size_t n = (size_t)rc;
        CHECK(port != 0, name, len, "port 0 accepted");
        for (size_t i = 0; i < n; i++)
            CHECK(out[i] && out[i] < 0x80, name, len, "request is not ASCII");
        /* "CONNECT " A " HTTP/1.1\r\nHost: " A "\r\n" [P] "\r\n" */
        static const char mid[] = " HTTP/1.1\r\nHost: ";
        static const char pa[] = "Proxy-Authorization: Basic ";
        size_t creds = 0;
        if (user) {
            const char *pw = pass ? pass : "";
            creds = sizeof pa - 1 + (ulen + 1 + strlen(pw) + 2) / 3 * 4 + 2;
        }
        size_t fixed = 8 + (sizeof mid - 1) + 2 + creds + 2;
        CHECK(n > fixed && (n - fixed) % 2 == 0, name, len, "request length");
        size_t a = (n - fixed) / 2;
        const uint8_t *a1 = out + 8, *a2 = out + 8 + a + sizeof mid - 1;
        CHECK(!memcmp(out, "CONNECT ", 8) && !memcmp(a1 + a, mid, sizeof mid - 1) &&
                  !memcmp(a1, a2, a) && !memcmp(a2 + a, "\r\n", 2) &&
                  !memcmp(out + n - 2, "\r\n", 2),
              name, len, "request layout");
        char port_text[8];
        int pl = snprintf(port_text, sizeof port_text, ":%u", (unsigned)port);
        CHECK(a > (size_t)pl && !memcmp(a1 + a - pl, port_text, (size_t)pl), name, len,
              "authority does not end in the port");
        if (user) {
            const uint8_t *p = a2 + a + 2;
            CHECK(!memcmp(p, pa, sizeof pa - 1), name, len, "Proxy-Authorization line");
            p += sizeof pa - 1;
            CHECK(basic_token_ok(p, creds - (sizeof pa - 1) - 2, user, pass ? pass : ""), name,
                  len, "Basic token is not base64(user:pass)");
        }
        /* exactly n bytes of room suffice, n - 1 do not */
        uint8_t *again = malloc(n);
        CHECK(sw_http_connect_request(host, port, user, pass, again, n) == rc &&
                  !memcmp(again, out, n),
              name, len, "cap == length gives another answer");
        CHECK(sw_http_connect_request(host, port, user, pass, again, n - 1) == -ENOSPC, name, len,
              "one byte short is not -ENOSPC");
        free(again);
    }
    free(out);
    free(host);
    free(user);
    free(pass);
}

/* ---------------------------------------------------------------------------
 * The TUN packet parser, rewriter and builders (csrc/pkt.h), on every input
 */

static uint64_t pkt_status[8], pkt_rewritten, pkt_verified, pkt_echoed, pkt_rst, pkt_udp;
static uint64_t vnet_parsed, vnet_accepted, vnet_gso, vnet_partial, vnet_exact;

static bool zeroed(const void *p, size_t n)
{
    const uint8_t *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i])
            return false;
    return true;
}

/* Parses buf (an exact block) and checks what any OK verdict promises. */
static int pkt_parse_checked(const uint8_t *buf, size_t len, sw_pkt *pk)
{
    memset(pk, 0xA5, sizeof *pk);
    int st = sw_pkt_parse(buf, len, pk);
    CHECK(st >= SW_PKT_OK && st <= SW_PKT_BAD_L4, "pkt", len, "status");
    if (st != SW_PKT_OK) {
        CHECK(zeroed(pk, sizeof *pk), "pkt", len, "out not zeroed on a refusal");
        return st;
    }
    size_t alen = pk->version == 4 ? 4 : 16;
    CHECK(pk->version == 4 || pk->version == 6, "pkt", len, "version");
    CHECK(pk->ip_len <= len && pk->l4_off + pk->l4_len == pk->ip_len, "pkt", len, "lengths");
    CHECK(pk->l4_off >= (pk->version == 4 ? 20u : 40u), "pkt", len, "l4_off");
    CHECK(pk->payload_off >= pk->l4_off && pk->payload_off + pk->payload_len <= pk->ip_len, "pkt",
          len, "payload span");
    CHECK(zeroed(pk->src + alen, 16 - alen) && zeroed(pk->dst + alen, 16 - alen), "pkt", len,
          "address tail");
    CHECK(!memcmp(pk->src, buf + (pk->version == 4 ? 12 : 8), alen) &&
              !memcmp(pk->dst, buf + (pk->version == 4 ? 16 : 24), alen),
          "pkt", len, "addresses");
    return st;
}

static void run_pkt(const uint8_t *input, size_t len)
{
    uint8_t *p = exact_copy(input, len);
    sw_pkt pk, k2, k3;
    int st = pkt_parse_checked(p, len, &pk);
    pkt_status[st]++;
    if (st != SW_PKT_OK) {
        free(p);
        return;
    }
    size_t alen = pk.version == 4 ? 4 : 16;
    int csum_ok = sw_pkt_l4_csum_ok(p, &pk);
    CHECK(csum_ok == 0 || csum_ok == 1, "pkt", len, "l4_csum_ok");

    /* The NAT rewrite: the new endpoints parse back, nothing else moves, a
     * checksum that verified still does, and the reverse rewrite restores
     * every byte but the two forms of a zero checksum. */
    uint8_t *q = exact_copy(input, len);
    uint8_t na[16] = {0}, nb[16] = {0};
    for (size_t i = 0; i < alen; i++)
        na[i] = (uint8_t)rnd(), nb[i] = (uint8_t)rnd();
    uint16_t np1 = (uint16_t)rnd(), np2 = (uint16_t)rnd();
    k2 = pk;
    int rc = sw_pkt_rewrite(q, &k2, na, np1, nb, np2);
    if (pk.proto == SW_PROTO_TCP || pk.proto == SW_PROTO_UDP) {
        CHECK(rc == 0, "pkt_rewrite", len, "refused TCP/UDP");
        pkt_rewritten++;
        CHECK(pkt_parse_checked(q, len, &k3) == SW_PKT_OK, "pkt_rewrite", len, "no longer parses");
        CHECK(!memcmp(&k2, &k3, sizeof k2), "pkt_rewrite", len, "fields != its parse");
        CHECK(!memcmp(k3.src, na, 16) && !memcmp(k3.dst, nb, 16) && k3.sport == np1 &&
                  k3.dport == np2,
              "pkt_rewrite", len, "endpoints");
        CHECK(!memcmp(q + pk.payload_off, p + pk.payload_off, pk.payload_len) &&
                  !memcmp(q + pk.ip_len, p + pk.ip_len, len - pk.ip_len),
              "pkt_rewrite", len, "payload or trailer touched");
        if (csum_ok) {
            CHECK(sw_pkt_l4_csum_ok(q, &k3) == 1, "pkt_rewrite", len, "checksum broken");
            pkt_verified++;
        }
        CHECK(sw_pkt_rewrite(q, &k3, pk.src, pk.sport, pk.dst, pk.dport) == 0, "pkt_rewrite", len,
              "reverse");
        size_t at = pk.l4_off + (pk.proto == SW_PROTO_TCP ? 16 : 6);
        for (size_t i = 0; i < len; i++)
            if (q[i] != p[i] && !(i == at || i == at + 1))
                CHECK(0, "pkt_rewrite", len, "reverse rewrite differs");
        uint16_t a = (uint16_t)(q[at] << 8 | q[at + 1]), b = (uint16_t)(p[at] << 8 | p[at + 1]);
        CHECK(a == b || (a % 0xffff) == (b % 0xffff), "pkt_rewrite", len, "reverse checksum");
    } else {
        CHECK(rc == -EINVAL && !memcmp(q, p, len), "pkt_rewrite", len, "rewrote another protocol");
    }
    free(q);

    q = exact_copy(input, len);
    k2 = pk;
    rc = sw_pkt_echo_reply(q, &k2);
    if (rc == 0) {
        pkt_echoed++;
        CHECK(pkt_parse_checked(q, len, &k3) == SW_PKT_OK && !memcmp(&k2, &k3, sizeof k2),
              "pkt_echo", len, "reply fields");
        CHECK(!memcmp(k3.src, pk.dst, 16) && !memcmp(k3.dst, pk.src, 16), "pkt_echo", len, "swap");
        CHECK(sw_pkt_l4_csum_ok(q, &k3) == csum_ok, "pkt_echo", len, "checksum");
    } else {
        CHECK(rc == -EINVAL && !memcmp(q, p, len), "pkt_echo", len, "refusal touched the packet");
    }
    free(q);

    size_t need = (pk.version == 4 ? 20 : 40) + 20, cap = chance(4) ? below(need + 1) : need;
    q = malloc(cap); /* exactly cap bytes: ASan catches a write past it */
    rc = sw_pkt_build_tcp_rst(q, cap, &pk);
    if (pk.proto != SW_PROTO_TCP || (pk.tcp_flags & SW_TCP_RST)) {
        CHECK(rc == -EINVAL, "pkt_rst", len, "answered a non-TCP or RST packet");
    } else if (cap < need) {
        CHECK(rc == -EMSGSIZE, "pkt_rst", len, "short cap");
    } else {
        pkt_rst++;
        CHECK(rc == (int)need && pkt_parse_checked(q, cap, &k3) == SW_PKT_OK, "pkt_rst", len,
              "length");
        CHECK((k3.tcp_flags & SW_TCP_RST) && sw_pkt_l4_csum_ok(q, &k3) &&
                  !memcmp(k3.src, pk.dst, 16) && k3.sport == pk.dport && k3.dport == pk.sport,
              "pkt_rst", len, "reset fields");
    }
    free(q);

    /* A UDP datagram carrying this packet's payload, in a block of exactly
     * the length it needs (or one byte short). */
    need = (pk.version == 4 ? 20 : 40) + 8 + pk.payload_len;
    cap = chance(8) ? need - 1 : need;
    q = malloc(cap);
    rc = sw_pkt_build_udp(q, cap, pk.version, pk.src, pk.sport, pk.dst, pk.dport,
                          p + pk.payload_off, pk.payload_len);
    if (cap < need) {
        CHECK(rc == -EMSGSIZE, "pkt_udp", len, "short cap");
    } else {
        pkt_udp++;
        CHECK(rc == (int)need && pkt_parse_checked(q, cap, &k3) == SW_PKT_OK &&
                  k3.proto == SW_PROTO_UDP && sw_pkt_l4_csum_ok(q, &k3) &&
                  k3.payload_len == pk.payload_len &&
                  !memcmp(q + k3.payload_off, p + pk.payload_off, pk.payload_len),
              "pkt_udp", len, "datagram");
    }
    free(q);
    free(p);
}

/* The rules of sw_pkt_vnet_check (csrc/pkt.h), stated again here. */
static bool vnet_expect(const sw_vnet_hdr *h, const sw_pkt *pk)
{
    bool csum = h->flags == SW_VNET_F_NEEDS_CSUM;
    if (h->flags > 2)
        return false;
    switch (h->gso_type) {
    case SW_VNET_GSO_NONE:
        break;
    case SW_VNET_GSO_TCPV4:
    case SW_VNET_GSO_TCPV4 | SW_VNET_GSO_ECN:
        if (pk->version != 4)
            return false;
        goto tcp;
    case SW_VNET_GSO_TCPV6:
    case SW_VNET_GSO_TCPV6 | SW_VNET_GSO_ECN:
        if (pk->version != 6)
            return false;
    tcp:
        if (pk->proto != SW_PROTO_TCP || !csum || h->gso_size == 0 || h->gso_size == 65535)
            return false;
        break;
    default:
        return false;
    }
    if (csum && (!partial_at(pk) || h->csum_start != pk->l4_off ||
                 h->csum_start + h->csum_offset != partial_at(pk)))
        return false;
    return h->hdr_len <= pk->ip_len;
}

/* The input as [virtio-net header][packet]: the header check against an
 * independent statement of it, then the partial rewrite of an accepted
 * NEEDS_CSUM packet. */
static void run_vnet(const uint8_t *input, size_t len)
{
    if (len < SW_VNET_HDR_LEN)
        return;
    sw_vnet_hdr h;
    memcpy(&h, input, sizeof h);
    size_t n = len - SW_VNET_HDR_LEN;
    uint8_t *p = exact_copy(input + SW_VNET_HDR_LEN, n);
    sw_pkt pk, k2, k3;
    if (pkt_parse_checked(p, n, &pk) != SW_PKT_OK) {
        free(p);
        return;
    }
    vnet_parsed++;
    k2 = pk;
    sw_vnet_hdr h2 = h;
    int rc = sw_pkt_vnet_check(&h, &pk);
    CHECK(rc == 0 || rc == -EINVAL, "vnet", n, "check's answer");
    CHECK((rc == 0) == vnet_expect(&h, &pk), "vnet", n, "check != the rules");
    CHECK(!memcmp(&h, &h2, sizeof h) && !memcmp(&k2, &pk, sizeof pk), "vnet", n, "check wrote");
    if (rc != 0 || !(h.flags & SW_VNET_F_NEEDS_CSUM)) {
        free(p);
        return;
    }
    vnet_accepted++;
    vnet_gso += h.gso_type != SW_VNET_GSO_NONE;
    size_t at = partial_at(&pk), alen = pk.version == 4 ? 4 : 16;
    bool exact = ((p[at] << 8) | p[at + 1]) == pseudo_psum(&pk, partial_len(&pk));
    uint8_t *q = exact_copy(p, n);
    uint8_t na[16] = {0}, nb[16] = {0};
    for (size_t i = 0; i < alen; i++)
        na[i] = (uint8_t)rnd(), nb[i] = (uint8_t)rnd();
    uint16_t np1 = (uint16_t)rnd(), np2 = (uint16_t)rnd();
    CHECK(sw_pkt_rewrite_partial(q, &k2, na, np1, nb, np2) == 0, "vnet_rewrite", n, "refused");
    vnet_partial++;
    CHECK(pkt_parse_checked(q, n, &k3) == SW_PKT_OK && !memcmp(&k2, &k3, sizeof k2),
          "vnet_rewrite", n, "fields != its parse");
    CHECK(!memcmp(k3.src, na, 16) && !memcmp(k3.dst, nb, 16) && k3.sport == np1 &&
              k3.dport == np2,
          "vnet_rewrite", n, "endpoints");
    CHECK(!memcmp(q + pk.payload_off, p + pk.payload_off, pk.payload_len) &&
              !memcmp(q + pk.ip_len, p + pk.ip_len, n - pk.ip_len),
          "vnet_rewrite", n, "payload or trailer touched");
    uint16_t field = (uint16_t)(q[at] << 8 | q[at + 1]);
    if (exact) {
        vnet_exact++;
        CHECK(field == pseudo_psum(&k3, partial_len(&k3)), "vnet_rewrite", n,
              "not the new addresses' partial sum");
        /* Finished as the kernel would: the checksum over the segment. */
        uint8_t *r = exact_copy(q, n);
        uint16_t c = sw_pkt_checksum(r + k3.l4_off, partial_len(&k3));
        r[at] = (uint8_t)(c >> 8), r[at + 1] = (uint8_t)c;
        sw_pkt k4;
        CHECK(pkt_parse_checked(r, n, &k4) == SW_PKT_OK && sw_pkt_l4_csum_ok(r, &k4) == 1,
              "vnet_rewrite", n, "finished checksum does not verify");
        free(r);
    }
    CHECK(sw_pkt_rewrite_partial(q, &k3, pk.src, pk.sport, pk.dst, pk.dport) == 0, "vnet_rewrite",
          n, "reverse");
    for (size_t i = 0; i < n; i++)
        if (q[i] != p[i] && !((i == at || i == at + 1) && p[at] == 0 && p[at + 1] == 0 &&
                              q[at] == 0xff && q[at + 1] == 0xff))
            CHECK(0, "vnet_rewrite", n, "reverse rewrite differs");
    free(q);
    free(p);
}

/* The target host normalizer on the input as a host (see the header). */
static void run_host(const uint8_t *input, size_t len)
{
    uint8_t *p = exact_copy(input, len);
    size_t cap = (len > SW_HOST_ADDR_MAX - 1 ? len : SW_HOST_ADDR_MAX - 1) + 1;
    char *out = malloc(cap);
    uint8_t a[16], back[16];
    size_t n = 0;
    if (!out) {
        perror("malloc");
        exit(2);
    }
    int kind = sw_host_canon(p, len, out, cap, &n);
    CHECK(kind == SW_HOST_NAME || kind == SW_HOST_UNSURE || kind == SW_HOST_IP4 ||
              kind == SW_HOST_IP6,
          "host_canon", len, "kind");
    host_kinds[kind]++;
    CHECK(sw_host_addr(p, len, a) == kind, "host_addr", len, "kind differs from sw_host_canon");
    CHECK(n < cap && out[n] == 0, "host_canon", len, "text not NUL-terminated in cap");
    if (kind == SW_HOST_NAME || kind == SW_HOST_UNSURE) {
        CHECK((n == len || (n + 1 == len && input[len - 1] == '.')) && !memcmp(out, input, n),
              "host_canon", len, "a name is the input less at most one trailing dot");
    } else {
        CHECK(n < SW_HOST_ADDR_MAX && strlen(out) == n, "host_canon", len, "address text");
        bool v4 = kind == SW_HOST_IP4;
        CHECK(v4 ? sw_ip4_parse((const uint8_t *)out, n, back)
                 : sw_ip6_parse((const uint8_t *)out, n, back),
              "host_canon", len, "address text does not parse back");
        CHECK(!memcmp(a, back, v4 ? 4 : 16), "host_canon", len, "text is not sw_host_addr's");
        char again[SW_HOST_ADDR_MAX];
        size_t m = 0;
        CHECK(sw_host_canon((const uint8_t *)out, n, again, sizeof again, &m) == kind &&
                  m == n && !memcmp(again, out, n),
              "host_canon", len, "not idempotent");
    }
    free(out);
    /* Exact capacities: one short is refused, exactly enough is the same. */
    char *tight = malloc(n + 1);
    size_t m = 0;
    if (!tight) {
        perror("malloc");
        exit(2);
    }
    CHECK(sw_host_canon(p, len, tight, n, &m) == -ENOSPC, "host_canon", len, "cap == length");
    CHECK(sw_host_canon(p, len, tight, n + 1, &m) == kind && m == n, "host_canon", len,
          "cap == length + 1");
    free(tight);
    free(p);
}

/* Every parser once on the whole input, in a block of exactly its length,
 * then the builder on it. */
static void run_all(const uint8_t *input, size_t len)
{
    uint8_t *p = exact_copy(input, len);
    struct verdict v;
    for (int parser = 0; parser < P_COUNT; parser++)
        run_one(parser, p, len, &v, 0);
    free(p);
    run_builder(input, len);
    run_host(input, len);
    run_pkt(input, len);
    run_vnet(input, len);
}

/* Every parser at every prefix length (or a sample of them for long inputs):
 * NEED_MORE until a final verdict, which every longer prefix repeats.  The
 * one exception is Python's too: sniffing gives up (ERROR) at SNIFF_LIMIT
 * bytes while a TLS record is incomplete, yet the record headers of a
 * ClientHello spread over several records can take it past that limit, so
 * more bytes may still produce a host. */
static void sweep_prefixes(const uint8_t *input, size_t len)
{
    struct verdict first[P_COUNT], v;
    size_t final_at[P_COUNT];
    for (int parser = 0; parser < P_COUNT; parser++)
        final_at[parser] = SIZE_MAX;
    size_t step = len > PREFIX_SWEEP_MAX ? len / 64 : 1;
    prefix_sweeps++;
    /* A packet depends only on the bytes its IP length covers: a prefix is
     * OK only with the whole input's fields. */
    sw_pkt whole, part;
    uint8_t *wp = exact_copy(input, len);
    int whole_st = sw_pkt_parse(wp, len, &whole);
    free(wp);
    for (size_t cut = 0;; cut = cut + step < len ? cut + step : len) {
        uint8_t *p = exact_copy(input, cut);
        if (pkt_parse_checked(p, cut, &part) == SW_PKT_OK)
            CHECK(whole_st == SW_PKT_OK && !memcmp(&part, &whole, sizeof part), "pkt", cut,
                  "a prefix parsed other than the whole");
        for (int parser = 0; parser < P_COUNT; parser++) {
            run_one(parser, p, cut, &v, 1);
            if (final_at[parser] == SIZE_MAX) {
                if (v.status != SW_PARSE_NEED_MORE) {
                    first[parser] = v;
                    final_at[parser] = cut;
                }
                continue;
            }
            const struct verdict *f = &first[parser];
            if (parser == P_S5_UDP) {
                /* ERROR until the header is complete, then OK for good. */
                if (f->status == SW_PARSE_ERROR && v.status == SW_PARSE_OK) {
                    first[parser] = v;
                    continue;
                }
                CHECK(!(f->status == SW_PARSE_OK && v.status != SW_PARSE_OK), parser_name[parser],
                      cut, "a complete header failed with more bytes");
                if (v.status == SW_PARSE_OK)
                    CHECK(same_fields(parser, &v, f), parser_name[parser], cut,
                          "header fields changed with more bytes");
                continue;
            }
            if (parser == P_SNIFF && f->status == SW_PARSE_ERROR && final_at[parser] >= SNIFF_LIMIT)
                continue;
            CHECK(v.status == f->status, parser_name[parser], cut,
                  "a final verdict changed with more bytes");
            CHECK(v.reply_len == f->reply_len && !memcmp(v.reply, f->reply, v.reply_len),
                  parser_name[parser], cut, "the error reply changed with more bytes");
            if (v.status == SW_PARSE_OK)
                CHECK(same_fields(parser, &v, f), parser_name[parser], cut,
                      "OK fields changed with more bytes");
        }
        free(p);
        if (cut == len)
            break;
    }
}

#ifdef SW_FUZZ_LIBFUZZER
/* clang -fsanitize=fuzzer,address,undefined -DSW_FUZZ_LIBFUZZER -Icsrc \
 *     benchmarks/fuzz_parse.c csrc/parse.c csrc/iplit.c csrc/pkt.c */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > MAX_INPUT)
        return 0;
    cur_input = data;
    cur_len = size;
    /* one input in four also meets a max_size inside it */
    cur_max_size = size && data[size - 1] % 4 == 0 ? size / 2 + 1 : HTTP_MAX_HEAD;
    cur_fwd_flags = size ? data[size - 1] >> 6 : 0;
    run_all(data, size);
    if (size <= 512)
        sweep_prefixes(data, size);
    return 0;
}
#else
static void one_input(const uint8_t *input, size_t len, unsigned prefix_every)
{
    cur_input = input;
    cur_len = len;
    /* Mostly Python's default; else a bound the head may cross, or be near. */
    if (chance(4))
        cur_max_size = chance(2) ? below(len + 16) : (len > 8 ? len - 8 + below(16) : below(16));
    else
        cur_max_size = HTTP_MAX_HEAD;
    cur_fwd_flags = (int)below(4);
    inputs++;
    input_bytes += len;
    run_all(input, len);
    if (prefix_every && chance(prefix_every))
        sweep_prefixes(input, len);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void report(double seconds)
{
    uint64_t prefix_calls = 0;
    for (int p = 0; p < P_COUNT; p++)
        for (int k = 0; k < 4; k++)
            prefix_calls += outcomes[1][p][k];
    printf("inputs %" PRIu64 " (%.1f MB) in %.1f s, %.0f inputs/s; %" PRIu64
           " of them also at every prefix length (%" PRIu64 " more calls)\n",
           inputs, input_bytes / 1e6, seconds, inputs / (seconds > 0 ? seconds : 1), prefix_sweeps,
           prefix_calls);
    for (int kind = 0; kind < 2; kind++) {
        printf("%-14s %12s %12s %12s %12s   (%s)\n", "parser", status_name[0], status_name[1],
               status_name[2], status_name[3], kind ? "prefix calls" : "whole inputs");
        for (int p = 0; p < P_COUNT; p++)
            printf("%-14s %12" PRIu64 " %12" PRIu64 " %12" PRIu64 " %12" PRIu64 "\n",
                   parser_name[p], outcomes[kind][p][0], outcomes[kind][p][1],
                   outcomes[kind][p][2], outcomes[kind][p][3]);
    }
    printf("pkt: ok %" PRIu64 ", short %" PRIu64 ", bad_version %" PRIu64 ", bad_header %" PRIu64
           ", bad_checksum %" PRIu64 ", fragment %" PRIu64 ", ext_header %" PRIu64 ", bad_l4 %" PRIu64
           "; rewritten %" PRIu64 " (%" PRIu64 " with a verified checksum), echo replies %" PRIu64
           ", resets %" PRIu64 ", udp built %" PRIu64 "\n",
           pkt_status[0], pkt_status[1], pkt_status[2], pkt_status[3], pkt_status[4],
           pkt_status[5], pkt_status[6], pkt_status[7], pkt_rewritten, pkt_verified, pkt_echoed,
           pkt_rst, pkt_udp);
    printf("vnet: %" PRIu64 " frames with a packet that parses, %" PRIu64
           " accepted with NEEDS_CSUM (%" PRIu64 " GSO), %" PRIu64 " partial rewrites (%" PRIu64
           " of an exact partial sum)\n",
           vnet_parsed, vnet_accepted, vnet_gso, vnet_partial, vnet_exact);
    printf("host_canon: %" PRIu64 " names, %" PRIu64 " unsure, %" PRIu64 " IPv4, %" PRIu64
           " IPv6\n",
           host_kinds[SW_HOST_NAME], host_kinds[SW_HOST_UNSURE], host_kinds[SW_HOST_IP4],
           host_kinds[SW_HOST_IP6]);
    printf("connect_request: %" PRIu64 " built, %" PRIu64 " -EINVAL (each built one also at "
           "cap == length and length - 1)\n",
           builder_built, builder_einval);
    printf("http_response_error: %" PRIu64 " -EINVAL; messages (each also at cap length + 1, "
           "length, a random smaller one and 0), %" PRIu64 " bytes un-repr()'d, %" PRIu64
           " escapes, %" PRIu64 " non-ASCII:\n",
           resp_einval, resp_repr_bytes, resp_escapes, resp_non_ascii);
    for (size_t t = 0; t < RT_COUNT; t++)
        printf("  %12" PRIu64 " %12" PRIu64 "  %s%s\n", resp_text_count[0][t],
               resp_text_count[1][t], resp_texts[t], t >= RT_VERSION ? "'...'" : "");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    uint64_t count = 5000000, seed = 1;
    double limit = 600;
    unsigned prefix_every = 64;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (i + 1 >= argc) {
            fprintf(stderr, "fuzz_parse: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "-n"))
            count = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "-t"))
            limit = strtod(argv[++i], NULL);
        else if (!strcmp(argv[i], "-s"))
            seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "-p"))
            prefix_every = (unsigned)strtoul(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: fuzz_parse [-n COUNT] [-t SECONDS] [-s SEED] [-p EVERY] "
                            "[SEEDFILE...]\n");
            return 2;
        }
    }
    rng_state = seed;
    for (; i < argc; i++)
        load_seed_file(argv[i]);
    size_t file_seeds = seeds;

    static uint8_t scratch[MAX_INPUT];
    struct buf b = {scratch, 0, sizeof scratch};
    for (int k = 0; k < 512; k++) {
        b.len = 0;
        gen_valid(&b);
        add_seed(scratch, b.len);
    }
    printf("fuzz_parse: seed %" PRIu64 ", %zu seed files, %zu seeds, at most %" PRIu64
           " inputs or %.0f s\n",
           seed, file_seeds, seeds, count, limit);
    fflush(stdout);

    double start = now(), last = start;
    while (inputs < count) {
        if ((inputs & 1023) == 0) {
            double t = now();
            if (t - start >= limit)
                break;
            if (t - last >= 10) {
                fprintf(stderr, "fuzz_parse: %" PRIu64 " inputs, %.0f s\n", inputs, t - start);
                last = t;
            }
        }
        b.len = 0;
        size_t pick = below(100);
        if (pick < 10) {
            gen_valid(&b); /* a fresh valid message, kept as a seed too */
            if (chance(8))
                add_seed(scratch, b.len);
        } else if (pick < 90) {
            size_t s = below(seeds);
            put(&b, seed_data[s], seed_len[s]);
            mutate(&b);
        } else if (pick < 97) {
            size_t n = below(chance(8) ? 2048 : 64);
            for (size_t k = 0; k < n; k++)
                b.p[k] = (uint8_t)below(256);
            b.len = n;
        } else {
            size_t s = below(seeds);
            put(&b, seed_data[s], seed_len[s]);
            if (chance(100))
                grow(&b);
            else
                mutate(&b);
        }
        one_input(scratch, b.len, b.len > 20000 ? 0 : prefix_every);
    }
    report(now() - start);
    for (size_t s = 0; s < seeds; s++)
        free(seed_data[s]);
    return 0;
}
#endif
