/*
 * udpload: UDP echo load through SOCKS5 UDP ASSOCIATE (RFC 1928 section 7), and the
 * UDP echo server it runs against.  For spliceway's UDP benchmark (bench_udp.py).
 *
 *   udpload echo [--port 0] [--bind 127.0.0.1] [--max-seconds 900]
 *       UDP echo server: every datagram goes back to its sender unchanged
 *       (recvmmsg/sendmmsg batches, one thread).  Prints {"port": P, "pid": N} on
 *       stdout once bound; stops on SIGTERM/SIGINT, when its parent dies
 *       (PR_SET_PDEATHSIG) or after --max-seconds: always bounded in time.  On exit
 *       it prints its counters on stderr.
 *
 *   udpload client --target 127.0.0.1:PORT (--socks 127.0.0.1:PORT | --direct)
 *                  [--window 1] [--size 64] [--seconds 5] [--count 0]
 *                  [--timeout-ms 200] [--io auto|epoll|blocking]
 *       With --socks: a TCP control connection to the proxy, greeting 05 01 00 (no
 *       authentication), UDP ASSOCIATE declaring the client's UDP address
 *       (127.0.0.1:its port), then datagrams to the relay address of the reply
 *       (BND.ADDR:BND.PORT; an unspecified BND.ADDR means the proxy's address), each
 *       wrapped in the 10-byte header RSV RSV FRAG=0 ATYP=1 DST.ADDR DST.PORT naming
 *       --target; replies must carry the same header kind naming --target.  With
 *       --direct: the same datagrams straight to --target, unwrapped.
 *       --window W datagrams of --size payload bytes are kept in flight; a slot whose
 *       datagram is answered sends its next one at once.  A datagram not answered
 *       within --timeout-ms is counted lost and its slot reused (a reply that comes
 *       later is counted "late", not as a round trip).  The run stops after
 *       --seconds or once --count datagrams were answered or lost (whichever comes
 *       first; --count 0 = no count bound); datagrams in flight at the end are
 *       reported as "inflight_at_end".  The timing starts at the first datagram
 *       (the TCP handshake and the association are timed apart: "setup_us").
 *       --io blocking (the default for window 1): blocking recvmmsg; --io epoll (the
 *       default otherwise): non-blocking sockets, epoll on the UDP socket and the
 *       control connection.  Prints one JSON line: round trips/s, latency
 *       percentiles (send to reply, us), sent/received/lost/late/bad counts, its own
 *       CPU seconds.  Exit status 0 whenever the JSON line is printed: when the
 *       association could not be set up or the proxy closed the control connection
 *       during the run, its "error" says so (null otherwise); 2 on bad usage.
 *
 * Build: cc -O2 -Wall -Wextra -o udpload udpload.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#define MAX_DGRAM 2048
#define MAX_WINDOW 4096
#define HDR4 10 /* SOCKS5 UDP header with an IPv4 address */
#define MAGIC 0x31555753u /* "SWU1" little endian */

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig; g_stop = 1; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double cpu_self_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void die(const char *what) {
    fprintf(stderr, "udpload: %s: %s\n", what, strerror(errno));
    exit(2);
}

static int parse_hostport(const char *s, struct sockaddr_in *sa) {
    char host[64];
    const char *colon = strrchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof host) return -1;
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    int port = atoi(colon + 1);
    if (port <= 0 || port > 65535) return -1;
    sa->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

static void bounded_setup(void) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

/* ------------------------------------------------------------------ echo server */

