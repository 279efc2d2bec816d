/*
 * hookserver: epoll webhook receiver for spliceway's connector benchmark.
 *
 *   hookserver [--port 0] [--status 200] [--seconds 600] [--ids FILE] [--tick-ms 1000]
 *
 * One thread, one epoll loop, any number of keep-alive HTTP/1.1 connections
 * on 127.0.0.1.  For each request it finds the end of the head (\r\n\r\n),
 * reads the body (Content-Length, or Transfer-Encoding: chunked; header names
 * case-insensitive) and answers
 *
 *     HTTP/1.1 <status> <reason>\r\nContent-Length: 0\r\n\r\n
 *
 * Pipelined requests that arrive in one read are answered together, in order,
 * with one write.  "Connection: close" (or HTTP/1.0 without keep-alive) closes
 * the connection after the answer.  The method and path are not checked.
 *
 * --port N     listen on 127.0.0.1:N (0 = a free port); prints "port <n>"
 *              on stdout (flushed) once listening.
 * --status C   the status code of every answer (default 200).
 * --seconds S  hard stop after S seconds (default 600).
 * --ids FILE   append the value of every "event_id":"..." found in a body
 *              (a plain substring scan), one per line, to FILE; flushed with
 *              every stats line and at exit.
 * --tick-ms N  print the stats line every N ms instead of once a second.
 *
 * Once a second (--tick-ms), and once more at exit, it prints on stdout
 *
 *     t=<ms since start> requests=<total> bytes=<total> body_bytes=<total>
 *       conns=<open> accepted=<total> ids=<total> bad=<total>
 *
 * (one line; bytes = every request byte read, heads included; bad = requests
 * it could not parse, answered 400 and closed).  The last line starts with
 * "final ".  SIGTERM/SIGINT, the parent's death or --seconds end it with exit
 * status 0.
 *
 * Build: cc -O2 -o hookserver hookserver.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD (64 * 1024)          /* a longer head is a bad request */
#define MAX_BODY (64u * 1024 * 1024)  /* a larger body is a bad request */
#define READ_CHUNK (64 * 1024)
#define MAX_EVENTS 256

typedef struct conn {
    int fd;
    int want_out;         /* EPOLLOUT registered */
    int close_after;      /* close once `out` is written */
    char *in;
    size_t in_len, in_cap;
    char *out;
    size_t out_len, out_off, out_cap;
} conn;

static volatile sig_atomic_t g_stop;
static int g_ep;
static char g_resp[128];
static size_t g_resp_len;
static FILE *g_ids;
static char *g_scratch; /* de-chunked body */
static size_t g_scratch_cap;
static unsigned long long g_requests, g_bytes, g_body_bytes, g_accepted, g_ids_n, g_bad;
static int g_open;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) die("realloc");
    return q;
}

static const char *reason(int code) {
    switch (code) {
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Status";
    }
}

/* ------------------------------------------------------------------ output */

static void out_append(conn *c, const char *p, size_t n) {
    if (c->out_len + n > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_len + n) cap *= 2;
        c->out = xrealloc(c->out, cap);
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, p, n);
    c->out_len += n;
}

static void set_events(conn *c, int want_out) {
    if (want_out == c->want_out) return;
    struct epoll_event ev = {.events = EPOLLIN | (want_out ? EPOLLOUT : 0), .data.ptr = c};
    if (epoll_ctl(g_ep, EPOLL_CTL_MOD, c->fd, &ev) < 0) die("epoll_ctl mod");
    c->want_out = want_out;
}

static void conn_close(conn *c) {
    close(c->fd); /* also leaves the epoll set */
    free(c->in);
    free(c->out);
    free(c);
    g_open--;
}

/* Write what is pending; 0 = fine (maybe waiting for EPOLLOUT), -1 = closed. */
static int flush_out(conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t n = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (n > 0) {
            c->out_off += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            set_events(c, 1);
            return 0;
        } else {
            conn_close(c);
            return -1;
        }
    }
    c->out_off = c->out_len = 0;
    if (c->close_after) {
        conn_close(c);
        return -1;
    }
    set_events(c, 0);
    return 0;
}

/* ------------------------------------------------------------------ parsing */

/* Every "event_id" : "VALUE" in body, appended to --ids. */
static void scan_ids(const char *body, size_t n) {
    static const char key[] = "\"event_id\"";
    const char *p = body, *end = body + n;
    while (p < end) {
        const char *k = memmem(p, (size_t)(end - p), key, sizeof key - 1);
        if (!k) return;
        p = k + sizeof key - 1;
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
        if (p >= end || *p != ':') continue;
        p++;
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
        if (p >= end || *p != '"') continue;
        const char *v = ++p;
        while (p < end && *p != '"') p++;
        if (p >= end) return;
        fwrite(v, 1, (size_t)(p - v), g_ids);
        fputc('\n', g_ids);
        g_ids_n++;
        p++;
    }
}

