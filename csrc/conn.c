/*
 * spliceway C connection path.  See conn.h for the contract; this file
 * explains the choices behind it.
 *
 * Threads
 *   Each loop is a pthread with its own epoll set and owns the connections it
 *   accepted until they are handed to the relay, deferred to Python or closed.
 *   Listening sockets are in every loop's epoll set (EPOLLEXCLUSIVE, so one
 *   connection wakes one loop).  Other threads reach a loop only through its
 *   command list (mutex + eventfd): close a flow, a barrier for unlisten, stop.
 *
 * Records
 *   One single-producer ring per loop.  A loop accepts a connection only if
 *   the ring has room for two records per connection it holds (STARTED, then
 *   ROUTED or ENDED), counted in `promised`: so a record never waits for room,
 *   and a full ring pauses accepting until Python drains (sw_conn_drain wakes
 *   paused loops).  The relay's completion of a routed flow comes through the
 *   relay's own queue; Python matches the two by the relay handle.
 *
 * Tables
 *   The route table is read through an atomic pointer.  A loop publishes the
 *   global epoch it has seen at the top of every iteration and 0 while it
 *   sleeps in epoll_wait (holding no table then); a replaced table is freed
 *   once every loop that is awake has seen an epoch at least its retirement
 *   epoch (quiescent-state reclamation).  Connections that wait across
 *   iterations copy what they need from the table (target kind, address,
 *   credentials) instead of keeping a pointer.
 *
 * Timers
 *   One deadline per connection (handshake, sniff or connect), kept in a
 *   binary min-heap per loop: O(log n) per change, and the loop sleeps until
 *   the earliest.
 *
 * Files
 *   This file is the loop (events, accepting, commands); the rest of the path
 *   is split along its sections, sharing the types in conn_int.h:
 *   conn_flow.c (timers, records, lifetime, deferral, failure messages,
 *   replies, sniffing), conn_dns.c (the DNS answer cache), conn_route.c
 *   (routing and dialling), conn_upstream.c (upstream SOCKS5 and HTTP
 *   CONNECT, the hand-off to the relay), conn_forward.c (absolute-URI
 *   forwarding), conn_handshake.c (the client handshake) and conn_api.c
 *   (the public API of conn.h).
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- events ------------------------------------------------------------------------ */

void client_event(struct cconn *c, uint32_t events)
{
    switch (c->state) {
    case ST_HS_FIRST:
    case ST_S5_GREETING:
    case ST_S5_USERPASS:
    case ST_S5_REQUEST:
    case ST_HTTP_HEAD: {
        int n = client_read(c, events);
        if (n == -2) {
            /* Only an HTTP head can outgrow the buffer: Python reads on. */
            if (c->state == ST_HTTP_HEAD)
                conn_defer(c, SW_DEFER_HANDSHAKE);
            else
                conn_drop(c);
            return;
        }
        if (n < 0) {
            if (c->fwd_served)
                conn_release(c); /* closed (or failed) between requests: no flow */
            else
                conn_drop(c);
            return;
        }
        if (n > 0)
            handshake_step(c);
        /* The client hung up with its handshake unfinished: nothing more can come. */
        if (c->client_eof && !c->dead && c->state <= ST_HTTP_HEAD) {
            if (c->fwd_served)
                conn_release(c);
            else
                conn_drop(c);
        }
        return;
    }
    case ST_FWD_FLUSH:
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))
            fwd_flush(c);
        return;
    case ST_SNIFF_PRE:
        if (sniff_step(c) == SNIFF_DONE)
            sniff_pre_done(c);
        return;
    case ST_SNIFF_POST:
        if (sniff_step(c) == SNIFF_DONE)
            hand_off(c);
        return;
    default:
        /* Dialling: client bytes wait in the socket for the relay.  A hang-up
         * is seen by the relay too; only an error ends the flow here -- except
         * a forwarded request's, which, as on the Python path, finds out when
         * its answer is written (SW_END_FWD_CLIENT). */
        if ((events & EPOLLERR) && !c->fwd)
            conn_end(c, SW_END_CLIENT, ECONNRESET, 0);
        return;
    }
}

