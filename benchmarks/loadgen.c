/*
 * loadgen: epoll load generator for spliceway's end-to-end benchmarks,
 * talking to tinyserver directly or through a SOCKS5 or HTTP CONNECT proxy.
 *
 *   loadgen rate --target H:P [--socks H:P] --conc N --duration S [--count N]
 *                [--req 100] [--resp 1024] [--timeout-ms 5000] [--warmup S] [--threads T]
 *                [--rate R]
 *       N concurrent loops of: connect, [SOCKS5 greeting, wait for the method
 *       reply, CONNECT, wait for the reply], send --req bytes, read until EOF
 *       (expecting exactly --resp bytes; the server closes).  A connection's
 *       latency runs from just before connect() to the EOF.  New connections
 *       stop at --duration (or --count); the ones in flight finish.
 *       --rate R (paced, open loop): start R new connections per second over
 *       all threads on a fixed schedule instead of as soon as a slot frees;
 *       --conc is then the cap on connections in flight.
 *       --hosts FILE (one name a line): each request's Host header names the
 *       next of them in turn (per thread, from a different start), the
 *       request still --req bytes long when the name fits, so a proxy that
 *       sniffs routes each connection by another name (benchmarks/
 *       route_rules.py); without it every request says "bench.local".  A start that falls
 *       due while every slot is busy waits for one (such starts are counted
 *       in "paced_no_slot"); starts run at most ~1 ms late (epoll's resolution)
 *       and the schedule is absolute, so late starts catch up.
 *
 *   loadgen bulk --target H:P [--socks H:P] --conns N --bytes B --dir up|down
 *                [--max-seconds S] [--buf 262144] [--threads T]
 *       N parallel connections each move B bytes (tinyserver --bulk protocol);
 *       goodput = all bytes / wall time from the first connect() to the last
 *       completion.  --max-seconds aborts a run that is too slow and reports
 *       the bytes moved so far ("truncated": true).
 *
 *   loadgen hold --target H:P [--socks H:P] --conns N [--inflight 256]
 *                [--payload 16] [--hold-seconds 60] [--timeout-ms 10000]
 *       Opens N tunnels (at most --inflight handshakes at a time), sends
 *       --payload bytes on each and waits for tinyserver --idle to echo them,
 *       prints one JSON line, then holds every tunnel open until stdin reaches
 *       EOF (or a line arrives) or --hold-seconds pass, prints a second JSON
 *       line (how many tunnels were still open) and exits.
 *
 * --http H:P instead of --socks H:P goes through an HTTP proxy: each connection
 * sends "CONNECT <target> HTTP/1.1" with a Host header, reads the proxy's head
 * up to the blank line (a 2xx status, nothing after the head: the target never
 * speaks first here) and then runs the same exchange as above.
 *
 * rate and bulk run T epoll threads (default 1), the connections split evenly
 * between them, so the generator can use more than one core; the results are
 * merged.  Every mode prints JSON on stdout and is bounded in count and time.
 * Build: cc -O2 -pthread -o loadgen loadgen.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BIG_BUF (256 * 1024)

enum mode { M_RATE, M_BULK, M_HOLD };
enum state {
    S_FREE,
    S_CONNECTING,
    S_GREET,      /* waiting for the 2-byte method selection */
    S_REPLY,      /* waiting for the CONNECT reply */
    S_HTTP_HEAD,  /* HTTP CONNECT: reading the proxy's response head */
    S_RESP,       /* rate: reading the response until EOF */
    S_UP_SEND,    /* bulk upload: sending */
    S_UP_ACK,     /* bulk upload: waiting for the 8-byte ack */
    S_DOWN,       /* bulk download: reading until EOF */
    S_ECHO,       /* hold: waiting for the echo */
    S_HELD        /* hold: established, idle */
};

enum err {
    E_CONNECT, E_SOCKS_METHOD, E_SOCKS_REPLY, E_SHORT, E_TIMEOUT, E_IO, E_DROPPED, E_HTTP_REPLY,
    E_N
};
static const char *err_names[E_N] = {"connect", "socks_method", "socks_reply", "short_response",
                                     "timeout", "io",           "dropped",     "http_reply"};

typedef struct conn {
    int fd;
    int idx;
    enum state state;
    uint64_t t0;         /* ns, just before connect() */
    uint64_t deadline;   /* ns, per-connection timeout */
    uint32_t rlen;       /* bytes of the current small reply read so far */
    uint32_t need;       /* bytes of the current small reply needed */
    uint64_t left;       /* bulk: bytes still to send/receive */
    uint64_t moved;      /* bytes of payload moved on this connection */
    unsigned char rbuf[1024]; /* small replies; an HTTP CONNECT response head */
} conn;

