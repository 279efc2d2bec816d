/*
 * Routing a connection through the route table and dialling the target.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- routing and dialling -------------------------------------------------------- */

static void start_flow(struct cconn *c);

/* An IP literal as Python's resolver and encode_address read it (iplit.h). */
bool parse_ip_literal(const char *host, struct sockaddr_storage *ss, socklen_t *len, uint16_t port)
{
    size_t n = strlen(host);
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *sin = (struct sockaddr_in *)ss;
    if (sw_ip4_parse((const uint8_t *)host, n, (uint8_t *)&sin->sin_addr)) {
        sin->sin_family = AF_INET;
        sin->sin_port = htons(port);
        *len = sizeof *sin;
        return true;
    }
    struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;
    if (!memchr(host, '%', n) && sw_ip6_parse((const uint8_t *)host, n, sin6->sin6_addr.s6_addr)) {
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(port);
        *len = sizeof *sin6;
        return true;
    }
    return false;
}

/* The target host as the engine routes, dials and records it: canonical
 * (sw_host_canon, hostnorm.canonical_host), so every spelling of an address
 * ("2130706433", "127.1", "0x7f.0.0.1", "127.0.0.1.", "::ffff:127.0.0.1",
 * "0") is that address, and a name has no trailing dot.  A host C cannot be
 * sure of (non-ASCII, a '%') keeps its bytes for Python to read. */
void set_host(struct cconn *c, const char *s, size_t n)
{
    size_t m = 0;
    if (n >= sizeof c->host ||
        sw_host_canon((const uint8_t *)s, n, c->host, sizeof c->host, &m) < 0) {
        m = n < sizeof c->host ? n : sizeof c->host - 1;
        memmove(c->host, s, m);
        c->host[m] = 0;
    }
    c->host_len = (uint16_t)m;
}

/* Decide the route from the table installed now; returns false when the flow
 * must be deferred.  Everything later steps need from that table is copied
 * into the connection: the table may be swapped and freed before they run. */
bool decide(struct cconn *c)
{
    /* A flow sniffed before routing decides twice: nothing of the first
     * decision's upstream may leak into the second. */
    free(c->up_user);
    free(c->up_pass);
    free(c->up_tag);
    free(c->http_buf);
    c->up_user = c->up_pass = c->up_tag = NULL;
    c->http_buf = NULL;
    c->http_req_len = 0;
    const sw_table *t = atomic_load(&c->loop->conn->table);
    if (!t)
        return false;
    /* An inbound the flow hook selects: Python asks the hook, then routes. */
    if (sw_table_inbound_deferred(t, c->listener->index))
        return false;
    /* A fake-ip address: Python routes it by the domain it stands for. */
    if (sw_table_host_deferred(t, c->host, c->host_len))
        return false;
    /* process_lookup always, a client on this host: Python finds its process
     * before routing, so every record of the flow carries it. */
    if (sw_table_source_deferred(t, c->src_family, c->src_ip))
        return false;
    sw_route_query q;
    memset(&q, 0, sizeof q);
    q.host = c->host;
    q.host_len = c->host_len;
    if (c->sniffed_len) {
        q.sniffed = c->sniffed;
        q.sniffed_len = c->sniffed_len;
    }
    q.port = c->port;
    q.source_port = c->src_port;
    q.source_family = c->src_family;
    q.network = SW_NET_TCP;
    memcpy(q.source_ip, c->src_ip, 16);
    q.inbound = c->listener->index;
    q.principal = c->principal;
    /* A name whose address an ip_cidr rule may look at (routing.needs_address):
     * the first address the DNS cache has for it decides, and is then the only
     * one a direct dial tries (the Python path pins it too).  Without one the
     * table defers, and Python resolves the name. */
    bool pinned = false;
    uint8_t a[16];
    if (sw_table_mode(t) == SW_MODE_RULE && sw_table_first_ip_rule(t) < sw_table_rule_count(t) &&
        sw_host_addr((const uint8_t *)c->host, c->host_len, a) == SW_HOST_NAME &&
        dns_get(c->loop->conn, c->host, c, c->port)) {
        q.resolved_family = c->addr_family[0];
        memcpy(q.resolved_ip, c->addr_raw[0], 16);
        pinned = true;
    }
    if (sw_table_decide(t, &q, &c->rr) != 0 || c->rr.action == SW_ROUTE_DEFER)
        return false;
    c->epoch = sw_table_epoch(t);
    /* As the Python path's _sniff_may_reroute: only rule mode, and only when
     * a domain rule ranks before the match (before the end for the final). */
    int64_t matched = c->rr.rule >= 0 ? c->rr.rule : (int64_t)sw_table_rule_count(t);
    c->sniff_may_reroute =
        sw_table_mode(t) == SW_MODE_RULE && (int64_t)sw_table_first_domain_rule(t) < matched;
    c->out_kind = SW_OUT_BLOCK;
    if (c->rr.action == SW_ROUTE_BLOCK)
        return true;
    const sw_target_info *ti = sw_table_target_info(t, (uint32_t)c->rr.target);
    if (!ti || ti->kind == SW_OUT_DEFER)
        return false;
    c->out_kind = ti->kind;
    c->connect_timeout_ms = ti->connect_timeout_ms;
    if (ti->kind == SW_OUT_BLOCK)
        return true;
    const char *host = ti->kind == SW_OUT_DIRECT ? c->host : ti->server;
    uint16_t port = ti->kind == SW_OUT_DIRECT ? c->port : ti->port;
    if (!host)
        return false;
    c->naddrs = 1;
    c->addr_idx = 0;
    if (pinned && ti->kind == SW_OUT_DIRECT)
        addr_select(c, 0); /* the address the route was decided on, alone */
    else if (!parse_ip_literal(host, &c->up_addr, &c->up_addr_len, port) &&
             !dns_get(c->loop->conn, host, c, port))
        return false; /* a DNS miss: Python resolves (and fills the cache) */
    if (ti->kind == SW_OUT_SOCKS5 || ti->kind == SW_OUT_HTTP) {
        free(c->up_tag);
        c->up_tag = strdup(ti->tag ? ti->tag : "");
        if (!c->up_tag)
            return false;
        snprintf(c->up_where, sizeof c->up_where, "%s:%u", ti->server, ti->port);
    }
    if (ti->kind == SW_OUT_HTTP) {
        /* Built now, from the table's credentials: where http.connect_request
         * raises ValueError, Python's path must meet it too (-EINVAL: defer). */
        uint8_t req[4096];
        int n = sw_http_connect_request(c->host, c->port, ti->user, ti->pass, req, sizeof req);
        if (n < 0)
            return false;
        free(c->http_buf);
        c->http_buf = malloc((size_t)n);
        if (!c->http_buf)
            return false;
        memcpy(c->http_buf, req, (size_t)n);
        c->http_req_len = (uint32_t)n;
    } else if (ti->kind == SW_OUT_SOCKS5) {
        /* Non-ASCII targets need IDNA on the wire: Python's job. */
        for (uint16_t i = 0; i < c->host_len; i++)
            if ((uint8_t)c->host[i] >= 0x80)
                return false;
        if (ti->user) {
            c->up_user = strdup(ti->user);
            c->up_pass = strdup(ti->pass ? ti->pass : "");
            if (!c->up_user || !c->up_pass)
                return false;
        }
    } else if (ti->kind != SW_OUT_DIRECT) {
        return false;
    }
    return true;
}