/* The value of header `name` (case-insensitive) in head[0..n), or NULL. */
static const char *header(const char *head, size_t n, const char *name, size_t *vlen) {
    size_t nl = strlen(name);
    const char *p = memchr(head, '\n', n); /* skip the request line */
    const char *end = head + n;
    while (p && p + 1 < end) {
        const char *line = p + 1;
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (!eol) eol = end;
        if ((size_t)(eol - line) > nl && line[nl] == ':' && strncasecmp(line, name, nl) == 0) {
            const char *v = line + nl + 1;
            const char *ve = eol;
            while (v < ve && (*v == ' ' || *v == '\t')) v++;
            while (ve > v && (ve[-1] == '\r' || ve[-1] == ' ' || ve[-1] == '\t')) ve--;
            *vlen = (size_t)(ve - v);
            return v;
        }
        p = eol < end ? eol : NULL;
    }
    return NULL;
}

static int has_token(const char *v, size_t n, const char *tok) {
    size_t tl = strlen(tok);
    for (size_t i = 0; i + tl <= n; i++)
        if (strncasecmp(v + i, tok, tl) == 0) return 1;
    return 0;
}

/* A chunked body starting at p (n bytes available).  Returns the bytes it
 * takes (trailers included) once complete, 0 if more bytes are needed, -1 if
 * malformed; the data goes to g_scratch (*data_len bytes). */
static long parse_chunked(const char *p, size_t n, size_t *data_len) {
    size_t off = 0, dl = 0;
    for (;;) {
        const char *eol = memmem(p + off, n - off, "\r\n", 2);
        if (!eol) return n - off > 1024 ? -1 : 0;
        char *endp;
        unsigned long long size = strtoull(p + off, &endp, 16);
        if (endp == p + off || (endp != eol && *endp != ';' && *endp != ' ')) return -1;
        if (size > MAX_BODY || dl + size > MAX_BODY) return -1;
        off = (size_t)(eol - p) + 2;
        if (size == 0) { /* trailers until an empty line */
            for (;;) {
                const char *t = memmem(p + off, n - off, "\r\n", 2);
                if (!t) return n - off > MAX_HEAD ? -1 : 0;
                size_t len = (size_t)(t - (p + off));
                off += len + 2;
                if (len == 0) {
                    *data_len = dl;
                    return (long)off;
                }
            }
        }
        if (n - off < size + 2) return 0;
        if (dl + size > g_scratch_cap) {
            size_t cap = g_scratch_cap ? g_scratch_cap : 65536;
            while (cap < dl + size) cap *= 2;
            g_scratch = xrealloc(g_scratch, cap);
            g_scratch_cap = cap;
        }
        memcpy(g_scratch + dl, p + off, size);
        dl += size;
        off += size;
        if (p[off] != '\r' || p[off + 1] != '\n') return -1;
        off += 2;
    }
}

/* Answer every complete request in c->in; returns -1 if the connection must
 * close after the answers already queued (bad request or Connection: close). */
static int handle_requests(conn *c) {
    size_t pos = 0;
    int rc = 0;
    while (pos < c->in_len) {
        const char *base = c->in + pos;
        size_t avail = c->in_len - pos;
        const char *hend = memmem(base, avail, "\r\n\r\n", 4);
        if (!hend) {
            if (avail > MAX_HEAD) rc = -2;
            break;
        }
        size_t head_len = (size_t)(hend - base) + 4;
        if (head_len > MAX_HEAD) {
            rc = -2;
            break;
        }
        size_t vlen;
        const char *v;
        size_t body_len = 0, consumed;
        const char *body = base + head_len;
        if ((v = header(base, head_len, "transfer-encoding", &vlen)) &&
            has_token(v, vlen, "chunked")) {
            long took = parse_chunked(body, avail - head_len, &body_len);
            if (took < 0) {
                rc = -2;
                break;
            }
            if (took == 0) break;
            consumed = head_len + (size_t)took;
            body = g_scratch;
        } else {
            if ((v = header(base, head_len, "content-length", &vlen))) {
                char num[32];
                if (vlen == 0 || vlen >= sizeof num) {
                    rc = -2;
                    break;
                }
                memcpy(num, v, vlen);
                num[vlen] = 0;
                char *endp;
                unsigned long long cl = strtoull(num, &endp, 10);
                if (*endp || cl > MAX_BODY) {
                    rc = -2;
                    break;
                }
                body_len = (size_t)cl;
            }
            if (avail - head_len < body_len) break;
            consumed = head_len + body_len;
        }
        g_requests++;
        g_bytes += consumed;
        g_body_bytes += body_len;
        if (g_ids && body_len) scan_ids(body, body_len);
        out_append(c, g_resp, g_resp_len);
        pos += consumed;
        /* keep-alive: HTTP/1.1 unless "Connection: close"; HTTP/1.0 only with keep-alive */
        const char *sp = memchr(base, '\n', head_len);
        int http10 = sp && sp - base >= 9 && memcmp(sp - 9, "HTTP/1.0", 8) == 0;
        v = header(base, head_len, "connection", &vlen);
        int keep = v ? !has_token(v, vlen, "close") && (!http10 || has_token(v, vlen, "keep-alive"))
                     : !http10;
        if (!keep) {
            rc = -1;
            break;
        }
    }
    if (rc == -2) {
        static const char bad[] =
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        g_bad++;
        out_append(c, bad, sizeof bad - 1);
        pos = c->in_len;
        rc = -1;
    }
    if (pos) {
        memmove(c->in, c->in + pos, c->in_len - pos);
        c->in_len -= pos;
    }
    return rc;
}

