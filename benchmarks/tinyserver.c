/*
 * tinyserver: epoll server for spliceway's end-to-end benchmarks.
 *
 * One process serves up to three listeners, each on 127.0.0.1 (or --bind):
 *
 *   --rate PORT  connection-rate server: read a --req byte request (default 100),
 *                write a --resp byte response (default 1024), close.
 *   --bulk PORT  bulk sink/source: the client sends a 16-byte header
 *                "SWB1" mode(1) pad(3) length(u64 little endian).
 *                mode 'U' (upload): read `length` bytes and discard them, then
 *                write an 8-byte acknowledgement (the count) and close.
 *                mode 'D' (download): write `length` bytes, then close.
 *   --idle PORT  idle flows: echo whatever arrives, never close first.
 *
 * --threads N runs N epoll loops sharing the listeners (default 1).
 * PORT 0 picks a free port.  After binding, one JSON line with the chosen
 * ports and the pid is printed on stdout.  The server stops on SIGTERM/SIGINT,
 * when its parent dies, or after --max-seconds (default 900): it is always
 * bounded in time.
 *
 * Build: cc -O2 -pthread -o tinyserver tinyserver.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

enum kind { L_RATE, L_BULK, L_IDLE, C_RATE, C_BULK, C_IDLE };

#define BULK_BUF (256 * 1024)
#define HDR_LEN 16

typedef struct conn {
    enum kind kind;
    int fd;
    int state;           /* bulk: 0 header, 1 upload, 2 download, 3 ack */
    uint32_t got;        /* rate: request bytes read; bulk: header bytes read */
    uint32_t sent;       /* rate: response bytes written; bulk: ack bytes written */
    uint64_t remaining;  /* bulk: bytes left to read or write */
    uint64_t total;
    unsigned char hdr[HDR_LEN];
} conn;

static volatile sig_atomic_t g_stop;
static __thread int g_ep;         /* each thread has its own epoll set */
static __thread char *g_bulk_buf; /* and its own bulk buffer */
static uint32_t g_req = 100, g_resp = 1024;
static char *g_resp_buf;
static double g_deadline;
static conn *g_listeners[3];
static int g_nlisteners;
/* statistics, updated atomically */
static uint64_t g_accepted, g_rate_done, g_bulk_done;
static int64_t g_idle_open;
#define INC(x) __atomic_add_fetch(&(x), 1, __ATOMIC_RELAXED)
#define DEC(x) __atomic_sub_fetch(&(x), 1, __ATOMIC_RELAXED)

static void on_signal(int sig) { (void)sig; g_stop = 1; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    fprintf(stderr, "tinyserver: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void listener(const char *addr, int port, enum kind kind, int *bound_port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1) {
        fprintf(stderr, "tinyserver: bad address %s\n", addr);
        exit(2);
    }
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) die("bind");
    if (listen(fd, 65535) < 0) die("listen");
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    *bound_port = ntohs(sa.sin_port);
    conn *c = calloc(1, sizeof *c);
    c->kind = kind;
    c->fd = fd;
    g_listeners[g_nlisteners++] = c;
}

static void close_conn(conn *c) {
    if (c->kind == C_IDLE) DEC(g_idle_open);
    close(c->fd); /* also removes it from the epoll set */
    free(c);
}

static void set_events(conn *c, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(g_ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static void do_accept(conn *l) {
    for (;;) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                static int warned;
                if (!warned++) fprintf(stderr, "tinyserver: accept: %s\n", strerror(errno));
            }
            return;
        }
        INC(g_accepted);
        conn *c = calloc(1, sizeof *c);
        c->fd = fd;
        c->kind = l->kind == L_RATE ? C_RATE : l->kind == L_BULK ? C_BULK : C_IDLE;
        if (c->kind == C_IDLE) INC(g_idle_open);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (epoll_ctl(g_ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
            close_conn(c);
            continue;
        }
    }
}

