/*
 * Millisecond clocks for the C loops (conn.c, relay.c, tun.c, udp.c), one
 * spelling instead of one per file.  Internal (static inline), not part of
 * the cffi cdef.
 */
#ifndef SW_CLOCK_H
#define SW_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Whole milliseconds of clock `id`: the loops compare deadlines and stamp
 * records in ms, which is the resolution the Python side reports. */
static inline uint64_t sw_clock_ms(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Deadlines: immune to wall-clock steps. */
static inline uint64_t sw_mono_ms(void) { return sw_clock_ms(CLOCK_MONOTONIC); }

/* Record timestamps: Unix time, what the flow records carry. */
static inline uint64_t sw_real_ms(void) { return sw_clock_ms(CLOCK_REALTIME); }

#endif /* SW_CLOCK_H */