/* Options */
static enum mode g_mode;
static struct sockaddr_in g_target, g_socks; /* g_socks: the proxy, SOCKS5 or HTTP */
static int g_use_socks, g_use_http;
static char g_connect_req[160]; /* the HTTP CONNECT request */
static size_t g_connect_len;
static int g_conc = 1;
static double g_duration = 5, g_warmup = 0;
static uint64_t g_count;
static uint32_t g_req = 100, g_resp = 1024;
static int g_timeout_ms = 5000;
static uint64_t g_bytes = 1ull << 30;
static int g_up = 1;
static double g_max_seconds = 60;
static size_t g_buf = BIG_BUF;
static int g_inflight = 256;
static uint32_t g_payload = 16;
static double g_hold_seconds = 60;
static double g_rate; /* rate mode: new connections/s over all threads; 0 = closed loop */
static char **g_hosts; /* --hosts: Host header names, read-only once loaded */
static size_t g_nhosts;

/* Per-thread state (rate and bulk can run --threads epoll loops; each owns
 * its connections, buffers and results, merged by main at the end). */
#define TLS __thread
static TLS int g_ep;
static TLS conn *g_conns;
static TLS int g_nconns;
static TLS char *g_big;
static TLS char *g_reqbuf;
static TLS size_t g_host_next; /* the next of g_hosts this thread names */
static TLS uint64_t g_errs[E_N];
static TLS int g_first_errno[E_N];
static TLS uint64_t *g_lat;
static TLS size_t g_nlat, g_caplat;
static TLS uint64_t g_started, g_done, g_warm_done;
static TLS int g_active;
static TLS uint64_t g_paced_no_slot;

/* Shared, written before the threads start */
static int g_threads = 1;
static uint64_t g_start_ns;      /* common start of every thread */
static uint64_t g_measure_from;  /* ns: latencies of conns started before are warmup */

typedef struct result {
    int conc;            /* connections (slots) of this thread */
    int tid;             /* thread index */
    uint64_t paced_no_slot;
    uint64_t *lat;
    size_t nlat;
    uint64_t done, warm_done, moved;
    uint64_t errs[E_N];
    int first_errno[E_N];
    int unfinished, truncated;
    uint64_t end_ns;
} result;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "loadgen: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void parse_hostport(const char *s, struct sockaddr_in *sa) {
    char host[64];
    const char *colon = strrchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof host) {
        fprintf(stderr, "loadgen: bad HOST:PORT %s\n", s);
        exit(2);
    }
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
        fprintf(stderr, "loadgen: bad IPv4 address %s\n", host);
        exit(2);
    }
}

static void record_lat(uint64_t ns) {
    if (g_nlat == g_caplat) {
        g_caplat = g_caplat ? g_caplat * 2 : 65536;
        g_lat = realloc(g_lat, g_caplat * sizeof *g_lat);
        if (!g_lat) die("realloc");
    }
    g_lat[g_nlat++] = ns;
}

static void set_events(conn *c, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.u32 = (uint32_t)c->idx};
    if (epoll_ctl(g_ep, EPOLL_CTL_MOD, c->fd, &ev) < 0) die("epoll_ctl MOD");
}

static void close_conn(conn *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->state = S_FREE;
    g_active--;
}

static void fail(conn *c, enum err e, int errnum) {
    g_errs[e]++;
    if (!g_first_errno[e]) g_first_errno[e] = errnum ? errnum : -1;
    close_conn(c);
}

static int start_conn(conn *c) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        g_errs[E_CONNECT]++;
        if (!g_first_errno[E_CONNECT]) g_first_errno[E_CONNECT] = errno;
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    c->t0 = now_ns();
    c->deadline = c->t0 + (uint64_t)g_timeout_ms * 1000000ull;
    c->rlen = c->need = 0;
    c->moved = 0;
    c->left = 0;
    c->state = S_CONNECTING;
    g_active++;
    g_started++;
    struct sockaddr_in *sa = (g_use_socks || g_use_http) ? &g_socks : &g_target;
    int rc = connect(fd, (struct sockaddr *)sa, sizeof *sa);
    if (rc < 0 && errno != EINPROGRESS) {
        fail(c, E_CONNECT, errno);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLOUT, .data.u32 = (uint32_t)c->idx};
    if (epoll_ctl(g_ep, EPOLL_CTL_ADD, fd, &ev) < 0) die("epoll_ctl ADD");
    return 0;
}

/* Writes a small message in one go; sockets just connected always take it. */
static int send_small(conn *c, const void *buf, size_t len) {
    size_t off = 0;
    while (off < len) {
        ssize_t n = send(c->fd, (const char *)buf + off, len - off, MSG_NOSIGNAL);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {.fd = c->fd, .events = POLLOUT};
            poll(&p, 1, 100);
            continue;
        }
        return -1;
    }
    return 0;
}

