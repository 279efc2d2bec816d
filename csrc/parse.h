/*
 * spliceway C handshake and sniff parsers: pure functions over the bytes a
 * client (or an upstream proxy) sent so far, used by the C connection path
 * (conn.c), and the one request builder that path needs.  The Python codecs
 * in spliceway/protocols/ are their reference: for every input a C parser
 * either gives the same verdict, fields and error reply as the Python one,
 * or answers SW_PARSE_DEFER ("let Python handle this connection"), which is
 * always allowed and never wrong.  tests/csrc/test_parse_diff.py (and
 * test_udp_parse_diff.py for the UDP datagram header) holds them to that with Hypothesis; benchmarks/fuzz_parse.c fuzzes them under ASan/UBSan.
 *
 * Parsers return a status value (never -errno: they never fail); the builder
 * and sw_http_response_error return a length or -errno.  Everything between the SW_CDEF markers is part
 * of the cffi cdef.
 */
#ifndef SW_PARSE_H
#define SW_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

enum sw_parse_status {
    SW_PARSE_OK = 0,        /* a complete message; `consumed` bytes used */
    SW_PARSE_NEED_MORE = 1, /* incomplete; call again with more bytes */
    SW_PARSE_ERROR = 2,     /* malformed: send `reply` (reply_len may be 0), close */
    SW_PARSE_DEFER = 3      /* not decided here: hand the connection to Python */
};

/* Longest error reply a parser writes (a SOCKS5 reply is 10 bytes). */
#define SW_PARSE_REPLY_MAX 16
/* Longest host text: a SOCKS5 domain is <= 255 bytes; IPv6 text < 46. */
#define SW_HOST_MAX 256

typedef struct sw_s5_greeting {
    uint32_t consumed;
    uint8_t no_auth;  /* method 0x00 offered */
    uint8_t userpass; /* method 0x02 offered */
} sw_s5_greeting;

typedef struct sw_s5_userpass {
    uint32_t consumed;
    /* offsets into the caller's buffer; both strings validated as UTF-8 */
    uint16_t user_off;
    uint16_t user_len;
    uint16_t pass_off;
    uint16_t pass_len;
} sw_s5_userpass;

typedef struct sw_s5_request {
    uint32_t consumed;
    uint8_t command;  /* as sent: the caller answers unknown commands */
    uint8_t atyp;     /* 1 IPv4, 3 domain, 4 IPv6 */
    uint16_t port;
    uint16_t host_len;
    char host[256];   /* NUL-terminated text, exactly Python's Request.host */
} sw_s5_request;

typedef struct sw_http_connect {
    uint32_t consumed;   /* the whole head, blank line included */
    uint16_t port;
    uint16_t host_len;
    char host[256];      /* exactly Python's connect_authority() host */
    uint8_t has_creds;   /* a well-formed Proxy-Authorization: Basic */
    uint16_t user_len;
    uint16_t pass_len;
    char user[256];      /* decoded credentials (UTF-8), NUL-terminated */
    char pass[256];
} sw_http_connect;

typedef struct sw_sniffed {
    uint16_t host_len;
    char host[256];      /* exactly Python's Sniffed.host */
} sw_sniffed;

/* SOCKS5 (RFC 1928/1929), server side.  On SW_PARSE_ERROR `reply` holds
 * reply_len bytes to send before closing (Python's ProtocolError.reply; 0 =
 * None).  `reply` must have room for SW_PARSE_REPLY_MAX bytes. */
int sw_parse_s5_greeting(const uint8_t *buf, size_t len, sw_s5_greeting *out,
                         uint8_t *reply, size_t *reply_len);
int sw_parse_s5_userpass(const uint8_t *buf, size_t len, sw_s5_userpass *out,
                         uint8_t *reply, size_t *reply_len);
int sw_parse_s5_request(const uint8_t *buf, size_t len, sw_s5_request *out,
                        uint8_t *reply, size_t *reply_len);

/* An HTTP/1.x CONNECT head.  SW_PARSE_OK only when Python's
 * parse_request_head + connect_authority (+ proxy_basic_credentials) accept
 * the same bytes with the same result; SW_PARSE_NEED_MORE only when Python
 * would also want more; anything else (another method, an oddity C does not
 * check, any error, a head longer than `len` allows) is SW_PARSE_DEFER: C
 * never answers an HTTP error itself. */
int sw_parse_http_connect(const uint8_t *buf, size_t len, sw_http_connect *out);