void fail_flow(struct cconn *c, uint32_t end, int err, int detail, int socks_code, int http_status,
               const char *message)
{
    if (c->fwd) {
        fwd_refuse(c, end, err, detail, http_status, message);
        return;
    }
    failure_reply(c, socks_code, http_status, message);
    conn_end(c, end, err, detail);
}

void connect_failed(struct cconn *c, int err)
{
    if (err == ETIMEDOUT) {
        /* Python's connect raises TimeoutError for it: "timed out", at once. */
        connect_timed_out(c);
        return;
    }
    if (c->addr_idx + 1 < c->naddrs) {
        /* open_tcp tries the next address, within the same deadline. */
        close(c->ufd); /* its epoll registration goes with it (never dup'ed) */
        c->ufd = -1;
        addr_select(c, (uint8_t)(c->addr_idx + 1));
        start_connect(c);
        return;
    }
    char msg[600];
    int socks = 1, http = 502;
    switch (err) {
    case ECONNREFUSED:
        socks = 5;
        break;
    case ENETUNREACH:
        socks = 3;
        break;
    case EHOSTUNREACH:
        socks = 4;
        break;
    case ETIMEDOUT:
        socks = 6;
        http = 504;
        break;
    default:
        break;
    }
    /* Python names what it connected to: the target, or the proxy server. */
    if (c->out_kind == SW_OUT_DIRECT)
        snprintf(msg, sizeof msg, "connect to %s:%u failed: %s", c->host, c->port, strerror(err));
    else
        snprintf(msg, sizeof msg, "connect to %s failed: %s", c->up_where, strerror(err));
    fail_flow(c, SW_END_CONNECT_FAILED, err, 0, socks, http, msg);
}

