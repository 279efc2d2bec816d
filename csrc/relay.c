/*
 * spliceway C relay.  See relay.h for the contract; this file explains the
 * choices behind it.
 *
 * Threads and ownership
 *   Each loop is a pthread with its own epoll set.  A flow belongs to one
 *   loop for its whole life and only that loop (or sw_relay_shutdown() after
 *   the loops are joined) touches its sockets, pipes and loop-private state.
 *   Other threads reach a flow only through atomics (generation, counters) or
 *   through the loop's request list (mutex + eventfd), so no fd is ever closed
 *   from a caller's thread while the loop might still use it.
 *
 * Generations
 *   A slot's generation is odd while a flow lives in it and even while it is
 *   free; handles and epoll cookies carry it, so stale handles and stale
 *   events (for a flow completed earlier in the same epoll batch) are
 *   recognised by one atomic load.  Counter readers validate the generation
 *   before and after reading, seqlock style.
 *
 * Adoption
 *   sw_relay_add() registers the sockets with epoll from the caller's thread
 *   (so a failure can still be reported and undone) but the loop ignores
 *   every event of a flow until it has taken the flow off its request list.
 *   Adoption then treats both sockets as readable and writable, which covers
 *   any edge that arrived before it: ignoring those edges loses nothing.
 *
 * Shadowsocks AEAD flows (sw_relay_add_aead)
 *   Same loops, same lifecycle, but a copy path: client -> upstream reads up
 *   to four chunks of plaintext (65532 bytes) into the loop's scratch buffer,
 *   seals them into a second scratch buffer and sends; upstream -> client
 *   reads up to 64 KiB of ciphertext, opens every chunk it completes and
 *   sends the plaintext.  Only what a socket refuses is copied into a per-flow
 *   stash (at most one pass, so < 64 KiB per direction), and the source is not
 *   read again until the stash is written out: backpressure as in copy mode.
 *   A chunk cut by a read boundary is kept in a per-flow buffer of one
 *   maximal chunk (16399 bytes), allocated when first needed and released
 *   when the upstream runs dry on a chunk boundary.  So a flow costs its two
 *   EVP_CIPHER_CTX (keys set once; per chunk only the nonce is set) plus
 *   buffers only while a chunk straddles reads or a socket is full.
 *   Integrity failures (bad tag, chunk length 0 or > 0x3FFF, upstream EOF
 *   inside the salt or a chunk) end the flow as ERROR/EBADMSG on the upstream
 *   side; the plaintext of the chunks before is sent first (best effort) and
 *   the client is then reset, so a cut stream never looks complete.  An
 *   upstream EOF before any byte or on a chunk boundary is a clean EOF.
 */
#define _GNU_SOURCE
#include "relay.h"
#include "clock.h"
#include "evloop.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>

enum {
    /* Bytes one flow may read per service before it goes to the back of the
     * ready list, so one bulk flow cannot starve the others on its loop. */
    FLOW_BUDGET = 1 << 20,
    EVENTS_MAX = 256,
    /* Requests handled per loop iteration, so a storm of adds cannot delay
     * I/O of flows already running. */
    REQ_BUDGET = 1024,
    /* Empty pipes kept per loop, and the pipe capacity they may add up to;
     * beyond either a drained pipe is closed.  The byte cap matters for
     * unprivileged users: pipe capacity counts against pipe-user-pages-soft
     * (64 MiB per user by default), past which the kernel shrinks new pipes. */
    POOL_MAX = 64,
    POOL_MAX_BYTES = 16 << 20,
    COPY_BUF = 64 * 1024,
    /* Idle timer wheel: 256 buckets of 25 ms.  Granularity 25 ms is under the
     * 50 ms promised; longer timeouts are revisited once per 6.4 s round and
     * rescheduled, which costs nothing measurable. */
    WHEEL_SLOTS = 256,
    WHEEL_TICK_MS = 25,
    /* benchmarks/bench_relay_raw.py, 8 TCP streams on 2 cores: relay CPU per
     * GB was 0.49 s with the 64 KiB default pipe, 0.39 s at 256 KiB, 0.28 s at
     * 512 KiB and 0.29 s at 1 MiB.  End to end (run_peers.py --only bulk, the
     * engine between loadgen and tinyserver, five alternating pairs) 1 MiB
     * cost 0.22-0.34 s/GB against 0.34-0.48 at 512 KiB, at equal goodput; Go's
     * splice (mihomo, sing-box) moves 1 MiB a call too.  1 MiB is the default
     * pipe-max-size, so unprivileged processes get it; they reach
     * pipe-user-pages-soft (64 MiB) with 64 pipes holding data at once, past
     * which new pipes are small: slower, still correct. */
    DEFAULT_PIPE_SIZE = 1024 << 10,

    /* Shadowsocks AEAD (SIP004) framing. */
    SS_MAX_PAYLOAD = 0x3FFF,
    SS_TAG = 16,
    SS_NONCE = 12,
    SS_LEN_UNIT = 2 + SS_TAG, /* the sealed length of a chunk */
    SS_MAX_UNIT = SS_MAX_PAYLOAD + SS_TAG,
    /* Per seal pass: four full chunks of plaintext, sealed in AEAD_OUT_BUF. */
    AEAD_PT_READ = 4 * SS_MAX_PAYLOAD,
    /* Per open pass: ciphertext read plus a buffered partial chunk. */
    AEAD_CT_READ = 64 * 1024,
    AEAD_OUT_BUF = AEAD_PT_READ + 4 * (SS_LEN_UNIT + SS_TAG),
};

/* Reads land in L->buf; opened plaintext never exceeds the ciphertext. */
_Static_assert(AEAD_PT_READ <= COPY_BUF && AEAD_CT_READ <= COPY_BUF, "read scratch");
_Static_assert(AEAD_OUT_BUF >= AEAD_CT_READ, "open scratch");

#define WAKE_COOKIE UINT64_MAX
#define REQ_ADOPT 1u
#define REQ_CLOSE 2u
#define SPLICE_FLAGS (SPLICE_F_MOVE | SPLICE_F_NONBLOCK)

enum { C_CLIENT_RX, C_CLIENT_TX, C_UP_RX, C_UP_TX, C_COUNT };

/* Intrusive circular doubly linked list; next == NULL means "not linked". */
struct dnode {
    struct dnode *prev, *next;
};

#define CONTAINER(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

static void dl_init(struct dnode *h) { h->prev = h->next = h; }
static bool dl_empty(const struct dnode *h) { return h->next == h; }
static bool dl_linked(const struct dnode *n) { return n->next != NULL; }

static void dl_push(struct dnode *h, struct dnode *n)
{
    n->prev = h->prev;
    n->next = h;
    h->prev->next = n;
    h->prev = n;
}

static void dl_del(struct dnode *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = NULL;
}

static struct dnode *dl_pop(struct dnode *h)
{
    if (dl_empty(h))
        return NULL;
    struct dnode *n = h->next;
    dl_del(n);
    return n;
}

/* Moves every node of `from` onto the empty list `to`. */
static void dl_move_all(struct dnode *from, struct dnode *to)
{
    dl_init(to);
    if (dl_empty(from))
        return;
    to->next = from->next;
    to->prev = from->prev;
    to->next->prev = to;
    to->prev->next = to;
    dl_init(from);
}

/* One direction: bytes read from side d and written to side d ^ 1. */
struct dir {
    int pipe_r, pipe_w;
    uint32_t pipe_cap;
    uint32_t inpipe;     /* bytes in the pipe, read but not yet written */
    char *stash;         /* copy mode: bytes read but not yet written */
    uint32_t stash_off, stash_len;
    bool eof;            /* the source side sent FIN */
    bool shut;           /* shutdown(SHUT_WR) done on the destination */
    bool copy;           /* read()/send() instead of splice() */
};

