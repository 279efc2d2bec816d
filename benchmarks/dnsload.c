/*
 * dnsload: a UDP DNS query load generator for benchmarks/bench_dns.py.
 *
 *   dnsload --target H:P [--inflight 64] [--duration 3] [--warmup 0.5]
 *           [--names 100] [--suffix bench.test] [--timeout-ms 1000]
 *
 * Keeps --inflight A queries (no EDNS, RD set, as the glibc stub sends them)
 * in flight on one UDP socket, for names n0.<suffix> .. n<names-1>.<suffix>
 * in turn: each answer (matched by ID and name) is timed from its send and
 * replaced at once by the next query.  A query unanswered after --timeout-ms
 * counts as lost and is replaced.  Sends and receives go in batches
 * (sendmmsg/recvmmsg), so the generator spends few syscalls per query and is
 * not the bottleneck of a single-threaded server.  Answers during --warmup
 * are not recorded.  Prints one JSON line: queries sent, answers recorded,
 * answers/s, latency p50/p99/p99.9 in microseconds, rcode counts, lost.
 * Bounded: stops at warmup + duration (answers in flight then are dropped).
 *
 * Build: cc -O2 -o dnsload dnsload.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_INFLIGHT 4096
#define BATCH 64
#define HIST_US 200000 /* latency histogram: 1 us buckets up to 200 ms */

