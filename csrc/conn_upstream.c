/*
 * Upstream proxies: the SOCKS5 and HTTP CONNECT handshakes, then the hand-off
 * to the relay.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- upstream socks5 ------------------------------------------------------------ */

static int up_send(struct cconn *c, const void *p, size_t n)
{
    int rc = write_all(c->ufd, p, n);
    if (rc == 0)
        c->utx += (uint32_t)n;
    return rc;
}

/* The upstream proxy broke its protocol: Python's DialError message for it. */
static void up_broken(struct cconn *c, int kind, uint8_t byte)
{
    char msg[600];
    const char *tag = c->up_tag ? c->up_tag : "";
    switch (kind) {
    case SW_PROTO_CLOSED:
        snprintf(msg, sizeof msg, "upstream proxy closed during handshake");
        break;
    case SW_PROTO_METHOD_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: server is not SOCKS5: version byte 0x%02x", tag, byte);
        break;
    case SW_PROTO_AUTH_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: bad username/password status version %u", tag, byte);
        break;
    case SW_PROTO_REPLY_VERSION:
        snprintf(msg, sizeof msg, "proxy %s: server reply is not SOCKS5: version byte 0x%02x", tag,
                 byte);
        break;
    case SW_PROTO_REPLY_ATYP:
        snprintf(msg, sizeof msg, "proxy %s: unknown address type %u", tag, byte);
        break;
    case SW_PROTO_EMPTY_DOMAIN:
        snprintf(msg, sizeof msg, "proxy %s: empty domain name", tag);
        break;
    default:
        snprintf(msg, sizeof msg, "proxy %s: undecodable domain name", tag);
        break;
    }
    fail_flow(c, SW_END_UPSTREAM_PROTO, 0, kind | byte << 8, 1, 502, msg);
}