/* Shadowsocks AEAD state of one flow; owned like the flow's sockets. */
struct aead {
    const EVP_CIPHER *cipher;
    uint32_t key_len;
    EVP_CIPHER_CTX *seal, *open; /* keyed once; per chunk only the nonce changes */
    uint64_t seal_nonce, open_nonce;
    uint8_t master[32];          /* wiped once the server's subkey is derived */
    uint8_t salt[32];
    uint32_t salt_have;          /* bytes of the server's salt read so far */
    bool open_keyed;
    bool in_payload;             /* the unit being read is a payload (else a length) */
    uint32_t need;               /* size of that unit, tag included */
    uint8_t *part;               /* its bytes read so far (SS_MAX_UNIT, lazily) */
    uint32_t part_len;
};

struct loop;

struct flow {
    _Atomic uint32_t gen;
    _Atomic uint32_t loop_idx;
    _Atomic uint64_t ctr[C_COUNT];
    _Atomic uint64_t last_activity_ms;

    /* Owned by the loop once adopted; written by the adder before that. */
    int fd[2];
    uint32_t timeout_ms;
    bool rd[2], wr[2], errq[2]; /* edge-triggered readiness, as hints */
    bool adopted;
    bool own;                   /* the fds came from sw_relay_add_own: never dup'ed */
    uint8_t first_dir;
    struct dir dir[2];
    struct aead *aead;          /* NULL for spliced flows */
    int64_t last_act_mono;
    int64_t timer_tick;
    struct dnode ready, timer;

    /* Guarded by L->req_lock. */
    struct dnode req;
    uint8_t req_flags;

    /* Guarded by relay->slot_lock. */
    struct flow *free_next;
};

struct pooled_pipe {
    int r, w;
    uint32_t cap;
};

struct loop {
    struct sw_relay *relay;
    int epfd, wakefd;
    pthread_t thread;
    bool started;
    _Atomic int stop;
    _Atomic uint32_t nflows;

    pthread_mutex_t req_lock;
    bool req_lock_ok;
    struct dnode reqs;

    /* Everything below belongs to the loop thread. */
    bool req_more;
    struct dnode ready;
    uint32_t nready;
    struct dnode wheel[WHEEL_SLOTS];
    uint32_t ntimed;
    int64_t wheel_cursor;
    struct pooled_pipe pool[POOL_MAX];
    int npool;
    size_t pool_bytes;
    char *buf;                  /* COPY_BUF: copy-mode and AEAD reads */
    uint8_t *abuf;              /* AEAD_OUT_BUF: sealed or opened output */
    int64_t now_mono, now_real;
};

struct sw_relay {
    int nloops;
    uint32_t capacity;
    struct loop *loops;

    struct flow *flows;
    size_t flows_bytes;
    pthread_mutex_t slot_lock;
    struct flow *free_head;
    _Atomic uint32_t hwm;

    _Atomic uint32_t active;
    _Atomic uint32_t rr;
    _Atomic int force_copy;
    _Atomic uint32_t pipe_size;

    /* Readers: add and request_close.  Writer: shutdown, so no add can slip
     * a flow in after the shutdown sweep. */
    pthread_rwlock_t life;
    bool shutting;
    pthread_mutex_t shutdown_lock; /* serialises sw_relay_shutdown() */

    /* Completions: a ring that sw_relay_add() grows in advance (one reserved
     * entry per live flow), so completing a flow never allocates. */
    pthread_mutex_t cq_lock;
    pthread_cond_t cq_cond;
    sw_completion *cq;
    size_t cq_cap, cq_head, cq_count, cq_reserved;
    bool cq_closed;
    int cfd;
};

/* ------------------------------------------------------------------------ */

/* A flow's public handle (handle_slot() splits it again); its epoll cookies
 * add the side in bit 31, which slot indices never reach. */
static inline uint64_t flow_handle(uint32_t gen, uint32_t idx)
{
    return ((uint64_t)gen << 32) | idx;
}

static inline uint64_t cookie(uint32_t gen, int side, uint32_t idx)
{
    return flow_handle(gen, idx) | ((uint64_t)side << 31);
}

static inline int ctr_rx(int side) { return side == 0 ? C_CLIENT_RX : C_UP_RX; }
static inline int ctr_tx(int side) { return side == 0 ? C_CLIENT_TX : C_UP_TX; }

/* Single writer (the owning loop), so load + store needs no atomic RMW. */
static inline void ctr_add(struct flow *f, int i, uint64_t n)
{
    uint64_t v = atomic_load_explicit(&f->ctr[i], memory_order_relaxed);
    atomic_store_explicit(&f->ctr[i], v + n, memory_order_relaxed);
}

static inline void touch(struct loop *L, struct flow *f)
{
    f->last_act_mono = L->now_mono;
    atomic_store_explicit(&f->last_activity_ms, (uint64_t)L->now_real, memory_order_relaxed);
}


/* Relaxed loads: the flow's loop is the only writer, and readers on other
 * threads validate the generation around the snapshot. */
static void counters_load(struct flow *f, sw_counters *c)
{
    c->client_rx = atomic_load_explicit(&f->ctr[C_CLIENT_RX], memory_order_relaxed);
    c->client_tx = atomic_load_explicit(&f->ctr[C_CLIENT_TX], memory_order_relaxed);
    c->upstream_rx = atomic_load_explicit(&f->ctr[C_UP_RX], memory_order_relaxed);
    c->upstream_tx = atomic_load_explicit(&f->ctr[C_UP_TX], memory_order_relaxed);
    c->last_activity_unix_ms = atomic_load_explicit(&f->last_activity_ms, memory_order_relaxed);
}

static bool is_reset(int err) { return err == ECONNRESET || err == EPIPE; }

static inline struct loop *flow_loop(struct sw_relay *r, struct flow *f)
{
    return &r->loops[atomic_load_explicit(&f->loop_idx, memory_order_relaxed)];
}

/* ---- completions -------------------------------------------------------- */

static int cq_reserve(struct sw_relay *r)
{
    int rc = 0;
    pthread_mutex_lock(&r->cq_lock);
    if (r->cq_reserved == r->cq_cap) {
        size_t ncap = r->cq_cap ? r->cq_cap * 2 : 256;
        sw_completion *n = malloc(ncap * sizeof *n);
        if (!n) {
            rc = -ENOMEM;
            goto out;
        }
        for (size_t i = 0; i < r->cq_count; i++)
            n[i] = r->cq[(r->cq_head + i) % r->cq_cap];
        free(r->cq);
        r->cq = n;
        r->cq_cap = ncap;
        r->cq_head = 0;
    }
    r->cq_reserved++;
out:
    pthread_mutex_unlock(&r->cq_lock);
    return rc;
}

static void cq_unreserve(struct sw_relay *r)
{
    pthread_mutex_lock(&r->cq_lock);
    r->cq_reserved--;
    pthread_mutex_unlock(&r->cq_lock);
}

static void cq_push(struct sw_relay *r, const sw_completion *c)
{
    pthread_mutex_lock(&r->cq_lock);
    r->cq[(r->cq_head + r->cq_count) % r->cq_cap] = *c;
    if (r->cq_count++ == 0) {
        efd_signal(r->cfd);
        pthread_cond_broadcast(&r->cq_cond);
    }
    pthread_mutex_unlock(&r->cq_lock);
}

/* ---- slots -------------------------------------------------------------- */

static struct flow *slot_alloc(struct sw_relay *r)
{
    struct flow *f = NULL;
    pthread_mutex_lock(&r->slot_lock);
    if (r->free_head) {
        f = r->free_head;
        r->free_head = f->free_next;
    } else {
        uint32_t h = atomic_load_explicit(&r->hwm, memory_order_relaxed);
        if (h < r->capacity) {
            f = &r->flows[h];
            atomic_store_explicit(&r->hwm, h + 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&r->slot_lock);
    return f;
}

static void slot_free(struct sw_relay *r, struct flow *f)
{
    pthread_mutex_lock(&r->slot_lock);
    f->free_next = r->free_head;
    r->free_head = f;
    pthread_mutex_unlock(&r->slot_lock);
}

/* ---- pipes -------------------------------------------------------------- */

static int pipe_get(struct loop *L, struct dir *D)
{
    if (L->npool > 0) {
        struct pooled_pipe *p = &L->pool[--L->npool];
        L->pool_bytes -= p->cap;
        D->pipe_r = p->r;
        D->pipe_w = p->w;
        D->pipe_cap = p->cap;
        return 0;
    }
    int p[2];
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) < 0)
        return errno;
    uint32_t want = atomic_load_explicit(&L->relay->pipe_size, memory_order_relaxed);
    /* Failure is fine: over pipe-user-pages-soft the kernel may refuse and
     * the pipe keeps whatever size it got, which F_GETPIPE_SZ reports. */
    if (want)
        (void)fcntl(p[1], F_SETPIPE_SZ, (int)want);
    int cap = fcntl(p[1], F_GETPIPE_SZ);
    D->pipe_r = p[0];
    D->pipe_w = p[1];
    D->pipe_cap = cap > 0 ? (uint32_t)cap : 4096;
    return 0;
}

