"""Python face of the C splice relay in ``spliceway._relay`` (whose connection path and
route tables have their own faces, :mod:`spliceway.native.conn` and
:mod:`spliceway.native.route`; the three share :func:`check` and :class:`RelayError`).

The relay moves bytes between pairs of connected sockets in C threads that never
take the GIL.  Python hands it two fds with :meth:`Relay.add` (spliced) or
:meth:`Relay.add_aead` (the upstream speaks Shadowsocks AEAD, sealed and opened
in C), samples byte counters while the flow runs, and learns how each flow ended
from completions (:meth:`Relay.wait` / :meth:`Relay.drain`, or by polling
:meth:`Relay.fileno`).

Handles are opaque integers that stay unique per slot reuse, so a handle of a
finished flow never names a newer one: its counters read as ``None`` and
closing it returns ``False``.
"""

from __future__ import annotations

import enum
import errno as errno_mod
import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from spliceway._relay import ffi, lib
from spliceway.protocols.shadowsocks import CIPHERS

__all__ = [
    "ABI_VERSION",
    "Cause",
    "Completion",
    "Counters",
    "Relay",
    "RelayError",
    "check",
    "native_abi_version",
]

#: The C ABI this module was written against; the compiled library must match.
ABI_VERSION = 2

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
_INT_MAX = (1 << 31) - 1
#: A wait(None) is done in slices this long, so Ctrl-C is seen between them.
_WAIT_SLICE_MS = 1000
_SIDES: dict[int, str | None] = {0: "client", 1: "upstream"}
_FINISHED = (errno_mod.ENOENT, errno_mod.ESTALE, errno_mod.ESHUTDOWN)
#: Shadowsocks AEAD method name -> enum sw_aead_cipher (key sizes: the codec's CIPHERS).
_AEAD_CODES: dict[str, int] = {
    "aes-128-gcm": lib.SW_AEAD_AES_128_GCM,
    "aes-256-gcm": lib.SW_AEAD_AES_256_GCM,
    "chacha20-ietf-poly1305": lib.SW_AEAD_CHACHA20_POLY1305,
}


class Cause(enum.IntEnum):
    """Why a flow ended."""

    DONE = 1  # both directions reached EOF and every byte was delivered
    RESET = 2  # ECONNRESET/EPIPE on one side; the reset was passed to the other
    ERROR = 3  # any other error; EBADMSG: an AEAD stream failed authentication or was cut
    IDLE = 4  # no byte moved for the flow's idle timeout
    CLOSED = 5  # Relay.request_close()
    SHUTDOWN = 6  # the relay was closed with the flow still open


class Counters(NamedTuple):
    """Byte counts of one flow, exact to the byte."""

    client_rx: int  # read from the client socket
    client_tx: int  # written to the client socket
    upstream_rx: int  # read from the upstream socket
    upstream_tx: int  # written to the upstream socket
    last_activity_unix_ms: int  # wall clock of the last byte moved (the add time before)


class Completion(NamedTuple):
    """How one flow ended, with its final counters."""

    handle: int
    cause: Cause
    errno: int  # 0 when the cause carries no error
    side: str | None  # "client", "upstream", or None when no side failed
    counters: Counters


class RelayError(OSError):
    """A relay call failed; ``errno`` is the C code, ``strerror`` its text."""

    def __init__(self, code: int, message: str | None = None) -> None:
        text = ffi.string(lib.sw_strerror(code)).decode("utf-8", "replace")
        super().__init__(code, f"{message}: {text}" if message else text)


def native_abi_version() -> int:
    """The ABI version the loaded ``spliceway._relay`` was compiled with."""
    return int(lib.sw_relay_abi_version())


def check(rc: int, what: str) -> int:
    """``rc`` when it is not an error; a negative ``-errno`` raises RelayError.

    Shared by every module that calls into ``spliceway._relay``.
    """
    if rc < 0:
        raise RelayError(-rc, what)
    return rc


def _counters(c: Any) -> Counters:
    return Counters(
        int(c.client_rx),
        int(c.client_tx),
        int(c.upstream_rx),
        int(c.upstream_tx),
        int(c.last_activity_unix_ms),
    )


def _int_arg(name: str, value: object, lo: int, hi: int) -> int:
    # bool is an int subclass but never a meaningful fd, count or handle.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _flow_args(client_fd: int, upstream_fd: int, idle_timeout_ms: int) -> None:
    """The checks :meth:`Relay.add` and :meth:`Relay.add_aead` share."""
    _int_arg("client_fd", client_fd, 0, _INT_MAX)
    _int_arg("upstream_fd", upstream_fd, 0, _INT_MAX)
    _int_arg("idle_timeout_ms", idle_timeout_ms, 0, _U32_MAX)
    if client_fd == upstream_fd:
        raise ValueError("client_fd and upstream_fd must differ")