static void upstream_event(struct cconn *c, uint32_t events)
{
    if (c->state == ST_CONNECT) {
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))
            connected(c);
        return;
    }
    if (c->state == ST_UP_S5_METHOD || c->state == ST_UP_S5_AUTH ||
        c->state == ST_UP_S5_REPLY) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            upstream_readable(c);
    } else if (c->state == ST_UP_HTTP_REPLY) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            http_readable(c);
    } else if (c->state == ST_FWD_RESP) {
        if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP))
            fwd_readable(c);
    }
}

static void timer_fired(struct cconn *c)
{
    c->heap_idx = SIZE_MAX;
    c->deadline = 0;
    switch (c->state) {
    case ST_SNIFF_PRE:
        sniff_pre_done(c);
        return;
    case ST_SNIFF_POST:
        hand_off(c);
        return;
    case ST_CONNECT:
    case ST_UP_S5_METHOD:
    case ST_UP_S5_AUTH:
    case ST_UP_S5_REPLY:
    case ST_UP_HTTP_REPLY:
        connect_timed_out(c);
        return;
    case ST_FWD_RESP:
        fwd_timed_out(c);
        return;
    default:
        if (c->fwd_served) {
            /* Idle between requests (runtime.tcp_idle_timeout): no flow to end. */
            conn_release(c);
            return;
        }
        /* The handshake timed out: no flow existed, nothing to answer. */
        conn_drop(c);
        return;
    }
}

/* The TUN "handshake": the accepted socket's peer is the stack's NAT address
 * and port; its entry holds the original source and destination. */
static bool tun_handshake(struct cconn *c)
{
    sw_tun_flow f;
    if (!c->src_family ||
        sw_tun_peer_lookup(c->listener->tun, c->src_family, c->src_ip, c->src_port, &f) < 0)
        return false;
    c->proto = 3;
    c->command = 1;
    c->src_family = f.version;
    memcpy(c->src_ip, f.src, 16);
    c->src_port = f.sport;
    if (f.version == 4)
        c->host_len = (uint16_t)sprintf(c->host, "%u.%u.%u.%u", f.dst[0], f.dst[1], f.dst[2],
                                        f.dst[3]);
    else
        c->host_len = (uint16_t)sw_ip6_text(f.dst, c->host);
    c->port = f.dport;
    return true;
}