/* Returns the pipe to the pool if it is empty, else closes it (its bytes are
 * being dropped with the flow). */
static void pipe_put(struct loop *L, struct dir *D)
{
    if (D->pipe_r < 0)
        return;
    if (D->inpipe == 0 && L->npool < POOL_MAX &&
        L->pool_bytes + D->pipe_cap <= POOL_MAX_BYTES) {
        L->pool[L->npool++] = (struct pooled_pipe){D->pipe_r, D->pipe_w, D->pipe_cap};
        L->pool_bytes += D->pipe_cap;
    } else {
        close(D->pipe_r);
        close(D->pipe_w);
    }
    D->pipe_r = D->pipe_w = -1;
    D->inpipe = 0;
}

static void stash_free(struct dir *D)
{
    free(D->stash);
    D->stash = NULL;
    D->stash_off = D->stash_len = 0;
}

/* The destination refused splice() with bytes already in the pipe: move them
 * to a heap stash so the copy path can deliver them. */
static int pipe_to_stash(struct loop *L, struct dir *D)
{
    char *s = malloc(D->inpipe);
    if (!s)
        return ENOMEM;
    uint32_t got = 0;
    while (got < D->inpipe) {
        ssize_t n = read(D->pipe_r, s + got, D->inpipe - got);
        if (n <= 0) {
            free(s);
            return n < 0 ? errno : EIO;
        }
        got += (uint32_t)n;
    }
    D->inpipe = 0;
    pipe_put(L, D);
    D->stash = s;
    D->stash_off = 0;
    D->stash_len = got;
    return 0;
}

static ssize_t send_nosig(int fd, const void *buf, size_t len)
{
    return send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static int sock_error(int fd)
{
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        return errno;
    return err;
}

/* Half-close: the source of direction D reached EOF and everything is written,
 * so end the destination's write side (once). */
static int shut_dest(struct flow *f, struct dir *D, int t, int *side)
{
    if (D->shut)
        return 0;
    D->shut = true;
    /* The other direction is done too: the flow completes now and close()
     * sends this FIN (all input was read, so not a reset), one syscall less
     * per flow. */
    if (f->own && f->dir[D == &f->dir[0]].shut)
        return 0; /* (only our own sockets: a foreign caller may hold a dup) */
    if (shutdown(f->fd[t], SHUT_WR) < 0) {
        int e = sock_error(f->fd[t]);
        *side = t;
        return e ? e : errno;
    }
    return 0;
}

/* Sends buf[0..n) to side t; what the socket does not take is copied to D's
 * (empty) stash.  Returns 0 or a positive errno with *side set. */
static int send_or_stash(struct loop *L, struct flow *f, struct dir *D, int t,
                         const void *buf, size_t n, int *side)
{
    ssize_t m = send_nosig(f->fd[t], buf, n);
    if (m < 0) {
        if (errno != EAGAIN && errno != EINTR) {
            *side = t;
            return errno;
        }
        if (errno == EAGAIN)
            f->wr[t] = false;
        m = 0;
    }
    if (m > 0) {
        ctr_add(f, ctr_tx(t), (uint64_t)m);
        touch(L, f);
    }
    if ((size_t)m < n) {
        D->stash = malloc(n - (size_t)m);
        if (!D->stash) {
            *side = -1;
            return ENOMEM;
        }
        memcpy(D->stash, (const char *)buf + m, n - (size_t)m);
        D->stash_off = 0;
        D->stash_len = (uint32_t)(n - (size_t)m);
    }
    return 0;
}

/* Writes D's stash to side t until it is empty or the socket is full (then
 * f->wr[t] is cleared).  Returns 0 or a positive errno with *side set. */
static int stash_flush(struct loop *L, struct flow *f, struct dir *D, int t, int *side)
{
    while (D->stash_len > 0) {
        if (!f->wr[t])
            return 0;
        ssize_t n = send_nosig(f->fd[t], D->stash + D->stash_off, D->stash_len - D->stash_off);
        if (n > 0) {
            ctr_add(f, ctr_tx(t), (uint64_t)n);
            touch(L, f);
            D->stash_off += (uint32_t)n;
            if (D->stash_off == D->stash_len)
                stash_free(D);
            continue;
        }
        if (n == 0 || errno == EAGAIN) {
            f->wr[t] = false;
            return 0;
        }
        if (errno != EINTR) {
            *side = t;
            return errno;
        }
    }
    return 0;
}

/* ---- Shadowsocks AEAD --------------------------------------------------- */

static pthread_once_t crypto_once = PTHREAD_ONCE_INIT;
static EVP_CIPHER *crypto_ciphers[4]; /* by enum sw_aead_cipher */
static EVP_KDF *crypto_hkdf;

/* Fetched once per process rather than implicitly at every key setup, which
 * in OpenSSL 3 takes a global lock per fetch.  Never freed: process-wide. */
static void crypto_init(void)
{
    static const char *const names[4] = {NULL, "AES-128-GCM", "AES-256-GCM",
                                          "ChaCha20-Poly1305"};
    for (int i = 1; i < 4; i++)
        crypto_ciphers[i] = EVP_CIPHER_fetch(NULL, names[i], NULL);
    crypto_hkdf = EVP_KDF_fetch(NULL, "HKDF", NULL);
}

static void aead_free(struct aead *X)
{
    if (!X)
        return;
    EVP_CIPHER_CTX_free(X->seal);
    EVP_CIPHER_CTX_free(X->open);
    free(X->part);
    OPENSSL_cleanse(X, sizeof *X);
    free(X);
}

static int aead_new(const sw_aead_params *p, struct aead **out)
{
    static const uint32_t key_lens[4] = {0, 16, 32, 32};
    if (!p || p->cipher < SW_AEAD_AES_128_GCM || p->cipher > SW_AEAD_CHACHA20_POLY1305 ||
        p->key_len != key_lens[p->cipher])
        return -EINVAL;
    pthread_once(&crypto_once, crypto_init);
    if (!crypto_ciphers[p->cipher] || !crypto_hkdf)
        return -EOPNOTSUPP;
    struct aead *X = calloc(1, sizeof *X);
    if (!X)
        return -ENOMEM;
    X->cipher = crypto_ciphers[p->cipher];
    X->key_len = p->key_len;
    X->seal_nonce = p->enc_nonce;
    memcpy(X->master, p->master_key, p->key_len);
    X->seal = EVP_CIPHER_CTX_new();
    X->open = EVP_CIPHER_CTX_new();
    if (!X->seal || !X->open) {
        aead_free(X);
        return -ENOMEM;
    }
    /* GCM and ChaCha20-Poly1305 both default to the 12-byte nonce SIP004 uses. */
    if (EVP_EncryptInit_ex(X->seal, X->cipher, NULL, p->enc_subkey, NULL) != 1) {
        aead_free(X);
        return -EIO;
    }
    *out = X;
    return 0;
}

static void nonce_le(uint64_t counter, uint8_t iv[SS_NONCE])
{
    for (int i = 0; i < 8; i++)
        iv[i] = (uint8_t)(counter >> (8 * i));
    memset(iv + 8, 0, SS_NONCE - 8);
}

/* n bytes of `in` -> n bytes of ciphertext and the tag at out. */
static bool aead_seal(struct aead *X, const uint8_t *in, int n, uint8_t *out)
{
    uint8_t iv[SS_NONCE];
    int len, fin;
    nonce_le(X->seal_nonce++, iv);
    return EVP_EncryptInit_ex(X->seal, NULL, NULL, NULL, iv) == 1 &&
           EVP_EncryptUpdate(X->seal, out, &len, in, n) == 1 &&
           EVP_EncryptFinal_ex(X->seal, out + len, &fin) == 1 &&
           EVP_CIPHER_CTX_ctrl(X->seal, EVP_CTRL_AEAD_GET_TAG, SS_TAG, out + n) == 1;
}

/* n bytes of ciphertext followed by the tag at `in` -> n bytes at out, which
 * the caller may use only when this returns true. */
static bool aead_open(struct aead *X, const uint8_t *in, int n, uint8_t *out)
{
    uint8_t iv[SS_NONCE];
    int len, fin;
    nonce_le(X->open_nonce++, iv);
    return EVP_DecryptInit_ex(X->open, NULL, NULL, NULL, iv) == 1 &&
           EVP_CIPHER_CTX_ctrl(X->open, EVP_CTRL_AEAD_SET_TAG, SS_TAG, (void *)(in + n)) == 1 &&
           EVP_DecryptUpdate(X->open, out, &len, in, n) == 1 &&
           EVP_DecryptFinal_ex(X->open, out + len, &fin) == 1;
}

/* HKDF-SHA1(ikm = master key, salt, info = "ss-subkey", L = key_len). */
static bool aead_key_open(struct aead *X)
{
    uint8_t subkey[32];
    EVP_KDF_CTX *k = EVP_KDF_CTX_new(crypto_hkdf);
    if (!k)
        return false;
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, (char *)"SHA1", 0),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, X->master, X->key_len),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, X->salt, X->key_len),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, (char *)"ss-subkey", 9),
        OSSL_PARAM_construct_end(),
    };
    bool ok = EVP_KDF_derive(k, subkey, X->key_len, params) == 1 &&
              EVP_DecryptInit_ex(X->open, X->cipher, NULL, subkey, NULL) == 1;
    EVP_KDF_CTX_free(k);
    OPENSSL_cleanse(subkey, sizeof subkey);
    OPENSSL_cleanse(X->master, sizeof X->master);
    return ok;
}

