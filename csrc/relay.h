/*
 * spliceway C relay: moves bytes between pairs of connected sockets with
 * splice() in epoll loops that run on their own pthreads, never touching
 * Python, so the proxy's data path runs without the GIL.  Flows added with
 * sw_relay_add_aead() instead speak Shadowsocks AEAD (SIP004) on the upstream
 * side, sealed and opened by the same loops through OpenSSL's libcrypto.
 *
 * Conventions: every function returns 0 (or a count) on success and -errno on
 * failure; sw_strerror() renders such a code.  Everything between the
 * SW_CDEF markers is read verbatim by csrc/relay_build.py as the cffi cdef,
 * so that part must stay free of #include, #if and expression macros.
 */
#ifndef SW_RELAY_H
#define SW_RELAY_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

/* Bumped whenever a struct layout or a function signature below changes, so
 * a stale build of the extension is refused instead of misread. */
#define SW_RELAY_ABI_VERSION 2

/* Upper bound for `capacity`: slot indices share the epoll cookie with a
 * generation and a side bit. */
#define SW_RELAY_MAX_CAPACITY 16777216

typedef struct sw_relay sw_relay;

/* Byte counts are exact; last_activity_unix_ms is CLOCK_REALTIME in ms of the
 * last time bytes moved (the add time until then).  For AEAD flows the client
 * counts are plaintext and the upstream counts ciphertext (salt, lengths,
 * tags included), each as read from or written to its socket. */
typedef struct sw_counters {
    uint64_t client_rx;   /* read from the client socket */
    uint64_t client_tx;   /* written to the client socket */
    uint64_t upstream_rx; /* read from the upstream socket */
    uint64_t upstream_tx; /* written to the upstream socket */
    uint64_t last_activity_unix_ms;
} sw_counters;

enum sw_cause {
    SW_CAUSE_DONE = 1,     /* both directions reached EOF, all bytes delivered */
    SW_CAUSE_RESET = 2,    /* ECONNRESET/EPIPE on `side`; reset propagated */
    SW_CAUSE_ERROR = 3,    /* any other error, see err (EBADMSG: AEAD stream
                              failed authentication or was cut mid-chunk) */
    SW_CAUSE_IDLE = 4,     /* no byte moved for idle_timeout_ms */
    SW_CAUSE_CLOSED = 5,   /* sw_relay_request_close() */
    SW_CAUSE_SHUTDOWN = 6  /* the relay was shut down with the flow open */
};

enum sw_side {
    SW_SIDE_NONE = -1,
    SW_SIDE_CLIENT = 0,
    SW_SIDE_UPSTREAM = 1
};

typedef struct sw_completion {
    uint64_t handle;
    int32_t cause;  /* enum sw_cause */
    int32_t err;    /* positive errno, 0 when none */
    int32_t side;   /* enum sw_side */
    int32_t reserved;
    sw_counters counters; /* final values */
} sw_completion;

int sw_relay_abi_version(void);
const char *sw_strerror(int code);

/* nloops 0 = one loop per online CPU.  capacity = maximum concurrent flows. */
int sw_relay_new(int nloops, uint32_t capacity, sw_relay **out);
/* Stops the loops, completes every open flow with SW_CAUSE_SHUTDOWN (their
 * completions stay drainable) and wakes sw_relay_wait().  Idempotent. */
int sw_relay_shutdown(sw_relay *relay);
/* sw_relay_shutdown() and then releases everything.  No other call may be in
 * progress or follow. */
void sw_relay_free(sw_relay *relay);

int sw_relay_loops(sw_relay *relay);
uint32_t sw_relay_active(sw_relay *relay);

/* Takes ownership of both fds on success only. */
int sw_relay_add(sw_relay *relay, int client_fd, int upstream_fd,
                 uint32_t idle_timeout_ms, uint64_t *handle_out);
int sw_relay_request_close(sw_relay *relay, uint64_t handle);
int sw_relay_counters(sw_relay *relay, uint64_t handle, sw_counters *out);
/* alive[i] = 1 and out[i] filled for open flows; alive[i] = 0 otherwise.
 * Returns how many were alive. */
int sw_relay_counters_many(sw_relay *relay, const uint64_t *handles,
                           sw_counters *out, uint8_t *alive, size_t n);

int sw_relay_completion_fd(sw_relay *relay);
int sw_relay_drain(sw_relay *relay, sw_completion *out, size_t max);
/* timeout_ms < 0 waits without limit.  Returns the number of completions
 * pending (0 on timeout or once the relay is shut down with none left). */
int sw_relay_wait(sw_relay *relay, int timeout_ms);

/* Shadowsocks AEAD ciphers (SIP004 method names aes-128-gcm, aes-256-gcm,
 * chacha20-ietf-poly1305). */
enum sw_aead_cipher {
    SW_AEAD_AES_128_GCM = 1,
    SW_AEAD_AES_256_GCM = 2,
    SW_AEAD_CHACHA20_POLY1305 = 3
};

typedef struct sw_aead_params {
    int32_t cipher;          /* enum sw_aead_cipher */
    uint32_t key_len;        /* 16 or 32, must match cipher */
    uint8_t master_key[32];  /* first key_len bytes used */
    uint8_t enc_subkey[32];  /* subkey of the salt the caller already sent */
    uint64_t enc_nonce;      /* next nonce counter for sealing */
} sw_aead_params;

/* Like sw_relay_add, but the upstream side speaks Shadowsocks AEAD (copy
 * path).  The caller has already sent its salt (and usually the sealed target
 * header) upstream; the relay seals what the client sends as chunks with
 * enc_subkey from nonce enc_nonce on, and opens the server's stream (salt,
 * then chunks; subkey = HKDF-SHA1(master_key, salt, "ss-subkey")).  A failed
 * tag, a bad chunk length or an upstream EOF inside the salt or a chunk
 * completes the flow with SW_CAUSE_ERROR, EBADMSG, SW_SIDE_UPSTREAM and resets
 * the client.  -EINVAL for bad params; the params are copied, not kept. */
int sw_relay_add_aead(sw_relay *relay, int client_fd, int upstream_fd,
                      uint32_t idle_timeout_ms, const sw_aead_params *params,
                      uint64_t *handle_out);

/* Size requested with F_SETPIPE_SZ for pipes created from now on (default
 * 1 MiB); 0 keeps the kernel default.  Pipes already pooled keep their size.
 * A refused request is not an error: the pipe keeps the size it has. */
int sw_relay_set_pipe_size(sw_relay *relay, uint32_t bytes);

/* Test hook: flows added afterwards copy through user space instead of
 * splicing, exercising the fallback used for fds that refuse splice(). */
int sw_relay_debug_force_copy(sw_relay *relay, int on);

/* SW_CDEF_END */

/* For the C connection path: sw_relay_add for two sockets it made itself
 * (distinct, non-blocking), without re-checking them: four syscalls fewer. */
int sw_relay_add_own(sw_relay *relay, int client_fd, int upstream_fd,
                     uint32_t idle_timeout_ms, uint64_t *handle_out);

#endif /* SW_RELAY_H */
