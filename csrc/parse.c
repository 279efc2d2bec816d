/*
 * spliceway C handshake and sniff parsers.  See parse.h for the contract;
 * this file explains how each parser stays inside it.
 *
 * The reference is Python
 *   Every parser mirrors a function in spliceway/protocols/ (named in its
 *   comment) check for check, in the same order where the order decides the
 *   verdict.  Where Python's behaviour rests on a library routine (UTF-8
 *   decoding, ipaddress, base64) the C replica follows that routine's rules,
 *   not a general standard: e.g. IPv6 text is parsed the way
 *   ipaddress._BaseV6._ip_int_from_string splits it, not like inet_pton.
 *
 * SOCKS5 never defers
 *   Its messages are small and fully specified, so every byte string gets
 *   Python's own verdict, fields and reply here.
 *
 * HTTP defers freely
 *   C answers OK only for one well-understood shape: optional leading empty
 *   lines, "CONNECT <authority> HTTP/1.<d>", header fields without obs-fold,
 *   Content-Length, Transfer-Encoding or a second Host, and an optional
 *   Proxy-Authorization.  It answers NEED_MORE only while the bytes so far
 *   are a prefix of that shape (which Python's partial-head checks accept as
 *   well) and the head is still under http.MAX_HEAD_SIZE.  Everything else
 *   is DEFER, and so are all of Python's errors: C never writes an HTTP
 *   reply, so an error verdict would buy nothing.
 *
 * The upstream proxy's response cannot defer either
 *   sw_parse_http_response() is the C path's only reader of an upstream
 *   HTTP proxy's answer, so it decides every input as
 *   http.parse_response_head() does: the early judgement of a complete
 *   status line, max_size, NUL and bare CR, obs-fold (refused before the
 *   first field, unchecked after it) and field syntax.  It only needs the
 *   status and the head's length, so it validates without unfolding.
 *   sw_http_response_error() names the failure the way Python does: the
 *   same walk reports which ProtocolError Python raises first, and its text
 *   is rebuilt here, repr() of latin-1 text included, so the C path can
 *   fail a flow with the Python outbound's exact words.
 *   sw_http_connect_request() builds http.connect_request()'s bytes, with
 *   ipaddress's verdicts (iplit.c) deciding what is an IP literal.
 *
 * Sniffing cannot defer
 *   sw_sniff() answers exactly like sniff.sniff(), including the TLS record
 *   reassembly, SNIFF_LIMIT and normalize_host().  A ClientHello spread over
 *   several records is read in place through a forward cursor instead of
 *   being copied, so the parser needs no buffer of its own.
 *
 * No function allocates, keeps state or loops more than a constant number of
 * times per input byte.
 */
#include "parse.h"
#include "iplit.h"
#include "ip6text.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <string.h>

enum {
    S5_VERSION = 5,
    S5_USERPASS_VERSION = 1,
    S5_METHOD_NO_AUTH = 0x00,
    S5_METHOD_USERPASS = 0x02,
    S5_ATYP_IPV4 = 1,
    S5_ATYP_DOMAIN = 3,
    S5_ATYP_IPV6 = 4,
    S5_REP_GENERAL_FAILURE = 1,
    S5_REP_ATYP_NOT_SUPPORTED = 8,

    /* http.MAX_HEAD_SIZE: no request head longer than this is ever accepted. */
    HTTP_MAX_HEAD = SW_HTTP_MAX_HEAD,
    /* The longest CONNECT target whose host fits in sw_http_connect.host:
     * a 255-byte reg-name, ':' and five port digits.  An IPv6 literal is
     * shorter ('[' 45 ']' ':' 5). */
    HTTP_TARGET_MAX = 255 + 1 + 5,

    /* sniff.SNIFF_LIMIT: one maximal TLS record plus its header. */
    SNIFF_LIMIT = 16384 + 5,
    TLS_RECORD_HANDSHAKE = 22,
    TLS_CLIENT_HELLO = 1,
    TLS_MAX_RECORD = 16384,
    /* normalize_host() refuses more than 253 characters after dropping one
     * trailing dot, so a longer raw name is refused without copying it. */
    HOST_NAME_MAX_RAW = 254,

    /* Longest IPv6 text we produce: eight 4-digit hextets and 7 colons. */
    IP6_TEXT_MAX = 39,
};

_Static_assert(SW_HOST_MAX > IP6_TEXT_MAX && SW_HOST_MAX > HOST_NAME_MAX_RAW, "host room");

static void set_reply(uint8_t *reply, size_t *reply_len, const uint8_t *bytes, size_t n)
{
    memcpy(reply, bytes, n);
    *reply_len = n;
}

/* ---------------------------------------------------------------------------
 * Shared text helpers
 */

/* Python's bytes.decode("utf-8") succeeds: shortest forms only, no UTF-16
 * surrogates (U+D800..DFFF), nothing above U+10FFFF.  The second-byte ranges
 * below are exactly what excludes those (Unicode Table 3-7). */
static bool utf8_valid(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more;
        uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) {
            more = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            more = 2;
            if (c == 0xE0)
                lo = 0xA0; /* overlong below U+0800 */
            else if (c == 0xED)
                hi = 0x9F; /* surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            more = 3;
            if (c == 0xF0)
                lo = 0x90; /* overlong below U+10000 */
            else if (c == 0xF4)
                hi = 0x8F; /* above U+10FFFF */
        } else {
            return false; /* continuation byte, C0/C1 overlongs, F5..FF */
        }
        if (n - i <= more)
            return false;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return false;
        for (size_t k = 2; k <= more; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                return false;
        i += more + 1;
    }
    return true;
}

static uint8_t ascii_lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

/* Case-insensitive (ASCII) equality with a lower-case literal. */
static bool eq_lower(const uint8_t *s, size_t n, const char *lit)
{
    size_t m = strlen(lit);
    if (n != m)
        return false;
    for (size_t i = 0; i < n; i++)
        if (ascii_lower(s[i]) != (uint8_t)lit[i])
            return false;
    return true;
}

static size_t put_dec(char *out, unsigned v)
{
    char tmp[10];
    size_t n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    return n;
}

/* str(ipaddress.IPv4Address(packed)). */
static size_t ip4_text(const uint8_t a[4], char *out)
{
    size_t n = 0;
    for (int i = 0; i < 4; i++) {
        if (i)
            out[n++] = '.';
        n += put_dec(out + n, a[i]);
    }
    return n;
}

/* ipaddress.IPv6Address(packed).ipv4_mapped is not None: ::ffff:0:0/96. */
static bool ip6_is_v4_mapped(const uint8_t a[16])
{
    for (int i = 0; i < 10; i++)
        if (a[i])
            return false;
    return a[10] == 0xFF && a[11] == 0xFF;
}

/* ---------------------------------------------------------------------------
 * SOCKS5 (socks5.parse_greeting / parse_userpass / parse_request)
 */

int sw_parse_s5_greeting(const uint8_t *buf, size_t len, sw_s5_greeting *out,
                         uint8_t *reply, size_t *reply_len)
{
    *reply_len = 0;
    if (len == 0)
        return SW_PARSE_NEED_MORE;
    /* Not SOCKS5: no reply means anything to such a peer. */
    if (buf[0] != S5_VERSION)
        return SW_PARSE_ERROR;
    if (len < 2)
        return SW_PARSE_NEED_MORE;
    size_t count = buf[1];
    if (count == 0) {
        static const uint8_t no_acceptable[] = {S5_VERSION, 0xFF};
        set_reply(reply, reply_len, no_acceptable, sizeof no_acceptable);
        return SW_PARSE_ERROR;
    }
    size_t end = 2 + count;
    if (len < end)
        return SW_PARSE_NEED_MORE;
    out->consumed = (uint32_t)end;
    out->no_auth = memchr(buf + 2, S5_METHOD_NO_AUTH, count) != NULL;
    out->userpass = memchr(buf + 2, S5_METHOD_USERPASS, count) != NULL;
    return SW_PARSE_OK;
}

int sw_parse_s5_userpass(const uint8_t *buf, size_t len, sw_s5_userpass *out,
                         uint8_t *reply, size_t *reply_len)
{
    static const uint8_t failure[] = {S5_USERPASS_VERSION, 0x01}; /* USERPASS_FAILURE */
    *reply_len = 0;
    if (len == 0)
        return SW_PARSE_NEED_MORE;
    if (buf[0] != S5_USERPASS_VERSION) {
        set_reply(reply, reply_len, failure, sizeof failure);
        return SW_PARSE_ERROR;
    }
    if (len < 2)
        return SW_PARSE_NEED_MORE;
    size_t ulen = buf[1];
    size_t plen_at = 2 + ulen;
    if (len <= plen_at)
        return SW_PARSE_NEED_MORE;
    size_t plen = buf[plen_at];
    size_t end = plen_at + 1 + plen;
    if (len < end)
        return SW_PARSE_NEED_MORE;
    /* Zero lengths are fine (Python accepts them); only UTF-8 is checked. */
    if (!utf8_valid(buf + 2, ulen) || !utf8_valid(buf + plen_at + 1, plen)) {
        set_reply(reply, reply_len, failure, sizeof failure);
        return SW_PARSE_ERROR;
    }
    out->consumed = (uint32_t)end;
    out->user_off = 2;
    out->user_len = (uint16_t)ulen;
    out->pass_off = (uint16_t)(plen_at + 1);
    out->pass_len = (uint16_t)plen;
    return SW_PARSE_OK;
}

/* socks5._decode_domain: non-empty strict UTF-8 without a code point <=
 * U+0020 or U+007F.  Those are all single bytes and UTF-8 never uses bytes
 * below 0x80 inside a multi-byte sequence, so the rule is a byte scan. */
static bool s5_domain_ok(const uint8_t *s, size_t n)
{
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= 0x20 || s[i] == 0x7F)
            return false;
    return utf8_valid(s, n);
}

/* socks5._parse_address's host text for a validated DST.ADDR of n bytes,
 * NUL-terminated into out (room for SW_HOST_MAX); its length. */