/* Seals in[0..n) as chunks into out (at most AEAD_OUT_BUF for n <= AEAD_PT_READ). */
static bool aead_seal_all(struct aead *X, const uint8_t *in, size_t n, uint8_t *out,
                          size_t *outn)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len = n - i < SS_MAX_PAYLOAD ? n - i : SS_MAX_PAYLOAD;
        const uint8_t be[2] = {(uint8_t)(len >> 8), (uint8_t)len};
        if (!aead_seal(X, be, 2, out + o))
            return false;
        o += SS_LEN_UNIT;
        if (!aead_seal(X, in + i, (int)len, out + o))
            return false;
        o += len + SS_TAG;
        i += len;
    }
    *outn = o;
    return true;
}

/* Feeds in[0..n) of the server's stream: salt, then length and payload units.
 * The plaintext of every payload it completes goes to out (*outn bytes, even
 * on failure).  Returns 0, EBADMSG, or EIO/ENOMEM. */
static int aead_open_all(struct aead *X, const uint8_t *in, size_t n, uint8_t *out,
                         size_t *outn)
{
    size_t i = 0, o = 0;
    int rc = 0;
    if (!X->open_keyed) {
        size_t take = X->key_len - X->salt_have;
        if (take > n)
            take = n;
        memcpy(X->salt + X->salt_have, in, take);
        X->salt_have += (uint32_t)take;
        i = take;
        if (X->salt_have < X->key_len)
            goto out;
        if (!aead_key_open(X)) {
            rc = EIO;
            goto out;
        }
        X->open_keyed = true;
        X->need = SS_LEN_UNIT;
    }
    while (i < n) {
        const uint8_t *unit;
        if (X->part_len > 0 || n - i < X->need) {
            if (!X->part && !(X->part = malloc(SS_MAX_UNIT))) {
                rc = ENOMEM;
                goto out;
            }
            size_t take = X->need - X->part_len;
            if (take > n - i)
                take = n - i;
            memcpy(X->part + X->part_len, in + i, take);
            X->part_len += (uint32_t)take;
            i += take;
            if (X->part_len < X->need)
                break;
            unit = X->part;
            X->part_len = 0;
        } else {
            unit = in + i;
            i += X->need;
        }
        if (!X->in_payload) {
            uint8_t be[2];
            if (!aead_open(X, unit, 2, be)) {
                rc = EBADMSG;
                goto out;
            }
            uint32_t len = (uint32_t)be[0] << 8 | be[1];
            if (len == 0 || len > SS_MAX_PAYLOAD) {
                rc = EBADMSG;
                goto out;
            }
            X->need = len + SS_TAG;
            X->in_payload = true;
        } else {
            uint32_t len = X->need - SS_TAG;
            if (!aead_open(X, unit, (int)len, out + o)) {
                rc = EBADMSG;
                goto out;
            }
            o += len;
            X->need = SS_LEN_UNIT;
            X->in_payload = false;
        }
    }
out:
    *outn = o;
    return rc;
}

/* True when the server's stream stopped inside its salt or a chunk. */
static bool aead_open_midway(const struct aead *X)
{
    return X->salt_have > 0 && (!X->open_keyed || X->part_len > 0 || X->in_payload);
}

/*
 * dir_pump for AEAD flows: direction 0 seals client plaintext for the
 * upstream, direction 1 opens the upstream's stream for the client.  Same
 * contract as dir_pump.
 */
static int aead_pump(struct loop *L, struct flow *f, int d, size_t *budget, int *side)
{
    const int s = d, t = d ^ 1;
    const bool sealing = d == 0;
    struct dir *D = &f->dir[d];
    struct aead *X = f->aead;

    for (;;) {
        if (D->stash_len > 0) {
            int e = stash_flush(L, f, D, t, side);
            if (e || D->stash_len > 0)
                return e;
        }

        if (D->eof) {
            if (!sealing && aead_open_midway(X)) {
                *side = s;
                return EBADMSG;
            }
            return shut_dest(f, D, t, side);
        }
        /* Not while the destination is full: the stash would only grow. */
        if (!f->rd[s] || *budget == 0 || !f->wr[t])
            return 0;
        if ((!L->buf && !(L->buf = malloc(COPY_BUF))) ||
            (!L->abuf && !(L->abuf = malloc(AEAD_OUT_BUF)))) {
            *side = -1;
            return ENOMEM;
        }
        size_t want = sealing ? AEAD_PT_READ : AEAD_CT_READ - X->part_len;
        if (want > *budget)
            want = *budget;
        ssize_t n = read(f->fd[s], L->buf, want);
        if (n > 0) {
            ctr_add(f, ctr_rx(s), (uint64_t)n);
            touch(L, f);
            *budget -= (size_t)n;
            const uint8_t *in = (const uint8_t *)L->buf;
            size_t out = 0;
            int bad;
            if (sealing)
                bad = aead_seal_all(X, in, (size_t)n, L->abuf, &out) ? 0 : EIO;
            else
                bad = aead_open_all(X, in, (size_t)n, L->abuf, &out);
            if (bad && bad != EBADMSG) {
                *side = -1;
                return bad;
            }
            /* On EBADMSG the chunks opened before the bad one still go out. */
            int e = out ? send_or_stash(L, f, D, t, L->abuf, out, side) : 0;
            if (e)
                return e;
            if (bad) {
                *side = s;
                return bad;
            }
            continue;
        }
        if (n == 0) {
            D->eof = true;
            continue;
        }
        if (errno == EAGAIN) {
            f->rd[s] = false;
            if (!sealing && X->part_len == 0) {
                free(X->part);
                X->part = NULL;
            }
            return 0;
        }
        if (errno == EINTR)
            continue;
        *side = s;
        return errno;
    }
}

/* ---- flow lifecycle ----------------------------------------------------- */

static void ready_push(struct loop *L, struct flow *f)
{
    if (!dl_linked(&f->ready)) {
        dl_push(&L->ready, &f->ready);
        L->nready++;
    }
}