static void s5_send_request(struct cconn *c)
{
    uint8_t req[4 + 1 + 255 + 2];
    size_t n = 0;
    struct sockaddr_storage ss;
    socklen_t sslen;
    req[n++] = 5;
    req[n++] = 1;
    req[n++] = 0;
    if (parse_ip_literal(c->host, &ss, &sslen, 0) && ss.ss_family == AF_INET) {
        req[n++] = 1;
        memcpy(req + n, &((struct sockaddr_in *)&ss)->sin_addr, 4);
        n += 4;
    } else if (ss.ss_family == AF_INET6) {
        req[n++] = 4;
        memcpy(req + n, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
        n += 16;
    } else {
        req[n++] = 3;
        req[n++] = (uint8_t)c->host_len;
        memcpy(req + n, c->host, c->host_len);
        n += c->host_len;
    }
    req[n++] = (uint8_t)(c->port >> 8);
    req[n++] = (uint8_t)c->port;
    if (up_send(c, req, n) < 0) {
        connect_failed(c, errno ? errno : EPIPE);
        return;
    }
    c->state = ST_UP_S5_REPLY;
}

/* The upstream's next two-byte answer (VER VALUE): 1 and *value when it is
 * there, 0 while incomplete, -1 when VER is wrong (the flow has failed). */
static int up_pair(struct cconn *c, uint8_t version, uint8_t *value)
{
    if (c->up_len < 2)
        return 0;
    if (c->up_buf[0] != version) {
        up_broken(c, version == 5 ? SW_PROTO_METHOD_VERSION : SW_PROTO_AUTH_VERSION, c->up_buf[0]);
        return -1;
    }
    *value = c->up_buf[1];
    memmove(c->up_buf, c->up_buf + 2, c->up_len - 2);
    c->up_len -= 2;
    return 1;
}

static void s5_send_userpass(struct cconn *c)
{
    uint8_t a[3 + 255 + 255];
    size_t ul = strlen(c->up_user), pl = strlen(c->up_pass), k = 0;
    if (ul > 255 || pl > 255) { /* config validation keeps them shorter */
        fail_flow(c, SW_END_INTERNAL, EINVAL, 0, 1, 502, "credentials too long");
        return;
    }
    a[k++] = 1;
    a[k++] = (uint8_t)ul;
    memcpy(a + k, c->up_user, ul);
    k += ul;
    a[k++] = (uint8_t)pl;
    memcpy(a + k, c->up_pass, pl);
    k += pl;
    if (up_send(c, a, k) < 0) {
        up_broken(c, SW_PROTO_CLOSED, 0);
        return;
    }
    c->state = ST_UP_S5_AUTH;
}

static void s5_on_reply(struct cconn *c)
{
    sw_s5_request rep;
    uint8_t ignored[SW_PARSE_REPLY_MAX];
    size_t ignored_len = 0;
    /* A reply has the request's layout (VER REP RSV ATYP ADDR PORT). */
    int rc = sw_parse_s5_request(c->up_buf, c->up_len, &rep, ignored, &ignored_len);
    if (rc == SW_PARSE_NEED_MORE)
        return;
    if (rc != SW_PARSE_OK) {
        /* Which of parse_reply's errors (the parser agrees with it on which
         * inputs fail; these bytes tell why). */
        const uint8_t *b = c->up_buf;
        if (b[0] != 5)
            up_broken(c, SW_PROTO_REPLY_VERSION, b[0]);
        else if (b[3] != 1 && b[3] != 3 && b[3] != 4)
            up_broken(c, SW_PROTO_REPLY_ATYP, b[3]);
        else if (b[3] == 3 && b[4] == 0)
            up_broken(c, SW_PROTO_EMPTY_DOMAIN, 0);
        else
            up_broken(c, SW_PROTO_BAD_DOMAIN, 0);
        return;
    }
    if (rep.command != 0) {
        /* What the Python path answers: the upstream's refused, unreachable
         * and TTL codes pass through (TTL as 504), anything else is a general
         * failure (outbounds.SOCKS_REPLY_NAMES, then DialError.socks_reply). */
        uint8_t code = rep.command;
        int socks = code >= 3 && code <= 6 ? code : 1;
        int http = code == 6 ? 504 : 502;
        char msg[600];
        snprintf(msg, sizeof msg, "proxy %s answered SOCKS5 reply %u for %s:%u", c->up_tag, code,
                 c->host, c->port);
        fail_flow(c, SW_END_UPSTREAM_REPLY, 0, code, socks, http, msg);
        return;
    }
    /* Bytes past the reply are the target's first: they go to the client at
     * the hand-off, as the Python path sends its dial's leftover. */
    c->left = c->up_buf + rep.consumed;
    c->left_len = c->up_len - (uint32_t)rep.consumed;
    timer_clear(c);
    proceed_after_reply(c);
}

/* The upstream refused our authentication: Python's "proxy TAG <what>". */
static void auth_failed(struct cconn *c, int detail, const char *what)
{
    char msg[600];
    snprintf(msg, sizeof msg, "proxy %s %s", c->up_tag, what);
    fail_flow(c, SW_END_UPSTREAM_AUTH, 0, detail, 1, 502, msg);
}

/* One step of the upstream SOCKS5 handshake on what it sent; false once it
 * must wait for more, or the flow has moved on or ended. */
static bool s5_step(struct cconn *c)
{
    uint8_t v;
    switch (c->state) {
    case ST_UP_S5_METHOD:
        if (up_pair(c, 5, &v) <= 0)
            return false;
        if (c->up_user && v != 2) {
            auth_failed(c, SW_AUTH_REFUSED_USERPASS, "refused user/password auth");
            return false;
        }
        if (!c->up_user && v != 0) {
            auth_failed(c, SW_AUTH_REQUIRED, "requires authentication");
            return false;
        }
        if (c->up_user)
            s5_send_userpass(c);
        else
            s5_send_request(c);
        return !c->dead;
    case ST_UP_S5_AUTH:
        if (up_pair(c, 1, &v) <= 0)
            return false;
        if (v != 0) {
            auth_failed(c, SW_AUTH_REJECTED, "rejected the credentials");
            return false;
        }
        s5_send_request(c);
        return !c->dead;
    case ST_UP_S5_REPLY:
        s5_on_reply(c);
        return false;
    default:
        return false;
    }
}

/* Upstream bytes during its handshake. */
void upstream_readable(struct cconn *c)
{
    for (;;) {
        ssize_t n = recv(c->ufd, c->up_buf + c->up_len, sizeof c->up_buf - c->up_len, 0);
        if (n > 0) {
            c->up_len += (uint32_t)n;
            c->urx += (uint32_t)n;
            if (c->up_len == sizeof c->up_buf)
                break;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        /* EOF or an error: what arrived before it still counts (a server that
         * rejects the credentials answers, then closes). */
        while (s5_step(c)) {
        }
        if (!c->dead && c->state >= ST_UP_S5_METHOD && c->state <= ST_UP_S5_REPLY)
            up_broken(c, SW_PROTO_CLOSED, 0);
        return;
    }
    while (s5_step(c)) {
    }
}

/* The upstream http proxy's response head, read as HttpOutbound reads it:
 * 4 KiB at a time, parsed after each read (parse_response_head's verdicts). */
void http_readable(struct cconn *c)
{
    for (;;) {
        if (c->http_cap - c->http_len < 4096) {
            uint32_t cap = c->http_cap ? c->http_cap * 2 : 8192;
            if (cap > SW_HTTP_MAX_HEAD + 8192)
                cap = SW_HTTP_MAX_HEAD + 8192;
            uint8_t *b = realloc(c->http_buf, cap);
            if (!b) {
                fail_flow(c, SW_END_INTERNAL, ENOMEM, 0, 1, 502, strerror(ENOMEM));
                return;
            }
            c->http_buf = b;
            c->http_cap = cap;
        }
        ssize_t n = recv(c->ufd, c->http_buf + c->http_len, 4096, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        if (n <= 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->http_len += (uint32_t)n;
        c->urx += (uint32_t)n;
        sw_http_response resp;
        int rc = sw_parse_http_response(c->http_buf, c->http_len, SW_HTTP_MAX_HEAD, &resp);
        if (rc == SW_PARSE_NEED_MORE)
            continue;
        if (rc != SW_PARSE_OK) {
            /* HttpOutbound._broken's "proxy TAG: <ProtocolError>", which can be
             * long (the error quotes the head): kept for Python too. */
            size_t cap = SW_HTTP_RESPONSE_ERROR_MAX + strlen(c->up_tag) + 16;
            char *msg = malloc(cap);
            if (!msg) {
                fail_flow(c, SW_END_INTERNAL, ENOMEM, 0, 1, 502, strerror(ENOMEM));
                return;
            }
            int k = snprintf(msg, cap, "proxy %s: ", c->up_tag);
            if (sw_http_response_error(c->http_buf, c->http_len, SW_HTTP_MAX_HEAD, msg + k,
                                       cap - (size_t)k) < 0)
                snprintf(msg + k, cap - (size_t)k, "malformed response");
            conn_message(c, msg);
            fail_flow(c, SW_END_UPSTREAM_PROTO, 0, SW_PROTO_HTTP, 1, 502, msg);
            free(msg);
            return;
        }
        if (resp.status < 200 || resp.status > 299) {
            char msg[700];
            snprintf(msg, sizeof msg, "proxy %s answered %d to CONNECT %s:%u", c->up_tag,
                     resp.status, c->host, c->port);
            fail_flow(c, SW_END_UPSTREAM_REPLY, 0, resp.status, 1, 502, msg);
            return;
        }
        c->left = c->http_buf + resp.consumed;
        c->left_len = c->http_len - (uint32_t)resp.consumed;
        timer_clear(c);
        proceed_after_reply(c);
        return;
    }
}

static void up_watch_or_fail(struct cconn *c)
{
    if (up_watch(c) < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
    }
}

/* connect() finished (EPOLLOUT on the upstream, or at once). */
void connected(struct cconn *c)
{
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->ufd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        err = errno;
    if (err) {
        connect_failed(c, err);
        return;
    }
    if (c->out_kind == SW_OUT_SOCKS5) {
        uint8_t greeting[3] = {5, 1, c->up_user ? 2 : 0};
        if (up_send(c, greeting, sizeof greeting) < 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->state = ST_UP_S5_METHOD;
        up_watch_or_fail(c);
        return; /* the deadline of the connect covers the handshake too */
    }
    if (c->out_kind == SW_OUT_HTTP) {
        if (up_send(c, c->http_buf, c->http_req_len) < 0) {
            up_broken(c, SW_PROTO_CLOSED, 0);
            return;
        }
        c->state = ST_UP_HTTP_REPLY;
        up_watch_or_fail(c);
        return;
    }
    timer_clear(c);
    if (c->fwd) {
        fwd_send(c);
        return;
    }
    proceed_after_reply(c);
}

/* Upstream ready: reply success (unless done), sniff, flush, hand off. */
void proceed_after_reply(struct cconn *c)
{
    c->dialled = true;
    if (!c->replied) {
        if (success_reply(c) < 0) {
            conn_end(c, SW_END_CLIENT, EPIPE, 0);
            return;
        }
        c->replied = true;
        if (c->listener->opts.sniff) {
            c->state = ST_SNIFF_POST;
            if (sniff_step(c) == SNIFF_WAIT) {
                timer_set(c, sw_mono_ms() + c->listener->opts.sniff_timeout_ms);
                return;
            }
        }
    }
    hand_off(c);
}

/* The address a ROUTED record says the upstream was dialled at. */
void record_resolved(sw_conn_record *r, const struct sockaddr_storage *addr)
{
    if (addr->ss_family == AF_INET) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)addr;
        r->resolved_family = 4;
        memcpy(r->resolved_ip, &sin->sin_addr, 4);
        r->resolved_port = ntohs(sin->sin_port);
    } else {
        const struct sockaddr_in6 *sin6 = (const struct sockaddr_in6 *)addr;
        r->resolved_family = 6;
        memcpy(r->resolved_ip, &sin6->sin6_addr, 16);
        r->resolved_port = ntohs(sin6->sin6_port);
    }
}

void hand_off(struct cconn *c)
{
    sw_conn *conn = c->loop->conn;
    timer_clear(c);
    if (c->len > c->consumed) {
        /* Client bytes pipelined past the request go upstream first. */
        uint32_t n = c->len - c->consumed;
        if (write_all(c->ufd, c->buf + c->consumed, n) < 0) {
            conn_end(c, SW_END_INTERNAL, errno ? errno : EPIPE, 0);
            return;
        }
        c->early = n;
        c->utx += n;
        c->consumed = c->len;
    }
    if (c->left_len) {
        if (client_send(c, c->left, c->left_len) < 0) {
            conn_end(c, SW_END_CLIENT, errno ? errno : EPIPE, 0);
            return;
        }
        c->late = c->left_len;
        c->left_len = 0;
    }
    epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->cfd, NULL);
    if (c->up_watched)
        epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->ufd, NULL);
    sw_conn_record *r = record_begin(c, SW_REC_ROUTED);
    record_name(r, c->sniffed, c->sniffed_len);
    record_resolved(r, &c->up_addr);
    uint64_t handle = 0;
    int rc =
        sw_relay_add_own(conn->relay, c->cfd, c->ufd, c->listener->opts.idle_timeout_ms, &handle);
    if (rc < 0) {
        /* Not published yet: turn the slot into an ENDED record instead. */
        r->kind = SW_REC_ENDED;
        r->end = SW_END_INTERNAL;
        r->err = -rc;
        r->name[0] = 0;
        r->name_len = 0;
        record_commit(c);
        atomic_fetch_add_explicit(&conn->stats.ended, 1, memory_order_relaxed);
        conn_release(c);
        return;
    }
    r->relay_handle = handle;
    record_commit(c);
    atomic_fetch_add_explicit(&conn->stats.routed, 1, memory_order_relaxed);
    /* The relay owns both fds now. */
    c->cfd = c->ufd = -1;
    conn_release(c);
}