/* Reads into rbuf until `need` bytes are there: 1 done, 0 more to come, -1 EOF/error. */
static int read_small(conn *c) {
    while (c->rlen < c->need) {
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->need - c->rlen, 0);
        if (n > 0) {
            c->rlen += (uint32_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (n == 0) errno = 0;
        return -1;
    }
    return 1;
}

/* read_small for a reply that ends an exchange: 1 complete, 0 not yet or
 * failed (counted as E_SHORT, closed). */
static int read_reply(conn *c) {
    int r = read_small(c);
    if (r < 0) fail(c, E_SHORT, errno);
    return r > 0;
}

/* A measured exchange completed: its latency counts and the connection closes. */
static void conn_done(conn *c) {
    record_lat(now_ns() - c->t0);
    g_done++;
    close_conn(c);
}

/* epoll_wait on this thread's set; EINTR counts as no event, other errors are fatal. */
static int wait_events(struct epoll_event *evs, int max, int timeout_ms) {
    int n = epoll_wait(g_ep, evs, max, timeout_ms);
    if (n >= 0) return n;
    if (errno != EINTR) die("epoll_wait");
    return 0;
}

static void app_start(conn *c);

static void on_connected(conn *c) {
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) {
        fail(c, E_CONNECT, err);
        return;
    }
    if (g_use_socks) {
        static const unsigned char greet[3] = {5, 1, 0};
        if (send_small(c, greet, 3) < 0) {
            fail(c, E_IO, errno);
            return;
        }
        c->state = S_GREET;
        c->rlen = 0;
        c->need = 2;
        set_events(c, EPOLLIN);
        return;
    }
    if (g_use_http) {
        if (send_small(c, g_connect_req, g_connect_len) < 0) {
            fail(c, E_IO, errno);
            return;
        }
        c->state = S_HTTP_HEAD;
        c->rlen = 0;
        set_events(c, EPOLLIN);
        return;
    }
    app_start(c);
}

/* HTTP CONNECT: read the proxy's response head up to the blank line; a 2xx
 * status opens the tunnel.  Bytes after the head are a protocol error (the
 * target never speaks first in any mode), so is a head that does not fit. */
static void on_http_head(conn *c) {
    for (;;) {
        size_t room = sizeof c->rbuf - 1 - c->rlen;
        if (room == 0) {
            fail(c, E_HTTP_REPLY, 0);
            return;
        }
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, room, 0);
        if (n > 0) {
            c->rlen += (uint32_t)n;
            c->rbuf[c->rlen] = 0;
            char *end = strstr((char *)c->rbuf, "\r\n\r\n");
            if (!end) continue;
            int ok = c->rlen >= 12 && !memcmp(c->rbuf, "HTTP/1.", 7) && c->rbuf[8] == ' ' &&
                     c->rbuf[9] == '2';
            if (!ok || (size_t)(end + 4 - (char *)c->rbuf) != c->rlen) {
                fail(c, E_HTTP_REPLY, 0);
                return;
            }
            app_start(c);
            return;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        fail(c, E_HTTP_REPLY, n < 0 ? errno : 0);
        return;
    }
}

static void on_greet(conn *c) {
    int r = read_small(c);
    if (r == 0) return;
    if (r < 0) {
        fail(c, E_SOCKS_METHOD, errno);
        return;
    }
    if (c->rbuf[0] != 5 || c->rbuf[1] != 0) {
        fail(c, E_SOCKS_METHOD, 0);
        return;
    }
    unsigned char req[10] = {5, 1, 0, 1};
    memcpy(req + 4, &g_target.sin_addr, 4);
    memcpy(req + 8, &g_target.sin_port, 2);
    if (send_small(c, req, sizeof req) < 0) {
        fail(c, E_IO, errno);
        return;
    }
    c->state = S_REPLY;
    c->rlen = 0;
    c->need = 5; /* up to the first byte of the bound address */
}

static void on_reply(conn *c) {
    for (;;) {
        int r = read_small(c);
        if (r == 0) return;
        if (r < 0) {
            fail(c, E_SOCKS_REPLY, errno);
            return;
        }
        if (c->need == 5) {
            if (c->rbuf[0] != 5 || c->rbuf[1] != 0) {
                fail(c, E_SOCKS_REPLY, 0);
                return;
            }
            switch (c->rbuf[3]) {
            case 1: c->need = 10; break;
            case 4: c->need = 22; break;
            case 3: c->need = 7 + c->rbuf[4]; break;
            default: fail(c, E_SOCKS_REPLY, 0); return;
            }
            if (c->rlen >= c->need) break;
            continue;
        }
        break;
    }
    app_start(c);
}

/* The rate request naming the next --hosts name: "GET / HTTP/1.1", its Host,
 * an X-Pad header filling it to --req bytes (longer when the name needs it);
 * its length.  g_reqbuf has room for --req or 512 bytes, whichever is more. */
static size_t host_request(void) {
    const char *name = g_hosts[g_host_next++ % g_nhosts];
    int n = snprintf(g_reqbuf, 512, "GET / HTTP/1.1\r\nHost: %.300s\r\nX-Pad: ", name);
    size_t len = (size_t)n;
    if (len + 4 < g_req) {
        memset(g_reqbuf + len, 'p', g_req - len - 4);
        len = g_req - 4;
    }
    memcpy(g_reqbuf + len, "\r\n\r\n", 4);
    return len + 4;
}