static void timer_schedule(struct loop *L, struct flow *f, int64_t deadline)
{
    int64_t tick = (deadline + WHEEL_TICK_MS - 1) / WHEEL_TICK_MS;
    if (tick < L->wheel_cursor)
        tick = L->wheel_cursor;
    f->timer_tick = tick;
    dl_push(&L->wheel[tick % WHEEL_SLOTS], &f->timer);
}

static void flow_complete(struct loop *L, struct flow *f, int cause, int err, int side)
{
    struct sw_relay *r = L->relay;

    if (dl_linked(&f->ready)) {
        dl_del(&f->ready);
        L->nready--;
    }
    if (dl_linked(&f->timer))
        dl_del(&f->timer);
    if (f->adopted && f->timeout_ms)
        L->ntimed--;

    if ((cause == SW_CAUSE_RESET || err == EBADMSG) && side >= 0) {
        /* An abortive close makes the peer of the other side see the reset
         * too, instead of a clean EOF that would pass for a complete reply
         * (EBADMSG: a corrupt or cut AEAD stream from the upstream). */
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        (void)setsockopt(f->fd[side ^ 1], SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    for (int s = 0; s < 2; s++) {
        /* Explicitly, because close() drops the epoll registration only
         * with the last reference: a dup kept elsewhere would leave it. */
        if (!f->own)
            (void)epoll_ctl(L->epfd, EPOLL_CTL_DEL, f->fd[s], NULL);
        close(f->fd[s]);
        f->fd[s] = -1;
    }
    for (int d = 0; d < 2; d++) {
        pipe_put(L, &f->dir[d]);
        stash_free(&f->dir[d]);
    }
    aead_free(f->aead);
    f->aead = NULL;

    uint32_t gen = atomic_load_explicit(&f->gen, memory_order_relaxed);
    sw_completion c;
    memset(&c, 0, sizeof c);
    c.handle = flow_handle(gen, (uint32_t)(f - r->flows));
    c.cause = cause;
    c.err = err;
    c.side = side;
    counters_load(f, &c.counters);

    /* Under req_lock so sw_relay_request_close() either sees the old
     * generation and links a request the unlink below removes, or sees the
     * new one and reports the flow as finished. */
    pthread_mutex_lock(&L->req_lock);
    if (dl_linked(&f->req))
        dl_del(&f->req);
    f->req_flags = 0;
    atomic_store_explicit(&f->gen, gen + 1, memory_order_release);
    pthread_mutex_unlock(&L->req_lock);

    /* Slot and counts are released before the completion is visible, so a
     * caller reacting to it finds the capacity available again. */
    atomic_fetch_sub_explicit(&L->nflows, 1, memory_order_relaxed);
    atomic_fetch_sub_explicit(&r->active, 1, memory_order_release);
    slot_free(r, f);
    cq_push(r, &c);
}

static void flow_adopt(struct loop *L, struct flow *f)
{
    f->adopted = true;
    f->rd[0] = f->rd[1] = f->wr[0] = f->wr[1] = true;
    f->last_act_mono = L->now_mono;
    if (f->timeout_ms) {
        L->ntimed++;
        timer_schedule(L, f, L->now_mono + f->timeout_ms);
    }
    ready_push(L, f);
}

/*
 * Moves bytes of direction d until the source runs dry, the destination is
 * full, or the budget is spent.  Returns 0, or a positive errno with *side
 * set to the socket that failed (-1 when neither did, e.g. ENOMEM).
 */
static int dir_pump(struct loop *L, struct flow *f, int d, size_t *budget, int *side)
{
    const int s = d, t = d ^ 1;
    struct dir *D = &f->dir[d];

    /* Each pass either moves bytes, stops on EAGAIN, or changes state; the
     * reads are bounded by the budget and the writes by what was read. */
    for (;;) {
        if (D->stash_len > 0) {
            int e = stash_flush(L, f, D, t, side);
            if (e || D->stash_len > 0)
                return e;
        }
        if (D->inpipe > 0) {
            if (!f->wr[t])
                return 0;
            ssize_t n = splice(D->pipe_r, NULL, f->fd[t], NULL, D->inpipe, SPLICE_FLAGS);
            if (n > 0) {
                ctr_add(f, ctr_tx(t), (uint64_t)n);
                touch(L, f);
                D->inpipe -= (uint32_t)n;
                if (D->inpipe == 0)
                    pipe_put(L, D);
                continue;
            }
            if (n == 0 || errno == EAGAIN) {
                f->wr[t] = false;
                return 0;
            }
            if (errno == EINTR)
                continue;
            if (errno == EINVAL) {
                int e = pipe_to_stash(L, D);
                if (e) {
                    *side = -1;
                    return e;
                }
                D->copy = true;
                continue;
            }
            *side = t;
            return errno;
        }

        if (D->eof) {
            return shut_dest(f, D, t, side);
        }
        if (!f->rd[s] || *budget == 0)
            return 0;

        ssize_t n;
        bool copy = D->copy;
        if (!copy && D->pipe_r < 0) {
            int e = pipe_get(L, D);
            if (e == EMFILE || e == ENFILE) {
                /* Out of descriptors: this pass copies through the loop's
                 * buffer rather than fail a flow that is already open; the
                 * next pass asks for a pipe again. */
                copy = true;
            } else if (e) {
                *side = -1;
                return e;
            }
        }
        if (copy) {
            /* Without a pipe to absorb it, reading while the destination is
             * full would only move the backlog into a heap stash. */
            if (!f->wr[t])
                return 0;
            if (!L->buf && !(L->buf = malloc(COPY_BUF))) {
                *side = -1;
                return ENOMEM;
            }
            size_t want = *budget < COPY_BUF ? *budget : COPY_BUF;
            n = read(f->fd[s], L->buf, want);
            if (n > 0) {
                ctr_add(f, ctr_rx(s), (uint64_t)n);
                touch(L, f);
                *budget -= (size_t)n;
                int e = send_or_stash(L, f, D, t, L->buf, (size_t)n, side);
                if (e)
                    return e;
                continue;
            }
        } else {
            /* Only an empty pipe is filled, so EAGAIN here always means "the
             * socket is dry", never "the pipe is full". */
            n = splice(f->fd[s], NULL, D->pipe_w, NULL, D->pipe_cap, SPLICE_FLAGS);
            if (n > 0) {
                D->inpipe = (uint32_t)n;
                ctr_add(f, ctr_rx(s), (uint64_t)n);
                touch(L, f);
                *budget = (size_t)n >= *budget ? 0 : *budget - (size_t)n;
                continue;
            }
        }
        if (n == 0) {
            D->eof = true;
            pipe_put(L, D);
            continue;
        }
        if (errno == EAGAIN) {
            f->rd[s] = false;
            pipe_put(L, D);
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno == EINVAL && !copy) {
            pipe_put(L, D);
            D->copy = true;
            continue;
        }
        *side = s;
        return errno;
    }
}

static void flow_service(struct loop *L, struct flow *f)
{
    size_t budget = FLOW_BUDGET;
    int side = -1, err = 0;

    for (int i = 0; i < 2 && !err; i++) {
        int d = f->first_dir ^ i;
        err = f->aead ? aead_pump(L, f, d, &budget, &side) : dir_pump(L, f, d, &budget, &side);
    }

    /* A socket can fail where no pump looks at it any more (for instance a
     * reset on a side whose direction already saw EOF), so ask it. */
    for (int s = 0; s < 2 && !err; s++) {
        if (f->errq[s]) {
            f->errq[s] = false;
            err = sock_error(f->fd[s]);
            side = s;
        }
    }
    if (err) {
        flow_complete(L, f, is_reset(err) ? SW_CAUSE_RESET : SW_CAUSE_ERROR, err, side);
        return;
    }
    if (f->dir[0].shut && f->dir[1].shut) {
        flow_complete(L, f, SW_CAUSE_DONE, 0, SW_SIDE_NONE);
        return;
    }
    if (budget == 0) {
        f->first_dir ^= 1;
        ready_push(L, f);
    }
}

/* ---- loop --------------------------------------------------------------- */

static void clocks_update(struct loop *L)
{
    L->now_mono = (int64_t)sw_mono_ms();
    L->now_real = (int64_t)sw_real_ms();
}

static void handle_event(struct loop *L, const struct epoll_event *ev)
{
    uint64_t ck = ev->data.u64;
    if (ck == WAKE_COOKIE) {
        efd_clear(L->wakefd);
        L->req_more = true;
        return;
    }
    uint32_t idx = (uint32_t)ck & 0x7fffffffu;
    int side = (int)((ck >> 31) & 1);
    uint32_t gen = (uint32_t)(ck >> 32);
    struct flow *f = &L->relay->flows[idx];
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != gen || !f->adopted)
        return;
    uint32_t e = ev->events;
    if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
        f->rd[side] = true;
    if (e & (EPOLLOUT | EPOLLHUP | EPOLLERR))
        f->wr[side] = true;
    if (e & EPOLLERR)
        f->errq[side] = true;
    ready_push(L, f);
}

static void requests_run(struct loop *L)
{
    for (int i = 0; i < REQ_BUDGET; i++) {
        struct flow *f = NULL;
        uint8_t flags = 0;
        pthread_mutex_lock(&L->req_lock);
        struct dnode *n = dl_pop(&L->reqs);
        if (n) {
            f = CONTAINER(n, struct flow, req);
            flags = f->req_flags;
            f->req_flags = 0;
        }
        pthread_mutex_unlock(&L->req_lock);
        if (!f) {
            L->req_more = false;
            return;
        }
        if (flags & REQ_CLOSE)
            flow_complete(L, f, SW_CAUSE_CLOSED, 0, SW_SIDE_NONE);
        else if (flags & REQ_ADOPT)
            flow_adopt(L, f);
    }
}

static void ready_run(struct loop *L)
{
    /* Only the flows queued before this pass: requeued ones wait for the next
     * epoll_wait so fresh events get their turn. */
    for (uint32_t n = L->nready; n > 0; n--) {
        struct dnode *node = dl_pop(&L->ready);
        if (!node)
            break;
        L->nready--;
        flow_service(L, CONTAINER(node, struct flow, ready));
    }
}

static void timers_run(struct loop *L)
{
    int64_t now_tick = L->now_mono / WHEEL_TICK_MS;
    if (L->ntimed == 0) {
        L->wheel_cursor = now_tick;
        return;
    }
    /* After a long stall one visit per bucket is enough: each entry is
     * checked against its real deadline. */
    if (now_tick - L->wheel_cursor >= WHEEL_SLOTS)
        L->wheel_cursor = now_tick - WHEEL_SLOTS + 1;
    for (; L->wheel_cursor <= now_tick; L->wheel_cursor++) {
        struct dnode *h = &L->wheel[L->wheel_cursor % WHEEL_SLOTS];
        if (dl_empty(h))
            continue;
        struct dnode batch, *n;
        dl_move_all(h, &batch);
        while ((n = dl_pop(&batch))) {
            struct flow *f = CONTAINER(n, struct flow, timer);
            if (f->timer_tick > L->wheel_cursor) {
                dl_push(h, n); /* due in a later round of the wheel */
                continue;
            }
            int64_t deadline = f->last_act_mono + f->timeout_ms;
            if (deadline <= L->now_mono)
                flow_complete(L, f, SW_CAUSE_IDLE, 0, SW_SIDE_NONE);
            else
                timer_schedule(L, f, deadline);
        }
    }
}

static int loop_timeout(struct loop *L)
{
    if (L->nready > 0 || L->req_more)
        return 0;
    if (L->ntimed == 0)
        return -1; /* nothing can happen without an event: sleep */
    L->now_mono = (int64_t)sw_mono_ms();
    for (int64_t i = 0; i < WHEEL_SLOTS; i++) {
        int64_t t = L->wheel_cursor + i;
        if (!dl_empty(&L->wheel[t % WHEEL_SLOTS])) {
            int64_t ms = t * WHEEL_TICK_MS - L->now_mono;
            return ms <= 0 ? 0 : (int)ms;
        }
    }
    return WHEEL_SLOTS * WHEEL_TICK_MS;
}

static void *loop_main(void *arg)
{
    struct loop *L = arg;
    struct epoll_event ev[EVENTS_MAX];

    clocks_update(L);
    L->wheel_cursor = L->now_mono / WHEEL_TICK_MS;
    while (!atomic_load_explicit(&L->stop, memory_order_acquire)) {
        int n = epoll_wait(L->epfd, ev, EVENTS_MAX, loop_timeout(L));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break; /* only EBADF/EINVAL, i.e. a bug: do not spin */
        }
        clocks_update(L);
        for (int i = 0; i < n; i++)
            handle_event(L, &ev[i]);
        if (L->req_more)
            requests_run(L);
        ready_run(L);
        timers_run(L);
    }
    return NULL;
}