class Relay:
    """A set of C event loops relaying socket pairs; thread-safe.

    ``loops`` is the number of relay threads (0 = one per online CPU) and
    ``capacity`` the maximum number of concurrent flows.  Call :meth:`close`
    (or use ``with``) when done; completions stay drainable after it.
    """

    def __init__(self, loops: int = 0, capacity: int = 65536) -> None:
        _int_arg("loops", loops, 0, 1024)
        _int_arg("capacity", capacity, 1, int(lib.SW_RELAY_MAX_CAPACITY))
        native = native_abi_version()
        if native != ABI_VERSION:
            raise RelayError(
                errno_mod.ELIBBAD,
                f"spliceway._relay ABI {native} does not match spliceway.native.relay ABI "
                f"{ABI_VERSION}; rebuild the extension",
            )
        out = ffi.new("sw_relay **")
        check(lib.sw_relay_new(loops, capacity, out), "sw_relay_new")
        # The C object is freed with the Python one: a thread still inside
        # wait() holds a reference, so it can never be freed under it.
        self._ptr = ffi.gc(out[0], lib.sw_relay_free)
        self._loops = int(lib.sw_relay_loops(self._ptr))
        self._close_lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"active={self.active_count()}"
        return f"<Relay loops={self._loops} {state}>"

    @property
    def loops(self) -> int:
        """Number of relay threads."""
        return self._loops

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def add(self, client_fd: int, upstream_fd: int, idle_timeout_ms: int = 0) -> int:
        """Start relaying between two connected sockets; returns the flow's handle.

        On success the relay owns both fds (it makes them non-blocking and closes
        them when the flow completes); detach them from any ``socket`` object
        first.  On failure a :class:`RelayError` is raised and the caller still
        owns both.  ``idle_timeout_ms`` 0 means no idle timeout.
        """
        _flow_args(client_fd, upstream_fd, idle_timeout_ms)
        out = ffi.new("uint64_t *")
        check(lib.sw_relay_add(self._ptr, client_fd, upstream_fd, idle_timeout_ms, out), "add")
        return int(out[0])

    def add_aead(
        self,
        client_fd: int,
        upstream_fd: int,
        idle_timeout_ms: int = 0,
        *,
        cipher: str,
        master_key: bytes,
        enc_subkey: bytes,
        enc_nonce: int,
    ) -> int:
        """Like :meth:`add`, but the upstream speaks Shadowsocks AEAD (SIP004).

        The caller has already sent its salt (and the sealed target header)
        upstream; ``enc_subkey`` is that salt's subkey and ``enc_nonce`` the next
        nonce counter of its Encryptor.  The relay seals the client's bytes as
        chunks, and opens the server's stream (its salt, then chunks) for the
        client.  Client counters are plaintext, upstream counters ciphertext.
        A failed tag or a stream cut mid-chunk completes the flow with
        ``Cause.ERROR``, ``errno.EBADMSG`` on the upstream side.
        """
        _flow_args(client_fd, upstream_fd, idle_timeout_ms)
        try:
            code = _AEAD_CODES[cipher]
        except (KeyError, TypeError):
            raise ValueError(
                f"cipher must be one of {', '.join(sorted(_AEAD_CODES))}, got {cipher!r}"
            ) from None
        key_size = CIPHERS[cipher].key_size
        for name, key in (("master_key", master_key), ("enc_subkey", enc_subkey)):
            if not isinstance(key, bytes | bytearray | memoryview):
                raise TypeError(f"{name} must be bytes, not {type(key).__name__}")
            if len(key) != key_size:
                raise ValueError(f"{name} must be {key_size} bytes for {cipher}, got {len(key)}")
        _int_arg("enc_nonce", enc_nonce, 0, _U64_MAX)
        params = ffi.new("sw_aead_params *")
        params.cipher = code
        params.key_len = key_size
        ffi.memmove(params.master_key, bytes(master_key), key_size)
        ffi.memmove(params.enc_subkey, bytes(enc_subkey), key_size)
        params.enc_nonce = enc_nonce
        out = ffi.new("uint64_t *")
        try:
            rc = lib.sw_relay_add_aead(
                self._ptr, client_fd, upstream_fd, idle_timeout_ms, params, out
            )
        finally:
            # The C side copied the keys; do not leave them in this buffer.
            ffi.memmove(params, bytes(ffi.sizeof("sw_aead_params")), ffi.sizeof("sw_aead_params"))
        check(rc, "add_aead")
        return int(out[0])

    def counters(self, handle: int) -> Counters | None:
        """Current counters of a running flow, or None once it has finished."""
        _int_arg("handle", handle, 0, _U64_MAX)
        out = ffi.new("sw_counters *")
        rc = lib.sw_relay_counters(self._ptr, handle, out)
        if rc in (-errno_mod.ENOENT, -errno_mod.ESTALE):
            return None
        check(rc, "counters")
        return _counters(out[0])

    def counters_many(self, handles: Sequence[int]) -> list[Counters | None]:
        """:meth:`counters` for many handles in one C call (for samplers)."""
        n = len(handles)
        if n == 0:
            return []
        for h in handles:
            _int_arg("handle", h, 0, _U64_MAX)
        arr = ffi.new("uint64_t[]", list(handles))
        out = ffi.new("sw_counters[]", n)
        alive = ffi.new("uint8_t[]", n)
        check(lib.sw_relay_counters_many(self._ptr, arr, out, alive, n), "counters_many")
        return [_counters(out[i]) if alive[i] else None for i in range(n)]

    def request_close(self, handle: int) -> bool:
        """Ask the flow's loop to close it (completion CLOSED); False if it had finished."""
        _int_arg("handle", handle, 0, _U64_MAX)
        rc = lib.sw_relay_request_close(self._ptr, handle)
        if rc < 0 and -rc in _FINISHED:
            return False
        check(rc, "request_close")
        return True

    def fileno(self) -> int:
        """An eventfd readable while completions are pending (and for good after close)."""
        return check(lib.sw_relay_completion_fd(self._ptr), "completion_fd")

    def drain(self, max_items: int = 1024) -> list[Completion]:
        """Take up to ``max_items`` pending completions without blocking."""
        _int_arg("max_items", max_items, 1, _INT_MAX)
        out = ffi.new("sw_completion[]", max_items)
        n = check(lib.sw_relay_drain(self._ptr, out, max_items), "drain")
        return [self._completion(out[i]) for i in range(n)]

    def wait(self, timeout: float | None = None) -> list[Completion]:
        """Block (without the GIL) until completions are pending, then drain them.

        Returns an empty list when ``timeout`` seconds pass first, or at once
        when the relay is closed and nothing is left.  ``None`` waits without
        limit (in slices, so signals are still handled).
        """
        if timeout is not None:
            if not isinstance(timeout, int | float) or isinstance(timeout, bool):
                raise TypeError("timeout must be a number or None")
            if math.isnan(timeout) or timeout < 0:
                raise ValueError("timeout must be >= 0")
            ms = min(math.ceil(timeout * 1000), _INT_MAX)
            check(lib.sw_relay_wait(self._ptr, ms), "wait")
            return self.drain()
        while True:
            n = check(lib.sw_relay_wait(self._ptr, _WAIT_SLICE_MS), "wait")
            if n or self._closed:
                return self.drain()

    def active_count(self) -> int:
        """Flows currently running (added and not yet completed)."""
        return int(lib.sw_relay_active(self._ptr))

    def close(self) -> None:
        """Stop the loops; open flows complete with SHUTDOWN.  Idempotent.

        The completions stay drainable, and threads blocked in :meth:`wait`
        return.
        """
        with self._close_lock:
            if self._closed:
                return
            # Set first so a wait(None) woken by the shutdown sees it at once.
            self._closed = True
            check(lib.sw_relay_shutdown(self._ptr), "shutdown")

    def _set_pipe_size(self, size: int) -> None:
        """Tuning hook: F_SETPIPE_SZ for pipes created from now on (0 = kernel default)."""
        _int_arg("size", size, 0, 1 << 30)
        check(lib.sw_relay_set_pipe_size(self._ptr, size), "set_pipe_size")

    def _debug_force_copy(self, on: bool) -> None:
        """Test hook: flows added from now on copy through user space instead of splicing."""
        check(lib.sw_relay_debug_force_copy(self._ptr, 1 if on else 0), "force_copy")

    @staticmethod
    def _completion(c: Any) -> Completion:
        return Completion(
            int(c.handle),
            Cause(c.cause),
            int(c.err),
            _SIDES.get(int(c.side)),
            _counters(c.counters),
        )
