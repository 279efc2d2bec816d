"""A lean keep-alive HTTP/1.1 POST client: one webhook delivery per call, bounded in time.

The sink posts one request per event, thousands per second, from Python; ``http.client`` spends
most of its time in the email-based header parser. This client writes a pre-built request head
plus the body on a raw socket and parses the answer with llhttp (``httptools``), about a third
of the CPU per request.

Only what delivery needs is interpreted: the status and ``Retry-After``. The response body is
read and dropped (at most 64 KiB, then the connection is dropped instead), redirects are never
followed, and every failure to get a complete answer is a :class:`DeliveryError`.
"""

from __future__ import annotations

import base64
import contextlib
import math
import re
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

import httptools

from spliceway import __version__
from spliceway.support.socket_mark import create_connection

__all__ = ["DeliveryError", "Response", "WebhookClient"]

# More body than this is not worth reading: the status is all delivery uses.
MAX_BODY_BYTES = 64 * 1024
_RECV_BYTES = 65536
# Framing is the client's job; a configured header must not contradict it.
_RESERVED = frozenset({"host", "content-length", "transfer-encoding"})
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BAD_VALUE = re.compile(r"[\x00\r\n]")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")


@dataclass(frozen=True, slots=True)
class Response:
    """The part of an HTTP answer that delivery acts on."""

    status: int
    retry_after: str | None


class DeliveryError(Exception):
    """No complete HTTP answer: refused, DNS, TLS, timeout, reset, malformed, closed early.

    ``str()`` is a short human message, fit for a sink's ``last_error``.
    """


class _Stale(DeliveryError):
    """A reused connection failed before any response byte: the server had closed it."""


class _ResponseState:
    """One connection's response parser, its httptools callbacks and the answer being read."""

    __slots__ = (
        "body_bytes",
        "delimited",
        "done",
        "headers_done",
        "interim",
        "keep_alive",
        "parser",
        "poller",
        "retry_after",
        "status",
        "trailing",
    )

    def __init__(self, plain: socket.socket | None) -> None:
        """Parse responses on one connection; ``plain`` is its socket when it is not TLS."""
        self.parser = httptools.HttpResponseParser(self)
        # A plain socket is non-blocking and waited on with poll: one syscall per wait instead
        # of settimeout's ioctl plus poll. TLS keeps socket timeouts (its reads may need writes).
        self.poller: select.poll | None = None
        if plain is not None:
            plain.setblocking(False)
            self.poller = select.poll()
            self.poller.register(plain, select.POLLIN)
        self.reset()

    def reset(self) -> None:
        """Forget the previous response before the next request."""
        self.status = 0
        self.retry_after: str | None = None
        self.delimited = False
        self.headers_done = False
        self.interim = False
        self.done = False
        self.keep_alive = False
        self.trailing = False
        self.body_bytes = 0

    def on_message_begin(self) -> None:
        # Bytes after the complete answer belong to no request of ours.
        if self.done:
            self.trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"retry-after":
            self.retry_after = value.decode("latin-1")
        elif name in (b"content-length", b"transfer-encoding"):
            self.delimited = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        # 100 Continue and 103 Early Hints precede the real answer; they decide nothing.
        if 100 <= status <= 199 and status != 101:
            self.interim = True
            return
        self.status = status
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.retry_after = None
            self.delimited = False
            return
        if not self.done:
            self.keep_alive = self.parser.should_keep_alive()
            self.done = True


