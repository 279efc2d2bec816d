/*
 * Absolute-URI forwarding (docs/http-forward.md): plain HTTP requests relayed
 * one by one.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- absolute-URI forwarding (docs/http-forward.md) --------------------------------- */

/* What C forwards itself: a whole request head in sw_parse_http_forward's
 * subset, alone in the buffer (pipelined requests are Python's), routed
 * direct by the table; its answer when sw_parse_http_fwd_response takes it
 * and it has come whole within the buffer.  Anything else goes to Python
 * before a byte of it is written: the connection at its head (as a first
 * request would), or, once the request went up, with the upstream socket and
 * the answer so far (SW_DEFER_FORWARD), where actors/http_forward.py carries
 * on.  One STARTED / ROUTED (relay_handle 0) / ENDED triple per request. */
enum { FWD_BUF = SW_CONN_RAW_MAX + 64 };

static void fwd_next(struct cconn *c);

/* Room in the ring for `k` more records of held connections. */
static bool fwd_room(struct cloop *L, uint32_t k)
{
    return ring_used(&L->ring) + L->promised + k <= L->ring.mask + 1;
}

/* A kept upstream connection with nothing unread and not closed: as
 * _Upstream.usable's peek. */
static bool fwd_usable(int fd)
{
    uint8_t b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static void fwd_drop_upstream(struct cconn *c)
{
    if (c->ufd >= 0)
        close(c->ufd); /* its epoll registration goes with it (never dup'ed) */
    c->ufd = -1;
    c->up_watched = false;
}

/* 1: C forwards the request at buf[0..n) (or already answered it); 0: a
 * head that may still become one, wait; -1: Python's. */
int fwd_try(struct cconn *c, const uint8_t *p, size_t n)
{
    if (!c->fbuf && !(c->fbuf = malloc(FWD_BUF)))
        return -1;
    if (!c->rbuf && !(c->rbuf = malloc(SW_CONN_RAW_MAX)))
        return -1;
    sw_http_forward f;
    int rc = sw_parse_http_forward(p, n, &f, c->fbuf, FWD_BUF);
    if (rc == SW_PARSE_NEED_MORE)
        return 0;
    if (rc != SW_PARSE_OK || f.consumed != n || c->consumed != 0)
        return -1;
    /* Three records per forwarded flow: the accept promised two. */
    uint32_t more = c->fwd_served ? RECORDS_PER_FLOW + 1 : 1;
    if (!fwd_room(c->loop, more))
        return -1;
    set_host(c, f.host, f.host_len);
    c->port = f.port;
    c->started_ms = sw_real_ms();
    c->hs_tx = 0;
    if (!decide(c) || c->out_kind != SW_OUT_DIRECT)
        return -1; /* blocked, a proxy outbound, a DNS miss...: Python's answer */
    timer_clear(c);
    c->promise += (uint8_t)more;
    c->loop->promised += more;
    c->fwd = true;
    c->fwd_keep = f.keep_alive;
    c->fwd_head = f.head;
    c->fwd_head_len = f.consumed;
    c->flen = f.wire_len;
    c->consumed = f.consumed;
    record_started(c);
    if (c->ufd >= 0) {
        if (c->fwd_target == c->rr.target && c->fwd_epoch == c->epoch && c->fwd_port == c->port &&
            !strcmp(c->fwd_host, c->host) && fwd_usable(c->ufd)) {
            fwd_send(c);
            return 1;
        }
        fwd_drop_upstream(c);
    }
    start_connect(c);
    return 1;
}

/* The ENDED record of the current request's flow (the connection lives on). */
static void fwd_end(struct cconn *c, uint32_t end, int err, int detail)
{
    sw_conn_record *r = record_begin(c, SW_REC_ENDED);
    record_name(r, c->sniffed, c->sniffed_len);
    r->end = end;
    r->err = err;
    r->detail = detail;
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.ended, 1, memory_order_relaxed);
}

/* Python's _refuse_request for a dial that failed: the status and message,
 * the connection kept when the client keeps it (its request had no body). */
void fwd_refuse(struct cconn *c, uint32_t end, int err, int detail, int http_status,
                const char *message)
{
    char reply[1024];
    size_t body = strlen(message) + 1;
    int n = snprintf(reply, sizeof reply, "HTTP/1.1 %d %s\r\n%sContent-Length: %zu\r\n%s\r\n%s\n",
                     http_status, http_phrase(http_status),
                     c->fwd_keep ? "Connection: keep-alive\r\n" : "", body,
                     c->fwd_keep ? "" : "Connection: close\r\n", message);
    bool sent = n > 0 && (size_t)n < sizeof reply && client_send(c, reply, (size_t)n) == 0;
    fwd_end(c, end, err, detail);
    fwd_drop_upstream(c);
    if (sent && c->fwd_keep)
        fwd_next(c);
    else
        conn_release(c);
}

/* Connected (or kept): the request goes up, then its ROUTED record. */
void fwd_send(struct cconn *c)
{
    timer_clear(c);
    c->dialled = true;
    c->fwd_target = c->rr.target;
    c->fwd_epoch = c->epoch;
    c->fwd_port = c->port;
    memcpy(c->fwd_host, c->host, (size_t)c->host_len + 1);
    bool sent = write_all(c->ufd, c->fbuf, c->flen) == 0;
    if (sent)
        c->utx += c->flen;
    sw_conn_record *r = record_begin(c, SW_REC_ROUTED);
    record_name(r, c->sniffed, c->sniffed_len);
    record_resolved(r, &c->up_addr);
    r->relay_handle = 0; /* forwarded by C: no relay */
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.routed, 1, memory_order_relaxed);
    c->rlen = 0;
    c->state = ST_FWD_RESP;
    if (!sent || up_watch(c) < 0) {
        /* Python reads what became of the upstream and answers as its path does. */
        conn_defer(c, SW_DEFER_FORWARD);
        return;
    }
    timer_set(c, sw_mono_ms() + c->listener->opts.idle_timeout_ms);
    fwd_readable(c);
}