/* ---- public API --------------------------------------------------------- */

int sw_relay_abi_version(void) { return SW_RELAY_ABI_VERSION; }

const char *sw_strerror(int code)
{
    if (code < 0)
        code = -code;
    switch (code) {
    case 0:
        return "success";
    case ESTALE:
        return "stale flow handle: the flow has finished";
    case ENOENT:
        return "no such flow";
    case ESHUTDOWN:
        return "relay is shut down";
    case ENOSPC:
        return "relay is at capacity";
    case EBADMSG:
        return "AEAD stream failed authentication or was cut mid-chunk";
    default:
        break;
    }
    /* Unlike strerror(), a pointer to constant storage: safe from any thread. */
    const char *s = strerrordesc_np(code);
    return s ? s : "unknown error";
}

static void loops_stop(struct sw_relay *r)
{
    for (int i = 0; i < r->nloops; i++) {
        struct loop *L = &r->loops[i];
        if (!L->started)
            continue;
        atomic_store_explicit(&L->stop, 1, memory_order_release);
        efd_signal(L->wakefd);
    }
    for (int i = 0; i < r->nloops; i++) {
        struct loop *L = &r->loops[i];
        if (L->started) {
            pthread_join(L->thread, NULL);
            L->started = false;
        }
    }
}

static void loops_teardown(struct sw_relay *r)
{
    for (int i = 0; i < r->nloops; i++) {
        struct loop *L = &r->loops[i];
        while (L->npool > 0) {
            struct pooled_pipe *p = &L->pool[--L->npool];
            close(p->r);
            close(p->w);
        }
        L->pool_bytes = 0;
        if (L->epfd >= 0)
            close(L->epfd);
        if (L->wakefd >= 0)
            close(L->wakefd);
        L->epfd = L->wakefd = -1;
        free(L->buf);
        L->buf = NULL;
        free(L->abuf);
        L->abuf = NULL;
    }
}

static void relay_destroy(struct sw_relay *r)
{
    loops_stop(r);
    loops_teardown(r);
    if (r->loops) {
        for (int i = 0; i < r->nloops; i++)
            if (r->loops[i].req_lock_ok)
                pthread_mutex_destroy(&r->loops[i].req_lock);
        free(r->loops);
    }
    if (r->flows && r->flows != MAP_FAILED)
        munmap(r->flows, r->flows_bytes);
    if (r->cfd >= 0)
        close(r->cfd);
    free(r->cq);
    pthread_mutex_destroy(&r->slot_lock);
    pthread_rwlock_destroy(&r->life);
    pthread_mutex_destroy(&r->shutdown_lock);
    pthread_mutex_destroy(&r->cq_lock);
    pthread_cond_destroy(&r->cq_cond);
    free(r);
}

static int loop_init(struct sw_relay *r, struct loop *L)
{
    L->relay = r;
    dl_init(&L->reqs);
    dl_init(&L->ready);
    for (int i = 0; i < WHEEL_SLOTS; i++)
        dl_init(&L->wheel[i]);
    if (pthread_mutex_init(&L->req_lock, NULL) != 0)
        return -ENOMEM;
    L->req_lock_ok = true;
    L->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (L->epfd < 0)
        return -errno;
    L->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (L->wakefd < 0)
        return -errno;
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = WAKE_COOKIE};
    if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, L->wakefd, &ev) < 0)
        return -errno;
    return 0;
}