static void on_readable(conn *c) {
    if (c->close_after) return; /* answering its last requests, then closing */
    int eof = 0;
    for (;;) {
        if (c->in_cap - c->in_len < READ_CHUNK) {
            size_t cap = c->in_cap ? c->in_cap * 2 : 2 * READ_CHUNK;
            if (cap > MAX_BODY + MAX_HEAD + 2 * READ_CHUNK) {
                eof = 1; /* more than one request can hold: drop the client */
                break;
            }
            c->in = xrealloc(c->in, cap);
            c->in_cap = cap;
        }
        size_t space = c->in_cap - c->in_len;
        ssize_t n = read(c->fd, c->in + c->in_len, space);
        if (n > 0) {
            c->in_len += (size_t)n;
            if ((size_t)n < space) break; /* a short read: the socket is drained */
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        eof = 1; /* EOF or error: answer what it sent, then close */
        break;
    }
    if (handle_requests(c) < 0 || eof) c->close_after = 1;
    if (c->out_len) {
        flush_out(c); /* closes it when close_after is set and all is written */
    } else if (c->close_after) {
        conn_close(c);
    }
}

/* ------------------------------------------------------------------ main */

static void stats_line(double t0, const char *prefix) {
    printf("%st=%lld requests=%llu bytes=%llu body_bytes=%llu conns=%d accepted=%llu ids=%llu "
           "bad=%llu\n",
           prefix, (long long)((now_s() - t0) * 1000.0), g_requests, g_bytes, g_body_bytes,
           g_open, g_accepted, g_ids_n, g_bad);
    fflush(stdout);
    if (g_ids) fflush(g_ids);
}

static void usage(void) {
    fprintf(stderr, "usage: hookserver [--port N] [--status CODE] [--seconds S] [--ids FILE] "
                    "[--tick-ms N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int port = 0, status = 200;
    double seconds = 600, tick = 1.0;
    const char *ids = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--port")) port = atoi(v);
        else if (!strcmp(a, "--status")) status = atoi(v);
        else if (!strcmp(a, "--seconds")) seconds = atof(v);
        else if (!strcmp(a, "--ids")) ids = v;
        else if (!strcmp(a, "--tick-ms")) tick = atof(v) / 1000.0;
        else usage();
    }
    if (status < 100 || status > 999 || port < 0 || port > 65535 || seconds <= 0 || tick < 0.01)
        usage();
    g_resp_len = (size_t)snprintf(g_resp, sizeof g_resp,
                                  "HTTP/1.1 %d %s\r\nContent-Length: 0\r\n\r\n", status,
                                  reason(status));
    if (ids) {
        g_ids = fopen(ids, "a");
        if (!g_ids) die(ids);
        setvbuf(g_ids, NULL, _IOFBF, 1 << 20);
    }

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0) die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0) die("bind");
    if (listen(lfd, 4096) < 0) die("listen");
    socklen_t alen = sizeof addr;
    if (getsockname(lfd, (struct sockaddr *)&addr, &alen) < 0) die("getsockname");

    g_ep = epoll_create1(EPOLL_CLOEXEC);
    if (g_ep < 0) die("epoll_create1");
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(g_ep, EPOLL_CTL_ADD, lfd, &lev) < 0) die("epoll_ctl listener");

    double t0 = now_s(), deadline = t0 + seconds, next_tick = t0 + tick;
    printf("port %d\n", ntohs(addr.sin_port));
    fflush(stdout);

    struct epoll_event evs[MAX_EVENTS];
    while (!g_stop) {
        double now = now_s();
        if (now >= deadline) break;
        if (now >= next_tick) {
            stats_line(t0, "");
            while (next_tick <= now) next_tick += tick;
        }
        double wait = next_tick - now;
        int n = epoll_wait(g_ep, evs, MAX_EVENTS, (int)(wait * 1000.0) + 1);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            if (!c) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (fd < 0) break; /* EAGAIN, or out of fds: retried on the next event */
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn *nc = calloc(1, sizeof *nc);
                    if (!nc) die("calloc");
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    if (epoll_ctl(g_ep, EPOLL_CTL_ADD, fd, &ev) < 0) die("epoll_ctl add");
                    g_accepted++;
                    g_open++;
                }
                continue;
            }
            if (evs[i].events & EPOLLOUT) {
                if (flush_out(c) < 0) continue;
            }
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(c);
        }
    }
    stats_line(t0, "final ");
    if (g_ids) fclose(g_ids);
    return 0;
}
