/*
 * A held connection's plumbing: timers, records, lifetime, deferral to Python,
 * failure messages, reading and answering the client, sniffing.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- small helpers ------------------------------------------------------ */

uint32_t hash_str(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* Writes all of `data` to a non-blocking socket or fails: handshake replies
 * are a few bytes on a fresh socket, so a short write means the client
 * stopped reading, which ends the connection like any other client error. */
int write_all(int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* ---- timers (min-heap by deadline) --------------------------------------- */

SW_HEAP_DEFINE(heap, struct cloop, struct cconn, heap_idx, deadline)

void timer_clear(struct cconn *c)
{
    struct cloop *L = c->loop;
    size_t i = c->heap_idx;
    if (i == SIZE_MAX)
        return;
    c->heap_idx = SIZE_MAX;
    c->deadline = 0;
    heap_remove(L, i);
}

int timer_set(struct cconn *c, uint64_t deadline)
{
    struct cloop *L = c->loop;
    timer_clear(c);
    c->deadline = deadline;
    int e = heap_push(L, c, 256);
    if (e)
        c->deadline = 0; /* not in the heap: no deadline, as timer_clear leaves it */
    return e;
}

/* ---- records ------------------------------------------------------------- */

uint32_t ring_used(struct ring *R) { return sw_ring_used(&R->head, &R->tail); }

/* Room for one more held connection's records? */
bool ring_has_room(struct cloop *L)
{
    uint32_t cap = L->ring.mask + 1;
    return ring_used(&L->ring) + L->promised + RECORDS_PER_FLOW <= cap;
}

sw_conn_record *record_begin(struct cconn *c, uint32_t kind)
{
    struct ring *R = &c->loop->ring;
    uint32_t head = sw_ring_head(&R->head);
    sw_conn_record *r = &R->slots[head & R->mask];
    memset(r, 0, offsetof(sw_conn_record, name));
    r->name[0] = 0;
    r->flow = c->flow;
    r->at_unix_ms = sw_real_ms();
    r->kind = kind;
    r->inbound = c->listener->index;
    r->principal = c->principal;
    r->rule = c->rr.rule;
    r->target = c->rr.target;
    r->action = c->rr.action;
    r->epoch = c->epoch;
    r->client_rx = c->crx;
    r->client_tx = c->ctx;
    r->upstream_rx = c->urx;
    r->upstream_tx = c->utx;
    r->early = c->early;
    r->late = c->late;
    r->port = c->port;
    r->source_port = c->src_port;
    r->protocol = c->fwd ? 4 : c->proto; /* 4: a request C forwards (sw_conn_record) */
    r->auth = c->auth;
    r->source_family = c->src_family;
    r->replied = c->replied;
    r->dialled = c->dialled;
    memcpy(r->source_ip, c->src_ip, 16);
    return r;
}

/* A listener's record (SW_REC_ACCEPT_*): no connection promised it, so the
 * caller checks the ring has room for one more. */
void record_listener(struct cloop *L, struct listener *l, uint32_t kind, uint32_t outage, int err,
                     int32_t detail)
{
    struct ring *R = &L->ring;
    uint32_t head = sw_ring_head(&R->head);
    sw_conn_record *r = &R->slots[head & R->mask];
    memset(r, 0, sizeof *r);
    r->flow = outage;
    r->at_unix_ms = sw_real_ms();
    r->kind = kind;
    r->inbound = l->index;
    r->principal = SW_NO_PRINCIPAL;
    r->rule = -1;
    r->target = -1;
    r->err = err;
    r->detail = detail;
    sw_ring_publish(&R->head, head);
    L->published = true;
}

void record_name(sw_conn_record *r, const char *s, uint16_t len)
{
    memcpy(r->name, s, len);
    r->name[len] = 0;
    r->name_len = len;
}

void record_commit(struct cconn *c)
{
    struct cloop *L = c->loop;
    struct ring *R = &L->ring;
    sw_ring_publish(&R->head, sw_ring_head(&R->head));
    L->promised--;
    c->promise--;
    L->published = true;
}

/* ---- connection lifetime ------------------------------------------------- */

void conn_release(struct cconn *c)
{
    struct cloop *L = c->loop;
    if (c->dead)
        return;
    c->dead = true;
    timer_clear(c);
    if (c->cfd >= 0)
        close(c->cfd);
    if (c->ufd >= 0)
        close(c->ufd);
    c->cfd = c->ufd = -1;
    /* Records it promised and will no longer write. */
    L->promised -= c->promise;
    c->promise = 0;
    if (c->prev)
        c->prev->next = c->next;
    else
        L->held = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next_dead = L->dead;
    L->dead = c;
}

void conn_free_dead(struct cloop *L)
{
    while (L->dead) {
        struct cconn *c = L->dead;
        L->dead = c->next_dead;
        free(c->buf);
        free(c->up_user);
        free(c->up_pass);
        free(c->up_tag);
        free(c->http_buf);
        free(c->fbuf);
        free(c->rbuf);
        free(c);
    }
}

/* A connection that never became a flow (handshake failure, client gone). */
void conn_drop(struct cconn *c)
{
    atomic_fetch_add_explicit(&c->loop->conn->stats.handshake_failed, 1, memory_order_relaxed);
    conn_release(c);
}

/* End a started flow before the relay: one ENDED record, then close. */
void conn_end(struct cconn *c, uint32_t end, int err, int detail)
{
    sw_conn_record *r = record_begin(c, SW_REC_ENDED);
    record_name(r, c->sniffed, c->sniffed_len);
    if (end == SW_END_CLOSED && c->state == ST_SNIFF_PRE)
        detail = 1; /* closed before its route was final */
    r->end = end;
    r->err = err;
    r->detail = detail;
    record_commit(c);
    atomic_fetch_add_explicit(&c->loop->conn->stats.ended, 1, memory_order_relaxed);
    conn_release(c);
}

/* ---- deferral -------------------------------------------------------------- */

void conn_defer(struct cconn *c, uint32_t stage)
{
    sw_conn *conn = c->loop->conn;
    struct deferred_item *it = malloc(sizeof *it);
    if (!it) {
        if (c->started)
            conn_end(c, SW_END_INTERNAL, ENOMEM, 0); /* its flow needs its end */
        else
            conn_drop(c);
        return;
    }
    sw_deferred *d = &it->d;
    memset(d, 0, offsetof(sw_deferred, raw));
    d->fd = c->cfd;
    d->stage = stage;
    d->inbound = c->listener->index;
    d->protocol = c->proto;
    d->principal = c->principal;
    d->auth = c->auth;
    d->client_rx = c->crx;
    d->client_tx = c->ctx;
    d->started_unix_ms = c->started_ms;
    d->flow = c->started ? c->flow : 0;
    d->port = c->port;
    d->source_port = c->src_port;
    d->source_family = c->src_family;
    d->replied = c->replied;
    d->command = c->command ? c->command : 1;
    memcpy(d->source_ip, c->src_ip, 16);
    d->host_len = c->host_len;
    memcpy(d->host, c->host, c->host_len);
    d->host[c->host_len] = 0;
    d->sniffed_len = c->sniffed_len;
    memcpy(d->sniffed, c->sniffed, c->sniffed_len);
    d->sniffed[c->sniffed_len] = 0;
    d->ufd = -1;
    if (stage == SW_DEFER_FORWARD) {
        /* The request head (still at the start of buf) and the answer so far;
         * fwd_readable keeps both within raw. */
        d->ufd = c->ufd;
        d->split = c->fwd_head_len;
        d->upstream_rx = c->urx;
        d->upstream_tx = c->utx;
        d->raw_len = c->fwd_head_len + c->rlen;
        memcpy(d->raw, c->buf, c->fwd_head_len);
        memcpy(d->raw + c->fwd_head_len, c->rbuf, c->rlen);
        if (c->up_watched)
            epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->ufd, NULL);
        c->ufd = -1;
    } else {
        uint32_t from = stage == SW_DEFER_HANDSHAKE ? 0 : c->consumed;
        d->raw_len = c->len - from;
        memcpy(d->raw, c->buf + from, d->raw_len);
    }
    it->next = NULL;
    /* The fd is Python's now: take it out of our epoll set before anyone can
     * close it, and forget it so conn_release does not close it. */
    epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->cfd, NULL);
    c->cfd = -1;
    pthread_mutex_lock(&conn->defer_lock);
    if (conn->defer_tail)
        conn->defer_tail->next = it;
    else
        conn->defer_head = it;
    conn->defer_tail = it;
    pthread_mutex_unlock(&conn->defer_lock);
    atomic_fetch_add_explicit(&conn->stats.deferred, 1, memory_order_relaxed);
    efd_signal(conn->efd);
    conn_release(c);
}