static void app_start(conn *c) {
    switch (g_mode) {
    case M_RATE:
        if (send_small(c, g_reqbuf, g_nhosts ? host_request() : g_req) < 0) {
            fail(c, E_IO, errno);
            return;
        }
        c->state = S_RESP;
        c->moved = 0;
        set_events(c, EPOLLIN);
        return;
    case M_BULK: {
        unsigned char hdr[16] = {'S', 'W', 'B', '1', g_up ? 'U' : 'D'};
        for (int i = 0; i < 8; i++) hdr[8 + i] = (unsigned char)(g_bytes >> (8 * i));
        if (send_small(c, hdr, sizeof hdr) < 0) {
            fail(c, E_IO, errno);
            return;
        }
        c->left = g_bytes;
        c->moved = 0;
        if (g_up) {
            c->state = S_UP_SEND;
            set_events(c, EPOLLOUT);
        } else {
            c->state = S_DOWN;
            set_events(c, EPOLLIN);
        }
        return;
    }
    case M_HOLD: {
        memset(g_reqbuf, 'h', g_payload);
        if (send_small(c, g_reqbuf, g_payload) < 0) {
            fail(c, E_IO, errno);
            return;
        }
        c->state = S_ECHO;
        c->rlen = 0;
        c->need = g_payload < sizeof c->rbuf ? g_payload : sizeof c->rbuf;
        set_events(c, EPOLLIN);
        return;
    }
    }
}

/* Reads (and counts in c->moved) until EOF: 1 at EOF, 0 more to come, -1 failed (closed). */
static int drain_to_eof(conn *c) {
    for (;;) {
        ssize_t n = recv(c->fd, g_big, g_buf, 0);
        if (n > 0) {
            c->moved += (uint64_t)n;
            continue;
        }
        if (n == 0) return 1;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        fail(c, E_IO, errno);
        return -1;
    }
}

static void on_resp(conn *c) {
    if (drain_to_eof(c) <= 0) return;
    if (c->moved != g_resp) {
        fail(c, E_SHORT, 0);
        return;
    }
    if (c->t0 >= g_measure_from) {
        conn_done(c);
        return;
    }
    g_warm_done++;
    close_conn(c);
}