/* Python's sniff.sniff(): SW_PARSE_OK with a host, SW_PARSE_NEED_MORE, or
 * SW_PARSE_ERROR for None (nothing sniffable). */
int sw_sniff(const uint8_t *buf, size_t len, sw_sniffed *out);

/* A SOCKS5 UDP ASSOCIATE datagram (RFC 1928 section 7):
 * RSV(2) FRAG ATYP DST.ADDR DST.PORT DATA. */
typedef struct sw_s5_udp {
    uint32_t header_len; /* DATA starts here (<= len) */
    uint8_t frag;        /* FRAG as sent: the caller drops FRAG != 0 */
    uint8_t atyp;        /* 1 IPv4, 3 domain, 4 IPv6 */
    uint16_t port;
    uint16_t addr_off;   /* the raw DST.ADDR is buf[addr_off, addr_off + addr_len) */
    uint16_t addr_len;   /* 4, 16, or the domain's length (1..255) */
    uint16_t host_len;
    char host[256];      /* NUL-terminated text, exactly Python's UdpDatagram.host */
} sw_s5_udp;

/* socks5.parse_udp_datagram(buf[0..len)) exactly: SW_PARSE_OK with the
 * fields (UdpDatagram.fragment, .host, .port; .payload is buf[header_len:])
 * or SW_PARSE_ERROR where Python raises ProtocolError (too short for its
 * header, an unknown ATYP, a domain that is empty, not UTF-8 or holds a
 * control or space).  Never NEED_MORE (a datagram is whole) nor DEFER.
 * RSV is ignored, as Python ignores it.  `out` is written only on OK. */
int sw_parse_s5_udp(const uint8_t *buf, size_t len, sw_s5_udp *out);

/* The client side of an upstream HTTP CONNECT proxy. */

/* http.MAX_HEAD_SIZE, parse_response_head's default max_size. */
#define SW_HTTP_MAX_HEAD 65536

typedef struct sw_http_response {
    size_t consumed; /* the head, blank line included (<= max_size) */
    int status;      /* 100..999 */
} sw_http_response;

/* http.parse_response_head(buf, max_size) exactly, for every input: never
 * SW_PARSE_DEFER.  SW_PARSE_OK fills `out` (ResponseHead.status and
 * .consumed); SW_PARSE_NEED_MORE where Python returns NEED_MORE (a complete
 * status line is judged at once, as Python does); SW_PARSE_ERROR wherever
 * Python raises ProtocolError (not "HTTP/", a bad status line, a malformed
 * field line, a NUL or bare CR, no end of head within max_size bytes).
 * Python's default max_size is SW_HTTP_MAX_HEAD.  `out` is written only on
 * SW_PARSE_OK. */
int sw_parse_http_response(const uint8_t *buf, size_t len, size_t max_size,
                           sw_http_response *out);

/* Room for any sw_http_response_error() message, NUL included, when
 * max_size <= SW_HTTP_MAX_HEAD: the longest fixed text (53 bytes), two
 * quotes, and at most 4 bytes ("\xNN") for each of the fewer than max_size
 * bytes a repr() quotes. */
#define SW_HTTP_RESPONSE_ERROR_MAX 262208

/* For an input sw_parse_http_response(buf, len, max_size, ...) answers
 * SW_PARSE_ERROR: str() of the ProtocolError http.parse_response_head(buf,
 * max_size) raises, as UTF-8, into msg[0..cap), NUL-terminated, and its
 * length (the NUL not counted).  That is the whole text, repr() of the
 * version or header name included ("unsupported response version
 * 'HTTP/2.0'", "malformed response head: invalid header name 'X Y'"):
 * latin-1 code points, Python's quote choice and escapes, printable
 * non-ASCII as UTF-8.  Where several checks fail, the message is the one
 * Python raises first (a complete head: NUL, bare CR, field lines in
 * order, then the status line).  -EINVAL (msg "") for an input that is
 * not an error (OK or NEED_MORE).  -ENOSPC when the message and its NUL
 * do not fit in cap (or it is longer than INT_MAX): msg then holds the
 * longest prefix that fits without splitting a UTF-8 sequence.  msg is
 * NUL-terminated whenever cap > 0, and nothing past its NUL is written;
 * with cap == 0 it may be NULL. */
int sw_http_response_error(const uint8_t *buf, size_t len, size_t max_size, char *msg,
                           size_t cap);