/* ---- failure messages ---------------------------------------------------- */

/* Keep the text of flow c's failure for Python (sw_conn_take_message), which
 * takes it when the ENDED record says so; the oldest go beyond the bound. */
void conn_message(struct cconn *c, const char *text)
{
    sw_conn *conn = c->loop->conn;
    size_t n = strlen(text);
    struct message *m = malloc(sizeof *m + n + 1);
    if (!m)
        return;
    m->flow = c->flow;
    memcpy(m->text, text, n + 1);
    pthread_mutex_lock(&conn->defer_lock);
    m->next = conn->messages;
    conn->messages = m;
    if (++conn->nmessages > MESSAGES_MAX) {
        struct message **pp = &conn->messages;
        while ((*pp)->next)
            pp = &(*pp)->next;
        free(*pp);
        *pp = NULL;
        conn->nmessages--;
    }
    pthread_mutex_unlock(&conn->defer_lock);
}

int sw_conn_take_message(sw_conn *conn, uint64_t flow, char *out, size_t cap)
{
    if (!conn || !out || cap == 0)
        return -EINVAL;
    pthread_mutex_lock(&conn->defer_lock);
    struct message **pp = &conn->messages, *m = NULL;
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->flow == flow) {
            m = *pp;
            *pp = m->next;
            conn->nmessages--;
            break;
        }
    }
    pthread_mutex_unlock(&conn->defer_lock);
    if (!m)
        return -ENOENT;
    size_t n = strlen(m->text);
    if (n >= cap)
        n = cap - 1;
    memcpy(out, m->text, n);
    out[n] = 0;
    free(m);
    return (int)n;
}