static void on_up_send(conn *c) {
    while (c->left > 0) {
        size_t want = c->left < g_buf ? (size_t)c->left : g_buf;
        ssize_t n = send(c->fd, g_big, want, MSG_NOSIGNAL);
        if (n > 0) {
            c->left -= (uint64_t)n;
            c->moved += (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        fail(c, E_IO, errno);
        return;
    }
    c->state = S_UP_ACK;
    c->rlen = 0;
    c->need = 8;
    set_events(c, EPOLLIN);
}

static void on_up_ack(conn *c) {
    if (read_reply(c)) conn_done(c);
}

static void on_down(conn *c) {
    if (drain_to_eof(c) <= 0) return;
    if (c->moved != g_bytes) {
        fail(c, E_SHORT, 0);
        return;
    }
    conn_done(c);
}

static TLS uint64_t g_established, g_dropped;

static void on_echo(conn *c) {
    if (!read_reply(c)) return;
    record_lat(now_ns() - c->t0);
    g_established++;
    c->state = S_HELD;
    /* stays registered for EPOLLIN: a tunnel the proxy drops is noticed */
}

static void on_held(conn *c) {
    char buf[512];
    ssize_t n = recv(c->fd, buf, sizeof buf, 0);
    if (n > 0) return; /* unexpected bytes: ignore */
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    g_dropped++;
    g_established--;
    fail(c, E_DROPPED, n < 0 ? errno : 0);
}

static void dispatch(conn *c) {
    switch (c->state) {
    case S_CONNECTING: on_connected(c); break;
    case S_GREET: on_greet(c); break;
    case S_REPLY: on_reply(c); break;
    case S_HTTP_HEAD: on_http_head(c); break;
    case S_RESP: on_resp(c); break;
    case S_UP_SEND: on_up_send(c); break;
    case S_UP_ACK: on_up_ack(c); break;
    case S_DOWN: on_down(c); break;
    case S_ECHO: on_echo(c); break;
    case S_HELD: on_held(c); break;
    default: break;
    }
}

static void check_timeouts(uint64_t now) {
    for (int i = 0; i < g_nconns; i++) {
        conn *c = &g_conns[i];
        if (c->state == S_FREE || c->state == S_HELD) continue;
        if (now > c->deadline) fail(c, E_TIMEOUT, ETIMEDOUT);
    }
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double pct_us(double p) {
    if (!g_nlat) return 0;
    size_t i = (size_t)(p * (double)(g_nlat - 1) + 0.5);
    return (double)g_lat[i] / 1000.0;
}

static void print_errors(void) {
    printf("\"errors\": {");
    for (int e = 0; e < E_N; e++)
        printf("%s\"%s\": %llu", e ? ", " : "", err_names[e], (unsigned long long)g_errs[e]);
    printf("}, \"first_errors\": {");
    int first = 1;
    for (int e = 0; e < E_N; e++) {
        if (!g_first_errno[e]) continue;
        printf("%s\"%s\": \"%s\"", first ? "" : ", ", err_names[e],
               g_first_errno[e] > 0 ? strerror(g_first_errno[e]) : "protocol");
        first = 0;
    }
    printf("}");
}

static void print_latency(void) {
    qsort(g_lat, g_nlat, sizeof *g_lat, cmp_u64);
    double sum = 0;
    for (size_t i = 0; i < g_nlat; i++) sum += (double)g_lat[i];
    printf("\"lat_us\": {\"n\": %zu, \"mean\": %.1f, \"p50\": %.1f, \"p90\": %.1f, "
           "\"p99\": %.1f, \"p999\": %.1f, \"max\": %.1f}",
           g_nlat, g_nlat ? sum / (double)g_nlat / 1000.0 : 0.0, pct_us(0.5), pct_us(0.9),
           pct_us(0.99), pct_us(0.999), g_nlat ? (double)g_lat[g_nlat - 1] / 1000.0 : 0.0);
}

/* Ends a JSON result line: latency, errors, and (with_cpu) this process's CPU seconds. */
static void print_tail(int with_cpu) {
    print_latency();
    printf(", ");
    print_errors();
    if (with_cpu) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        printf(", \"cpu_s\": %.3f",
               ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
                   ru.ru_stime.tv_usec / 1e6);
    }
    printf("}\n");
}

static void setup(int nconns) {
    g_nconns = nconns;
    g_conns = calloc((size_t)nconns, sizeof *g_conns);
    for (int i = 0; i < nconns; i++) {
        g_conns[i].fd = -1;
        g_conns[i].idx = i;
        g_conns[i].state = S_FREE;
    }
    g_ep = epoll_create1(EPOLL_CLOEXEC);
    if (g_ep < 0) die("epoll_create1");
    g_big = malloc(g_buf);
    memset(g_big, 'u', g_buf);
    size_t rq = g_req > g_payload ? g_req : g_payload;
    if (rq < 512)
        rq = 512; /* host_request's room */
    g_reqbuf = malloc(rq + 1);
    memset(g_reqbuf, 'q', rq);
    /* The request looks like what a client sends through a proxy: an HTTP/1.1
     * GET, padded to --req bytes with a header (a proxy that sniffs for a Host
     * finds one at once instead of waiting for more bytes). */
    static const char head[] = "GET / HTTP/1.1\r\nHost: bench.local\r\nX-Pad: ";
    size_t hl = sizeof head - 1;
    if (g_req >= hl + 4) {
        memcpy(g_reqbuf, head, hl);
        memset(g_reqbuf + hl, 'p', g_req - hl - 4);
        memcpy(g_reqbuf + g_req - 4, "\r\n\r\n", 4);
    }
}

static void save_result(result *r, int unfinished, int truncated, uint64_t end) {
    r->lat = g_lat;
    r->nlat = g_nlat;
    r->done = g_done;
    r->warm_done = g_warm_done;
    r->moved = 0;
    for (int i = 0; i < g_nconns; i++) r->moved += g_conns[i].moved;
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].state != S_FREE) fail(&g_conns[i], E_TIMEOUT, ETIMEDOUT);
    memcpy(r->errs, g_errs, sizeof g_errs);
    memcpy(r->first_errno, g_first_errno, sizeof g_first_errno);
    r->unfinished = unfinished;
    r->truncated = truncated;
    r->paced_no_slot = g_paced_no_slot;
    r->end_ns = end;
}

