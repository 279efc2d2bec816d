/*
 * The timer min-heap of the C loops (conn.c's connection deadlines, udp.c's
 * association timers): an array of element pointers ordered by a uint64_t
 * deadline, each element knowing its own index so it can be removed or
 * re-keyed in O(log n).  The element types differ, so, like <sys/tree.h>,
 * SW_HEAP_DEFINE writes the functions for one (owner, element) pair.
 * Internal (static inline), not part of the cffi cdef.
 *
 *   SW_HEAP_DEFINE(prefix, owner_type, elem_type, idx_field, key_field)
 *
 * expects `owner_type` to have `elem_type **heap; size_t heap_len, heap_cap;`
 * and defines, for an `owner_type *L`:
 *   prefix_swap(L, a, b)       swap two slots, fixing both indices
 *   prefix_up(L, i)            sift slot i toward the root
 *   prefix_down(L, i)          sift slot i toward the leaves
 *   prefix_push(L, e, first)   append e and sift it (capacity doubles from
 *                              `first`); 0 or -ENOMEM
 *   prefix_remove(L, i)        take slot i out (the caller resets its index)
 */
#ifndef SW_HEAP_H
#define SW_HEAP_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define SW_HEAP_DEFINE(prefix, owner_type, elem_type, idx_field, key_field)                        \
    static inline void prefix##_swap(owner_type *L, size_t a, size_t b)                            \
    {                                                                                              \
        elem_type *t = L->heap[a];                                                                 \
        L->heap[a] = L->heap[b];                                                                   \
        L->heap[b] = t;                                                                            \
        L->heap[a]->idx_field = a;                                                                 \
        L->heap[b]->idx_field = b;                                                                 \
    }                                                                                              \
                                                                                                   \
    static inline void prefix##_up(owner_type *L, size_t i)                                        \
    {                                                                                              \
        while (i > 0) {                                                                            \
            size_t p = (i - 1) / 2;                                                                \
            if (L->heap[p]->key_field <= L->heap[i]->key_field)                                    \
                break;                                                                             \
            prefix##_swap(L, i, p);                                                                \
            i = p;                                                                                 \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline void prefix##_down(owner_type *L, size_t i)                                      \
    {                                                                                              \
        for (;;) {                                                                                 \
            size_t l = 2 * i + 1, r = l + 1, m = i;                                                \
            if (l < L->heap_len && L->heap[l]->key_field < L->heap[m]->key_field)                  \
                m = l;                                                                             \
            if (r < L->heap_len && L->heap[r]->key_field < L->heap[m]->key_field)                  \
                m = r;                                                                             \
            if (m == i)                                                                            \
                return;                                                                            \
            prefix##_swap(L, i, m);                                                                \
            i = m;                                                                                 \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline int prefix##_push(owner_type *L, elem_type *e, size_t first)                     \
    {                                                                                              \
        if (L->heap_len == L->heap_cap) {                                                          \
            size_t cap = L->heap_cap ? L->heap_cap * 2 : first;                                    \
            elem_type **h = realloc(L->heap, cap * sizeof *h);                                     \
            if (!h)                                                                                \
                return -ENOMEM;                                                                    \
            L->heap = h;                                                                           \
            L->heap_cap = cap;                                                                     \
        }                                                                                          \
        e->idx_field = L->heap_len;                                                                \
        L->heap[L->heap_len++] = e;                                                                \
        prefix##_up(L, e->idx_field);                                                              \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    /* The last element fills the hole and moves whichever way its key says:                       \
     * at most one of the two sifts does anything. */                                              \
    static inline void prefix##_remove(owner_type *L, size_t i)                                    \
    {                                                                                              \
        L->heap_len--;                                                                             \
        if (i == L->heap_len)                                                                      \
            return;                                                                                \
        L->heap[i] = L->heap[L->heap_len];                                                         \
        L->heap[i]->idx_field = i;                                                                 \
        prefix##_up(L, i);                                                                         \
        prefix##_down(L, L->heap[i]->idx_field);                                                   \
    }

#endif /* SW_HEAP_H */