static int run_echo(int argc, char **argv) {
    const char *bind_addr = "127.0.0.1";
    int port = 0;
    double max_seconds = 900;
    for (int i = 0; i < argc; i++) {
        if (i + 1 >= argc) goto usage;
        const char *a = argv[i], *v = argv[++i];
        if (!strcmp(a, "--port")) port = atoi(v);
        else if (!strcmp(a, "--bind")) bind_addr = v;
        else if (!strcmp(a, "--max-seconds")) max_seconds = atof(v);
        else goto usage;
    }
    bounded_setup();
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    int buf = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, bind_addr, &sa.sin_addr) != 1) goto usage;
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) die("bind");
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    /* a blocking socket whose receive wakes at least every 250 ms: the stop flag and the
       deadline are checked that often (a signal also interrupts the call) */
    struct timeval tv = {.tv_sec = 0, .tv_usec = 250000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    printf("{\"port\": %d, \"pid\": %d}\n", ntohs(sa.sin_port), (int)getpid());
    fflush(stdout);

    static char bufs[BATCH][MAX_DGRAM];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    uint64_t got = 0, echoed = 0, send_fail = 0, batches = 0;
    uint64_t deadline = now_ns() + (uint64_t)(max_seconds * 1e9);
    while (!g_stop) {
        if (now_ns() > deadline) {
            fprintf(stderr, "udpload echo: --max-seconds reached, exiting\n");
            break;
        }
        for (int i = 0; i < BATCH; i++) {
            iov[i] = (struct iovec){bufs[i], MAX_DGRAM};
            msgs[i].msg_hdr = (struct msghdr){.msg_name = &from[i],
                                              .msg_namelen = sizeof from[i],
                                              .msg_iov = &iov[i],
                                              .msg_iovlen = 1};
        }
        int n = recvmmsg(fd, msgs, BATCH, MSG_WAITFORONE, NULL);
        if (n <= 0) {
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                die("recvmmsg");
            continue;
        }
        got += (uint64_t)n;
        batches++;
        for (int i = 0; i < n; i++) iov[i].iov_len = msgs[i].msg_len;
        int off = 0;
        while (off < n) {
            int s = sendmmsg(fd, msgs + off, (unsigned)(n - off), 0);
            if (s <= 0) {
                if (s < 0 && errno == EINTR) continue;
                send_fail += (uint64_t)(n - off); /* e.g. ECONNREFUSED from an ICMP: drop */
                break;
            }
            echoed += (uint64_t)s;
            off += s;
        }
    }
    fprintf(stderr,
            "udpload echo: received=%llu echoed=%llu send_failed=%llu batches=%llu\n",
            (unsigned long long)got, (unsigned long long)echoed,
            (unsigned long long)send_fail, (unsigned long long)batches);
    return 0;
usage:
    fprintf(stderr, "usage: udpload echo [--port P] [--bind ADDR] [--max-seconds S]\n");
    return 2;
}

/* ------------------------------------------------------------------ client */

typedef struct {
    uint64_t seq;     /* the datagram in flight on this slot (0: none) */
    uint64_t sent_ns; /* when it was sent */
} slot;

static struct {
    int udp, ctl;
    int socks;
    struct sockaddr_in target, proxy, relay;
    int window, size, timeout_ms, blocking;
    double seconds;
    uint64_t count;
    slot *slots;
    uint64_t next_seq;
    /* results */
    uint64_t sent, received, lost, late, bad, foreign, send_errors, send_again;
    uint32_t *lat; /* nanoseconds per answered datagram */
    size_t nlat, caplat;
    char error[160];
} C;

static unsigned char g_hdr[HDR4]; /* RSV RSV FRAG ATYP=1 DST.ADDR DST.PORT (--target) */
static unsigned char g_pad[MAX_DGRAM];