int sw_relay_new(int nloops, uint32_t capacity, sw_relay **out)
{
    if (!out || nloops < 0 || nloops > 1024 || capacity == 0 ||
        capacity > SW_RELAY_MAX_CAPACITY)
        return -EINVAL;
    *out = NULL;
    if (nloops == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        nloops = n < 1 ? 1 : (n > 1024 ? 1024 : (int)n);
    }

    struct sw_relay *r = calloc(1, sizeof *r);
    if (!r)
        return -ENOMEM;
    r->cfd = -1;
    r->nloops = nloops;
    r->capacity = capacity;
    atomic_store(&r->pipe_size, (uint32_t)DEFAULT_PIPE_SIZE);
    pthread_mutex_init(&r->slot_lock, NULL);
    pthread_rwlock_init(&r->life, NULL);
    pthread_mutex_init(&r->shutdown_lock, NULL);
    pthread_mutex_init(&r->cq_lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cq_cond, &ca);
    pthread_condattr_destroy(&ca);

    int rc;
    r->loops = calloc((size_t)nloops, sizeof *r->loops);
    if (!r->loops) {
        rc = -ENOMEM;
        goto fail;
    }
    for (int i = 0; i < nloops; i++)
        r->loops[i].epfd = r->loops[i].wakefd = -1;

    /* Reserved, not committed: pages of the slot table become resident only
     * as slots are first used, so a large capacity costs address space only. */
    r->flows_bytes = (size_t)capacity * sizeof(struct flow);
    r->flows = mmap(NULL, r->flows_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r->flows == MAP_FAILED) {
        r->flows = NULL;
        rc = -errno;
        goto fail;
    }
    r->cfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->cfd < 0) {
        rc = -errno;
        goto fail;
    }
    for (int i = 0; i < nloops; i++) {
        rc = loop_init(r, &r->loops[i]);
        if (rc)
            goto fail;
    }

    for (int i = 0; i < nloops; i++) {
        struct loop *L = &r->loops[i];
        rc = loop_thread_start(&L->thread, loop_main, L, "sw-relay", i);
        if (rc)
            goto fail;
        L->started = true;
    }
    *out = r;
    return 0;

fail:
    relay_destroy(r);
    return rc;
}

int sw_relay_shutdown(sw_relay *r)
{
    if (!r)
        return -EINVAL;
    pthread_mutex_lock(&r->shutdown_lock);
    /* Written only under shutdown_lock too, so readable here without `life`. */
    if (r->shutting) {
        pthread_mutex_unlock(&r->shutdown_lock);
        return 0;
    }
    pthread_rwlock_wrlock(&r->life);
    r->shutting = true;
    pthread_rwlock_unlock(&r->life);

    loops_stop(r);
    /* The loops are joined, so this thread may act as every loop now. */
    uint32_t hwm = atomic_load_explicit(&r->hwm, memory_order_acquire);
    for (uint32_t i = 0; i < hwm; i++) {
        struct flow *f = &r->flows[i];
        if (atomic_load_explicit(&f->gen, memory_order_acquire) & 1)
            flow_complete(flow_loop(r, f), f, SW_CAUSE_SHUTDOWN, 0, SW_SIDE_NONE);
    }
    loops_teardown(r);

    pthread_mutex_lock(&r->cq_lock);
    r->cq_closed = true;
    /* Left readable for good, so a poller notices the shutdown even when no
     * completion was pending. */
    efd_signal(r->cfd);
    pthread_cond_broadcast(&r->cq_cond);
    pthread_mutex_unlock(&r->cq_lock);

    pthread_mutex_unlock(&r->shutdown_lock);
    return 0;
}

void sw_relay_free(sw_relay *r)
{
    if (!r)
        return;
    sw_relay_shutdown(r);
    relay_destroy(r);
}

int sw_relay_loops(sw_relay *r) { return r ? r->nloops : -EINVAL; }

uint32_t sw_relay_active(sw_relay *r)
{
    return r ? atomic_load_explicit(&r->active, memory_order_acquire) : 0;
}

int sw_relay_set_pipe_size(sw_relay *r, uint32_t bytes)
{
    if (!r || (bytes != 0 && (bytes < 4096 || bytes > (1u << 30))))
        return -EINVAL;
    atomic_store(&r->pipe_size, bytes);
    return 0;
}

int sw_relay_debug_force_copy(sw_relay *r, int on)
{
    if (!r)
        return -EINVAL;
    atomic_store(&r->force_copy, on ? 1 : 0);
    return 0;
}

/* Under L->req_lock: adds `flag` to the flow's pending requests, queueing the
 * flow unless it already is (then the loop will see the flag anyway).  True
 * when the loop must be woken: its request list was empty. */
static bool req_post(struct loop *L, struct flow *f, uint8_t flag)
{
    bool wake = false;
    if (!f->req_flags) {
        wake = dl_empty(&L->reqs);
        dl_push(&L->reqs, &f->req);
    }
    f->req_flags |= flag;
    return wake;
}

/* Takes `life` as a reader, or fails with -ESHUTDOWN (and holds nothing) once
 * sw_relay_shutdown() has begun. */
static int life_enter(struct sw_relay *r)
{
    pthread_rwlock_rdlock(&r->life);
    if (r->shutting) {
        pthread_rwlock_unlock(&r->life);
        return -ESHUTDOWN;
    }
    return 0;
}

static uint32_t pick_loop(struct sw_relay *r)
{
    /* Least loaded, scanning from a rotating start so ties spread out. */
    uint32_t n = (uint32_t)r->nloops;
    uint32_t start = atomic_fetch_add_explicit(&r->rr, 1, memory_order_relaxed) % n;
    uint32_t best = start;
    uint32_t best_load = atomic_load_explicit(&r->loops[start].nflows, memory_order_relaxed);
    for (uint32_t i = 1; i < n && best_load > 0; i++) {
        uint32_t j = (start + i) % n;
        uint32_t load = atomic_load_explicit(&r->loops[j].nflows, memory_order_relaxed);
        if (load < best_load) {
            best = j;
            best_load = load;
        }
    }
    return best;
}

static void flow_init(struct sw_relay *r, struct flow *f, uint32_t li, int cfd, int ufd,
                      uint32_t idle_ms, struct aead *aead)
{
    atomic_store_explicit(&f->loop_idx, li, memory_order_relaxed);
    f->fd[0] = cfd;
    f->fd[1] = ufd;
    f->timeout_ms = idle_ms;
    f->adopted = false;
    f->first_dir = 0;
    for (int s = 0; s < 2; s++)
        f->rd[s] = f->wr[s] = f->errq[s] = false;
    bool copy = atomic_load_explicit(&r->force_copy, memory_order_relaxed) != 0;
    for (int d = 0; d < 2; d++) {
        f->dir[d] = (struct dir){.pipe_r = -1, .pipe_w = -1, .copy = copy};
    }
    f->aead = aead;
    f->last_act_mono = 0;
    f->timer_tick = 0;
    f->ready.prev = f->ready.next = NULL;
    f->timer.prev = f->timer.next = NULL;
    f->req.prev = f->req.next = NULL;
    f->req_flags = 0;
    f->free_next = NULL;
    /* Seqlock writer side: a reader holding a stale handle that sees any of
     * the zeroed counters below is guaranteed to also see the bumped
     * generation on its re-check. */
    atomic_thread_fence(memory_order_release);
    for (int i = 0; i < C_COUNT; i++)
        atomic_store_explicit(&f->ctr[i], 0, memory_order_relaxed);
    atomic_store_explicit(&f->last_activity_ms, sw_real_ms(), memory_order_relaxed);
}

/* sw_relay_add and sw_relay_add_aead; on success the flow owns `aead`. */
static int relay_add(sw_relay *r, int client_fd, int upstream_fd, uint32_t idle_timeout_ms,
                     struct aead *aead, bool own, uint64_t *handle_out)
{
    if (!r || !handle_out)
        return -EINVAL;
    if (client_fd < 0 || upstream_fd < 0)
        return -EBADF;
    if (client_fd == upstream_fd)
        return -EINVAL;
    const int fds[2] = {client_fd, upstream_fd};
    int oldfl[2] = {-1, -1};
    /* A caller's fds are checked and made non-blocking; the C path's own are
     * distinct non-blocking sockets already. */
    if (!own) {
        struct stat st[2];
        for (int i = 0; i < 2; i++) {
            if (fstat(fds[i], &st[i]) < 0)
                return -errno;
            if (!S_ISSOCK(st[i].st_mode))
                return -ENOTSOCK;
        }
        /* Two numbers for one socket (a dup) would relay it to itself. */
        if (st[0].st_dev == st[1].st_dev && st[0].st_ino == st[1].st_ino)
            return -EINVAL;
    }

