/*
 * What the relay and connection loops share about being epoll threads:
 * eventfd signalling and starting a loop thread.  Internal (static inline),
 * not part of the cffi cdef.
 */
#ifndef SW_EVLOOP_H
#define SW_EVLOOP_H

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

/* A failed write is EAGAIN, only if the counter is about to overflow:
 * already readable.  A failed read is EAGAIN: already clear. */
static inline void efd_signal(int fd)
{
    uint64_t one = 1;
    if (write(fd, &one, sizeof one) < 0) {
    }
}

static inline void efd_clear(int fd)
{
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) {
    }
}

/* Starts `fn(arg)` as thread "<prefix>-<index>" with every signal blocked:
 * signals belong to the host's threads (Python handles them on its main
 * thread), and a SIGPIPE raised by a write into a reset socket must not kill
 * the process.  Returns 0 or -errno. */
static inline int loop_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg,
                                    const char *prefix, int index)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(thread, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e)
        return -e;
    char name[16];
    snprintf(name, sizeof name, "%s-%d", prefix, index);
    (void)pthread_setname_np(*thread, name);
    return 0;
}

#endif /* SW_EVLOOP_H */