static int read_full(int fd, unsigned char *buf, size_t n, int timeout_ms) {
    size_t got = 0;
    while (got < n) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t k = read(fd, buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 0;
}

/* The SOCKS5 control connection and UDP ASSOCIATE; C.relay is where datagrams go. */
static int associate(void) {
    C.ctl = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (C.ctl < 0) die("socket");
    int one = 1;
    setsockopt(C.ctl, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(C.ctl, (struct sockaddr *)&C.proxy, sizeof C.proxy) < 0) {
        snprintf(C.error, sizeof C.error, "connect to the proxy: %s", strerror(errno));
        return -1;
    }
    unsigned char greet[3] = {5, 1, 0}, rep[32];
    if (write(C.ctl, greet, 3) != 3 || read_full(C.ctl, rep, 2, 5000) < 0) {
        snprintf(C.error, sizeof C.error, "no method reply");
        return -1;
    }
    if (rep[0] != 5 || rep[1] != 0) {
        snprintf(C.error, sizeof C.error, "method reply %02x %02x", rep[0], rep[1]);
        return -1;
    }
    struct sockaddr_in me;
    socklen_t len = sizeof me;
    getsockname(C.udp, (struct sockaddr *)&me, &len);
    unsigned char req[10] = {5, 3, 0, 1};
    memcpy(req + 4, &me.sin_addr, 4);
    memcpy(req + 8, &me.sin_port, 2);
    if (write(C.ctl, req, sizeof req) != (ssize_t)sizeof req || read_full(C.ctl, rep, 4, 5000) < 0) {
        snprintf(C.error, sizeof C.error, "no UDP ASSOCIATE reply");
        return -1;
    }
    if (rep[0] != 5 || rep[1] != 0) {
        snprintf(C.error, sizeof C.error, "UDP ASSOCIATE refused: REP %d", rep[1]);
        return -1;
    }
    C.relay = C.proxy;
    if (rep[3] == 1) {
        if (read_full(C.ctl, rep + 4, 6, 5000) < 0) goto short_reply;
        struct in_addr a;
        memcpy(&a, rep + 4, 4);
        if (a.s_addr != htonl(INADDR_ANY)) C.relay.sin_addr = a;
        memcpy(&C.relay.sin_port, rep + 8, 2);
    } else if (rep[3] == 4) {
        if (read_full(C.ctl, rep + 4, 18, 5000) < 0) goto short_reply;
        static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(rep + 4, mapped, 12)) memcpy(&C.relay.sin_addr, rep + 16, 4);
        /* "::" means the address the client reached the proxy on; other IPv6: not ours */
        memcpy(&C.relay.sin_port, rep + 20, 2);
    } else if (rep[3] == 3) {
        if (read_full(C.ctl, rep + 4, 1, 5000) < 0) goto short_reply;
        unsigned char host[260];
        if (read_full(C.ctl, host, (size_t)rep[4] + 2, 5000) < 0) goto short_reply;
        memcpy(&C.relay.sin_port, host + rep[4], 2); /* a name: assume the proxy's address */
    } else {
        snprintf(C.error, sizeof C.error, "UDP ASSOCIATE reply with ATYP %d", rep[3]);
        return -1;
    }
    if (C.relay.sin_port == 0) {
        snprintf(C.error, sizeof C.error, "UDP ASSOCIATE reply with port 0");
        return -1;
    }
    return 0;
short_reply:
    snprintf(C.error, sizeof C.error, "short UDP ASSOCIATE reply");
    return -1;
}

/* Puts the datagram of slot i into msg (iov[2] is its storage). */
static void fill(int i, struct mmsghdr *msg, struct iovec *iov, unsigned char *payload) {
    slot *s = &C.slots[i];
    s->seq = ++C.next_seq;
    uint32_t magic = MAGIC, idx = (uint32_t)i;
    memcpy(payload, &magic, 4);
    memcpy(payload + 4, &idx, 4);
    memcpy(payload + 8, &s->seq, 8);
    int k = 0;
    if (C.socks) iov[k++] = (struct iovec){g_hdr, HDR4};
    iov[k++] = (struct iovec){payload, (size_t)C.size};
    const struct sockaddr_in *dst = C.socks ? &C.relay : &C.target;
    msg->msg_hdr = (struct msghdr){.msg_name = (void *)dst,
                                   .msg_namelen = sizeof *dst,
                                   .msg_iov = iov,
                                   .msg_iovlen = (size_t)k};
}

/* Sends the datagrams of the n slots in idx[] (their send times set). */
static void send_slots(const int *idx, int n) {
    static unsigned char payloads[BATCH][MAX_DGRAM];
    struct mmsghdr msgs[BATCH];
    struct iovec iovs[BATCH][2];
    int done = 0;
    while (done < n) {
        int k = n - done < BATCH ? n - done : BATCH;
        for (int j = 0; j < k; j++) {
            memcpy(payloads[j] + 16, g_pad, (size_t)(C.size > 16 ? C.size - 16 : 0));
            fill(idx[done + j], &msgs[j], iovs[j], payloads[j]);
        }
        uint64_t t = now_ns();
        for (int j = 0; j < k; j++) C.slots[idx[done + j]].sent_ns = t;
        int off = 0;
        while (off < k) {
            int s = sendmmsg(C.udp, msgs + off, (unsigned)(k - off), 0);
            if (s > 0) {
                C.sent += (uint64_t)s;
                off += s;
                continue;
            }
            if (s < 0 && errno == EINTR) continue;
            /* EAGAIN (full socket buffer) or an error such as ECONNREFUSED: the datagram
               is not sent; its slot times out and counts as lost */
            if (s < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) C.send_again++;
            else C.send_errors++;
            off++;
        }
        done += k;
    }
}