static bool fd_exhausted(int err)
{
    return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

/* accept4 failed for want of descriptors.  The connection stays in the backlog,
 * so retrying at once (or on the next edge) would only fail again, and a
 * level-triggered loop would spin: this loop stops accepting on every listener
 * (the limit is the process's) until accept_retry_at, serving what it holds,
 * and the first failure of the listener's outage is reported to Python. */
static void accept_exhausted(struct cloop *L, struct listener *l, int err)
{
    uint32_t delay = L->accept_delay_ms ? L->accept_delay_ms * 2 : ACCEPT_BACKOFF_MIN_MS;
    L->accept_delay_ms = delay > ACCEPT_BACKOFF_MAX_MS ? ACCEPT_BACKOFF_MAX_MS : delay;
    L->accept_retry_at = sw_mono_ms() + L->accept_delay_ms;
    atomic_fetch_add_explicit(&l->outage_failures, 1, memory_order_relaxed);
    uint32_t none = 0;
    uint32_t number = atomic_load(&l->outages) + 1;
    /* ring_has_room held before this accept: one record fits. */
    if (atomic_compare_exchange_strong(&l->outage, &none, number)) {
        atomic_store(&l->outages, number);
        record_listener(L, l, SW_REC_ACCEPT_FAILED, number, err, 0);
    }
}

/* An accept succeeded: this loop accepts freely again, and the listener's
 * outage, if one is under way, ends (reported when the ring has room for the
 * record; else a later accept ends it). */
static void accept_recovered(struct cloop *L, struct listener *l)
{
    L->accept_delay_ms = 0;
    if (!atomic_load_explicit(&l->outage, memory_order_relaxed) ||
        ring_used(&L->ring) + L->promised + 1 > L->ring.mask + 1)
        return;
    uint32_t number = atomic_exchange(&l->outage, 0);
    if (!number)
        return;
    uint64_t failed = atomic_exchange(&l->outage_failures, 0);
    record_listener(L, l, SW_REC_ACCEPT_RESUMED, number, 0,
                    failed > INT32_MAX ? INT32_MAX : (int32_t)failed);
}

static void accept_on(struct cloop *L, struct listener *l)
{
    sw_conn *conn = L->conn;
    /* Listeners are edge-triggered: a batch that ends before EAGAIN must be
     * resumed by the loop itself (accept_more), and a paused loop resumes
     * every listener when Python makes room.  Out of descriptors, the loop's
     * retry timer resumes them (loop_main). */
    if (L->accept_retry_at)
        return;
    for (int i = 0;; i++) {
        if (i == ACCEPT_BATCH) {
            L->accept_more = true;
            return;
        }
        if (!atomic_load_explicit(&l->active, memory_order_acquire))
            return;
        if (!ring_has_room(L)) {
            if (!atomic_exchange(&L->paused, 1))
                atomic_fetch_add_explicit(&conn->stats.accept_paused, 1, memory_order_relaxed);
            return;
        }
        struct sockaddr_storage peer;
        socklen_t plen = sizeof peer;
        int fd = accept4(l->fd, (struct sockaddr *)&peer, &plen, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN)
                atomic_fetch_add_explicit(&conn->stats.accept_errors, 1, memory_order_relaxed);
            if (fd_exhausted(errno))
                accept_exhausted(L, l, errno);
            return;
        }
        atomic_fetch_add_explicit(&conn->stats.accepted, 1, memory_order_relaxed);
        struct cconn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->ep_client.type = EP_CLIENT;
        c->ep_up.type = EP_UPSTREAM;
        c->loop = L;
        c->listener = l;
        c->cfd = fd;
        c->ufd = -1;
        c->heap_idx = SIZE_MAX;
        c->principal = SW_NO_PRINCIPAL;
        c->rr.rule = -1;
        c->rr.target = -1;
        c->promise = RECORDS_PER_FLOW;
        L->promised += RECORDS_PER_FLOW;
        accept_recovered(L, l);
        if (peer.ss_family == AF_INET) {
            struct sockaddr_in *sin = (struct sockaddr_in *)&peer;
            c->src_family = 4;
            memcpy(c->src_ip, &sin->sin_addr, 4);
            c->src_port = ntohs(sin->sin_port);
        } else if (peer.ss_family == AF_INET6) {
            struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)&peer;
            static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
            if (memcmp(&sin6->sin6_addr, mapped, 12) == 0) {
                c->src_family = 4;
                memcpy(c->src_ip, (uint8_t *)&sin6->sin6_addr + 12, 4);
            } else {
                c->src_family = 6;
                memcpy(c->src_ip, &sin6->sin6_addr, 16);
            }
            c->src_port = ntohs(sin6->sin6_port);
        }
        switch (l->opts.protocol) {
        case SW_IN_SOCKS5:
            c->proto = 1;
            c->state = ST_S5_GREETING;
            break;
        case SW_IN_HTTP:
            c->proto = 2;
            c->state = ST_HTTP_HEAD;
            break;
        case SW_IN_TUN:
            c->proto = 3;
            c->state = ST_TUN;
            break;
        default:
            c->state = ST_HS_FIRST;
            break;
        }
        c->next = L->held;
        if (L->held)
            L->held->prev = c;
        L->held = c;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET,
                                 .data.ptr = &c->ep_client};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ||
            timer_set(c, sw_mono_ms() + l->opts.handshake_timeout_ms) < 0) {
            conn_drop(c);
            continue;
        }
        if (c->state == ST_TUN) {
            /* Nothing to read first: the NAT entry is the whole handshake. */
            if (!tun_handshake(c)) {
                conn_drop(c);
                continue;
            }
            timer_clear(c);
            after_handshake(c);
            continue;
        }
        /* Clients usually send their greeting with the ACK: read it now
         * rather than wait for the next epoll round. */
        client_event(c, EPOLLIN);
    }
}