class WebhookClient:
    """Posts bodies to one URL over one reused HTTP/1.1 connection.

    Not for concurrent ``post`` calls: one sink thread owns a client. :meth:`abort` may be
    called from any thread; it is final, every later ``post`` fails with ``"aborted"``.
    """

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str] | None,
        timeout_ms: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Prepare a client for ``url`` (http or https); nothing connects until :meth:`post`.

        ``headers`` are sent as configured after the defaults (``Content-Type``,
        ``User-Agent``), which they override; ``Host`` and the framing headers are the
        client's. ``ssl_context`` replaces ``ssl.create_default_context()`` for https.
        Raises ``ValueError`` for an unusable URL or header.
        """
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"webhook url must be http:// or https://, not {url!r}")
        host = parts.hostname
        if not host:
            raise ValueError(f"webhook url has no host: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        if _BAD_TARGET.search(target):
            raise ValueError(f"webhook url path must not contain spaces or controls: {url!r}")

        self.url = url
        self._host = host
        self._port = port
        self._timeout_s = timeout_ms / 1000
        self._timeout_ms = timeout_ms
        self._tls = (ssl_context or ssl.create_default_context()) if scheme == "https" else None
        self._head = _request_head(target, _host_header(host, port, scheme), parts, headers)
        self._sock: socket.socket | None = None
        self._state: _ResponseState | None = None
        self._aborted = False
        # Guards handing the socket between the posting thread and abort(): abort must never
        # shut down a descriptor number that close() already released for reuse.
        self._lock = threading.Lock()

    def post(self, body: bytes, extra_headers: bytes = b"") -> Response:
        """POST ``body`` and return the status; raises :class:`DeliveryError`.

        ``extra_headers`` are this request's own header lines, each ending in CRLF (a
        signature). Connect, send and the full response share one deadline of
        ``timeout_ms``.
        """
        deadline = time.monotonic() + self._timeout_s
        request = b"%b%bContent-Length: %d\r\n\r\n%b" % (
            self._head,
            extra_headers,
            len(body),
            body,
        )
        try:
            if self._aborted:
                raise DeliveryError("aborted")
            if self._sock is not None:
                try:
                    return self._exchange(request, deadline)
                except _Stale:
                    # The server closed the idle connection before reading a byte of ours:
                    # resending is safe, delivery is at-least-once and idempotent by event_id.
                    self._drop()
            self._connect(deadline)
            return self._exchange(request, deadline)
        except DeliveryError:
            self._drop()
            if self._aborted:
                raise DeliveryError("aborted") from None
            raise

    def abort(self) -> None:
        """Make a ``post`` blocked in another thread fail promptly, and every later one too."""
        self._aborted = True
        with self._lock:
            sock = self._sock
            if sock is not None:
                # The plain-socket shutdown, also for TLS: it wakes the blocked recv without
                # touching the TLS object the other thread is using.
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection; a later ``post`` opens a new one."""
        self._drop()

    def _connect(self, deadline: float) -> None:
        if self._aborted:
            raise DeliveryError("aborted")
        sock: socket.socket | None = None
        try:
            # Marked while a TUN runs: deliveries use the physical egress (interface.md 4.6).
            sock = create_connection((self._host, self._port), _remaining(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock.settimeout(_remaining(deadline))
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise self._error(exc) from None
        state = _ResponseState(sock if self._tls is None else None)
        with self._lock:
            self._sock, self._state = sock, state
        # abort() may have run before the socket was visible to it.
        if self._aborted:
            raise DeliveryError("aborted")

    def _exchange(self, request: bytes, deadline: float) -> Response:
        sock, state = self._sock, self._state
        assert sock is not None and state is not None
        state.reset()
        poller = state.poller
        received = False
        try:
            _send(sock, poller, request, deadline)
            while True:
                if poller is None:
                    sock.settimeout(_remaining(deadline))
                elif not poller.poll(_remaining_ms(deadline)):
                    raise TimeoutError
                try:
                    data = sock.recv(_RECV_BYTES)
                except BlockingIOError:
                    continue  # a spurious wake-up; poll again within the deadline
                if not data:
                    if state.headers_done and not state.delimited:
                        # No length and not chunked: the body ends where the connection does.
                        self._drop()
                        return Response(state.status, state.retry_after)
                    kind = DeliveryError if received else _Stale
                    raise kind("connection closed before a full response")
                received = True
                state.parser.feed_data(data)
                if state.done:
                    break
                if state.headers_done and state.body_bytes > MAX_BODY_BYTES:
                    self._drop()
                    return Response(state.status, state.retry_after)
        except httptools.HttpParserError:
            if not state.done:
                raise DeliveryError("malformed response") from None
            # Garbage after a complete answer: keep the answer, not the connection.
            state.trailing = True
        except (ConnectionResetError, BrokenPipeError) as exc:
            if received:
                raise self._error(exc) from None
            raise _Stale(str(self._error(exc))) from None
        except OSError as exc:
            raise self._error(exc) from None
        if not state.keep_alive or state.trailing:
            self._drop()
        return Response(state.status, state.retry_after)

    def _drop(self) -> None:
        with self._lock:
            sock, self._sock, self._state = self._sock, None, None
            if sock is not None:
                sock.close()

    def _error(self, exc: OSError) -> DeliveryError:
        if self._aborted:
            return DeliveryError("aborted")
        return DeliveryError(_describe(exc, self._host, self._timeout_ms))


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _remaining_ms(deadline: float) -> int:
    return math.ceil(_remaining(deadline) * 1000)


def _send(sock: socket.socket, poller: select.poll | None, data: bytes, deadline: float) -> None:
    if poller is None:
        sock.settimeout(_remaining(deadline))
        sock.sendall(data)
        return
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        # Rare (a body larger than the socket buffer, or a slow reader): the blocking
        # sendall with the remaining time is simpler than a POLLOUT loop.
        sock.settimeout(_remaining(deadline))
        sock.sendall(memoryview(data)[sent:])
        sock.setblocking(False)


def _describe(exc: OSError, host: str, timeout_ms: int) -> str:
    # Order matters: the ssl errors and TimeoutError are OSErrors too.
    if isinstance(exc, TimeoutError):
        return f"timeout after {timeout_ms} ms"
    if isinstance(exc, socket.gaierror):
        return f"dns failure for {host}: {exc.strerror}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"tls failure: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"tls failure: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError):
        return "connection reset"
    return f"network error: {exc.strerror or exc}"


def _host_header(host: str, port: int, scheme: str) -> str:
    name = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return name if port == default else f"{name}:{port}"


def _request_head(
    target: str,
    host: str,
    parts: urllib.parse.SplitResult,
    configured: Mapping[str, str] | None,
) -> bytes:
    """The constant request head: the request line and every fixed header, each ending in
    CRLF (a request's own headers and Content-Length follow)."""
    fields: dict[str, tuple[str, str]] = {
        "content-type": ("Content-Type", "application/json"),
        "user-agent": ("User-Agent", f"spliceway/{__version__}"),
    }
    if parts.username is not None:
        # Credentials in the URL become Basic auth, as curl does; a configured
        # Authorization header overrides them below.
        userinfo = f"{urllib.parse.unquote(parts.username)}:"
        userinfo += urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(userinfo.encode()).decode("ascii")
        fields["authorization"] = ("Authorization", f"Basic {token}")
    for name, value in (configured or {}).items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"invalid header name {name!r}")
        if _BAD_VALUE.search(value):
            raise ValueError(f"header {name!r} must not contain CR, LF or NUL")
        if name.lower() not in _RESERVED:
            fields[name.lower()] = (name, value)
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in fields.values()]
    try:
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("header values must be latin-1 text") from None