    int rc = life_enter(r);
    if (rc)
        return rc;
    rc = cq_reserve(r);
    if (rc)
        goto out_unlock;
    struct flow *f = slot_alloc(r);
    if (!f) {
        rc = -ENOSPC;
        goto out_unreserve;
    }
    for (int i = 0; i < 2 && !own; i++) { /* (see above) */
        int fl = fcntl(fds[i], F_GETFL);
        if (fl < 0 || (!(fl & O_NONBLOCK) && fcntl(fds[i], F_SETFL, fl | O_NONBLOCK) < 0)) {
            rc = -errno;
            goto out_restore;
        }
        oldfl[i] = fl;
    }

    uint32_t li = pick_loop(r);
    struct loop *L = &r->loops[li];
    uint32_t idx = (uint32_t)(f - r->flows);
    uint32_t gen = atomic_load_explicit(&f->gen, memory_order_relaxed) + 1;
    flow_init(r, f, li, client_fd, upstream_fd, idle_timeout_ms, aead);
    f->own = own;

    /* Events may reach the loop as soon as the first ADD returns; it drops
     * them until adoption (see the top of this file), so undoing is safe. */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET};
    ev.data.u64 = cookie(gen, 0, idx);
    if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, client_fd, &ev) < 0) {
        rc = -errno;
        goto out_restore;
    }
    ev.data.u64 = cookie(gen, 1, idx);
    if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, upstream_fd, &ev) < 0) {
        rc = -errno;
        (void)epoll_ctl(L->epfd, EPOLL_CTL_DEL, client_fd, NULL);
        goto out_restore;
    }

    atomic_fetch_add_explicit(&L->nflows, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->active, 1, memory_order_relaxed);
    atomic_store_explicit(&f->gen, gen, memory_order_release);
    *handle_out = flow_handle(gen, idx);

    pthread_mutex_lock(&L->req_lock);
    bool wake = req_post(L, f, REQ_ADOPT);
    pthread_mutex_unlock(&L->req_lock);
    if (wake)
        efd_signal(L->wakefd);
    pthread_rwlock_unlock(&r->life);
    return 0;

out_restore:
    for (int i = 0; i < 2; i++)
        if (oldfl[i] >= 0 && !(oldfl[i] & O_NONBLOCK))
            (void)fcntl(fds[i], F_SETFL, oldfl[i]);
    f->aead = NULL; /* still the caller's */
    slot_free(r, f);
out_unreserve:
    cq_unreserve(r);
out_unlock:
    pthread_rwlock_unlock(&r->life);
    return rc;
}

int sw_relay_add(sw_relay *r, int client_fd, int upstream_fd, uint32_t idle_timeout_ms,
                 uint64_t *handle_out)
{
    return relay_add(r, client_fd, upstream_fd, idle_timeout_ms, NULL, false, handle_out);
}

int sw_relay_add_own(sw_relay *r, int client_fd, int upstream_fd, uint32_t idle_timeout_ms,
                     uint64_t *handle_out)
{
    return relay_add(r, client_fd, upstream_fd, idle_timeout_ms, NULL, true, handle_out);
}

int sw_relay_add_aead(sw_relay *r, int client_fd, int upstream_fd, uint32_t idle_timeout_ms,
                      const sw_aead_params *params, uint64_t *handle_out)
{
    if (!r || !handle_out)
        return -EINVAL;
    struct aead *X;
    int rc = aead_new(params, &X);
    if (rc)
        return rc;
    rc = relay_add(r, client_fd, upstream_fd, idle_timeout_ms, X, false, handle_out);
    if (rc)
        aead_free(X);
    return rc;
}

/* Splits a handle and checks it names a slot that has been used. */
static struct flow *handle_slot(struct sw_relay *r, uint64_t handle, uint32_t *gen)
{
    uint32_t idx = (uint32_t)handle;
    *gen = (uint32_t)(handle >> 32);
    if (!(*gen & 1) || idx >= atomic_load_explicit(&r->hwm, memory_order_acquire))
        return NULL;
    return &r->flows[idx];
}

int sw_relay_request_close(sw_relay *r, uint64_t handle)
{
    if (!r)
        return -EINVAL;
    uint32_t gen;
    struct flow *f = handle_slot(r, handle, &gen);
    if (!f)
        return -ENOENT;
    int rc = life_enter(r);
    if (rc)
        return rc;
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != gen) {
        rc = -ESTALE;
        goto out;
    }
    /* Any loop index read here is valid; the generation re-check under that
     * loop's lock tells whether it is the flow's. */
    struct loop *L = flow_loop(r, f);
    pthread_mutex_lock(&L->req_lock);
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != gen) {
        pthread_mutex_unlock(&L->req_lock);
        rc = -ESTALE;
        goto out;
    }
    bool wake = req_post(L, f, REQ_CLOSE);
    pthread_mutex_unlock(&L->req_lock);
    if (wake)
        efd_signal(L->wakefd);
out:
    pthread_rwlock_unlock(&r->life);
    return rc;
}

static int read_counters(struct sw_relay *r, uint64_t handle, sw_counters *out)
{
    uint32_t gen;
    struct flow *f = handle_slot(r, handle, &gen);
    if (!f)
        return -ENOENT;
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != gen)
        return -ESTALE;
    sw_counters c;
    counters_load(f, &c);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&f->gen, memory_order_relaxed) != gen)
        return -ESTALE;
    *out = c;
    return 0;
}

int sw_relay_counters(sw_relay *r, uint64_t handle, sw_counters *out)
{
    if (!r || !out)
        return -EINVAL;
    return read_counters(r, handle, out);
}

int sw_relay_counters_many(sw_relay *r, const uint64_t *handles, sw_counters *out,
                           uint8_t *alive, size_t n)
{
    if (!r || (n && (!handles || !out || !alive)))
        return -EINVAL;
    int live = 0;
    for (size_t i = 0; i < n; i++) {
        alive[i] = read_counters(r, handles[i], &out[i]) == 0;
        if (alive[i])
            live++;
        else
            memset(&out[i], 0, sizeof out[i]);
    }
    return live;
}

int sw_relay_completion_fd(sw_relay *r) { return r ? r->cfd : -EINVAL; }

int sw_relay_drain(sw_relay *r, sw_completion *out, size_t max)
{
    if (!r || (max && !out))
        return -EINVAL;
    if (max > INT_MAX)
        max = INT_MAX;
    pthread_mutex_lock(&r->cq_lock);
    size_t n = r->cq_count < max ? r->cq_count : max;
    for (size_t i = 0; i < n; i++)
        out[i] = r->cq[(r->cq_head + i) % r->cq_cap];
    if (n) {
        r->cq_head = (r->cq_head + n) % r->cq_cap;
        r->cq_count -= n;
        r->cq_reserved -= n;
    }
    /* Keeps the eventfd readable exactly while completions are pending. */
    if (r->cq_count == 0 && !r->cq_closed)
        efd_clear(r->cfd);
    pthread_mutex_unlock(&r->cq_lock);
    return (int)n;
}

int sw_relay_wait(sw_relay *r, int timeout_ms)
{
    if (!r)
        return -EINVAL;
    struct timespec deadline;
    if (timeout_ms > 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&r->cq_lock);
    while (r->cq_count == 0 && !r->cq_closed && timeout_ms != 0) {
        int e = timeout_ms < 0 ? pthread_cond_wait(&r->cq_cond, &r->cq_lock)
                               : pthread_cond_timedwait(&r->cq_cond, &r->cq_lock, &deadline);
        if (e == ETIMEDOUT)
            break;
    }
    size_t n = r->cq_count;
    pthread_mutex_unlock(&r->cq_lock);
    return n > INT_MAX ? INT_MAX : (int)n;
}
