/*
 * The public API of conn.h: creating and freeing, listeners, tables, draining.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- public API --------------------------------------------------------------------- */

static void loop_post(struct cloop *L, struct cmd *cmd)
{
    pthread_mutex_lock(&L->cmd_lock);
    cmd->next = L->cmds;
    L->cmds = cmd;
    pthread_mutex_unlock(&L->cmd_lock);
    efd_signal(L->wakefd);
}

int sw_conn_new(sw_relay *relay, int nloops, uint32_t ring_records, sw_conn **out)
{
    if (!relay || !out || nloops < 0 || nloops > 64)
        return -EINVAL;
    if (nloops == 0)
        nloops = 1;
    uint32_t cap = ring_records ? ring_records : DEFAULT_RING;
    if (cap < 16 || cap > (1u << 24) || (cap & (cap - 1)))
        return -EINVAL;
    sw_conn *conn = calloc(1, sizeof *conn);
    if (!conn)
        return -ENOMEM;
    conn->relay = relay;
    conn->nloops = nloops;
    atomic_init(&conn->next_flow, 1);
    atomic_init(&conn->epoch, 1);
    pthread_mutex_init(&conn->retire_lock, NULL);
    pthread_mutex_init(&conn->listen_lock, NULL);
    pthread_mutex_init(&conn->dns_lock, NULL);
    pthread_mutex_init(&conn->defer_lock, NULL);
    pthread_mutex_init(&conn->drain_lock, NULL);
    conn->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    conn->loops = calloc((size_t)nloops, sizeof *conn->loops);
    int rc = 0;
    if (conn->efd < 0 || !conn->loops) {
        rc = conn->efd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    for (int i = 0; i < nloops; i++) {
        struct cloop *L = &conn->loops[i];
        L->conn = conn;
        L->wake_ep.type = EP_WAKE;
        L->epfd = L->wakefd = -1;
        pthread_mutex_init(&L->cmd_lock, NULL);
        pthread_cond_init(&L->cmd_cond, NULL);
        L->ring.mask = cap - 1;
        /* mmap: pages of the ring cost memory only once records reach them. */
        L->ring.bytes = (size_t)cap * sizeof(sw_conn_record);
        void *slots =
            mmap(NULL, L->ring.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (slots == MAP_FAILED) {
            rc = -errno;
            goto fail;
        }
        L->ring.slots = slots;
        L->epfd = epoll_create1(EPOLL_CLOEXEC);
        L->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (L->epfd < 0 || L->wakefd < 0) {
            rc = -errno;
            goto fail;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &L->wake_ep};
        if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, L->wakefd, &ev) < 0) {
            rc = -errno;
            goto fail;
        }
    }
    for (int i = 0; i < nloops; i++) {
        struct cloop *L = &conn->loops[i];
        rc = loop_thread_start(&L->thread, loop_main, L, "sw-conn", i);
        if (rc)
            goto fail;
        L->started = true;
    }
    *out = conn;
    return 0;
fail:
    sw_conn_free(conn);
    return rc;
}

int sw_conn_shutdown(sw_conn *conn)
{
    if (!conn)
        return -EINVAL;
    if (atomic_exchange(&conn->shut, 1))
        return 0;
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (!L->started)
            continue;
        atomic_store(&L->stop, 1);
        efd_signal(L->wakefd);
        pthread_join(L->thread, NULL);
        L->started = false;
    }
    /* The loops are gone: end what they held from this thread. */
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        while (L->held) {
            struct cconn *c = L->held;
            if (c->started)
                conn_end(c, SW_END_CLOSED, 0, 0);
            else
                conn_release(c);
        }
        conn_free_dead(L);
        L->heap_len = 0;
    }
    efd_signal(conn->efd);
    return 0;
}

static void listener_free(struct listener *l)
{
    for (size_t u = 0; u < l->nusers; u++) {
        free(l->users[u].name);
        free(l->users[u].pass);
    }
    free(l->users);
    free(l);
}

void sw_conn_free(sw_conn *conn)
{
    if (!conn)
        return;
    sw_conn_shutdown(conn);
    for (int i = 0; conn->loops && i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (L->epfd >= 0)
            close(L->epfd);
        if (L->wakefd >= 0)
            close(L->wakefd);
        if (L->ring.slots)
            munmap(L->ring.slots, L->ring.bytes);
        free(L->heap);
        while (L->cmds) {
            struct cmd *c = L->cmds;
            L->cmds = c->next;
            free(c);
        }
        pthread_mutex_destroy(&L->cmd_lock);
        pthread_cond_destroy(&L->cmd_cond);
    }
    free(conn->loops);
    for (int i = 0; i < MAX_LISTENERS; i++) {
        if (conn->listeners[i])
            listener_free(conn->listeners[i]);
    }
    while (conn->retired_listeners) {
        struct listener *l = conn->retired_listeners;
        conn->retired_listeners = l->next_retired;
        listener_free(l);
    }
    sw_table_free(atomic_load(&conn->table));
    while (conn->retired) {
        struct retired *r = conn->retired;
        conn->retired = r->next;
        sw_table_free(r->table);
        free(r);
    }
    for (size_t b = 0; b < DNS_BUCKETS; b++) {
        while (conn->dns[b]) {
            struct dns_entry *e = conn->dns[b];
            conn->dns[b] = e->next;
            free(e);
        }
    }
    while (conn->defer_head) {
        struct deferred_item *it = conn->defer_head;
        conn->defer_head = it->next;
        close(it->d.fd);
        free(it);
    }
    while (conn->messages) {
        struct message *m = conn->messages;
        conn->messages = m->next;
        free(m);
    }
    if (conn->efd >= 0)
        close(conn->efd);
    free(conn);
}