/* http.connect_request(host, port, credentials) byte for byte into out[0..cap):
 * the length written, -EINVAL where Python raises ValueError (port 0, a host
 * that is neither an IP literal nor a name it accepts, a ':' in the user,
 * non-ASCII host text, user or pass not valid UTF-8 -- what a str with lone
 * surrogates encodes to), else -ENOSPC when cap is too small (out's bytes
 * are then unspecified).  Strings are the Python strs in UTF-8, so they
 * cannot hold a NUL.  Credentials are sent when user != NULL; pass NULL
 * then means "" (outbounds.py's `password or ""`).  IPv6 text is Python
 * 3.11's .compressed (IPv4-mapped in hex; 3.13 would write ::ffff:a.b.c.d).
 * A zone id ("fe80::1%eth0") is copied as given, as Python does -- controls
 * included, so a host must not come from anywhere that lets CR LF into it
 * (no C parser's host can hold them). */
int sw_http_connect_request(const char *host, uint16_t port, const char *user,
                            const char *pass, uint8_t *out, size_t cap);

/* An absolute-URI request the proxy forwards (GET http://host/path HTTP/1.1), as the
 * origin is to get it: the first step of forwarding in C (docs/http-forward.md). */
typedef struct sw_http_forward {
    uint32_t consumed;   /* the whole head, leading empty lines and blank line included */
    uint32_t wire_len;   /* bytes written to `wire` */
    uint16_t port;
    uint16_t host_len;
    char host[256];      /* exactly ForwardRequest.host */
    uint8_t keep_alive;  /* ForwardRequest.keep_alive */
    uint8_t head;        /* the method is HEAD: its response has no body */
} sw_http_forward;

/* A request head that Python's parse_request_head + http_auth (no users) +
 * forward_request accept with no body (no Content-Length, no Transfer-Encoding)
 * and no Upgrade, as HTTP/1.1 with an upper-case method other than CONNECT, an
 * http:// target whose host is a name or IPv4 text (no IPv6 literal, no
 * userinfo), at most SW_HTTP_FWD_FIELDS fields and SW_HTTP_FWD_TOKENS
 * Connection tokens: SW_PARSE_OK, `out` filled and wire[0..wire_len) exactly
 * http.origin_request(head, request.path, request.host_header, connection="")
 * (what actors/http_forward.py sends for it).  SW_PARSE_NEED_MORE only where
 * Python wants more too; everything else -- any error, anything outside that
 * subset, a head that does not fit `wire_cap` -- SW_PARSE_DEFER: Python's path
 * answers it (its 400s included).  Never SW_PARSE_ERROR. */
#define SW_HTTP_FWD_FIELDS 64
#define SW_HTTP_FWD_TOKENS 16
int sw_parse_http_forward(const uint8_t *buf, size_t len, sw_http_forward *out, uint8_t *wire,
                          size_t wire_cap);

/* The response to such a request, as the client is to get it. */
typedef struct sw_http_fwd_response {
    uint32_t consumed;   /* the head, blank line included */
    uint32_t wire_len;   /* bytes written to `wire` */
    uint64_t length;     /* body bytes that follow (Content-Length; 0: none) */
    uint16_t status;     /* 200..999 */
} sw_http_fwd_response;

/* For a response head to a sw_parse_http_forward request (`head_request`:
 * its method was HEAD; `close`: the client does not keep its connection):
 * SW_PARSE_OK when Python's parse_response_head gives an HTTP/1.1 final
 * response (status >= 200) with none of Connection, Keep-Alive,
 * Proxy-Connection, Upgrade, Transfer-Encoding and no obs-fold, whose body
 * response_framing frames as none or by Content-Length (at most 18 digits):
 * `out` filled and wire[0..wire_len) exactly http.proxy_response(response,
 * "close" if close else None) (what actors/http_forward.py sends the client).
 * SW_PARSE_NEED_MORE exactly where Python wants more; anything else
 * SW_PARSE_DEFER (an interim or 101 answer, a close-delimited body, any
 * error: Python's path takes the exchange over).  Never SW_PARSE_ERROR. */
int sw_parse_http_fwd_response(const uint8_t *buf, size_t len, int head_request, int close,
                               sw_http_fwd_response *out, uint8_t *wire, size_t wire_cap);

/* SW_CDEF_END */

/* sw_parse_s5_udp without the host text (host_len 0, host ""): the same
 * verdict and other fields, for the datagram relay's hot path (udp.c), which
 * keys destinations by the raw address and renders text only for Python. */
int sw_parse_s5_udp_fields(const uint8_t *buf, size_t len, sw_s5_udp *out);

#endif /* SW_PARSE_H */