int sw_conn_take_deferred(sw_conn *conn, sw_deferred *out)
{
    if (!conn || !out)
        return -EINVAL;
    pthread_mutex_lock(&conn->defer_lock);
    struct deferred_item *it = conn->defer_head;
    if (it) {
        conn->defer_head = it->next;
        if (!conn->defer_head)
            conn->defer_tail = NULL;
    }
    pthread_mutex_unlock(&conn->defer_lock);
    if (!it)
        return 0;
    memcpy(out, &it->d, offsetof(sw_deferred, raw) + it->d.raw_len);
    free(it);
    return 1;
}

/* ---- reading the client ----------------------------------------------------- */

/* Reads what is available into c->buf (bounded by SW_CONN_RAW_MAX).
 * Returns >0 bytes read, 0 on EAGAIN with nothing new, -1 on EOF or error,
 * -2 when the buffer is full. */
int client_read(struct cconn *c, uint32_t events)
{
    /* A short read means the socket is drained, unless the peer's FIN came
     * with this edge: then only a read of 0 sees it, and no further edge
     * will come for it. */
    bool hup = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
    int total = 0;
    for (;;) {
        if (c->len == c->cap) {
            if (c->cap >= SW_CONN_RAW_MAX)
                return total ? total : -2;
            uint32_t cap = c->cap ? c->cap * 4 : BUF_INITIAL;
            if (cap > SW_CONN_RAW_MAX)
                cap = SW_CONN_RAW_MAX;
            uint8_t *b = realloc(c->buf, cap);
            if (!b)
                return -1;
            c->buf = b;
            c->cap = cap;
        }
        uint32_t room = c->cap - c->len;
        ssize_t n = recv(c->cfd, c->buf + c->len, room, 0);
        if (n > 0) {
            c->len += (uint32_t)n;
            c->crx += (uint32_t)n;
            total += (int)n;
            if ((uint32_t)n < room && !hup)
                return total;
            continue;
        }
        if (n == 0) {
            c->client_eof = true;
            return total ? total : -1;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN)
            return total;
        return -1;
    }
}