static struct listener *listener_get(sw_conn *conn, uint32_t inbound, bool create)
{
    if (inbound >= MAX_LISTENERS)
        return NULL;
    struct listener *l = conn->listeners[inbound];
    if (!l && create) {
        l = calloc(1, sizeof *l);
        if (!l)
            return NULL;
        l->ep.type = EP_LISTENER;
        l->fd = -1;
        l->index = inbound;
        conn->listeners[inbound] = l;
    }
    return l;
}

int sw_conn_listener_user(sw_conn *conn, uint32_t inbound, const char *user, const char *pass,
                          uint32_t principal)
{
    if (!conn || !user || !pass)
        return -EINVAL;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, true);
    int rc = -EINVAL;
    if (l && !atomic_load(&l->active)) {
        struct user *u = realloc(l->users, (l->nusers + 1) * sizeof *u);
        rc = -ENOMEM;
        if (u) {
            l->users = u;
            u = &l->users[l->nusers];
            u->name = strdup(user);
            u->pass = strdup(pass);
            u->pass_len = strlen(pass);
            u->principal = principal;
            if (u->name && u->pass) {
                l->nusers++;
                rc = 0;
            } else {
                free(u->name);
                free(u->pass);
            }
        }
    }
    pthread_mutex_unlock(&conn->listen_lock);
    return rc;
}

static int listen_on(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                     sw_tun *tun);

int sw_conn_listen(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts)
{
    if (!conn || fd < 0 || !opts || opts->protocol < SW_IN_SOCKS5 || opts->protocol > SW_IN_MIXED)
        return -EINVAL;
    return listen_on(conn, inbound, fd, opts, NULL);
}

int sw_conn_listen_tun(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                       sw_tun *tun)
{
    if (!conn || fd < 0 || !opts || !tun || opts->protocol != SW_IN_TUN)
        return -EINVAL;
    return listen_on(conn, inbound, fd, opts, tun);
}

static int listen_on(sw_conn *conn, uint32_t inbound, int fd, const sw_listener_opts *opts,
                     sw_tun *tun)
{
    if (atomic_load(&conn->shut))
        return -ESHUTDOWN;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, true);
    int rc = 0;
    if (!l || atomic_load(&l->active) || (opts->users_required && l->nusers == 0)) {
        rc = l ? -EINVAL : -ENOMEM;
        goto out;
    }
    /* Accepted sockets inherit TCP_NODELAY from the listener (Linux copies
     * the socket): one setsockopt here instead of one per connection. */
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        rc = -errno;
        goto out;
    }
    l->fd = fd;
    l->opts = *opts;
    l->tun = tun;
    atomic_store(&l->active, 1);
    for (int i = 0; i < conn->nloops; i++) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLET | EPOLLEXCLUSIVE, .data.ptr = &l->ep};
        if (epoll_ctl(conn->loops[i].epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
            rc = -errno;
            for (int j = 0; j < i; j++)
                epoll_ctl(conn->loops[j].epfd, EPOLL_CTL_DEL, fd, NULL);
            atomic_store(&l->active, 0);
            l->fd = -1;
            goto out;
        }
    }
out:
    pthread_mutex_unlock(&conn->listen_lock);
    return rc;
}

int sw_conn_unlisten(sw_conn *conn, uint32_t inbound)
{
    if (!conn)
        return -EINVAL;
    pthread_mutex_lock(&conn->listen_lock);
    struct listener *l = listener_get(conn, inbound, false);
    if (!l || !atomic_load(&l->active)) {
        pthread_mutex_unlock(&conn->listen_lock);
        return -ENOENT;
    }
    atomic_store(&l->active, 0);
    for (int i = 0; i < conn->nloops; i++)
        epoll_ctl(conn->loops[i].epfd, EPOLL_CTL_DEL, l->fd, NULL);
    l->fd = -1;
    /* The slot may serve a new listener (a reload), with other options and users;
     * connections this one accepted keep pointing at it, so it is kept, not reused. */
    conn->listeners[inbound] = NULL;
    l->next_retired = conn->retired_listeners;
    conn->retired_listeners = l;
    pthread_mutex_unlock(&conn->listen_lock);
    /* A barrier per loop: once each has run it, none is inside accept_on for
     * this listener any more, so the caller may close the fd. */
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        if (!L->started || atomic_load(&L->stop))
            continue;
        struct cmd *cmd = calloc(1, sizeof *cmd);
        if (!cmd)
            return -ENOMEM;
        cmd->kind = CMD_BARRIER;
        loop_post(L, cmd);
        pthread_mutex_lock(&L->cmd_lock);
        while (!cmd->done && L->started && !atomic_load(&L->stop)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&L->cmd_cond, &L->cmd_lock, &ts);
        }
        int done = cmd->done;
        pthread_mutex_unlock(&L->cmd_lock);
        if (done)
            free(cmd);
        /* else the loop stopped with it queued: sw_conn_free frees it. */
    }
    return 0;
}

