/*
 * flowhook_fast: a flow hook (docs/flow-hook.md) that allows every flow, as fast
 * as one epoll thread can, for benchmarks/bench_flow_hook.py.
 *
 *   flowhook_fast PATH [--seconds 600]
 *
 * Listens on the Unix stream socket PATH (a stale file there is removed) and
 * prints "ready" on stdout once it does.  For every request line it reads
 * ({"id": N, "flow": ...}) it answers {"id":N,"verdict":"allow"}; the answers to
 * the requests of one read go out in one write.  It does not parse the flow
 * record: the engine writes "id" first, so the number after the first "id": is
 * the request's id (a line without one is counted as bad and not answered).
 *
 * Every connection is served; the engine keeps one.  SIGTERM/SIGINT, the
 * parent's death or --seconds end it; it then prints one JSON line on stdout,
 * {"requests": N, "bad": N, "connections": N}, and exits 0.
 *
 * Build: cc -O2 -o flowhook_fast flowhook_fast.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define READ_CHUNK (256 * 1024)
#define MAX_LINE (4 * 1024 * 1024) /* a longer line is dropped (never in practice) */

struct conn {
    int fd;
    char *in;          /* bytes of an unfinished line */
    size_t in_len, in_cap;
    char *out;         /* answers not written yet */
    size_t out_len, out_off, out_cap;
    int want_out;      /* EPOLLOUT is armed */
};

static volatile sig_atomic_t g_stop;
static unsigned long long g_requests, g_bad, g_conns;

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static int grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t ncap = *cap ? *cap : 4096;
    while (ncap < need)
        ncap *= 2;
    char *nb = realloc(*buf, ncap);
    if (!nb)
        return -1;
    *buf = nb;
    *cap = ncap;
    return 0;
}

/* One request line (without its newline): queue its answer. */
static int answer(struct conn *c, const char *line, size_t len)
{
    const char *key = memmem(line, len, "\"id\":", 5);
    if (!key) {
        g_bad++;
        return 0;
    }
    const char *p = key + 5, *end = line + len;
    while (p < end && *p == ' ')
        p++;
    unsigned long long id = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9'; p++, digits++)
        id = id * 10 + (unsigned long long)(*p - '0');
    if (!digits) {
        g_bad++;
        return 0;
    }
    if (grow(&c->out, &c->out_cap, c->out_len + 64) < 0)
        return -1;
    c->out_len += (size_t)snprintf(c->out + c->out_len, 64, "{\"id\":%llu,\"verdict\":\"allow\"}\n", id);
    g_requests++;
    return 0;
}

/* Write what is queued; 0 when all of it went, 1 when the socket is full, -1 on error. */
static int flush_out(struct conn *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                return 1;
            return -1;
        }
        c->out_off += (size_t)n;
    }
    c->out_len = c->out_off = 0;
    return 0;
}

static void conn_close(int ep, struct conn *c)
{
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

/* Read everything available, answer every whole line; -1 closes the connection. */
static int serve(struct conn *c, char *buf)
{
    for (;;) {
        ssize_t n = read(c->fd, buf, READ_CHUNK);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                break;
            return -1;
        }
        if (n == 0)
            return -1;
        size_t start = 0;
        for (size_t i = 0; i < (size_t)n; i++) {
            if (buf[i] != '\n')
                continue;
            if (c->in_len) {
                if (grow(&c->in, &c->in_cap, c->in_len + (i - start)) < 0)
                    return -1;
                memcpy(c->in + c->in_len, buf + start, i - start);
                if (answer(c, c->in, c->in_len + (i - start)) < 0)
                    return -1;
                c->in_len = 0;
            } else if (answer(c, buf + start, i - start) < 0) {
                return -1;
            }
            start = i + 1;
        }
        size_t rest = (size_t)n - start;
        if (rest) {
            if (c->in_len + rest > MAX_LINE) {
                c->in_len = 0;
                g_bad++;
            } else {
                if (grow(&c->in, &c->in_cap, c->in_len + rest) < 0)
                    return -1;
                memcpy(c->in + c->in_len, buf + start, rest);
                c->in_len += rest;
            }
        }
    }
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: flowhook_fast PATH [--seconds S]\n");
        return 2;
    }
    const char *path = argv[1];
    double seconds = 600;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--seconds"))
            seconds = atof(argv[i + 1]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "path too long\n");
        return 2;
    }
    strcpy(addr.sun_path, path);
    unlink(path);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 128) < 0) {
        perror("listen");
        return 1;
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev);
    char *buf = malloc(READ_CHUNK);
    if (ep < 0 || !buf)
        return 1;
    printf("ready\n");
    fflush(stdout);

    double deadline = now_s() + seconds;
    struct epoll_event evs[64];
    while (!g_stop && now_s() < deadline) {
        int n = epoll_wait(ep, evs, 64, 200);
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (!c) {
                int fd;
                while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                    struct conn *nc = calloc(1, sizeof *nc);
                    if (!nc) {
                        close(fd);
                        continue;
                    }
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
                    g_conns++;
                }
                continue;
            }
            int bad = 0;
            if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
                bad = serve(c, buf) < 0;
            if (!bad) {
                int rc = flush_out(c);
                if (rc < 0) {
                    bad = 1;
                } else if ((rc == 1) != c->want_out) {
                    /* Full socket: wait for room (reading pauses meanwhile). */
                    c->want_out = rc == 1;
                    struct epoll_event ev = {
                        .events = c->want_out ? EPOLLOUT : EPOLLIN | EPOLLRDHUP, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                }
            }
            if (bad)
                conn_close(ep, c);
        }
    }
    unlink(path);
    printf("{\"requests\": %llu, \"bad\": %llu, \"connections\": %llu}\n", g_requests, g_bad,
           g_conns);
    return 0;
}