void start_connect(struct cconn *c)
{
    int fd = socket(c->up_addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* The engine's own traffic must leave by the physical egress, not loop back
     * into the TUN it serves (spliceway/support/socket_mark.py): the route is chosen at
     * connect(), so the mark goes on first.  A refusal (EPERM: no CAP_NET_ADMIN)
     * is counted, not fatal: the flow is dialled unmarked, as it would be
     * without a TUN. */
    uint32_t mark = atomic_load_explicit(&c->loop->conn->mark, memory_order_relaxed);
    if (mark && setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark) < 0)
        atomic_fetch_add_explicit(&c->loop->conn->stats.mark_failed, 1, memory_order_relaxed);
    c->ufd = fd;
    c->up_watched = false;
    int rc = connect(fd, (struct sockaddr *)&c->up_addr, c->up_addr_len);
    if (rc < 0 && errno != EINPROGRESS) {
        connect_failed(c, errno);
        return;
    }
    c->state = ST_CONNECT;
    if (c->addr_idx == 0) /* one deadline for every address, as open_tcp has */
        timer_set(c, sw_mono_ms() + c->connect_timeout_ms);
    /* A loopback (or otherwise local) handshake has finished inside connect()
     * though it said EINPROGRESS: go on now rather than one epoll round later
     * (and never put a relayed direct upstream in this loop's set at all). */
    struct pollfd pfd = {.fd = fd, .events = POLLOUT};
    if (rc == 0 || (poll(&pfd, 1, 0) == 1 && pfd.revents)) {
        connected(c);
        return;
    }
    if (up_watch(c) < 0) {
        int err = errno;
        fail_flow(c, SW_END_INTERNAL, err, 0, 1, 502, strerror(err));
    }
}

/* Puts the upstream in the loop's epoll set (once): for a connect in flight
 * or an upstream proxy's reply. */
int up_watch(struct cconn *c)
{
    if (c->up_watched)
        return 0;
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN | EPOLLRDHUP | EPOLLET,
                             .data.ptr = &c->ep_up};
    if (epoll_ctl(c->loop->epfd, EPOLL_CTL_ADD, c->ufd, &ev) < 0)
        return -1;
    c->up_watched = true;
    return 0;
}

void connect_timed_out(struct cconn *c)
{
    char msg[600];
    if (c->out_kind == SW_OUT_DIRECT)
        snprintf(msg, sizeof msg, "connect to %s:%u timed out", c->host, c->port);
    else if (c->state == ST_CONNECT)
        snprintf(msg, sizeof msg, "connect to %s timed out", c->up_where);
    else
        snprintf(msg, sizeof msg, "proxy %s handshake timed out", c->up_tag);
    fail_flow(c, SW_END_CONNECT_TIMEOUT, 0, 0, 6, 504, msg);
}

/* Routed and ready to dial (or block). */
static void dial(struct cconn *c)
{
    if (c->out_kind == SW_OUT_BLOCK) {
        fail_flow(c, SW_END_BLOCKED, 0, 0, 2, 403, "blocked by rule");
        return;
    }
    start_connect(c);
}

/* The handshake completed: route, maybe sniff first, then dial. */
void after_handshake(struct cconn *c)
{
    c->started_ms = sw_real_ms();
    c->hs_tx = c->ctx;
    if (!decide(c)) {
        conn_defer(c, SW_DEFER_ROUTE);
        return;
    }
    if (c->listener->opts.sniff && c->sniff_may_reroute) {
        /* A domain rule ranked before the match could claim this flow by its
         * first bytes, which the client sends only once told the tunnel is
         * open: answer first, then sniff and decide again. */
        if (success_reply(c) < 0) {
            conn_drop(c);
            return;
        }
        c->replied = true;
        /* The client was told the tunnel is open: from here the flow exists
         * (listed, closable, completed on stop), as on the Python path. */
        record_started(c);
        c->state = ST_SNIFF_PRE;
        if (sniff_step(c) == SNIFF_WAIT) {
            timer_set(c, sw_mono_ms() + c->listener->opts.sniff_timeout_ms);
            return;
        }
        if (!decide(c)) {
            conn_defer(c, SW_DEFER_ROUTE);
            return;
        }
    }
    start_flow(c);
}

void sniff_pre_done(struct cconn *c)
{
    timer_clear(c);
    if (!decide(c)) {
        conn_defer(c, SW_DEFER_ROUTE);
        return;
    }
    start_flow(c);
}

/* C owns the flow from here: STARTED, then dial. */
static void start_flow(struct cconn *c)
{
    if (!c->started)
        record_started(c);
    dial(c);
}

/* The STARTED record (once per flow). */
void record_started(struct cconn *c)
{
    sw_conn *conn = c->loop->conn;
    c->flow = atomic_fetch_add_explicit(&conn->next_flow, 1, memory_order_relaxed);
    sw_conn_record *r = record_begin(c, SW_REC_STARTED);
    r->at_unix_ms = c->started_ms;
    /* The handshake's bytes only, as flow.started carries; a success reply sent
     * before routing is counted in ROUTED/ENDED. */
    r->client_tx = c->hs_tx;
    record_name(r, c->host, c->host_len);
    record_commit(c);
    c->started = true;
    atomic_fetch_add_explicit(&conn->stats.started, 1, memory_order_relaxed);
}