struct slot {
    uint64_t sent_ns;
    uint32_t name;
    uint16_t id;
    int busy;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static char suffix[200] = "bench.test";

/* An A query for n<name>.<suffix> with `id`; its length. */
static size_t build_query(uint8_t *buf, uint16_t id, uint32_t name)
{
    uint8_t *p = buf;
    *p++ = (uint8_t)(id >> 8);
    *p++ = (uint8_t)id;
    *p++ = 0x01; /* RD */
    *p++ = 0x00;
    memcpy(p, "\0\1\0\0\0\0\0\0", 8);
    p += 8;
    char label[16];
    int n = snprintf(label, sizeof label, "n%u", name);
    *p++ = (uint8_t)n;
    memcpy(p, label, (size_t)n);
    p += n;
    const char *s = suffix;
    while (*s) {
        const char *dot = strchr(s, '.');
        size_t len = dot ? (size_t)(dot - s) : strlen(s);
        *p++ = (uint8_t)len;
        memcpy(p, s, len);
        p += len;
        s += len + (dot ? 1 : 0);
    }
    *p++ = 0;
    memcpy(p, "\0\1\0\1", 4); /* A, IN */
    p += 4;
    return (size_t)(p - buf);
}

static double pct(const uint64_t *hist, uint64_t total, double q)
{
    if (!total)
        return 0;
    uint64_t want = (uint64_t)(q * (double)total);
    uint64_t seen = 0;
    for (int i = 0; i <= HIST_US; i++) {
        seen += hist[i];
        if (seen > want)
            return i;
    }
    return HIST_US;
}

int main(int argc, char **argv)
{
    const char *target = NULL;
    int inflight = 64, names = 100, timeout_ms = 1000;
    double duration = 3, warmup = 0.5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--inflight"))
            inflight = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--duration"))
            duration = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup"))
            warmup = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--names"))
            names = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--timeout-ms"))
            timeout_ms = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--suffix"))
            snprintf(suffix, sizeof suffix, "%s", argv[i + 1]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!target || inflight < 1 || inflight > MAX_INFLIGHT || names < 1) {
        fprintf(stderr, "usage: dnsload --target H:P [--inflight 1..%d] ...\n", MAX_INFLIGHT);
        return 2;
    }
    char host[64];
    const char *colon = strrchr(target, ':');
    if (!colon || (size_t)(colon - target) >= sizeof host)
        return 2;
    memcpy(host, target, (size_t)(colon - target));
    host[colon - target] = 0;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return 2;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        perror("socket");
        return 1;
    }
    int big = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);

    static struct slot slots[MAX_INFLIGHT];
    static uint8_t qbuf[BATCH][300], rbuf[BATCH][1500];
    static uint64_t hist[HIST_US + 1];
    struct mmsghdr qmsg[BATCH], rmsg[BATCH];
    struct iovec qiov[BATCH], riov[BATCH];
    memset(qmsg, 0, sizeof qmsg);
    memset(rmsg, 0, sizeof rmsg);
    for (int i = 0; i < BATCH; i++) {
        qiov[i].iov_base = qbuf[i];
        qmsg[i].msg_hdr.msg_iov = &qiov[i];
        qmsg[i].msg_hdr.msg_iovlen = 1;
        riov[i].iov_base = rbuf[i];
        riov[i].iov_len = sizeof rbuf[i];
        rmsg[i].msg_hdr.msg_iov = &riov[i];
        rmsg[i].msg_hdr.msg_iovlen = 1;
    }
    int pending[MAX_INFLIGHT], npending = 0; /* free slots to send */
    for (int i = 0; i < inflight; i++)
        pending[npending++] = i;
    uint32_t next_name = 0;
    uint16_t gen = 0;
    uint64_t sent = 0, answered = 0, lost = 0, recorded = 0, rcodes[16] = {0}, mismatched = 0;
    uint64_t start = now_ns();
    uint64_t rec_from = start + (uint64_t)(warmup * 1e9);
    uint64_t end = rec_from + (uint64_t)(duration * 1e9);
    uint64_t timeout_ns = (uint64_t)timeout_ms * 1000000u, next_sweep = start + timeout_ns;
    for (;;) {
        uint64_t t = now_ns();
        if (t >= end)
            break;
        /* Send what is free, in batches. */
        while (npending) {
            int n = npending < BATCH ? npending : BATCH;
            for (int i = 0; i < n; i++) {
                int s = pending[npending - 1 - i];
                gen++;
                slots[s].id = (uint16_t)((s & 0xFFF) | ((gen & 0xF) << 12));
                slots[s].name = next_name;
                next_name = (next_name + 1) % (uint32_t)names;
                qiov[i].iov_len = build_query(qbuf[i], slots[s].id, slots[s].name);
                slots[s].sent_ns = t;
                slots[s].busy = 1;
            }
            int k = sendmmsg(fd, qmsg, (unsigned)n, 0);
            if (k <= 0) {
                /* Buffer full: those slots stay pending; try after a receive. */
                for (int i = 0; i < n; i++)
                    slots[pending[npending - 1 - i]].busy = 0;
                break;
            }
            for (int i = k; i < n; i++)
                slots[pending[npending - 1 - i]].busy = 0;
            npending -= k;
            sent += (uint64_t)k;
        }
        int k = recvmmsg(fd, rmsg, BATCH, MSG_DONTWAIT, NULL);
        if (k <= 0) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, 1);
        }
        t = now_ns();
        for (int i = 0; i < k; i++) {
            uint8_t *r = rbuf[i];
            if (rmsg[i].msg_len < 12)
                continue;
            uint16_t id = (uint16_t)(r[0] << 8 | r[1]);
            int s = id & 0xFFF;
            if (s >= inflight || !slots[s].busy || slots[s].id != id) {
                mismatched++; /* a late answer to a query already counted lost */
                continue;
            }
            slots[s].busy = 0;
            pending[npending++] = s;
            answered++;
            if (slots[s].sent_ns >= rec_from) {
                uint64_t us = (t - slots[s].sent_ns) / 1000;
                hist[us > HIST_US ? HIST_US : us]++;
                recorded++;
                rcodes[r[3] & 0xF]++;
            }
        }
        if (t >= next_sweep) {
            for (int s = 0; s < inflight; s++)
                if (slots[s].busy && t - slots[s].sent_ns > timeout_ns) {
                    slots[s].busy = 0;
                    pending[npending++] = s;
                    if (slots[s].sent_ns >= rec_from)
                        lost++;
                }
            next_sweep = t + timeout_ns / 4;
        }
    }
    double secs = duration;
    printf("{\"sent\": %llu, \"answered\": %llu, \"recorded\": %llu, \"qps\": %.0f, "
           "\"p50_us\": %.0f, \"p99_us\": %.0f, \"p999_us\": %.0f, \"noerror\": %llu, "
           "\"other_rcode\": %llu, \"lost\": %llu, \"late\": %llu, \"inflight\": %d, "
           "\"names\": %d, \"seconds\": %.2f}\n",
           (unsigned long long)sent, (unsigned long long)answered,
           (unsigned long long)recorded, (double)recorded / secs, pct(hist, recorded, 0.5),
           pct(hist, recorded, 0.99), pct(hist, recorded, 0.999),
           (unsigned long long)rcodes[0], (unsigned long long)(recorded - rcodes[0]),
           (unsigned long long)lost, (unsigned long long)mismatched, inflight, names, secs);
    return 0;
}