static void reclaim_tables(sw_conn *conn)
{
    uint64_t min_seen = UINT64_MAX;
    for (int i = 0; i < conn->nloops; i++) {
        uint64_t s = atomic_load(&conn->loops[i].seen);
        if (s && s < min_seen)
            min_seen = s;
    }
    struct retired **pp = &conn->retired;
    while (*pp) {
        struct retired *r = *pp;
        if (r->epoch <= min_seen) {
            *pp = r->next;
            sw_table_free(r->table);
            free(r);
        } else {
            pp = &r->next;
        }
    }
}

int sw_conn_set_table(sw_conn *conn, sw_table *table)
{
    if (!conn || !table) {
        sw_table_free(table);
        return -EINVAL;
    }
    struct retired *r = malloc(sizeof *r);
    if (!r) {
        sw_table_free(table);
        return -ENOMEM;
    }
    pthread_mutex_lock(&conn->retire_lock);
    sw_table *old = atomic_exchange(&conn->table, table);
    uint64_t e = atomic_fetch_add(&conn->epoch, 1) + 1;
    if (old) {
        r->table = old;
        r->epoch = e;
        r->next = conn->retired;
        conn->retired = r;
    } else {
        free(r);
    }
    reclaim_tables(conn);
    pthread_mutex_unlock(&conn->retire_lock);
    return 0;
}

int sw_conn_request_close(sw_conn *conn, uint64_t flow)
{
    if (!conn || flow == 0)
        return -EINVAL;
    if (atomic_load(&conn->shut))
        return -ESHUTDOWN;
    /* Which loop holds it is not recorded: every loop checks (there are few). */
    for (int i = 0; i < conn->nloops; i++) {
        struct cmd *cmd = calloc(1, sizeof *cmd);
        if (!cmd)
            return -ENOMEM;
        cmd->kind = CMD_CLOSE;
        cmd->flow = flow;
        loop_post(&conn->loops[i], cmd);
    }
    return 0;
}

int sw_conn_fd(sw_conn *conn) { return conn ? conn->efd : -EINVAL; }

int sw_conn_drain(sw_conn *conn, sw_conn_record *out, size_t max)
{
    if (!conn || (!out && max))
        return -EINVAL;
    pthread_mutex_lock(&conn->drain_lock);
    efd_clear(conn->efd);
    size_t n = 0;
    bool more = false;
    for (int i = 0; i < conn->nloops; i++) {
        struct cloop *L = &conn->loops[i];
        struct ring *R = &L->ring;
        uint32_t tail = sw_ring_tail(&R->tail);
        uint32_t head = sw_ring_ready(&R->head);
        uint32_t took = 0;
        while (tail != head && n < max) {
            memcpy(&out[n++], &R->slots[tail & R->mask], sizeof(sw_conn_record));
            tail++;
            took++;
        }
        if (tail != head)
            more = true;
        sw_ring_release(&R->tail, tail);
        if (took && atomic_load(&L->paused))
            efd_signal(L->wakefd); /* room again: let it accept */
    }
    pthread_mutex_lock(&conn->defer_lock);
    if (conn->defer_head)
        more = true;
    pthread_mutex_unlock(&conn->defer_lock);
    if (more)
        efd_signal(conn->efd);
    pthread_mutex_unlock(&conn->drain_lock);
    return (int)n;
}

int sw_conn_stats_get(sw_conn *conn, sw_conn_stats *out)
{
    if (!conn || !out)
        return -EINVAL;
    out->accepted = atomic_load(&conn->stats.accepted);
    out->handshake_failed = atomic_load(&conn->stats.handshake_failed);
    out->deferred = atomic_load(&conn->stats.deferred);
    out->started = atomic_load(&conn->stats.started);
    out->routed = atomic_load(&conn->stats.routed);
    out->ended = atomic_load(&conn->stats.ended);
    out->accept_paused = atomic_load(&conn->stats.accept_paused);
    out->accept_errors = atomic_load(&conn->stats.accept_errors);
    out->mark_failed = atomic_load(&conn->stats.mark_failed);
    return 0;
}

int sw_conn_set_mark(sw_conn *conn, uint32_t mark)
{
    if (!conn)
        return -EINVAL;
    atomic_store_explicit(&conn->mark, mark, memory_order_relaxed);
    return 0;
}