static void record_latency(uint64_t ns) {
    if (C.nlat == C.caplat) {
        C.caplat = C.caplat ? C.caplat * 2 : 1 << 16;
        C.lat = realloc(C.lat, C.caplat * sizeof *C.lat);
        if (!C.lat) die("realloc");
    }
    C.lat[C.nlat++] = ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
}

/* One received datagram: its slot index if it answers the slot's datagram in flight
   (latency recorded), else -1 (late, bad or foreign: counted). */
static int on_reply(const unsigned char *buf, size_t len, const struct sockaddr_in *from,
                    uint64_t t) {
    const struct sockaddr_in *want = C.socks ? &C.relay : &C.target;
    if (from->sin_family != AF_INET || from->sin_port != want->sin_port ||
        from->sin_addr.s_addr != want->sin_addr.s_addr) {
        C.foreign++;
        return -1;
    }
    size_t off = 0;
    if (C.socks) {
        /* RSV RSV FRAG ATYP ADDR PORT naming the target (IPv4, or v4-mapped IPv6) */
        if (len < 4 || buf[0] || buf[1] || buf[2]) goto bad;
        if (buf[3] == 1) {
            if (len < HDR4 || memcmp(buf + 4, g_hdr + 4, 6)) goto bad;
            off = HDR4;
        } else if (buf[3] == 4) {
            static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
            if (len < 22 || memcmp(buf + 4, mapped, 12) || memcmp(buf + 16, g_hdr + 4, 6))
                goto bad;
            off = 22;
        } else {
            goto bad;
        }
    }
    if (len - off != (size_t)C.size || C.size < 16) goto bad;
    uint32_t magic, idx;
    uint64_t seq;
    memcpy(&magic, buf + off, 4);
    memcpy(&idx, buf + off + 4, 4);
    memcpy(&seq, buf + off + 8, 8);
    if (magic != MAGIC || idx >= (uint32_t)C.window) goto bad;
    slot *s = &C.slots[idx];
    if (s->seq != seq || seq == 0) {
        C.late++; /* answered after its timeout (or a duplicate) */
        return -1;
    }
    C.received++;
    record_latency(t - s->sent_ns);
    s->seq = 0;
    return (int)idx;
bad:
    C.bad++;
    return -1;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static double pct_us(double p) {
    if (!C.nlat) return 0;
    size_t i = (size_t)(p / 100.0 * (double)(C.nlat - 1) + 0.5);
    return C.lat[i] / 1000.0;
}

/* 1 when the control connection has been closed (or failed) by the proxy. */
static int ctl_closed(void) {
    unsigned char b[64];
    ssize_t n = recv(C.ctl, b, sizeof b, MSG_DONTWAIT);
    if (n == 0) return 1;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    return 0; /* unexpected bytes: ignored */
}

static int run_client(int argc, char **argv) {
    const char *io = "auto";
    C.window = 1;
    C.size = 64;
    C.seconds = 5;
    C.timeout_ms = 200;
    int have_target = 0, direct = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--direct")) {
            direct = 1;
            continue;
        }
        if (i + 1 >= argc) goto usage;
        const char *v = argv[++i];
        if (!strcmp(a, "--target")) {
            if (parse_hostport(v, &C.target) < 0) goto usage;
            have_target = 1;
        } else if (!strcmp(a, "--socks")) {
            if (parse_hostport(v, &C.proxy) < 0) goto usage;
            C.socks = 1;
        } else if (!strcmp(a, "--window")) C.window = atoi(v);
        else if (!strcmp(a, "--size")) C.size = atoi(v);
        else if (!strcmp(a, "--seconds")) C.seconds = atof(v);
        else if (!strcmp(a, "--count")) C.count = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--timeout-ms")) C.timeout_ms = atoi(v);
        else if (!strcmp(a, "--io")) io = v;
        else goto usage;
    }
    if (!have_target || C.socks == direct || C.window < 1 || C.window > MAX_WINDOW ||
        C.size < 16 || C.size > MAX_DGRAM - 32 || C.seconds <= 0 || C.seconds > 3600 ||
        C.timeout_ms < 1)
        goto usage;
    if (!strcmp(io, "auto")) C.blocking = C.window == 1;
    else if (!strcmp(io, "blocking")) C.blocking = 1;
    else if (!strcmp(io, "epoll")) C.blocking = 0;
    else goto usage;
    bounded_setup();
    memset(g_pad, 'u', sizeof g_pad);
    g_hdr[3] = 1;
    memcpy(g_hdr + 4, &C.target.sin_addr, 4);
    memcpy(g_hdr + 8, &C.target.sin_port, 2);
    C.slots = calloc((size_t)C.window, sizeof *C.slots);
    C.ctl = -1;

    C.udp = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | (C.blocking ? 0 : SOCK_NONBLOCK), 0);
    if (C.udp < 0) die("socket");
    int buf = 4 << 20;
    setsockopt(C.udp, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    setsockopt(C.udp, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    struct sockaddr_in me = {.sin_family = AF_INET};
    me.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(C.udp, (struct sockaddr *)&me, sizeof me) < 0) die("bind");

    uint64_t t_setup = now_ns();
    int rc = 0;
    if (C.socks && associate() < 0) rc = 1;
    double setup_us = (double)(now_ns() - t_setup) / 1e3;
    double cpu0 = cpu_self_s();
    uint64_t t0 = now_ns(), t_end = t0, stop_at = t0 + (uint64_t)(C.seconds * 1e9);
    uint64_t timeout_ns = (uint64_t)C.timeout_ms * 1000000u;
    int ep = -1;

    if (rc == 0) {
        int slice_ms = C.timeout_ms < 100 ? C.timeout_ms : 100;
        if (C.blocking) {
            struct timeval tv = {.tv_sec = slice_ms / 1000, .tv_usec = (slice_ms % 1000) * 1000};
            setsockopt(C.udp, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        } else {
            ep = epoll_create1(EPOLL_CLOEXEC);
            struct epoll_event ev = {.events = EPOLLIN, .data.fd = C.udp};
            epoll_ctl(ep, EPOLL_CTL_ADD, C.udp, &ev);
            if (C.ctl >= 0) {
                struct epoll_event ec = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = C.ctl};
                epoll_ctl(ep, EPOLL_CTL_ADD, C.ctl, &ec);
            }
        }
        static unsigned char rbufs[BATCH][MAX_DGRAM];
        struct mmsghdr msgs[BATCH];
        struct iovec iov[BATCH];
        struct sockaddr_in from[BATCH];
        int *free_idx = malloc((size_t)C.window * sizeof(int));
        for (int i = 0; i < C.window; i++) free_idx[i] = i;
        int nfree = C.window;
        uint64_t next_ctl_check = t0;
        t0 = now_ns();
        stop_at = t0 + (uint64_t)(C.seconds * 1e9);
        for (;;) {
            uint64_t t = now_ns();
            uint64_t done = C.received + C.lost;
            int over = t >= stop_at || g_stop || (C.count && done >= C.count);
            if (!over && nfree) {
                /* under --count, never more in flight than datagrams still wanted */
                int n = nfree;
                if (C.count) {
                    uint64_t inflight = (uint64_t)(C.window - nfree);
                    uint64_t left = C.count > done + inflight ? C.count - done - inflight : 0;
                    if ((uint64_t)n > left) n = (int)left;
                }
                if (n > 0) {
                    send_slots(free_idx + nfree - n, n);
                    nfree -= n;
                }
            }
            if (over) break;
            /* wait for replies */
            int got;
            for (int i = 0; i < BATCH; i++) {
                iov[i] = (struct iovec){rbufs[i], MAX_DGRAM};
                msgs[i].msg_hdr = (struct msghdr){.msg_name = &from[i],
                                                  .msg_namelen = sizeof from[i],
                                                  .msg_iov = &iov[i],
                                                  .msg_iovlen = 1};
            }
            if (C.blocking) {
                got = recvmmsg(C.udp, msgs, BATCH, MSG_WAITFORONE, NULL);
            } else {
                /* sleep until the earliest slot deadline (at most the slice) */
                uint64_t first = UINT64_MAX;
                for (int i = 0; i < C.window; i++)
                    if (C.slots[i].seq && C.slots[i].sent_ns < first) first = C.slots[i].sent_ns;
                int wait_ms = slice_ms;
                if (first != UINT64_MAX) {
                    uint64_t dl = first + timeout_ns;
                    uint64_t now = now_ns();
                    int ms = dl > now ? (int)((dl - now) / 1000000u) + 1 : 0;
                    if (ms < wait_ms) wait_ms = ms;
                }
                struct epoll_event evs[2];
                int ne = epoll_wait(ep, evs, 2, wait_ms);
                got = 0;
                for (int i = 0; i < ne; i++) {
                    if (evs[i].data.fd == C.ctl && ctl_closed()) {
                        snprintf(C.error, sizeof C.error,
                                 "the proxy closed the control connection");
                        rc = 1;
                    }
                }
                if (rc) break;
                if (ne > 0) got = recvmmsg(C.udp, msgs, BATCH, MSG_DONTWAIT, NULL);
            }
            if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                /* ECONNREFUSED: an ICMP port unreachable came back; keep going */
                if (errno != ECONNREFUSED) die("recvmmsg");
            }
            uint64_t tr = now_ns();
            for (int i = 0; i < got; i++) {
                int idx = on_reply(rbufs[i], msgs[i].msg_len, &from[i], tr);
                if (idx >= 0) free_idx[nfree++] = idx;
            }
            /* datagrams past their timeout: lost, slot reused */
            for (int i = 0; i < C.window; i++) {
                slot *s = &C.slots[i];
                if (s->seq && tr - s->sent_ns >= timeout_ns) {
                    s->seq = 0;
                    C.lost++;
                    free_idx[nfree++] = i;
                }
            }
            if (C.blocking && C.ctl >= 0 && tr >= next_ctl_check) {
                next_ctl_check = tr + 100000000u; /* every 100 ms */
                if (ctl_closed()) {
                    snprintf(C.error, sizeof C.error, "the proxy closed the control connection");
                    rc = 1;
                    break;
                }
            }
        }
        t_end = now_ns();
        free(free_idx);
    }
    double cpu = cpu_self_s() - cpu0;
    uint64_t inflight = 0;
    for (int i = 0; i < C.window; i++) inflight += C.slots[i].seq != 0;
    double wall = (double)(t_end - t0) / 1e9;
    qsort(C.lat, C.nlat, sizeof *C.lat, cmp_u32);
    double sum = 0;
    for (size_t i = 0; i < C.nlat; i++) sum += C.lat[i];
    char relay[64] = "";
    if (C.socks && rc == 0)
        snprintf(relay, sizeof relay, "%s:%d", inet_ntoa(C.relay.sin_addr),
                 ntohs(C.relay.sin_port));
    printf("{\"mode\": \"%s\", \"window\": %d, \"size\": %d, \"io\": \"%s\", "
           "\"relay\": \"%s\", \"setup_us\": %.1f, \"wall_s\": %.4f, \"sent\": %llu, "
           "\"received\": %llu, \"lost\": %llu, \"late\": %llu, \"bad\": %llu, "
           "\"foreign\": %llu, \"send_errors\": %llu, \"send_eagain\": %llu, "
           "\"inflight_at_end\": %llu, \"rtt_per_s\": %.1f, "
           "\"lat_us\": {\"mean\": %.1f, \"p50\": %.1f, \"p90\": %.1f, \"p99\": %.1f, "
           "\"p999\": %.1f, \"max\": %.1f}, \"cpu_s\": %.3f, \"error\": %s%s%s}\n",
           C.socks ? "socks5" : "direct", C.window, C.size, C.blocking ? "blocking" : "epoll",
           relay, setup_us, wall, (unsigned long long)C.sent, (unsigned long long)C.received,
           (unsigned long long)C.lost, (unsigned long long)C.late, (unsigned long long)C.bad,
           (unsigned long long)C.foreign, (unsigned long long)C.send_errors,
           (unsigned long long)C.send_again, (unsigned long long)inflight,
           wall > 0 ? (double)C.received / wall : 0.0, C.nlat ? sum / (double)C.nlat / 1e3 : 0.0,
           pct_us(50), pct_us(90), pct_us(99), pct_us(99.9), pct_us(100), cpu,
           C.error[0] ? "\"" : "", C.error[0] ? C.error : "null", C.error[0] ? "\"" : "");
    fflush(stdout);
    if (C.ctl >= 0) close(C.ctl);
    close(C.udp);
    return 0; /* the JSON line tells (rc != 0: "error" is set) */
usage:
    fprintf(stderr,
            "usage: udpload client --target H:P (--socks H:P | --direct) [--window W]\n"
            "                      [--size B] [--seconds S] [--count N] [--timeout-ms T]\n"
            "                      [--io auto|epoll|blocking]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "echo")) return run_echo(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "client")) return run_client(argc - 2, argv + 2);
    fprintf(stderr, "usage: udpload echo ... | udpload client ...  (see the top of udpload.c)\n");
    return 2;
}