static size_t s5_host_text(uint8_t atyp, const uint8_t *addr, size_t n, char *out)
{
    if (atyp == S5_ATYP_DOMAIN) {
        memcpy(out, addr, n); /* <= 255: the host text is the name's UTF-8 as sent */
    } else if (atyp == S5_ATYP_IPV4) {
        n = ip4_text(addr, out);
    } else if (ip6_is_v4_mapped(addr)) {
        /* socks5._ip_text spells mapped addresses out as ::ffff:a.b.c.d so
         * that its text does not depend on the interpreter. */
        memcpy(out, "::ffff:", 7);
        n = 7 + ip4_text(addr + 12, out + 7);
    } else {
        n = sw_ip6_text(addr, out);
    }
    out[n] = '\0';
    return n;
}

int sw_parse_s5_request(const uint8_t *buf, size_t len, sw_s5_request *out,
                        uint8_t *reply, size_t *reply_len)
{
    /* socks5.reply(code): VER REP RSV, then ATYP 1 0.0.0.0 port 0. */
    static const uint8_t general_failure[] = {S5_VERSION, S5_REP_GENERAL_FAILURE, 0, 1,
                                              0, 0, 0, 0, 0, 0};
    static const uint8_t atyp_unsupported[] = {S5_VERSION, S5_REP_ATYP_NOT_SUPPORTED, 0, 1,
                                               0, 0, 0, 0, 0, 0};
    _Static_assert(sizeof general_failure <= SW_PARSE_REPLY_MAX, "reply room");
    *reply_len = 0;
    if (len == 0)
        return SW_PARSE_NEED_MORE;
    if (buf[0] != S5_VERSION) {
        set_reply(reply, reply_len, general_failure, sizeof general_failure);
        return SW_PARSE_ERROR;
    }
    /* _parse_address(buf, 3, ...) from here on. */
    if (len <= 3)
        return SW_PARSE_NEED_MORE;
    uint8_t atyp = buf[3];
    size_t start = 4, end;
    if (atyp == S5_ATYP_IPV4) {
        end = start + 4;
    } else if (atyp == S5_ATYP_IPV6) {
        end = start + 16;
    } else if (atyp == S5_ATYP_DOMAIN) {
        if (len <= start)
            return SW_PARSE_NEED_MORE;
        /* Python refuses a zero length before waiting for the name. */
        if (buf[start] == 0) {
            set_reply(reply, reply_len, general_failure, sizeof general_failure);
            return SW_PARSE_ERROR;
        }
        start++;
        end = start + buf[start - 1];
    } else {
        set_reply(reply, reply_len, atyp_unsupported, sizeof atyp_unsupported);
        return SW_PARSE_ERROR;
    }
    if (len < end + 2)
        return SW_PARSE_NEED_MORE;
    if (atyp == S5_ATYP_DOMAIN && !s5_domain_ok(buf + start, end - start)) {
        set_reply(reply, reply_len, general_failure, sizeof general_failure);
        return SW_PARSE_ERROR;
    }
    size_t n = s5_host_text(atyp, buf + start, end - start, out->host);
    out->host_len = (uint16_t)n;
    out->consumed = (uint32_t)(end + 2);
    out->command = buf[1];
    out->atyp = atyp;
    out->port = (uint16_t)(buf[end] << 8 | buf[end + 1]);
    return SW_PARSE_OK;
}

/* ---------------------------------------------------------------------------
 * SOCKS5 UDP ASSOCIATE datagrams (socks5.parse_udp_datagram)
 *
 * A datagram is whole, so there is no NEED_MORE: where _parse_address
 * would want more bytes, parse_udp_datagram raises, and so do we.  RSV is
 * not looked at and FRAG is returned, not judged, exactly as Python does:
 * dropping fragments is the relay's decision (RFC 1928 section 7 lets a
 * server that does not reassemble drop them), not the codec's.
 */

int sw_parse_s5_udp_fields(const uint8_t *buf, size_t len, sw_s5_udp *out)
{
    /* len(data) < 3, then _parse_address(data, 3) wanting the ATYP byte. */
    if (len <= 3)
        return SW_PARSE_ERROR;
    uint8_t atyp = buf[3];
    size_t start = 4, end;
    if (atyp == S5_ATYP_IPV4) {
        end = start + 4;
    } else if (atyp == S5_ATYP_IPV6) {
        end = start + 16;
    } else if (atyp == S5_ATYP_DOMAIN) {
        if (len <= start || buf[start] == 0)
            return SW_PARSE_ERROR;
        start++;
        end = start + buf[start - 1];
    } else {
        return SW_PARSE_ERROR;
    }
    if (len < end + 2)
        return SW_PARSE_ERROR;
    if (atyp == S5_ATYP_DOMAIN && !s5_domain_ok(buf + start, end - start))
        return SW_PARSE_ERROR;
    out->header_len = (uint32_t)(end + 2);
    out->frag = buf[2];
    out->atyp = atyp;
    out->port = (uint16_t)(buf[end] << 8 | buf[end + 1]);
    out->addr_off = (uint16_t)start;
    out->addr_len = (uint16_t)(end - start);
    out->host_len = 0;
    out->host[0] = '\0';
    return SW_PARSE_OK;
}

int sw_parse_s5_udp(const uint8_t *buf, size_t len, sw_s5_udp *out)
{
    int rc = sw_parse_s5_udp_fields(buf, len, out);
    if (rc == SW_PARSE_OK)
        out->host_len = (uint16_t)s5_host_text(out->atyp, buf + out->addr_off, out->addr_len,
                                               out->host);
    return rc;
}

/* ---------------------------------------------------------------------------
 * HTTP CONNECT (http.parse_request_head + connect_authority +
 * proxy_basic_credentials)
 */