int client_send(struct cconn *c, const void *data, size_t len)
{
    int rc = write_all(c->cfd, data, len);
    if (rc == 0)
        c->ctx += (uint32_t)len;
    return rc;
}

/* ---- replies ---------------------------------------------------------------- */

static const uint8_t S5_SUCCESS[10] = {5, 0, 0, 1, 0, 0, 0, 0, 0, 0};
static const char HTTP_ESTABLISHED[] = "HTTP/1.1 200 Connection established\r\n\r\n";

int success_reply(struct cconn *c)
{
    if (c->proto == 3)
        return 0; /* TUN: the kernel's handshake was the reply */
    if (c->proto == 1)
        return client_send(c, S5_SUCCESS, sizeof S5_SUCCESS);
    return client_send(c, HTTP_ESTABLISHED, sizeof HTTP_ESTABLISHED - 1);
}

const char *http_phrase(int status)
{
    switch (status) {
    case 403:
        return "Forbidden";
    case 502:
        return "Bad Gateway";
    case 504:
        return "Gateway Timeout";
    default:
        return "";
    }
}

/* The failure reply the Python inbound sends (Handshake.failure_reply): a
 * SOCKS5 reply code, or an HTTP error with the message as its body. */
void failure_reply(struct cconn *c, int socks_code, int http_status, const char *message)
{
    if (c->replied)
        return;
    if (c->proto == 3) {
        /* TUN: the client only knows a TCP connection; a reset on close is
         * the nearest to the refusal a direct connection would have met. */
        struct linger lg = {1, 0};
        (void)setsockopt(c->cfd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        return;
    }
    if (c->proto == 1) {
        uint8_t r[10] = {5, (uint8_t)socks_code, 0, 1, 0, 0, 0, 0, 0, 0};
        (void)client_send(c, r, sizeof r);
        return;
    }
    /* The body is the failure message, as Python's reply carries it: a
     * proxy's malformed answer can make that long, so size the buffer. */
    static const char fmt[] =
        "HTTP/1.1 %d %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s\n";
    char small[1024], *out = small;
    size_t body = strlen(message) + 1;
    int n =
        snprintf(small, sizeof small, fmt, http_status, http_phrase(http_status), body, message);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof small) {
        out = malloc((size_t)n + 1);
        if (!out)
            return;
        snprintf(out, (size_t)n + 1, fmt, http_status, http_phrase(http_status), body, message);
    }
    (void)client_send(c, out, (size_t)n);
    if (out != small)
        free(out);
}

/* ---- sniffing ----------------------------------------------------------------- */

/* Peek at the client's first bytes (they stay in the socket for the relay).
 * Early bytes C already holds are sniffed instead, as the Python path does. */
int sniff_step(struct cconn *c)
{
    sw_sniffed s;
    if (c->len > c->consumed) {
        if (sw_sniff(c->buf + c->consumed, c->len - c->consumed, &s) == SW_PARSE_OK) {
            memcpy(c->sniffed, s.host, s.host_len);
            c->sniffed_len = s.host_len;
        }
        return SNIFF_DONE;
    }
    ssize_t n = recv(c->cfd, c->loop->peek, SW_CONN_RAW_MAX + 5, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return SNIFF_WAIT;
    if (n <= 0)
        return SNIFF_DONE;
    int rc = sw_sniff(c->loop->peek, (size_t)n, &s);
    if (rc == SW_PARSE_NEED_MORE)
        return SNIFF_WAIT;
    if (rc == SW_PARSE_OK) {
        memcpy(c->sniffed, s.host, s.host_len);
        c->sniffed_len = s.host_len;
    }
    return SNIFF_DONE;
}