static void *rate_worker(void *arg) {
    result *res = arg;
    int conc = res->conc;
    setup(conc);
    /* Threads name different hosts at any one time. */
    g_host_next = g_nhosts ? (size_t)res->tid * (g_nhosts / (size_t)g_threads + 1) : 0;
    struct epoll_event evs[1024];
    uint64_t start = g_start_ns;
    uint64_t stop_at = g_measure_from + (uint64_t)(g_duration * 1e9);
    uint64_t hard_stop = stop_at + (uint64_t)g_timeout_ms * 1000000ull + 1000000000ull;
    uint64_t count = g_count ? (g_count + (uint64_t)g_threads - 1) / (uint64_t)g_threads : 0;
    uint64_t last_scan = start;
    int stopping = 0;
    uint64_t measured_started = 0;
    /* paced: this thread's share of --rate, its starts staggered against the others' */
    int paced = g_rate > 0;
    uint64_t interval = paced ? (uint64_t)(1e9 * (double)g_threads / g_rate) : 0;
    uint64_t next_due = start + (paced ? (uint64_t)(1e9 * (double)res->tid / g_rate) : 0);
    int hint = 0;
    uint64_t blocked_due = 0; /* the due time already counted in paced_no_slot */
    for (int i = 0; i < conc && !paced; i++) {
        if (g_measure_from <= now_ns()) measured_started++;
        start_conn(&g_conns[i]);
    }
    for (;;) {
        uint64_t now = now_ns();
        if (!stopping && (now >= stop_at || (count && measured_started >= count))) stopping = 1;
        if (stopping && g_active == 0) break;
        if (now > hard_stop) break;
        if (paced && !stopping) {
            /* start every connection that is due (a late loop catches up) */
            while (next_due <= now && !(count && measured_started >= count) && next_due < stop_at) {
                int slot = -1;
                for (int k = 0; k < conc; k++) {
                    int i = (hint + k) % conc;
                    if (g_conns[i].state == S_FREE) {
                        slot = i;
                        break;
                    }
                }
                if (slot < 0) {
                    if (blocked_due != next_due) g_paced_no_slot++; /* once per start */
                    blocked_due = next_due;
                    break; /* stays due; started when a slot frees */
                }
                hint = (slot + 1) % conc;
                if (now >= g_measure_from) measured_started++;
                start_conn(&g_conns[slot]);
                next_due += interval;
            }
        }
        int wait_ms = 50;
        if (paced && !stopping && next_due > now) {
            uint64_t ms = (next_due - now + 999999) / 1000000; /* round up: never early */
            if (ms < (uint64_t)wait_ms) wait_ms = (int)ms;
        } else if (paced && !stopping) {
            wait_ms = 1; /* due but no free slot: look again soon */
        }
        int n = wait_events(evs, 1024, wait_ms);
        now = now_ns();
        for (int i = 0; i < n; i++) dispatch(&g_conns[evs[i].data.u32]);
        if (now - last_scan > 100000000ull) {
            check_timeouts(now);
            last_scan = now;
        }
        if (!stopping && !paced) {
            for (int i = 0; i < conc; i++) {
                if (g_conns[i].state != S_FREE) continue;
                if (count && measured_started >= count) break;
                if (now_ns() >= g_measure_from) measured_started++;
                start_conn(&g_conns[i]);
            }
        }
    }
    save_result(res, g_active, 0, now_ns());
    return NULL;
}

static void *bulk_worker(void *arg) {
    result *res = arg;
    setup(res->conc);
    struct epoll_event evs[256];
    uint64_t start = g_start_ns;
    uint64_t hard_stop = start + (uint64_t)(g_max_seconds * 1e9);
    uint64_t last_scan = start;
    for (int i = 0; i < res->conc; i++) start_conn(&g_conns[i]);
    int truncated = 0;
    while (g_active > 0) {
        uint64_t now = now_ns();
        if (now > hard_stop) {
            truncated = 1;
            break;
        }
        int n = wait_events(evs, 256, 50);
        for (int i = 0; i < n; i++) dispatch(&g_conns[evs[i].data.u32]);
        now = now_ns();
        if (now - last_scan > 100000000ull) {
            /* bulk connections only time out in their handshake phases */
            for (int i = 0; i < g_nconns; i++) {
                conn *c = &g_conns[i];
                if ((c->state == S_CONNECTING || c->state == S_GREET || c->state == S_REPLY ||
                     c->state == S_HTTP_HEAD) &&
                    now > c->deadline)
                    fail(c, E_TIMEOUT, ETIMEDOUT);
            }
            last_scan = now;
        }
    }
    save_result(res, g_active, truncated, now_ns());
    return NULL;
}

/* Runs `worker` on --threads threads (connections split evenly), then merges
 * their results into the calling thread's state for printing. */
static void run_threads(void *(*worker)(void *), result *merged) {
    int nt = g_threads < g_conc ? g_threads : g_conc;
    if (nt < 1) nt = 1;
    g_threads = nt;
    result *rs = calloc((size_t)nt, sizeof *rs);
    pthread_t *th = calloc((size_t)nt, sizeof *th);
    for (int t = 0; t < nt; t++) {
        rs[t].conc = g_conc / nt + (t < g_conc % nt ? 1 : 0);
        rs[t].tid = t;
    }
    g_start_ns = now_ns();
    g_measure_from = g_start_ns + (uint64_t)(g_warmup * 1e9);
    for (int t = 1; t < nt; t++)
        if (pthread_create(&th[t], NULL, worker, &rs[t]) != 0) die("pthread_create");
    worker(&rs[0]);
    for (int t = 1; t < nt; t++) pthread_join(th[t], NULL);
    /* merge into this thread's state */
    g_nlat = 0;
    for (int t = 0; t < nt; t++) g_nlat += rs[t].nlat;
    uint64_t *all = malloc((g_nlat ? g_nlat : 1) * sizeof *all);
    size_t off = 0;
    memset(merged, 0, sizeof *merged);
    memset(g_errs, 0, sizeof g_errs);
    memset(g_first_errno, 0, sizeof g_first_errno);
    for (int t = 0; t < nt; t++) {
        if (rs[t].nlat) memcpy(all + off, rs[t].lat, rs[t].nlat * sizeof *all);
        off += rs[t].nlat;
        merged->done += rs[t].done;
        merged->warm_done += rs[t].warm_done;
        merged->moved += rs[t].moved;
        merged->unfinished += rs[t].unfinished;
        merged->truncated |= rs[t].truncated;
        merged->paced_no_slot += rs[t].paced_no_slot;
        if (rs[t].end_ns > merged->end_ns) merged->end_ns = rs[t].end_ns;
        for (int e = 0; e < E_N; e++) {
            g_errs[e] += rs[t].errs[e];
            if (!g_first_errno[e]) g_first_errno[e] = rs[t].first_errno[e];
        }
    }
    g_lat = all;
    g_done = merged->done;
}

