/*
 * The index arithmetic of the single-producer, single-consumer record rings
 * that the C loops (conn.c, tun.c, udp.c) hand to Python: a power-of-two slot
 * array and two free-running 32-bit counters, `head` written only by the
 * producing loop and `tail` only by the draining thread.  Each module keeps
 * its own slot type and its own extra bookkeeping (payload bytes, promised
 * slots); what they share is here.  Internal (static inline), not part of
 * the cffi cdef.
 */
#ifndef SW_RING_H
#define SW_RING_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* Slots the consumer has not taken yet, seen from the producer: the acquire
 * on `tail` orders the consumer's reads of those slots before our reuse. */
static inline uint32_t sw_ring_used(_Atomic uint32_t *head, _Atomic uint32_t *tail)
{
    return atomic_load_explicit(head, memory_order_relaxed) -
           atomic_load_explicit(tail, memory_order_acquire);
}

/* Room for one more record in a ring of mask + 1 slots? */
static inline bool sw_ring_has_room(_Atomic uint32_t *head, _Atomic uint32_t *tail, uint32_t mask)
{
    return sw_ring_used(head, tail) <= mask;
}

/* The producer's next slot index (mask it to address the slot). */
static inline uint32_t sw_ring_head(_Atomic uint32_t *head)
{
    return atomic_load_explicit(head, memory_order_relaxed);
}

/* Hands the slot at `at` (from sw_ring_head) to the consumer: the release
 * orders the slot's contents before the new head. */
static inline void sw_ring_publish(_Atomic uint32_t *head, uint32_t at)
{
    atomic_store_explicit(head, at + 1, memory_order_release);
}

/* The consumer's view: its own tail, and the head whose slots it may read. */
static inline uint32_t sw_ring_tail(_Atomic uint32_t *tail)
{
    return atomic_load_explicit(tail, memory_order_relaxed);
}

static inline uint32_t sw_ring_ready(_Atomic uint32_t *head)
{
    return atomic_load_explicit(head, memory_order_acquire);
}

/* Gives the slots before `tail` back to the producer (after they are read). */
static inline void sw_ring_release(_Atomic uint32_t *tail_ptr, uint32_t tail)
{
    atomic_store_explicit(tail_ptr, tail, memory_order_release);
}

/* The least power of two >= n, capped at `max` (itself a power of two): ring
 * and hash table sizes, so that `& mask` replaces `%`. */
static inline uint32_t sw_pow2_at_least(uint32_t n, uint32_t max)
{
    uint32_t p = 1;
    while (p < n && p < max)
        p <<= 1;
    return p;
}

#endif /* SW_RING_H */