static void run_commands(struct cloop *L)
{
    efd_clear(L->wakefd);
    pthread_mutex_lock(&L->cmd_lock);
    struct cmd *cmds = L->cmds;
    L->cmds = NULL;
    pthread_mutex_unlock(&L->cmd_lock);
    while (cmds) {
        struct cmd *next = cmds->next;
        if (cmds->kind == CMD_CLOSE) {
            for (struct cconn *c = L->held; c; c = c->next) {
                if (c->started && c->flow == cmds->flow && !c->dead) {
                    conn_end(c, SW_END_CLOSED, 0, 0);
                    break;
                }
            }
            free(cmds);
        } else {
            pthread_mutex_lock(&L->cmd_lock);
            cmds->done = 1;
            pthread_cond_broadcast(&L->cmd_cond);
            pthread_mutex_unlock(&L->cmd_lock);
        }
        cmds = next;
    }
}

static void resume_accepting(struct cloop *L)
{
    sw_conn *conn = L->conn;
    for (int i = 0; i < MAX_LISTENERS; i++) {
        struct listener *l = conn->listeners[i];
        if (l && atomic_load(&l->active))
            accept_on(L, l);
    }
}

void *loop_main(void *arg)
{
    struct cloop *L = arg;
    sw_conn *conn = L->conn;
    struct epoll_event events[EVENTS_MAX];
    while (!atomic_load(&L->stop)) {
        int timeout = -1;
        if (L->accept_more) {
            timeout = 0;
        } else if (L->heap_len || L->accept_retry_at) {
            uint64_t now = sw_mono_ms();
            uint64_t first = L->heap_len ? L->heap[0]->deadline : UINT64_MAX;
            if (L->accept_retry_at && L->accept_retry_at < first)
                first = L->accept_retry_at;
            timeout = first <= now ? 0 : (int)(first - now > 60000 ? 60000 : first - now);
        }
        atomic_store(&L->seen, 0); /* asleep: holds no table */
        int n = epoll_wait(L->epfd, events, EVENTS_MAX, timeout);
        atomic_store(&L->seen, atomic_load(&conn->epoch));
        if (n < 0 && errno != EINTR)
            break;
        L->published = false;
        for (int i = 0; i < n; i++) {
            struct ep *ep = events[i].data.ptr;
            switch (ep->type) {
            case EP_WAKE:
                run_commands(L);
                if (atomic_exchange(&L->paused, 0))
                    resume_accepting(L);
                break;
            case EP_LISTENER:
                accept_on(L, (struct listener *)ep);
                break;
            case EP_CLIENT: {
                struct cconn *c = (struct cconn *)((char *)ep - offsetof(struct cconn, ep_client));
                if (!c->dead)
                    client_event(c, events[i].events);
                break;
            }
            case EP_UPSTREAM: {
                struct cconn *c = (struct cconn *)((char *)ep - offsetof(struct cconn, ep_up));
                if (!c->dead)
                    upstream_event(c, events[i].events);
                break;
            }
            default:
                break;
            }
        }
        uint64_t now = sw_mono_ms();
        while (L->heap_len && L->heap[0]->deadline <= now) {
            struct cconn *c = L->heap[0];
            timer_clear(c);
            timer_fired(c);
        }
        if (L->accept_retry_at && L->accept_retry_at <= now) {
            /* The backoff is over: try every listener (edges that came meanwhile
             * were ignored); a failure starts the next, longer pause. */
            L->accept_retry_at = 0;
            L->accept_more = false;
            if (!atomic_load(&L->paused))
                resume_accepting(L);
        }
        if (L->accept_more) {
            L->accept_more = false;
            if (!atomic_load(&L->paused))
                resume_accepting(L);
        }
        conn_free_dead(L);
        if (L->published)
            efd_signal(conn->efd);
    }
    atomic_store(&L->seen, 0);
    return NULL;
}