static const char *proxy_kind(void) {
    return g_use_socks ? "socks5" : g_use_http ? "http" : "none";
}

static int run_rate(void) {
    result m;
    run_threads(rate_worker, &m);
    double measured_s = (double)(m.end_ns - g_measure_from) / 1e9;
    printf("{\"mode\": \"rate\", \"socks\": %s, \"proxy\": \"%s\", \"conc\": %d, \"threads\": %d, \"count\": %llu, "
           "\"warmup_count\": %llu, \"seconds\": %.3f, \"conn_per_s\": %.1f, \"unfinished\": %d, ",
           g_use_socks ? "true" : "false", proxy_kind(), g_conc, g_threads,
           (unsigned long long)m.done,
           (unsigned long long)m.warm_done, measured_s,
           measured_s > 0 ? (double)m.done / measured_s : 0.0, m.unfinished);
    if (g_rate > 0)
        printf("\"paced_rate\": %.1f, \"paced_no_slot\": %llu, ", g_rate,
               (unsigned long long)m.paced_no_slot);
    print_tail(1);
    return 0;
}

static int run_bulk(void) {
    result m;
    run_threads(bulk_worker, &m);
    double secs = (double)(m.end_ns - g_start_ns) / 1e9;
    printf("{\"mode\": \"bulk\", \"socks\": %s, \"proxy\": \"%s\", \"dir\": \"%s\", \"conns\": %d, \"threads\": %d, "
           "\"bytes_per_conn\": %llu, \"completed\": %llu, \"bytes\": %llu, \"seconds\": %.4f, "
           "\"mb_per_s\": %.1f, \"truncated\": %s, ",
           g_use_socks ? "true" : "false", proxy_kind(), g_up ? "up" : "down", g_conc, g_threads,
           (unsigned long long)g_bytes, (unsigned long long)m.done, (unsigned long long)m.moved,
           secs, secs > 0 ? (double)m.moved / secs / 1e6 : 0.0, m.truncated ? "true" : "false");
    print_tail(1);
    return 0;
}

static int run_hold(void) {
    setup(g_conc);
    struct epoll_event evs[1024];
    uint64_t start = now_ns();
    uint64_t open_stop = start + (uint64_t)g_timeout_ms * 1000000ull * 6; /* whole ramp bound */
    uint64_t last_scan = start;
    int next = 0;
    for (;;) {
        uint64_t now = now_ns();
        /* open connections not yet established (in their handshake or echo) */
        int inflight = g_active - (int)g_established;
        if (next == g_nconns && inflight == 0) break;
        if (now > open_stop) break;
        while (next < g_nconns && inflight < g_inflight) {
            start_conn(&g_conns[next++]);
            inflight++;
        }
        int n = wait_events(evs, 1024, 20);
        for (int i = 0; i < n; i++) dispatch(&g_conns[evs[i].data.u32]);
        now = now_ns();
        if (now - last_scan > 100000000ull) {
            check_timeouts(now);
            last_scan = now;
        }
    }
    double ramp = (double)(now_ns() - start) / 1e9;
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].state != S_FREE && g_conns[i].state != S_HELD)
            fail(&g_conns[i], E_TIMEOUT, ETIMEDOUT);
    printf("{\"mode\": \"hold\", \"phase\": \"established\", \"socks\": %s, \"proxy\": \"%s\", "
           "\"conns\": %d, \"established\": %llu, \"ramp_seconds\": %.3f, ",
           g_use_socks ? "true" : "false", proxy_kind(), g_nconns,
           (unsigned long long)g_established, ramp);
    print_tail(0);
    fflush(stdout);

    /* Hold: until stdin has a line or EOF, or --hold-seconds pass. */
    /* (stdin that epoll cannot watch, e.g. a regular file: only --hold-seconds ends it) */
    struct epoll_event sev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    epoll_ctl(g_ep, EPOLL_CTL_ADD, 0, &sev);
    uint64_t hold_end = now_ns() + (uint64_t)(g_hold_seconds * 1e9);
    int done = 0;
    while (!done && now_ns() < hold_end) {
        int n = wait_events(evs, 1024, 100);
        for (int i = 0; i < n; i++) {
            if (evs[i].data.u32 == UINT32_MAX) {
                done = 1;
                continue;
            }
            dispatch(&g_conns[evs[i].data.u32]);
        }
    }
    printf("{\"mode\": \"hold\", \"phase\": \"released\", \"still_open\": %llu, \"dropped\": %llu, "
           "\"held_seconds\": %.3f}\n",
           (unsigned long long)g_established, (unsigned long long)g_dropped,
           (double)(now_ns() - start) / 1e9 - ramp);
    fflush(stdout);
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].fd >= 0) close(g_conns[i].fd);
    return 0;
}