/* RFC 9110 tchar, http._TOKEN_RE. */
static bool is_tchar(uint8_t c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return true;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* What a field value may hold per http._BAD_VALUE_CHAR_RE (VCHAR, obs-text,
 * SP, HTAB); CR and LF only end the line, and a NUL fails _head_lines. */
static bool is_value_char(uint8_t c) { return c == '\t' || (c >= 0x20 && c != 0x7F); }

/* http._REG_NAME_RE. */
static bool is_reg_name_char(uint8_t c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           c == '_' || c == '-' || c == '.';
}

/* http._PORT_RE then 0 < port <= 0xFFFF; -1 when Python refuses it. */
static long parse_port(const uint8_t *s, size_t n)
{
    if (n < 1 || n > 5)
        return -1;
    long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    return (v > 0 && v <= 0xFFFF) ? v : -1;
}

/* http._parse_authority(target, None) with Python's result, or false
 * wherever Python raises -- and also (the caller then defers) for an
 * IPv4-mapped literal, whose .compressed text differs between Python 3.11
 * ("::ffff:102:304") and 3.13 ("::ffff:1.2.3.4"), and for a host that does
 * not fit in `out`. */
static bool http_authority(const uint8_t *t, size_t n, sw_http_connect *out)
{
    const uint8_t *port_text;
    size_t port_len, host_len;
    if (n && t[0] == '[') {
        const uint8_t *close = memchr(t, ']', n);
        if (!close)
            return false;
        size_t lit_len = (size_t)(close - t) - 1;
        uint8_t a[16];
        if (memchr(t + 1, '%', lit_len) || !sw_ip6_parse(t + 1, lit_len, a) || ip6_is_v4_mapped(a))
            return false;
        const uint8_t *rest = close + 1;
        size_t rest_len = n - (size_t)(rest - t);
        /* "[v6]" and "[v6]:" both lack the required port. */
        if (rest_len < 2 || rest[0] != ':')
            return false;
        port_text = rest + 1;
        port_len = rest_len - 1;
        host_len = sw_ip6_text(a, out->host);
    } else {
        const uint8_t *colon = memchr(t, ':', n);
        if (!colon)
            return false;
        host_len = (size_t)(colon - t);
        if (host_len == 0 || host_len >= SW_HOST_MAX)
            return false;
        for (size_t i = 0; i < host_len; i++) {
            if (!is_reg_name_char(t[i]))
                return false;
            out->host[i] = (char)ascii_lower(t[i]);
        }
        port_text = colon + 1;
        port_len = n - host_len - 1;
    }
    long port = parse_port(port_text, port_len);
    if (port < 0)
        return false;
    out->host[host_len] = '\0';
    out->host_len = (uint16_t)host_len;
    out->port = (uint16_t)port;
    return true;
}

static int b64_value(uint8_t c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

enum { B64_INVALID = -1, B64_VERSION_DEPENDENT = -2 };

/* base64.b64decode(token, validate=True), i.e. binascii.a2b_base64 in
 * strict mode: the standard alphabet only, no leading '=', nothing but '='
 * after the first '=', and the padding the data length calls for -- none
 * after whole quads, "==" after 2 extra characters, "=" after 3 (1 extra
 * is always refused).  Unused low bits of the last data character are
 * ignored, as binascii does.  '=' after whole quads is where interpreters
 * disagree: 3.11 accepts any number of them ("OjAw==" decodes), later
 * releases (3.12.4 on) refuse them ("Excess padding not allowed"), so that
 * case is B64_VERSION_DEPENDENT (the caller defers).  Returns the number of data
 * characters, or one of those two codes. */
static long b64_data_len(const uint8_t *s, size_t n)
{
    size_t data = 0;
    while (data < n && b64_value(s[data]) >= 0)
        data++;
    for (size_t i = data; i < n; i++)
        if (s[i] != '=')
            return B64_INVALID;
    size_t pad = n - data;
    if (pad == 0)
        return data % 4 ? B64_INVALID : (long)data; /* unpadded: whole quads only */
    if (data == 0)
        return B64_INVALID; /* leading padding */
    switch (data % 4) {
    case 0:
        return B64_VERSION_DEPENDENT;
    case 2:
        return pad == 2 ? (long)data : B64_INVALID;
    case 3:
        return pad == 1 ? (long)data : B64_INVALID;
    default:
        return B64_INVALID;
    }
}

enum creds_result { CREDS_NONE, CREDS_OK, CREDS_DEFER };

/* proxy_basic_credentials() over the (already OWS-stripped) first
 * Proxy-Authorization value: CREDS_NONE where Python returns None,
 * CREDS_OK with the same user and password, CREDS_DEFER where Python's
 * answer depends on its version (see b64_data_len) or where it would
 * return credentials that sw_http_connect cannot carry faithfully (longer
 * than 255 bytes, or holding a NUL that would cut the C strings). */
static enum creds_result http_basic_creds(const uint8_t *v, size_t n, sw_http_connect *out)
{
    const uint8_t *sp = memchr(v, ' ', n);
    size_t scheme_len = sp ? (size_t)(sp - v) : n;
    if (!eq_lower(v, scheme_len, "basic"))
        return CREDS_NONE;
    const uint8_t *tok = sp ? sp + 1 : v + n;
    size_t tok_len = (size_t)(v + n - tok);
    while (tok_len && (tok[0] == ' ' || tok[0] == '\t')) {
        tok++;
        tok_len--;
    }
    while (tok_len && (tok[tok_len - 1] == ' ' || tok[tok_len - 1] == '\t'))
        tok_len--;
    long data = b64_data_len(tok, tok_len);
    if (data == B64_VERSION_DEPENDENT)
        return CREDS_DEFER;
    if (data < 0)
        return CREDS_NONE;

    /* Decode straight into user (up to the first ':') and pass. */
    size_t ulen = 0, plen = 0;
    bool colon = false, nul = false, overflow = false;
    uint32_t acc = 0;
    int bits = 0;
    for (long i = 0; i < data; i++) {
        acc = (acc << 6 | (uint32_t)b64_value(tok[i])) & 0xFFFFFF;
        bits += 6;
        if (bits < 8)
            continue;
        bits -= 8;
        uint8_t byte = (uint8_t)(acc >> bits);
        if (byte == 0)
            nul = true;
        if (!colon && byte == ':') {
            colon = true;
        } else if (!colon) {
            if (ulen < SW_HOST_MAX - 1)
                out->user[ulen] = (char)byte;
            else
                overflow = true;
            ulen++;
        } else {
            if (plen < SW_HOST_MAX - 1)
                out->pass[plen] = (char)byte;
            else
                overflow = true;
            plen++;
        }
    }
    if (!colon)
        return CREDS_NONE;
    if (overflow || nul)
        return CREDS_DEFER;
    /* The whole decode must be UTF-8; ':' is ASCII and never inside a
     * multi-byte sequence, so checking both halves is the same test. */
    if (!utf8_valid((const uint8_t *)out->user, ulen) ||
        !utf8_valid((const uint8_t *)out->pass, plen))
        return CREDS_NONE;
    out->user[ulen] = '\0';
    out->pass[plen] = '\0';
    out->user_len = (uint16_t)ulen;
    out->pass_len = (uint16_t)plen;
    return CREDS_OK;
}

/* Matches the literal `lit` at buf[*i..]: 1 on a full match (advancing *i),
 * 0 when the buffer ends inside a matching prefix, -1 on a mismatch. */
static int match_lit(const uint8_t *buf, size_t n, size_t *i, const char *lit)
{
    for (size_t k = 0; lit[k]; k++) {
        if (*i + k >= n)
            return 0;
        if (buf[*i + k] != (uint8_t)lit[k])
            return -1;
    }
    *i += strlen(lit);
    return 1;
}

/* A line ending at buf[*i]: "\n" or "\r\n".  1 (advancing *i), 0 when the
 * buffer ends first, -1 for anything else (a bare CR Python refuses). */
static int match_eol(const uint8_t *buf, size_t n, size_t *i)
{
    if (*i >= n)
        return 0;
    if (buf[*i] == '\n') {
        *i += 1;
        return 1;
    }
    if (buf[*i] != '\r')
        return -1;
    if (*i + 1 >= n)
        return 0;
    if (buf[*i + 1] != '\n')
        return -1;
    *i += 2;
    return 1;
}

int sw_parse_http_connect(const uint8_t *buf, size_t len, sw_http_connect *out)
{
    /* Python looks for the end of the head in the first MAX_HEAD_SIZE bytes
     * only; past them, no terminator means 431 (an error: defer). */
    const size_t n = len < HTTP_MAX_HEAD ? len : HTTP_MAX_HEAD;
    const int incomplete = len >= HTTP_MAX_HEAD ? SW_PARSE_DEFER : SW_PARSE_NEED_MORE;
    size_t i = 0;
    int m;

    /* _LEADING_EOL_RE: empty lines before the request line are skipped. */
    for (;;) {
        if (i < n && buf[i] == '\n')
            i++;
        else if (i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n')
            i += 2;
        else
            break;
    }
    /* A lone trailing CR may be one more empty line (_check_partial_request
     * waits for it too); anything else must be the request line. */
    if (i == n || (i + 1 == n && buf[i] == '\r'))
        return incomplete;

    /* The request line, "CONNECT <target> HTTP/1.<d>".  Each prefix of it
     * passes Python's partial checks (method token prefix, no NUL, no CR
     * before the end), and a complete one passes _parse_request_line. */
    if ((m = match_lit(buf, n, &i, "CONNECT ")) <= 0)
        return m == 0 ? incomplete : SW_PARSE_DEFER;
    const size_t target = i;
    /* _BAD_TARGET_CHAR_RE allows obs-text too, but no authority holds it. */
    while (i < n && buf[i] > 0x20 && buf[i] < 0x7F) {
        if (i - target >= HTTP_TARGET_MAX)
            return SW_PARSE_DEFER;
        i++;
    }
    const size_t target_len = i - target;
    if (i == n)
        return incomplete;
    if (target_len == 0)
        return SW_PARSE_DEFER;
    if ((m = match_lit(buf, n, &i, " HTTP/1.")) <= 0)
        return m == 0 ? incomplete : SW_PARSE_DEFER;
    if (i == n)
        return incomplete;
    if (buf[i] < '0' || buf[i] > '9')
        return SW_PARSE_DEFER;
    i++;
    if ((m = match_eol(buf, n, &i)) <= 0)
        return m == 0 ? incomplete : SW_PARSE_DEFER;
    /* The target is final now: one Python would refuse is no use waiting for. */
    if (!http_authority(buf + target, target_len, out))
        return SW_PARSE_DEFER;

    /* Field lines up to the empty line.  The first "\n\r?\n" after the
     * leading empty lines (_HEAD_END_RE) is exactly where an empty line
     * follows, because no line accepted here holds a LF of its own. */
    const uint8_t *auth = NULL;
    size_t auth_len = 0;
    int hosts = 0;
    for (;;) {
        if ((m = match_eol(buf, n, &i)) == 1)
            break;
        if (m == 0)
            return incomplete;
        if (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\r')
            return SW_PARSE_DEFER; /* obs-fold, or a bare CR */
        const size_t name = i;
        while (i < n && is_tchar(buf[i]))
            i++;
        if (i == n)
            return incomplete;
        if (buf[i] != ':' || i == name)
            return SW_PARSE_DEFER;
        const size_t name_len = i - name;
        i++;
        size_t value = i;
        while (i < n && is_value_char(buf[i]))
            i++;
        size_t value_end = i;
        if ((m = match_eol(buf, n, &i)) <= 0)
            return m == 0 ? incomplete : SW_PARSE_DEFER;
        /* Body framing is Python's business (_check_framing and smuggling
         * rules), and it refuses a second Host. */
        if (eq_lower(buf + name, name_len, "content-length") ||
            eq_lower(buf + name, name_len, "transfer-encoding"))
            return SW_PARSE_DEFER;
        if (eq_lower(buf + name, name_len, "host") && ++hosts > 1)
            return SW_PARSE_DEFER;
        if (!auth && eq_lower(buf + name, name_len, "proxy-authorization")) {
            /* value.strip(_OWS), as _parse_fields stores it */
            while (value < value_end && (buf[value] == ' ' || buf[value] == '\t'))
                value++;
            while (value_end > value && (buf[value_end - 1] == ' ' || buf[value_end - 1] == '\t'))
                value_end--;
            auth = buf + value;
            auth_len = value_end - value;
        }
    }

    out->has_creds = 0;
    out->user_len = out->pass_len = 0;
    out->user[0] = out->pass[0] = '\0';
    if (auth) {
        enum creds_result r = http_basic_creds(auth, auth_len, out);
        if (r == CREDS_DEFER)
            return SW_PARSE_DEFER;
        if (r == CREDS_OK) {
            out->has_creds = 1;
        } else {
            out->user_len = out->pass_len = 0;
            out->user[0] = out->pass[0] = '\0';
        }
    }
    out->consumed = (uint32_t)i;
    return SW_PARSE_OK;
}

/* ---------------------------------------------------------------------------
 * HTTP absolute-URI forwarding (http.parse_request_head + inbound.forward_request
 * + http.origin_request(connection=""))
 */

enum {
    /* "http://", a host (< SW_HOST_MAX), ":65535", and a path: what C forwards. */
    FWD_TARGET_MAX = 8192,
    FWD_METHOD_MAX = 16,
};

/* inbound.py's hop-by-hop drop set, http._HOP_BY_HOP. */
static bool fwd_hop_by_hop(const uint8_t *s, size_t n)
{
    return eq_lower(s, n, "connection") || eq_lower(s, n, "proxy-connection") ||
           eq_lower(s, n, "keep-alive") || eq_lower(s, n, "proxy-authorization") ||
           eq_lower(s, n, "te") || eq_lower(s, n, "upgrade");
}

/* Case-insensitive equality of two byte strings. */
static bool eq_nocase(const uint8_t *a, size_t an, const uint8_t *b, size_t bn)
{
    if (an != bn)
        return false;
    for (size_t i = 0; i < an; i++)
        if (ascii_lower(a[i]) != ascii_lower(b[i]))
            return false;
    return true;
}

struct fwd_span {
    uint32_t off, len;
};

struct fwd_writer {
    uint8_t *out;
    size_t cap, len;
    bool overflow;
};

static void fwd_put(struct fwd_writer *w, const void *data, size_t n)
{
    if (w->overflow || n > w->cap - w->len) {
        w->overflow = true;
        return;
    }
    memcpy(w->out + w->len, data, n);
    w->len += n;
}

/* The members of a comma-separated value, each .strip(_OWS), into tokens[]
 * (connection_tokens' and origin_request's split).  false when more than
 * SW_HTTP_FWD_TOKENS members in all: the caller defers. */
static bool fwd_tokens(const uint8_t *v, size_t n, uint32_t base, struct fwd_span *tokens,
                       size_t *ntokens)
{
    size_t start = 0;
    for (size_t k = 0; k <= n; k++) {
        if (k < n && v[k] != ',')
            continue;
        size_t a = start, b = k;
        while (a < b && (v[a] == ' ' || v[a] == '\t'))
            a++;
        while (b > a && (v[b - 1] == ' ' || v[b - 1] == '\t'))
            b--;
        if (*ntokens >= SW_HTTP_FWD_TOKENS)
            return false;
        tokens[*ntokens].off = base + (uint32_t)a;
        tokens[*ntokens].len = (uint32_t)(b - a);
        (*ntokens)++;
        start = k + 1;
    }
    return true;
}

int sw_parse_http_forward(const uint8_t *buf, size_t len, sw_http_forward *out, uint8_t *wire,
                          size_t wire_cap)
{
    /* As sw_parse_http_connect: Python looks for the head's end in the first
     * MAX_HEAD_SIZE bytes only. */
    const size_t n = len < HTTP_MAX_HEAD ? len : HTTP_MAX_HEAD;
    const int incomplete = len >= HTTP_MAX_HEAD ? SW_PARSE_DEFER : SW_PARSE_NEED_MORE;
    size_t i = 0;
    int m;

    for (;;) {
        if (i < n && buf[i] == '\n')
            i++;
        else if (i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n')
            i += 2;
        else
            break;
    }
    if (i == n || (i + 1 == n && buf[i] == '\r'))
        return incomplete;

    /* "<METHOD> <target> HTTP/1.1": every prefix C waits on passes Python's
     * partial checks (a token prefix, no NUL, no CR before the line's end). */
    const size_t method = i;
    while (i < n && buf[i] >= 'A' && buf[i] <= 'Z') {
        if (i - method >= FWD_METHOD_MAX)
            return SW_PARSE_DEFER;
        i++;
    }
    if (i == n)
        return incomplete;
    const size_t method_len = i - method;
    if (method_len == 0 || buf[i] != ' ')
        return SW_PARSE_DEFER;
    if (method_len == 7 && memcmp(buf + method, "CONNECT", 7) == 0)
        return SW_PARSE_DEFER; /* a tunnel: sw_parse_http_connect's */
    i++;
    const size_t target = i;
    /* _BAD_TARGET_CHAR_RE: no controls, no space, no DEL (obs-text passes). */
    while (i < n && buf[i] > 0x20 && buf[i] != 0x7F) {
        if (i - target >= FWD_TARGET_MAX)
            return SW_PARSE_DEFER;
        i++;
    }
    const size_t target_len = i - target;
    if (i == n)
        return incomplete;
    if (target_len == 0)
        return SW_PARSE_DEFER;
    if ((m = match_lit(buf, n, &i, " HTTP/1.1")) <= 0)
        return m == 0 ? incomplete : SW_PARSE_DEFER;
    if ((m = match_eol(buf, n, &i)) <= 0)
        return m == 0 ? incomplete : SW_PARSE_DEFER;

    /* http.split_absolute_uri: scheme "http" (any case), then the authority up
     * to the first of "/?#", the path up to "#" and "/"-prefixed. */
    const uint8_t *t = buf + target;
    if (target_len < 7 || !eq_lower(t, 4, "http") || memcmp(t + 4, "://", 3) != 0)
        return SW_PARSE_DEFER;
    const uint8_t *rest = t + 7;
    const size_t rest_len = target_len - 7;
    size_t cut = rest_len;
    for (size_t k = 0; k < rest_len; k++)
        if (rest[k] == '/' || rest[k] == '?' || rest[k] == '#') {
            cut = k;
            break;
        }
    const uint8_t *colon = memchr(rest, ':', cut);
    const size_t host_len = colon ? (size_t)(colon - rest) : cut;
    if (host_len == 0 || host_len >= SW_HOST_MAX)
        return SW_PARSE_DEFER; /* an empty host is a 400; "[" (IPv6) and "@" fail below */
    for (size_t k = 0; k < host_len; k++) {
        if (!is_reg_name_char(rest[k]))
            return SW_PARSE_DEFER;
        out->host[k] = (char)ascii_lower(rest[k]);
    }
    out->host[host_len] = '\0';
    out->host_len = (uint16_t)host_len;
    long port = 80; /* no port, or an empty one: the scheme's */
    if (colon && cut - host_len > 1) {
        port = parse_port(colon + 1, cut - host_len - 1);
        if (port < 0)
            return SW_PARSE_DEFER;
    }
    out->port = (uint16_t)port;
    const uint8_t *path = rest + cut;
    const uint8_t *hash = memchr(path, '#', rest_len - cut);
    const size_t path_len = hash ? (size_t)(hash - path) : rest_len - cut;
    const bool slash = path_len == 0 || path[0] != '/';

    /* Field lines, as sw_parse_http_connect reads them, kept for the rewrite. */
    struct fwd_span names[SW_HTTP_FWD_FIELDS], values[SW_HTTP_FWD_FIELDS];
    struct fwd_span named[SW_HTTP_FWD_TOKENS], hop[SW_HTTP_FWD_TOKENS];
    size_t nfields = 0, nnamed = 0, nhop = 0;
    int hosts = 0;
    for (;;) {
        if ((m = match_eol(buf, n, &i)) == 1)
            break;
        if (m == 0)
            return incomplete;
        if (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\r')
            return SW_PARSE_DEFER; /* obs-fold (a 400), or a bare CR */
        const size_t name = i;
        while (i < n && is_tchar(buf[i]))
            i++;
        if (i == n)
            return incomplete;
        if (buf[i] != ':' || i == name)
            return SW_PARSE_DEFER;
        const size_t name_len = i - name;
        i++;
        size_t value = i;
        while (i < n && is_value_char(buf[i]))
            i++;
        size_t value_end = i;
        if ((m = match_eol(buf, n, &i)) <= 0)
            return m == 0 ? incomplete : SW_PARSE_DEFER;
        const uint8_t *nm = buf + name;
        /* A body, a protocol switch or a second Host (a 400) are Python's. */
        if (eq_lower(nm, name_len, "content-length") ||
            eq_lower(nm, name_len, "transfer-encoding") || eq_lower(nm, name_len, "upgrade"))
            return SW_PARSE_DEFER;
        if (eq_lower(nm, name_len, "host") && ++hosts > 1)
            return SW_PARSE_DEFER;
        if (nfields >= SW_HTTP_FWD_FIELDS)
            return SW_PARSE_DEFER;
        while (value < value_end && (buf[value] == ' ' || buf[value] == '\t'))
            value++;
        while (value_end > value && (buf[value_end - 1] == ' ' || buf[value_end - 1] == '\t'))
            value_end--;
        names[nfields] = (struct fwd_span){(uint32_t)name, (uint32_t)name_len};
        values[nfields] = (struct fwd_span){(uint32_t)value, (uint32_t)(value_end - value)};
        nfields++;
        /* Connection names fields to drop (origin_request); Connection and
         * Proxy-Connection together say whether the client keeps its
         * connection (forward_request's connection_tokens). */
        bool is_conn = eq_lower(nm, name_len, "connection");
        if (is_conn && !fwd_tokens(buf + value, value_end - value, (uint32_t)value, named, &nnamed))
            return SW_PARSE_DEFER;
        if ((is_conn || eq_lower(nm, name_len, "proxy-connection")) &&
            !fwd_tokens(buf + value, value_end - value, (uint32_t)value, hop, &nhop))
            return SW_PARSE_DEFER;
    }
    out->consumed = (uint32_t)i;
    out->keep_alive = 1;
    for (size_t k = 0; k < nhop; k++)
        if (eq_lower(buf + hop[k].off, hop[k].len, "close"))
            out->keep_alive = 0;
    out->head = method_len == 4 && memcmp(buf + method, "HEAD", 4) == 0;

    /* origin_request: the request line in origin form, the Host from the
     * target (in place of the first, or first of all), no hop-by-hop field. */
    char host_header[SW_HOST_MAX + 8];
    size_t hh = host_len;
    memcpy(host_header, out->host, host_len);
    if (port != 80) {
        host_header[hh++] = ':';
        hh += put_dec(host_header + hh, (unsigned)port);
    }
    struct fwd_writer w = {wire, wire_cap, 0, false};
    fwd_put(&w, buf + method, method_len);
    fwd_put(&w, " ", 1);
    if (slash)
        fwd_put(&w, "/", 1);
    fwd_put(&w, path, path_len);
    fwd_put(&w, " HTTP/1.1\r\n", 11);
    if (!hosts) {
        fwd_put(&w, "Host: ", 6);
        fwd_put(&w, host_header, hh);
        fwd_put(&w, "\r\n", 2);
    }
    for (size_t f = 0; f < nfields; f++) {
        const uint8_t *nm = buf + names[f].off;
        const size_t nl = names[f].len;
        if (eq_lower(nm, nl, "host")) {
            fwd_put(&w, nm, nl);
            fwd_put(&w, ": ", 2);
            fwd_put(&w, host_header, hh);
            fwd_put(&w, "\r\n", 2);
            continue;
        }
        bool drop = fwd_hop_by_hop(nm, nl);
        for (size_t k = 0; k < nnamed && !drop; k++)
            drop = eq_nocase(nm, nl, buf + named[k].off, named[k].len);
        if (drop)
            continue;
        fwd_put(&w, nm, nl);
        fwd_put(&w, ": ", 2);
        fwd_put(&w, buf + values[f].off, values[f].len);
        fwd_put(&w, "\r\n", 2);
    }
    fwd_put(&w, "\r\n", 2);
    if (w.overflow)
        return SW_PARSE_DEFER;
    out->wire_len = (uint32_t)w.len;
    return SW_PARSE_OK;
}

/* ---------------------------------------------------------------------------
 * HTTP upstream proxy, client side (http.connect_request and
 * http.parse_response_head)
 */

/* The host part of http._authority(host, port): an IP literal's canonical
 * text (IPv6 bracketed, with its zone id as given), or the name as given. */
struct up_authority {
    char ip[IP6_TEXT_MAX + 1];
    size_t ip_len;
    bool v6;
    const char *scope; /* IPv6 zone id after '%' (NULL: none) */
    size_t scope_len;
    const char *name; /* a host name (NULL: an IP literal) */
    size_t name_len;
};

/* http._authority's host rules plus the request's final .encode("ascii"),
 * whose UnicodeEncodeError is a ValueError too: 0, or -EINVAL where Python
 * raises.  The C string is the Python str in UTF-8; UTF-8 puts no ASCII byte
 * inside a multi-byte character, so splitting at '.', ':' or '%' and the
 * ASCII-only digit rules of ipaddress read the bytes as they read the text,
 * and any byte >= 0x80 in the output is an encode failure. */
static int up_authority(const char *host, struct up_authority *a)
{
    const uint8_t *s = (const uint8_t *)host;
    const size_t n = strlen(host);
    /* host[1:-1] when it starts with '[' and ends with ']' ("[" alone does
     * not: it does not end with ']') */
    const uint8_t *bare = s;
    size_t bn = n;
    if (n >= 2 && s[0] == '[' && s[n - 1] == ']') {
        bare++;
        bn -= 2;
    }
    a->v6 = false;
    a->scope = a->name = NULL;
    a->scope_len = a->name_len = 0;
    /* ipaddress.ip_address(bare): IPv4Address, then IPv6Address; both
     * refuse any '/' first. */
    if (!memchr(bare, '/', bn)) {
        uint8_t v4[4], v6[16];
        if (sw_ip4_parse(bare, bn, v4)) {
            a->ip_len = ip4_text(v4, a->ip);
            return 0;
        }
        /* _split_scope_id: at the first '%', a non-empty id without '%' */
        const uint8_t *pct = memchr(bare, '%', bn);
        const size_t addr_len = pct ? (size_t)(pct - bare) : bn;
        const size_t scope_len = pct ? bn - addr_len - 1 : 0;
        if ((!pct || (scope_len && !memchr(pct + 1, '%', scope_len))) &&
            sw_ip6_parse(bare, addr_len, v6)) {
            /* .compressed: 3.11's hex spelling even for IPv4-mapped
             * addresses (3.13 writes ::ffff:a.b.c.d), then "%" and the zone
             * id unchecked -- Python's _authority does not look at it, so
             * neither may C, save for the ASCII encoding. */
            a->v6 = true;
            a->ip_len = sw_ip6_text(v6, a->ip);
            if (pct) {
                for (size_t i = 0; i < scope_len; i++)
                    if (pct[1 + i] >= 0x80)
                        return -EINVAL;
                a->scope = (const char *)pct + 1;
                a->scope_len = scope_len;
            }
            return 0;
        }
    }
    /* A name: _check_head_text (non-empty, no control, space or DEL), no
     * ':', '/' or '@', and ASCII.  The brackets, if any, stay. */
    if (n == 0)
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= 0x20 || s[i] >= 0x7F || s[i] == ':' || s[i] == '/' || s[i] == '@')
            return -EINVAL;
    a->name = host;
    a->name_len = n;
    return 0;
}

/* A bounded writer: copies what fits, counts everything, so one pass both
 * fills `out` and finds the length when it does not fit. */
struct up_writer {
    uint8_t *out;
    size_t cap;
    uint64_t len;
};

static void up_put(struct up_writer *w, const void *data, size_t n)
{
    if (w->len < w->cap) {
        size_t room = w->cap - (size_t)w->len;
        memcpy(w->out + w->len, data, n < room ? n : room);
    }
    w->len += n;
}

static void up_put_str(struct up_writer *w, const char *s) { up_put(w, s, strlen(s)); }

/* f"{host}:{port}" / f"[{ip.compressed}]:{port}" as http._authority has it. */
static void up_put_authority(struct up_writer *w, const struct up_authority *a, const char *port,
                             size_t port_len)
{
    if (a->name) {
        up_put(w, a->name, a->name_len);
    } else {
        if (a->v6)
            up_put(w, "[", 1);
        up_put(w, a->ip, a->ip_len);
        if (a->scope) {
            up_put(w, "%", 1);
            up_put(w, a->scope, a->scope_len);
        }
        if (a->v6)
            up_put(w, "]", 1);
    }
    up_put(w, ":", 1);
    up_put(w, port, port_len);
}

/* base64.b64encode(f"{user}:{password}".encode()) without building the
 * joined string: byte i of it is read straight from the two C strings. */
static void up_put_basic_token(struct up_writer *w, const char *user, size_t ulen,
                               const char *pass, size_t plen)
{
    static const char alphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const size_t n = ulen + 1 + plen;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = 0;
        for (size_t k = 0; k < 3; k++) {
            size_t j = i + k;
            uint8_t c = 0; /* past the end: the zero bits padding encodes */
            if (j < ulen)
                c = (uint8_t)user[j];
            else if (j == ulen)
                c = ':';
            else if (j < n)
                c = (uint8_t)pass[j - ulen - 1];
            v = v << 8 | c;
        }
        char quad[4] = {alphabet[v >> 18 & 63], alphabet[v >> 12 & 63],
                        i + 1 < n ? alphabet[v >> 6 & 63] : '=',
                        i + 2 < n ? alphabet[v & 63] : '='};
        up_put(w, quad, sizeof quad);
    }
}

int sw_http_connect_request(const char *host, uint16_t port, const char *user, const char *pass,
                            uint8_t *out, size_t cap)
{
    /* Every ValueError first, so that -ENOSPC never hides one. */
    struct up_authority a;
    if (port == 0 || host == NULL || up_authority(host, &a) < 0)
        return -EINVAL;
    size_t ulen = 0, plen = 0;
    if (user) {
        /* outbounds.py passes (username, password or ""): NULL is "". */
        if (!pass)
            pass = "";
        ulen = strlen(user);
        plen = strlen(pass);
        /* A ':' in the user cannot be encoded; invalid UTF-8 is what a str
         * with lone surrogates becomes, and .encode() refuses those. */
        if (memchr(user, ':', ulen) || !utf8_valid((const uint8_t *)user, ulen) ||
            !utf8_valid((const uint8_t *)pass, plen))
            return -EINVAL;
    }
    char port_text[5];
    size_t port_len = put_dec(port_text, port);

    struct up_writer w = {.out = out, .cap = out ? cap : 0, .len = 0};
    up_put_str(&w, "CONNECT ");
    up_put_authority(&w, &a, port_text, port_len);
    up_put_str(&w, " HTTP/1.1\r\nHost: ");
    up_put_authority(&w, &a, port_text, port_len);
    up_put_str(&w, "\r\n");
    if (user) {
        up_put_str(&w, "Proxy-Authorization: Basic ");
        up_put_basic_token(&w, user, ulen, pass, plen);
        up_put_str(&w, "\r\n");
    }
    up_put_str(&w, "\r\n");
    /* The return value must carry the length: a request past INT_MAX bytes
     * (gigabyte strings) fits no buffer this can describe. */
    if (w.len > w.cap || w.len > INT_MAX)
        return -ENOSPC;
    return (int)w.len;
}

/* http._HEAD_END_RE.search(buf, 0, n): the offset just past the first
 * "\n\r?\n" lying wholly in buf[0..n), or 0 for none (a match is >= 2). */
static size_t head_end(const uint8_t *buf, size_t n)
{
    size_t i = 0;
    while (i < n) {
        const uint8_t *lf = memchr(buf + i, '\n', n - i);
        if (!lf)
            break;
        i = (size_t)(lf - buf);
        if (i + 1 < n && buf[i + 1] == '\n')
            return i + 2;
        if (i + 2 < n && buf[i + 1] == '\r' && buf[i + 2] == '\n')
            return i + 3;
        i++;
    }
    return 0;
}

/* The longest fixed text (RW_VALUE's) is 53 bytes; a repr() adds two
 * quotes and at most 4 bytes for each of its fewer than max_size bytes. */
_Static_assert(SW_HTTP_RESPONSE_ERROR_MAX >= 53 + 2 + 4 * (size_t)SW_HTTP_MAX_HEAD + 1,
               "room for the longest response error message");

/* Why http.parse_response_head raises: one value per ProtocolError text it
 * can produce (see resp_message for the texts).  RW_VERSION, RW_NAME and
 * RW_VALUE quote a piece of the head with repr(); `text` points at it. */
enum resp_why {
    RW_NONE = 0,
    RW_TOO_LARGE, /* "response head too large" */
    RW_NOT_HTTP,  /* "not an HTTP response" */
    RW_VERSION,   /* "unsupported response version {version!r}" */
    RW_STATUS,    /* "malformed status code" */
    RW_REASON,    /* "invalid reason phrase" */
    RW_NUL,       /* "malformed response head: NUL in head" */
    RW_BARE_CR,   /* "malformed response head: bare CR in head" */
    RW_FOLD,      /* "malformed response head: obsolete line folding" */
    RW_NO_COLON,  /* "malformed response head: header line without a colon" */
    RW_NAME,      /* "malformed response head: invalid header name {name!r}" */
    RW_VALUE,     /* "malformed response head: invalid character in header {name!r}" */
};

struct resp_fail {
    enum resp_why why;
    const uint8_t *text; /* the repr()'d piece (latin-1 bytes), or NULL */
    size_t text_len;
};

static void resp_fail_set(struct resp_fail *f, enum resp_why why, const uint8_t *text, size_t n)
{
    f->why = why;
    f->text = text;
    f->text_len = n;
}

/* http._parse_status_line over one line (its text is its bytes: latin-1):
 * the status code, or -1 where Python raises, with *f saying which of its
 * raises, checked in its order.  Any CR or NUL the line still holds fails
 * one of the checks, as it does in Python. */
static int status_line(const uint8_t *s, size_t n, struct resp_fail *f)
{
    /* version, _, rest = line.partition(" ") */
    const uint8_t *sp = memchr(s, ' ', n);
    const size_t vlen = sp ? (size_t)(sp - s) : n;
    /* _HTTP1_VERSION_RE.fullmatch */
    if (vlen != 8 || memcmp(s, "HTTP/1.", 7) != 0 || s[7] < '0' || s[7] > '9') {
        resp_fail_set(f, RW_VERSION, s, vlen);
        return -1;
    }
    if (!sp) {
        resp_fail_set(f, RW_STATUS, NULL, 0); /* rest == "": status_text is empty */
        return -1;
    }
    /* status_text, _, reason = rest.partition(" ") */
    const uint8_t *rest = sp + 1;
    const size_t rlen = n - vlen - 1;
    const uint8_t *sp2 = memchr(rest, ' ', rlen);
    const size_t slen = sp2 ? (size_t)(sp2 - rest) : rlen;
    /* len 3, .isdigit() and .isascii(): three ASCII digits (latin-1's
     * superscript digits pass isdigit() but not isascii()) */
    int status = slen == 3 ? 0 : -1;
    for (size_t i = 0; i < 3 && status >= 0; i++)
        status = rest[i] >= '0' && rest[i] <= '9' ? status * 10 + (rest[i] - '0') : -1;
    if (status < 0) {
        resp_fail_set(f, RW_STATUS, NULL, 0);
        return -1;
    }
    if (sp2) {
        /* _BAD_VALUE_CHAR_RE.search(reason), before the status < 100 check */
        const uint8_t *reason = sp2 + 1;
        const size_t reason_len = rlen - slen - 1;
        for (size_t i = 0; i < reason_len; i++)
            if (!is_value_char(reason[i])) {
                resp_fail_set(f, RW_REASON, NULL, 0);
                return -1;
            }
    }
    if (status < 100) {
        resp_fail_set(f, RW_STATUS, NULL, 0);
        return -1;
    }
    return status;
}

/* http._parse_fields(lines, unfold=True) for one field line (CR- and
 * NUL-free: _head_lines has refused both): true, or false with *f saying
 * which ValueError.  An obs-fold line continues the previous field
 * unchecked -- Python strips and appends it without looking at its
 * characters -- and is refused only before any field. */
static bool response_field_ok(const uint8_t *s, size_t n, bool have_field, struct resp_fail *f)
{
    if (n && (s[0] == ' ' || s[0] == '\t')) {
        if (!have_field)
            resp_fail_set(f, RW_FOLD, NULL, 0);
        return have_field;
    }
    /* name, colon, value = line.partition(":") */
    const uint8_t *colon = memchr(s, ':', n);
    if (!colon) {
        resp_fail_set(f, RW_NO_COLON, NULL, 0);
        return false;
    }
    const size_t name_len = (size_t)(colon - s);
    bool name_ok = name_len > 0; /* _TOKEN_RE is "+" */
    for (size_t i = 0; i < name_len && name_ok; i++)
        name_ok = is_tchar(s[i]);
    if (!name_ok) {
        resp_fail_set(f, RW_NAME, s, name_len);
        return false;
    }
    /* value.strip(_OWS) only drops SP and HTAB, both allowed: the check
     * over the unstripped value is the same. */
    for (const uint8_t *p = colon + 1; p < s + n; p++)
        if (!is_value_char(*p)) {
            resp_fail_set(f, RW_VALUE, s, name_len);
            return false;
        }
    return true;
}

/* http.parse_response_head(buf, max_size): the verdict, and with `why` the
 * ProtocolError Python raises on an ERROR.  Without `why` it stops at the
 * first failing check it meets -- every failure is the same ERROR -- but
 * with it the complete head's checks report in Python's order: a NUL
 * anywhere, then a bare CR in any line (_head_lines), then the first bad
 * field line (_parse_fields), and only then the status line, so a bad
 * status line or field found early is held until the later lines have
 * been searched for a bare CR.  A complete head: `end` is the first
 * terminator within max_size bytes, the lines before it are split at LF
 * with one trailing CR dropped (_head_lines). */
static int parse_response(const uint8_t *buf, size_t len, size_t max_size, sw_http_response *out,
                          struct resp_fail *why)
{
    struct resp_fail scratch;
    struct resp_fail *f = why ? why : &scratch;
    resp_fail_set(f, RW_NONE, NULL, 0);
    /* _find_head(buf, max_size, 0) */
    const size_t n = len < max_size ? len : max_size;
    const size_t end = n ? head_end(buf, n) : 0;
    if (!end && len >= max_size) {
        resp_fail_set(f, RW_TOO_LARGE, NULL, 0);
        return SW_PARSE_ERROR;
    }
    /* _STATUS_PREFIX.startswith(buf[:5]) */
    if (len && memcmp(buf, "HTTP/", len < 5 ? len : 5) != 0) {
        resp_fail_set(f, RW_NOT_HTTP, NULL, 0);
        return SW_PARSE_ERROR;
    }
    if (!end) {
        /* The status line is judged as soon as its LF is here (the whole
         * buffer is under max_size at this point). */
        const uint8_t *lf = len ? memchr(buf, '\n', len) : NULL;
        if (lf) {
            size_t line = (size_t)(lf - buf);
            if (line && buf[line - 1] == '\r')
                line--;
            if (status_line(buf, line, f) < 0)
                return SW_PARSE_ERROR;
        }
        return SW_PARSE_NEED_MORE;
    }
    /* _head_lines: no NUL anywhere in the head (terminator included) */
    if (memchr(buf, '\0', end)) {
        resp_fail_set(f, RW_NUL, NULL, 0);
        return SW_PARSE_ERROR;
    }
    /* The LF that starts the terminator ends the last line: "\n\n" or
     * "\n\r\n" end the head. */
    const size_t last_lf = buf[end - 2] == '\n' ? end - 2 : end - 3;
    struct resp_fail status_fail = {RW_NONE, NULL, 0}, field_fail = {RW_NONE, NULL, 0};
    int status = -1;
    bool have_field = false;
    for (size_t start = 0; start <= last_lf;) {
        /* never NULL: buf[last_lf] is a LF */
        const uint8_t *nl = memchr(buf + start, '\n', last_lf + 1 - start);
        const size_t lf = (size_t)(nl - buf);
        size_t stop = lf;
        if (stop > start && buf[stop - 1] == '\r')
            stop--;
        if (memchr(buf + start, '\r', stop - start)) {
            resp_fail_set(f, RW_BARE_CR, NULL, 0);
            return SW_PARSE_ERROR;
        }
        if (start == 0) {
            status = status_line(buf, stop, &status_fail);
            if (status < 0 && !why)
                return SW_PARSE_ERROR;
        } else if (field_fail.why == RW_NONE) {
            /* past a bad field only bare CRs still matter */
            if (response_field_ok(buf + start, stop - start, have_field, &field_fail))
                have_field = true;
            else if (!why)
                return SW_PARSE_ERROR;
        }
        start = lf + 1;
    }
    if (field_fail.why != RW_NONE || status < 0) {
        *f = field_fail.why != RW_NONE ? field_fail : status_fail;
        return SW_PARSE_ERROR;
    }
    out->status = status;
    out->consumed = end;
    return SW_PARSE_OK;
}

int sw_parse_http_response(const uint8_t *buf, size_t len, size_t max_size, sw_http_response *out)
{
    return parse_response(buf, len, max_size, out, NULL);
}

/* ---------------------------------------------------------------------------
 * A forwarded request's response head (http.parse_response_head +
 * http_message.response_framing + http.proxy_response), in C's subset
 */

int sw_parse_http_fwd_response(const uint8_t *buf, size_t len, int head_request, int close,
                               sw_http_fwd_response *out, uint8_t *wire, size_t wire_cap)
{
    sw_http_response r;
    int rc = parse_response(buf, len, HTTP_MAX_HEAD, &r, NULL);
    if (rc == SW_PARSE_NEED_MORE)
        return SW_PARSE_NEED_MORE; /* exactly where Python wants more */
    if (rc != SW_PARSE_OK)
        return SW_PARSE_DEFER; /* Python's error, with its message */
    /* Interim answers and protocol switches are Python's; and only an
     * HTTP/1.1 answer keeps the upstream connection by itself. */
    if (r.status < 200 || r.status > 999 || memcmp(buf, "HTTP/1.1 ", 9) != 0)
        return SW_PARSE_DEFER;
    const size_t end = r.consumed;
    /* The status line (valid: parse_response said so): "HTTP/1.1 ddd[ reason]". */
    const uint8_t *lf = memchr(buf, '\n', end);
    size_t line = (size_t)(lf - buf);
    if (line && buf[line - 1] == '\r')
        line--;
    const uint8_t *reason = buf + 12;
    const size_t reason_len = line > 12 ? line - 13 : 0;
    if (line > 12)
        reason = buf + 13; /* past the space after the status */

    /* Fields: none C would have to drop or to read the framing from
     * (Connection and what it names, Keep-Alive, Proxy-Connection, Upgrade,
     * Transfer-Encoding), no obs-fold (unfolded by Python); Content-Length's
     * members collected as _content_length compares them, as strings. */
    struct fwd_writer w = {wire, wire_cap, 0, false};
    char status_text[4];
    put_dec(status_text, (unsigned)r.status);
    fwd_put(&w, "HTTP/1.1 ", 9);
    fwd_put(&w, status_text, 3);
    fwd_put(&w, " ", 1);
    fwd_put(&w, reason, reason_len);
    fwd_put(&w, "\r\n", 2);
    const uint8_t *cl = NULL;
    size_t cl_len = 0;
    bool cl_bad = false;
    size_t start = (size_t)(lf - buf) + 1;
    for (;;) {
        const uint8_t *nl = memchr(buf + start, '\n', end - start);
        size_t stop = (size_t)(nl - buf);
        const size_t next = stop + 1;
        if (stop > start && buf[stop - 1] == '\r')
            stop--;
        if (stop == start)
            break; /* the empty line */
        if (buf[start] == ' ' || buf[start] == '\t')
            return SW_PARSE_DEFER;
        const uint8_t *colon = memchr(buf + start, ':', stop - start);
        const uint8_t *nm = buf + start;
        const size_t nl_len = (size_t)(colon - nm);
        if (eq_lower(nm, nl_len, "connection") || eq_lower(nm, nl_len, "keep-alive") ||
            eq_lower(nm, nl_len, "proxy-connection") || eq_lower(nm, nl_len, "upgrade") ||
            eq_lower(nm, nl_len, "transfer-encoding"))
            return SW_PARSE_DEFER;
        size_t v = (size_t)(colon - buf) + 1, ve = stop;
        while (v < ve && (buf[v] == ' ' || buf[v] == '\t'))
            v++;
        while (ve > v && (buf[ve - 1] == ' ' || buf[ve - 1] == '\t'))
            ve--;
        if (eq_lower(nm, nl_len, "content-length")) {
            /* Each comma-separated member, stripped: all the same digits. */
            size_t ms = v;
            for (size_t k = v; k <= ve; k++) {
                if (k < ve && buf[k] != ',')
                    continue;
                size_t a = ms, b = k;
                while (a < b && (buf[a] == ' ' || buf[a] == '\t'))
                    a++;
                while (b > a && (buf[b - 1] == ' ' || buf[b - 1] == '\t'))
                    b--;
                if (!cl) {
                    cl = buf + a;
                    cl_len = b - a;
                } else if (b - a != cl_len || memcmp(buf + a, cl, cl_len) != 0) {
                    cl_bad = true;
                }
                ms = k + 1;
            }
        }
        fwd_put(&w, nm, nl_len);
        fwd_put(&w, ": ", 2);
        fwd_put(&w, buf + v, ve - v);
        fwd_put(&w, "\r\n", 2);
        start = next;
    }
    /* response_framing: no body after HEAD, 204, 304 whatever the fields say. */
    uint64_t length = 0;
    if (!head_request && r.status != 204 && r.status != 304) {
        if (!cl || cl_bad || cl_len == 0 || cl_len > 18)
            return SW_PARSE_DEFER; /* read to the close, or Python's 502 */
        for (size_t k = 0; k < cl_len; k++) {
            if (cl[k] < '0' || cl[k] > '9')
                return SW_PARSE_DEFER;
            length = length * 10 + (uint64_t)(cl[k] - '0');
        }
    }
    if (close)
        fwd_put(&w, "Connection: close\r\n", 19);
    fwd_put(&w, "\r\n", 2);
    if (w.overflow)
        return SW_PARSE_DEFER;
    out->consumed = (uint32_t)end;
    out->wire_len = (uint32_t)w.len;
    out->length = length;
    out->status = (uint16_t)r.status;
    return SW_PARSE_OK;
}

/* A bounded UTF-8 writer: copies what fits and counts everything, but
 * never splits a character (a `whole` piece: one UTF-8 sequence) and
 * writes nothing after the first piece that did not fit whole.  So msg
 * always holds a prefix of the message that is valid UTF-8: all of it, or
 * cap - 1 bytes, or cap - 2 when byte cap - 1 would start a character. */
struct msg_writer {
    char *out;
    size_t room; /* cap - 1: bytes available before the NUL */
    size_t written;
    uint64_t len; /* the whole message's length */
    bool cut;     /* something did not fit: write no more */
};

static void msg_put(struct msg_writer *w, const char *piece, size_t n, bool whole)
{
    if (!w->cut) {
        const size_t room = w->room - w->written;
        const size_t k = n <= room ? n : whole ? 0 : room;
        if (k) /* with cap 0, out may be NULL */
            memcpy(w->out + w->written, piece, k);
        w->written += k;
        w->cut = k < n;
    }
    w->len += n;
}

/* Python's str.isprintable() for U+0080..U+00FF: all but the C1 controls,
 * NO-BREAK SPACE (Zs, and only ASCII space is printable) and SOFT HYPHEN
 * (Cf). */
static bool latin1_printable(uint8_t c) { return c > 0xA0 && c != 0xAD; }

/* repr(text.decode("latin-1")) as CPython's unicode_repr writes it: single
 * quotes unless the text holds ' and no "; backslash escapes for the quote,
 * \\, \t, \n and \r; \xNN (lower-case hex) for the other controls, DEL and
 * the non-printable code points above it; everything else as itself, in
 * UTF-8 above U+007F. */
static void msg_put_repr(struct msg_writer *w, const uint8_t *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const bool squote = memchr(s, '\'', n) != NULL, dquote = memchr(s, '"', n) != NULL;
    const char quote = squote && !dquote ? '"' : '\'';
    msg_put(w, &quote, 1, false);
    for (size_t i = 0; i < n; i++) {
        const uint8_t c = s[i];
        char piece[4];
        size_t k = 0;
        bool utf8 = false;
        if (c == (uint8_t)quote || c == '\\') {
            piece[k++] = '\\';
            piece[k++] = (char)c;
        } else if (c == '\t' || c == '\n' || c == '\r') {
            piece[k++] = '\\';
            piece[k++] = c == '\t' ? 't' : c == '\n' ? 'n' : 'r';
        } else if (c < 0x20 || c == 0x7F || (c >= 0x80 && !latin1_printable(c))) {
            piece[k++] = '\\';
            piece[k++] = 'x';
            piece[k++] = hex[c >> 4];
            piece[k++] = hex[c & 15];
        } else if (c < 0x80) {
            piece[k++] = (char)c;
        } else {
            piece[k++] = (char)(0xC0 | c >> 6);
            piece[k++] = (char)(0x80 | (c & 0x3F));
            utf8 = true;
        }
        msg_put(w, piece, k, utf8);
    }
    msg_put(w, &quote, 1, false);
}

static const char *const resp_message[] = {
    [RW_TOO_LARGE] = "response head too large",
    [RW_NOT_HTTP] = "not an HTTP response",
    [RW_VERSION] = "unsupported response version ",
    [RW_STATUS] = "malformed status code",
    [RW_REASON] = "invalid reason phrase",
    [RW_NUL] = "malformed response head: NUL in head",
    [RW_BARE_CR] = "malformed response head: bare CR in head",
    [RW_FOLD] = "malformed response head: obsolete line folding",
    [RW_NO_COLON] = "malformed response head: header line without a colon",
    [RW_NAME] = "malformed response head: invalid header name ",
    [RW_VALUE] = "malformed response head: invalid character in header ",
};

int sw_http_response_error(const uint8_t *buf, size_t len, size_t max_size, char *msg, size_t cap)
{
    struct msg_writer w = {msg, cap ? cap - 1 : 0, 0, 0, false};
    struct resp_fail f;
    sw_http_response unused;
    int rc = -EINVAL;
    if (parse_response(buf, len, max_size, &unused, &f) == SW_PARSE_ERROR) {
        const char *text = resp_message[f.why];
        msg_put(&w, text, strlen(text), false);
        if (f.why == RW_VERSION || f.why == RW_NAME || f.why == RW_VALUE)
            msg_put_repr(&w, f.text, f.text_len);
        rc = w.cut || w.len > INT_MAX ? -ENOSPC : (int)w.len;
    }
    if (cap)
        msg[w.written] = '\0';
    return rc;
}

/* ---------------------------------------------------------------------------
 * Sniffing (sniff.sniff)
 */

/* sniff._more_or_give_up: wait, but never past SNIFF_LIMIT bytes. */
static int more_or_give_up(size_t len)
{
    return len < SNIFF_LIMIT ? SW_PARSE_NEED_MORE : SW_PARSE_ERROR;
}

/* sniff.normalize_host() for a name without ':' (both callers have refused
 * or split at one): lower-case, drop one trailing dot, 1..253 characters of
 * dot-separated labels, each 1..63 long matching _HOST_LABEL_RE. */
static int normalize_host(const uint8_t *s, size_t n, sw_sniffed *out)
{
    if (n && s[n - 1] == '.')
        n--;
    if (n == 0 || n > 253)
        return SW_PARSE_ERROR;
    size_t label = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && s[i] != '.') {
            uint8_t c = ascii_lower(s[i]);
            bool edge_ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
            bool inner_ok = edge_ok || c == '-';
            /* first and last of a label: no hyphen */
            bool edge = i == label || i + 1 == n || s[i + 1] == '.';
            if (!(edge ? edge_ok : inner_ok))
                return SW_PARSE_ERROR;
            out->host[i] = (char)c;
            continue;
        }
        if (i == label || i - label > 63)
            return SW_PARSE_ERROR;
        if (i < n)
            out->host[i] = '.';
        label = i + 1;
    }
    out->host[n] = '\0';
    out->host_len = (uint16_t)n;
    return SW_PARSE_OK;
}

/* A forward cursor over the handshake bytes carried by consecutive TLS
 * records, so a ClientHello spread over several records is read in place.
 * Only offsets below the handshake length that sniff_tls has already seen
 * whole are ever asked for, so every record reached here is complete. */
struct hs_cursor {
    const uint8_t *buf;
    size_t end;  /* bytes of buf in records sniff_tls checked */
    size_t rec;  /* buf offset of the current record's payload */
    size_t size; /* its length */
    size_t base; /* handshake offset of its first byte */
};

static void hs_rewind(struct hs_cursor *c)
{
    c->rec = 5;
    c->size = (size_t)c->buf[3] << 8 | c->buf[4];
    c->base = 0;
}

static uint8_t hs_at(struct hs_cursor *c, size_t off)
{
    if (off < c->base)
        hs_rewind(c); /* never needed by the forward parse; keeps it exact */
    while (off >= c->base + c->size) {
        size_t next = c->rec + c->size; /* the next record's header */
        /* Unreachable while callers stay below the handshake length; a
         * cheap guard that a later edit cannot turn into an over-read. */
        if (next + 5 > c->end)
            return 0;
        c->base += c->size;
        c->rec = next + 5;
        c->size = (size_t)c->buf[next + 3] << 8 | c->buf[next + 4];
    }
    return c->buf[c->rec + off - c->base];
}

static size_t hs_u16(struct hs_cursor *c, size_t off)
{
    size_t hi = hs_at(c, off);
    return hi << 8 | hs_at(c, off + 1);
}

/* sniff._server_name over ext = handshake[ext_at, ext_at + ext_len). */
static int tls_server_name(struct hs_cursor *c, size_t ext_at, size_t ext_len, sw_sniffed *out)
{
    if (ext_len < 2)
        return SW_PARSE_ERROR;
    size_t end = 2 + hs_u16(c, ext_at);
    if (end > ext_len)
        return SW_PARSE_ERROR;
    size_t pos = 2;
    while (pos + 3 <= end) {
        uint8_t type = hs_at(c, ext_at + pos);
        size_t name_len = hs_u16(c, ext_at + pos + 1);
        pos += 3;
        if (pos + name_len > end)
            return SW_PARSE_ERROR;
        if (type == 0) { /* host_name */
            if (name_len > HOST_NAME_MAX_RAW)
                return SW_PARSE_ERROR; /* over 253 after any trailing dot */
            uint8_t name[HOST_NAME_MAX_RAW];
            for (size_t k = 0; k < name_len; k++) {
                name[k] = hs_at(c, ext_at + pos + k);
                /* not ASCII; or ':' (RFC 6066 forbids IP literals, so
                 * Python calls it malformed rather than IPv6) */
                if (name[k] >= 0x80 || name[k] == ':')
                    return SW_PARSE_ERROR;
            }
            return normalize_host(name, name_len, out);
        }
        pos += name_len;
    }
    return SW_PARSE_ERROR;
}

/* sniff._client_hello_sni over body = handshake[4, 4 + body_len). */
static int tls_client_hello_sni(struct hs_cursor *c, size_t body_len, sw_sniffed *out)
{
    enum { B = 4 }; /* body offset within the handshake */
    size_t pos = 34; /* legacy_version, random */
    if (body_len < pos + 1)
        return SW_PARSE_ERROR;
    pos += 1 + hs_at(c, B + pos); /* session_id */
    if (body_len < pos + 2)
        return SW_PARSE_ERROR;
    pos += 2 + hs_u16(c, B + pos); /* cipher_suites */
    if (body_len < pos + 1)
        return SW_PARSE_ERROR;
    pos += 1 + hs_at(c, B + pos); /* compression_methods */
    if (body_len < pos + 2)
        return SW_PARSE_ERROR; /* no extensions: no SNI */
    size_t ext_end = pos + 2 + hs_u16(c, B + pos);
    if (ext_end > body_len)
        return SW_PARSE_ERROR;
    pos += 2;
    while (pos + 4 <= ext_end) {
        size_t type = hs_u16(c, B + pos);
        size_t ext_len = hs_u16(c, B + pos + 2);
        pos += 4;
        if (pos + ext_len > ext_end)
            return SW_PARSE_ERROR;
        if (type == 0) /* server_name: only the first one counts */
            return tls_server_name(c, B + pos, ext_len, out);
        pos += ext_len;
    }
    return SW_PARSE_ERROR;
}

/* sniff._sniff_tls: walk whole handshake records until the ClientHello's
 * declared length is covered, then read its SNI. */
static int sniff_tls(const uint8_t *buf, size_t len, sw_sniffed *out)
{
    size_t pos = 0, have = 0, needed = 0;
    bool known = false;
    uint8_t head[4]; /* msg_type and uint24 length, maybe across records */
    while (!known || have < needed) {
        if (len < pos + 5)
            return more_or_give_up(len);
        const uint8_t *h = buf + pos;
        size_t size = (size_t)h[3] << 8 | h[4];
        /* only handshake records (no interleaving), legacy major version 3 */
        if (h[0] != TLS_RECORD_HANDSHAKE || h[1] != 3 || size == 0 || size > TLS_MAX_RECORD)
            return SW_PARSE_ERROR;
        if (len < pos + 5 + size)
            return more_or_give_up(len);
        for (size_t k = 0; k < size && have + k < 4; k++)
            head[have + k] = h[5 + k];
        have += size;
        pos += 5 + size;
        if (!known && have >= 4) {
            if (head[0] != TLS_CLIENT_HELLO)
                return SW_PARSE_ERROR;
            needed = 4 + ((size_t)head[1] << 16 | (size_t)head[2] << 8 | head[3]);
            if (needed > SNIFF_LIMIT)
                return SW_PARSE_ERROR;
            known = true;
        }
    }
    struct hs_cursor c = {.buf = buf, .end = pos};
    hs_rewind(&c);
    return tls_client_hello_sni(&c, needed - 4, out);
}

/* sniff._valid_port_suffix for the text after a Host's ':': 0..5 digits. */
static bool valid_port_digits(const uint8_t *s, size_t n)
{
    if (n > 5)
        return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return false;
    return true;
}

/* sniff._http_host over an OWS-stripped Host value. */
static int sniff_http_host(const uint8_t *v, size_t n, sw_sniffed *out)
{
    for (size_t i = 0; i < n; i++)
        if (v[i] >= 0x80)
            return SW_PARSE_ERROR; /* .decode("ascii") fails */
    if (n && v[0] == '[') {
        const uint8_t *close = memchr(v + 1, ']', n - 1);
        if (!close)
            return SW_PARSE_ERROR;
        const uint8_t *rest = close + 1;
        size_t rest_len = n - (size_t)(rest - v);
        size_t lit_len = (size_t)(close - v) - 1;
        if (rest_len && (rest[0] != ':' || !valid_port_digits(rest + 1, rest_len - 1)))
            return SW_PARSE_ERROR;
        uint8_t a[16];
        if (memchr(v + 1, '%', lit_len) || !sw_ip6_parse(v + 1, lit_len, a))
            return SW_PARSE_ERROR;
        /* .compressed as Python 3.11 has it, IPv4-mapped ones in hex too
         * (3.13 would write ::ffff:a.b.c.d; sniff.py does not pin it). */
        size_t m = sw_ip6_text(a, out->host);
        out->host[m] = '\0';
        out->host_len = (uint16_t)m;
        return SW_PARSE_OK;
    }
    const uint8_t *colon = memchr(v, ':', n);
    size_t name_len = colon ? (size_t)(colon - v) : n;
    if (colon && !valid_port_digits(colon + 1, n - name_len - 1))
        return SW_PARSE_ERROR;
    return normalize_host(v, name_len, out);
}

/* sniff._sniff_http: the Host of a request with a well-known method,
 * looking at complete lines within the first SNIFF_LIMIT bytes. */
static int sniff_http(const uint8_t *buf, size_t len, sw_sniffed *out)
{
    static const char *const methods[] = {"GET ", "POST ", "HEAD ", "PUT ", "DELETE ",
                                          "OPTIONS ", "PATCH ", "TRACE ", "CONNECT "};
    const size_t n = len < SNIFF_LIMIT ? len : SNIFF_LIMIT;
    bool known = false, could_be = false;
    for (size_t k = 0; k < sizeof methods / sizeof methods[0]; k++) {
        size_t m = strlen(methods[k]);
        if (n >= m ? memcmp(buf, methods[k], m) == 0 : memcmp(buf, methods[k], n) == 0) {
            if (n >= m)
                known = true;
            else
                could_be = true; /* still a prefix of "METHOD " */
        }
    }
    if (!known)
        return could_be ? SW_PARSE_NEED_MORE : SW_PARSE_ERROR;

    const uint8_t *nl = memchr(buf, '\n', n);
    if (!nl)
        return more_or_give_up(len);
    /* _REQUEST_LINE_RE: [A-Z]+ SP target SP "HTTP/1." DIGIT, then an
     * optional CR.  Neither class holds a space, so there is one way to
     * match: the method runs to the first space, the target to the next. */
    size_t line = (size_t)(nl - buf), i = 0;
    while (i < line && buf[i] >= 'A' && buf[i] <= 'Z')
        i++;
    if (i == 0 || i == line || buf[i] != ' ')
        return SW_PARSE_ERROR;
    size_t t = ++i;
    while (i < line && buf[i] > 0x20 && buf[i] != 0x7F)
        i++;
    if (i == t)
        return SW_PARSE_ERROR;
    static const char version[] = " HTTP/1.";
    size_t vlen = sizeof version - 1;
    if (line - i < vlen + 1 || memcmp(buf + i, version, vlen) != 0)
        return SW_PARSE_ERROR;
    i += vlen;
    if (buf[i] < '0' || buf[i] > '9')
        return SW_PARSE_ERROR;
    i++;
    if (i < line && buf[i] == '\r')
        i++;
    if (i != line)
        return SW_PARSE_ERROR;

    size_t p = line + 1;
    while (p < n) {
        const uint8_t *e = memchr(buf + p, '\n', n - p);
        if (!e)
            break; /* a line still arriving is not looked at */
        size_t end = (size_t)(e - buf);
        size_t le = end;
        if (le > p && buf[le - 1] == '\r')
            le--;
        if (le == p)
            return SW_PARSE_ERROR; /* end of head without a Host */
        const uint8_t *colon = memchr(buf + p, ':', le - p);
        if (colon && eq_lower(buf + p, (size_t)(colon - (buf + p)), "host")) {
            const uint8_t *v = colon + 1, *ve = buf + le;
            while (v < ve && (*v == ' ' || *v == '\t'))
                v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            return sniff_http_host(v, (size_t)(ve - v), out);
        }
        p = end + 1;
    }
    return more_or_give_up(len);
}

int sw_sniff(const uint8_t *buf, size_t len, sw_sniffed *out)
{
    if (len == 0)
        return SW_PARSE_NEED_MORE;
    if (buf[0] == TLS_RECORD_HANDSHAKE)
        return sniff_tls(buf, len, out);
    return sniff_http(buf, len, out);
}