/* The answer, from fbuf[foff..flen), to the client; then the next request. */
void fwd_flush(struct cconn *c)
{
    while (c->foff < c->flen) {
        ssize_t n = send(c->cfd, c->fbuf + c->foff, c->flen - c->foff, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->foff += (uint32_t)n;
            c->ctx += (uint32_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN) {
            /* As sock_sendall on the Python path: wait for room, no deadline. */
            timer_clear(c);
            c->state = ST_FWD_FLUSH;
            if (!c->fwd_out_watch) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                                         .data.ptr = &c->ep_client};
                epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->cfd, &ev);
                c->fwd_out_watch = true;
            }
            return;
        }
        /* The client went away mid-answer: its flow ends, and the connection. */
        fwd_end(c, SW_END_FWD_CLIENT, n < 0 ? errno : EPIPE, 0);
        conn_release(c);
        return;
    }
    fwd_end(c, SW_END_FORWARDED, 0, 0);
    if (!c->fwd_keep) {
        conn_release(c);
        return;
    }
    if (!c->fwd_reuse)
        fwd_drop_upstream(c);
    fwd_next(c);
}

void fwd_readable(struct cconn *c)
{
    /* The head and the answer must fit raw for a hand-over. */
    const uint32_t cap = SW_CONN_RAW_MAX - c->fwd_head_len;
    bool eof = false, failed = false;
    while (c->rlen < cap) {
        ssize_t n = recv(c->ufd, c->rbuf + c->rlen, cap - c->rlen, 0);
        if (n > 0) {
            c->rlen += (uint32_t)n;
            c->urx += (uint32_t)n;
            continue;
        }
        if (n == 0) {
            eof = true;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            failed = true;
        break;
    }
    sw_http_fwd_response fr;
    int rc = sw_parse_http_fwd_response(c->rbuf, c->rlen, c->fwd_head, !c->fwd_keep, &fr, c->fbuf,
                                        FWD_BUF);
    if (rc == SW_PARSE_OK && fr.consumed + fr.length <= c->rlen &&
        fr.wire_len + fr.length <= FWD_BUF) {
        const uint32_t body = (uint32_t)fr.length;
        memcpy(c->fbuf + fr.wire_len, c->rbuf + fr.consumed, body);
        c->flen = fr.wire_len + body;
        c->foff = 0;
        /* Bytes past the answer put the upstream out of step (as _download). */
        c->fwd_reuse = fr.consumed + body == c->rlen && !eof && !failed;
        timer_clear(c);
        fwd_flush(c);
        return;
    }
    if (rc == SW_PARSE_DEFER || eof || failed || c->rlen >= cap) {
        conn_defer(c, SW_DEFER_FORWARD);
        return;
    }
    /* More to come: the timer set when the request went up still runs. */
}

/* The upstream went quiet (runtime.tcp_idle_timeout): as _download's
 * TimeoutError, a 502 before the head, the part that came after it. */
void fwd_timed_out(struct cconn *c)
{
    sw_http_fwd_response fr;
    int rc = sw_parse_http_fwd_response(c->rbuf, c->rlen, c->fwd_head, !c->fwd_keep, &fr, c->fbuf,
                                        FWD_BUF);
    if (rc != SW_PARSE_OK) {
        failure_reply(c, 1, 502, "upstream connection failed: timed out");
        fwd_end(c, SW_END_FWD_TIMEOUT, 0, 0);
    } else {
        /* Whole answers never wait here: this one's body is cut short. */
        uint32_t part = c->rlen - fr.consumed;
        if (fr.wire_len + part <= FWD_BUF) {
            memcpy(c->fbuf + fr.wire_len, c->rbuf + fr.consumed, part);
            if (write_all(c->cfd, c->fbuf, fr.wire_len + part) == 0)
                c->ctx += fr.wire_len + part;
        }
        fwd_end(c, SW_END_FWD_TIMEOUT, 0, 1);
    }
    conn_release(c);
}

/* The request's flow is over and the client keeps its connection: wait for
 * its next head (idle timeout), the upstream kept when it may serve it. */
static void fwd_next(struct cconn *c)
{
    c->fwd = false;
    c->fwd_served = true;
    c->started = c->dialled = c->replied = false;
    c->crx = c->ctx = c->urx = c->utx = c->early = c->late = 0;
    c->sniffed_len = 0;
    c->sniffed[0] = 0;
    c->rlen = 0;
    c->len = c->consumed = 0; /* the head it answered was all the buffer held */
    c->state = ST_HTTP_HEAD;
    if (c->fwd_out_watch) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET,
                                 .data.ptr = &c->ep_client};
        epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->cfd, &ev);
        c->fwd_out_watch = false;
    }
    if (timer_set(c, sw_mono_ms() + c->listener->opts.idle_timeout_ms) < 0) {
        conn_release(c);
        return;
    }
    /* A next request that came meanwhile left its edge behind: read now. */
    client_event(c, EPOLLIN);
}