/* --hosts FILE: one name a line (empty lines skipped), at most 300 bytes each. */
static void load_hosts(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) die("--hosts");
    char line[512];
    size_t cap = 0;
    while (fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\r\n");
        if (!n || n > 300) continue;
        line[n] = 0;
        if (g_nhosts == cap) {
            cap = cap ? cap * 2 : 1024;
            g_hosts = realloc(g_hosts, cap * sizeof *g_hosts);
            if (!g_hosts) die("realloc");
        }
        g_hosts[g_nhosts] = strdup(line);
        if (!g_hosts[g_nhosts++]) die("strdup");
    }
    fclose(f);
    if (!g_nhosts) {
        fprintf(stderr, "loadgen: no host in %s\n", path);
        exit(2);
    }
}

static void usage(void) {
    fprintf(stderr,
            "usage: loadgen rate|bulk|hold --target H:P [--socks H:P | --http H:P] [options]\n"
            "  rate: --conc N --duration S [--count N] [--warmup S] [--req B] [--resp B]\n"
            "        [--timeout-ms MS] [--threads T] [--rate CONN_PER_S] [--hosts FILE]\n"
            "  bulk: --conns N --bytes B --dir up|down [--max-seconds S] [--buf B] [--threads T]\n"
            "  hold: --conns N [--inflight N] [--payload B] [--hold-seconds S] [--timeout-ms MS]\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    if (!strcmp(argv[1], "rate")) g_mode = M_RATE;
    else if (!strcmp(argv[1], "bulk")) g_mode = M_BULK;
    else if (!strcmp(argv[1], "hold")) g_mode = M_HOLD;
    else usage();
    int have_target = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--target")) {
            parse_hostport(v, &g_target);
            have_target = 1;
        } else if (!strcmp(a, "--socks")) {
            parse_hostport(v, &g_socks);
            g_use_socks = 1;
        } else if (!strcmp(a, "--http")) {
            parse_hostport(v, &g_socks);
            g_use_http = 1;
        } else if (!strcmp(a, "--conc") || !strcmp(a, "--conns")) g_conc = atoi(v);
        else if (!strcmp(a, "--duration")) g_duration = atof(v);
        else if (!strcmp(a, "--warmup")) g_warmup = atof(v);
        else if (!strcmp(a, "--count")) g_count = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--req")) g_req = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--resp")) g_resp = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--timeout-ms")) g_timeout_ms = atoi(v);
        else if (!strcmp(a, "--bytes")) g_bytes = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--dir")) g_up = !strcmp(v, "up");
        else if (!strcmp(a, "--max-seconds")) g_max_seconds = atof(v);
        else if (!strcmp(a, "--buf")) g_buf = (size_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--inflight")) g_inflight = atoi(v);
        else if (!strcmp(a, "--payload")) g_payload = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--hold-seconds")) g_hold_seconds = atof(v);
        else if (!strcmp(a, "--threads")) g_threads = atoi(v);
        else if (!strcmp(a, "--rate")) g_rate = atof(v);
        else if (!strcmp(a, "--hosts")) load_hosts(v);
        else usage();
    }
    if (!have_target || (g_use_socks && g_use_http) || g_conc < 1 || g_buf < 4096 || g_inflight < 1 || g_threads < 1 ||
        g_threads > 64 || g_rate < 0 || g_rate > 1e7)
        usage();
    if (g_duration > 3600) g_duration = 3600;          /* always bounded */
    if (g_max_seconds > 3600) g_max_seconds = 3600;
    if (g_hold_seconds > 3600) g_hold_seconds = 3600;
    if (g_payload > 256) g_payload = 256;

    if (g_use_http) {
        char host[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &g_target.sin_addr, host, sizeof host);
        int port = ntohs(g_target.sin_port);
        g_connect_len = (size_t)snprintf(g_connect_req, sizeof g_connect_req,
                                         "CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n", host,
                                         port, host, port);
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    switch (g_mode) {
    case M_RATE: return run_rate();
    case M_BULK: return run_bulk();
    case M_HOLD: return run_hold();
    }
    return 0;
}