/* Writes buf[c->sent..len): 1 all written, 0 waiting for EPOLLOUT, -1 failed (closed). */
static int write_rest(conn *c, const void *buf, uint32_t len) {
    while (c->sent < len) {
        ssize_t n = write(c->fd, (const char *)buf + c->sent, len - c->sent);
        if (n > 0) {
            c->sent += (uint32_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            set_events(c, EPOLLOUT);
            return 0;
        }
        close_conn(c);
        return -1;
    }
    return 1;
}

/* Rate: read the request, write the response, close. */
static void on_rate(conn *c, uint32_t events) {
    if (c->got < g_req) {
        char buf[4096];
        for (;;) {
            ssize_t n = read(c->fd, buf, sizeof buf);
            if (n > 0) {
                c->got += (uint32_t)n;
                if (c->got >= g_req) break;
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                if (events & (EPOLLHUP | EPOLLERR)) close_conn(c);
                return;
            }
            close_conn(c); /* EOF or error before the whole request */
            return;
        }
    }
    if (write_rest(c, g_resp_buf, g_resp) <= 0) return;
    INC(g_rate_done);
    close_conn(c);
}

/* Bulk: reads (upload) or writes (download) c->remaining bytes of g_bulk_buf:
 * 1 all moved, 0 waiting for the socket, -1 EOF or failed (closed). */
static int bulk_move(conn *c, int upload) {
    while (c->remaining > 0) {
        size_t want = c->remaining < BULK_BUF ? c->remaining : BULK_BUF;
        ssize_t n = upload ? read(c->fd, g_bulk_buf, want) : write(c->fd, g_bulk_buf, want);
        if (n > 0) {
            c->remaining -= (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        close_conn(c); /* EOF or error before the whole transfer */
        return -1;
    }
    return 1;
}

static void on_bulk(conn *c, uint32_t events) {
    (void)events;
    if (c->state == 0) {
        while (c->got < HDR_LEN) {
            ssize_t n = read(c->fd, c->hdr + c->got, HDR_LEN - c->got);
            if (n > 0) {
                c->got += (uint32_t)n;
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            close_conn(c);
            return;
        }
        if (memcmp(c->hdr, "SWB1", 4) != 0 || (c->hdr[4] != 'U' && c->hdr[4] != 'D')) {
            fprintf(stderr, "tinyserver: bad bulk header\n");
            close_conn(c);
            return;
        }
        uint64_t len = 0;
        for (int i = 0; i < 8; i++) len |= (uint64_t)c->hdr[8 + i] << (8 * i);
        c->remaining = c->total = len;
        if (c->hdr[4] == 'U') {
            c->state = 1;
        } else {
            c->state = 2;
            set_events(c, EPOLLOUT);
            return; /* write when writable */
        }
    }
    if (c->state == 1) {
        if (bulk_move(c, 1) <= 0) return;
        c->state = 3;
        c->sent = 0;
    }
    if (c->state == 3) {
        unsigned char ack[8];
        for (int i = 0; i < 8; i++) ack[i] = (unsigned char)(c->total >> (8 * i));
        if (write_rest(c, ack, sizeof ack) <= 0) return;
        INC(g_bulk_done);
        close_conn(c);
        return;
    }
    if (c->state == 2) {
        if (bulk_move(c, 0) <= 0) return;
        INC(g_bulk_done);
        close_conn(c); /* FIN follows the queued data */
    }
}

/* Idle: echo what arrives (a tunnel's few probe bytes), keep the connection. */
static void on_idle(conn *c, uint32_t events) {
    char buf[4096];
    for (;;) {
        ssize_t n = read(c->fd, buf, sizeof buf);
        if (n > 0) {
            ssize_t off = 0;
            while (off < n) {
                ssize_t w = write(c->fd, buf + off, (size_t)(n - off));
                if (w > 0) off += w;
                else if (w < 0 && errno == EINTR) continue;
                else break; /* a full send buffer on an idle probe: drop the rest */
            }
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (events & (EPOLLHUP | EPOLLERR)) close_conn(c);
            return;
        }
        close_conn(c);
        return;
    }
}

/* One epoll loop; every thread watches every listener (EPOLLEXCLUSIVE wakes
 * one of them per connection) and serves the connections it accepted. */
static void *worker(void *arg) {
    (void)arg;
    g_ep = epoll_create1(EPOLL_CLOEXEC);
    if (g_ep < 0) die("epoll_create1");
    g_bulk_buf = malloc(BULK_BUF);
    memset(g_bulk_buf, 'b', BULK_BUF);
    for (int i = 0; i < g_nlisteners; i++) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = g_listeners[i]};
        if (epoll_ctl(g_ep, EPOLL_CTL_ADD, g_listeners[i]->fd, &ev) < 0) die("epoll_ctl");
    }
    struct epoll_event evs[512];
    while (!g_stop) {
        if (now_s() > g_deadline) {
            g_stop = 1;
            fprintf(stderr, "tinyserver: --max-seconds reached, exiting\n");
            break;
        }
        int n = epoll_wait(g_ep, evs, 512, 500);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            uint32_t e = evs[i].events;
            switch (c->kind) {
            case L_RATE: case L_BULK: case L_IDLE: do_accept(c); break;
            case C_RATE: on_rate(c, e); break;
            case C_BULK: on_bulk(c, e); break;
            case C_IDLE: on_idle(c, e); break;
            }
        }
    }
    return NULL;
}

static void usage(void) {
    fprintf(stderr,
            "usage: tinyserver [--rate PORT] [--bulk PORT] [--idle PORT] [--bind ADDR]\n"
            "                  [--req BYTES] [--resp BYTES] [--max-seconds S] [--threads N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int rate_port = -1, bulk_port = -1, idle_port = -1;
    const char *bind_addr = "127.0.0.1";
    double max_seconds = 900;
    int nthreads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--rate")) rate_port = atoi(v);
        else if (!strcmp(a, "--bulk")) bulk_port = atoi(v);
        else if (!strcmp(a, "--idle")) idle_port = atoi(v);
        else if (!strcmp(a, "--bind")) bind_addr = v;
        else if (!strcmp(a, "--req")) g_req = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--resp")) g_resp = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--max-seconds")) max_seconds = atof(v);
        else if (!strcmp(a, "--threads")) nthreads = atoi(v);
        else usage();
    }
    if ((rate_port < 0 && bulk_port < 0 && idle_port < 0) || nthreads < 1 || nthreads > 64)
        usage();

    prctl(PR_SET_PDEATHSIG, SIGTERM);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    g_resp_buf = malloc(g_resp ? g_resp : 1);
    memset(g_resp_buf, 'r', g_resp);
    int pr = 0, pb = 0, pi = 0;
    if (rate_port >= 0) listener(bind_addr, rate_port, L_RATE, &pr);
    if (bulk_port >= 0) listener(bind_addr, bulk_port, L_BULK, &pb);
    if (idle_port >= 0) listener(bind_addr, idle_port, L_IDLE, &pi);
    printf("{\"rate\": %d, \"bulk\": %d, \"idle\": %d, \"pid\": %d}\n", pr, pb, pi, (int)getpid());
    fflush(stdout);

    g_deadline = now_s() + max_seconds;
    pthread_t th[64];
    for (int t = 1; t < nthreads; t++)
        if (pthread_create(&th[t], NULL, worker, NULL) != 0) die("pthread_create");
    worker(NULL);
    for (int t = 1; t < nthreads; t++) pthread_join(th[t], NULL);
    fprintf(stderr,
            "tinyserver: accepted=%llu rate_done=%llu bulk_done=%llu idle_open=%lld\n",
            (unsigned long long)g_accepted, (unsigned long long)g_rate_done,
            (unsigned long long)g_bulk_done, (long long)g_idle_open);
    return 0;
}
