"""Waitress, hardened for a listener anyone may connect to (docs/security.md, limits).

Waitress alone lets connections that say nothing hold the server: its
``channel_timeout`` restarts on every byte, so a client trickling one byte at a
time keeps its connection forever, and ``connection_limit`` (100) connections
like that lock every client out. It also reads a request's whole body, spilling
it to a temporary file, before the application can look at the headers. The
attacks happen before the app runs, so the defences live here, in Waitress's
server, channel and parser layers:

- **Deadlines, not inactivity timeouts.** A connection waiting for a request
  (new, or kept alive after a response) is closed ``idle_s`` after it became
  idle unless a request starts; a request head must be complete ``head_s`` after
  its first byte, its body ``body_s`` after the head; a response the client reads
  nothing of for ``send_stall_s`` closes the connection. Trickling resets none
  of them.
- **Pending connections are capped and the oldest is evicted.** A connection
  with no complete request head (idle ones included) is *pending*. At
  ``max_pending_per_source`` pending connections from one source (an IPv4
  address, an IPv6 /64) a new one from it evicts that source's oldest pending
  one; at ``max_pending`` overall, a new one evicts the oldest pending
  connection of the source holding the most. Accepting never stops for pending
  connections, so a client that sends its head promptly is always served;
  ``connection_limit`` is far above the pending caps.
- **The head decides before the body is read.** Once the head is in, the
  listener's :class:`HeadPolicy` may refuse the request (authentication, the
  declared body size); the refusal is answered at once with the listener's own
  error format, nothing of the body is read or buffered, and the connection
  closes. A chunked body is cut off at ``max_body_bytes``.
- **Refusals close.** Every 401, 403, 413 and 429, the application's included,
  is sent with ``Connection: close``, so refused clients cannot sit on
  connections.
- **Out of descriptors, accepting pauses** (:class:`spliceway.support.fdlimit.AcceptBackoff`)
  instead of spinning, and open connections are still served. One descriptor (of
  ``/dev/null``) is held in reserve: when accepting fails for want of descriptors, it
  is given up to take one waiting connection, so an operator can still reach the API
  on a new connection while the rest of the engine is out of them; it is taken back as
  soon as that connection closes (or, failing that, a descriptor frees up).

:func:`create_guarded_server` builds the server for any WSGI app; the control
API (``api.server``) passes its keys and error envelope as a :class:`HeadPolicy`.
"""

from __future__ import annotations

import functools
import http
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher, WSGITask
from waitress.utilities import Error, RequestEntityTooLarge

from spliceway.support.fdlimit import AcceptBackoff, is_fd_exhaustion

logger = logging.getLogger(__name__)

#: Statuses after which the connection is closed: the client was refused, and a
#: refused client must not keep a connection (and a slot of the server) open.
CLOSING_STATUSES = frozenset({"401", "403", "413", "429"})
#: The WSGI environ key of a callable returning the bytes of this response (and any
#: before it) the server holds unsent: a streaming app can tell a slow reader.
UNSENT_BYTES_KEY = "spliceway.unsent_bytes"


@dataclass(frozen=True, slots=True)
class GuardLimits:
    """The bounds one guarded listener enforces (docs/security.md)."""

    #: A connection with no request under way (new, or idle after a response).
    idle_s: float = 10.0
    #: From a request head's first byte to its end.
    head_s: float = 10.0
    #: From the end of the head to the end of the body.
    body_s: float = 60.0
    #: Output waiting while the client accepts none of it.
    send_stall_s: float = 60.0
    max_pending: int = 128
    max_pending_per_source: int = 32
    #: Every connection, pending or not (Waitress stops accepting there).
    connection_limit: int = 1000
    max_body_bytes: int = 16 * 1024 * 1024
    #: How often deadlines are checked (and how long the loop may sleep).
    tick_s: float = 0.25


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a :class:`HeadPolicy` sees of a request whose head is complete."""

    method: str
    path: str
    #: Waitress's spelling: upper case, ``-`` as ``_`` (``AUTHORIZATION``).
    headers: Mapping[str, str]
    #: The declared body length; None for a chunked body.
    content_length: int | None
    #: The client's source (see :func:`source_key`).
    source: str


class Refusal(Error):
    """A response the server sends instead of running the app; the connection closes."""

    def __init__(
        self,
        status: int,
        body: bytes,
        headers: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> None:
        super().__init__(body)
        self.code = status
        self.reason = http.HTTPStatus(status).phrase
        self.response_headers = [("Content-Type", content_type), *headers]

    def to_response(self, ident: str | None = None) -> tuple[str, list[tuple[str, str]], bytes]:
        """Status line, headers and body, as Waitress's ErrorTask sends them."""
        return f"{self.code} {self.reason}", list(self.response_headers), self.body


class HeadPolicy(Protocol):
    """What a listener decides from a request's head, in its own error format."""

    def check_head(self, head: RequestHead) -> Refusal | None:
        """A refusal for this request, or None to read its body and run the app."""

    def too_large(self, limit: int) -> Refusal:
        """The answer to a body over ``limit`` bytes."""


def source_key(address: str) -> str:
    """The source a connection counts against: an IPv4 address (IPv4-mapped IPv6
    included), or an IPv6 address's /64, which one host usually holds whole."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class GuardedParser(HTTPRequestParser):
    """Waitress's parser, timing the request and asking the policy once the head is in."""

    def __init__(self, adj: Adjustments, *, channel: GuardedChannel) -> None:
        super().__init__(adj)
        self._channel = channel
        self._checked = False
        #: When the head's first byte came (monotonic).
        self.started_at = time.monotonic()
        #: When the head was complete (monotonic); None before.
        self.head_done_at: float | None = None
        self.refused = False

    def received(self, data: bytes) -> int:
        """Parse ``data``; refuse at the end of the head when the policy says so."""
        if self.completed:
            return 0
        consumed: int = super().received(data)
        if self.headers_finished and not self._checked:
            self._checked = True
            self.head_done_at = time.monotonic()
            refusal = self._check_head()
            if refusal is not None:
                self._refuse(refusal)
                # The rest of this read (the body's start) is the refused request's.
                return len(data)
        elif isinstance(self.error, RequestEntityTooLarge) and not self.refused:
            # A chunked body ran past the limit: answer in the listener's format.
            self._refuse(self._channel.policy.too_large(self._channel.limits.max_body_bytes))
            return len(data)
        return consumed

    def _check_head(self) -> Refusal | None:
        too_large = isinstance(self.error, RequestEntityTooLarge)
        if self.error is not None and not too_large:
            return None  # a malformed head: Waitress's own 400/431/501, as before
        if self.empty:
            return None
        head = RequestHead(
            method=self.command,
            path=self.path,
            headers=self.headers,
            content_length=None if self.chunked else self.content_length,
            source=self._channel.source,
        )
        policy = self._channel.policy
        refusal = policy.check_head(head)
        if refusal is None and too_large:
            refusal = policy.too_large(self._channel.limits.max_body_bytes)
        return refusal

    def _refuse(self, refusal: Refusal) -> None:
        self.close()
        self.body_rcv = None
        self.error = refusal
        self.completed = True
        self.refused = True
        # No "100 Continue": the client must not send the body at all.
        self.expect_continue = False
        self.connection_close = True
        self._channel.refusing = True


class ClosingTask(WSGITask):
    """The app's responses; a refusal status closes the connection after it is sent."""

    def get_environment(self) -> dict[str, Any]:
        """Waitress's environ plus :data:`UNSENT_BYTES_KEY`."""
        environ: dict[str, Any] = super().get_environment()
        channel = self.channel
        environ[UNSENT_BYTES_KEY] = lambda: channel.total_outbufs_len
        return environ

    def build_response_header(self) -> bytes:
        """Waitress's header, with ``Connection: close`` on a refusal status."""
        if self.status[:3] in CLOSING_STATUSES:
            self.set_close_on_finish()
        header: bytes = super().build_response_header()
        return header


class GuardedChannel(HTTPChannel):
    """One client connection: its phase and deadlines, read by the server."""

    task_class = ClosingTask

    def __init__(
        self, server: GuardedServer, sock: socket.socket, addr: Any, adj: Adjustments, map: Any
    ) -> None:
        self.policy: HeadPolicy = server.policy
        self.limits: GuardLimits = server.limits
        host = addr[0] if isinstance(addr, tuple) and addr else str(addr)
        self.source = source_key(str(host))
        #: When the connection last became idle (accepted, or a response served).
        self.idle_since = time.monotonic()
        #: A refusal is on its way: read nothing more, close once it is sent.
        self.refusing = False
        #: Flushes that sent bytes, and the server's last look at them (stall check).
        self.sends = 0
        self.stall_mark: tuple[float, int] | None = None
        self.parser_class = functools.partial(GuardedParser, channel=self)
        #: Accepted on the server's reserve descriptor: closing it gives the reserve back.
        self.on_reserve = False
        self._guard = server
        super().__init__(server, sock, addr, adj, map=map)

    def handle_close(self) -> None:
        """Close; a connection on the reserve descriptor hands it back at once, before
        another thread can take the number it frees."""
        super().handle_close()
        if self.on_reserve:
            self.on_reserve = False
            self._guard.restore_reserve()

    def readable(self) -> bool:
        """Waitress's rule; nothing more is read behind a refusal."""
        return not self.refusing and bool(super().readable())

    def received(self, data: bytes) -> bool:
        """Parse ``data`` unless a refusal is on its way (then it is dropped)."""
        if self.refusing:
            return False
        return bool(super().received(data))

    def _flush_some(self, do_close: bool = True) -> bool:
        sent: bool = super()._flush_some(do_close=do_close)
        if sent:
            self.sends += 1
        return sent

    def service(self) -> None:
        """Serve the queued request; the connection is idle from when it is done."""
        super().service()
        self.idle_since = time.monotonic()

    def phase(self) -> str:
        """``idle`` (no request under way), ``head``, ``body`` (being received, no
        request being served), ``busy`` (a request served or output being sent) or
        ``closing``."""
        if self.will_close or self.close_when_flushed or not self.connected:
            return "closing"
        if self.requests or self.total_outbufs_len:
            return "busy"
        request = self.request
        if request is None:
            return "idle"
        if not request.headers_finished:
            return "head"
        return "body"

    def deadline_passed(self, now: float) -> str | None:
        """Which deadline this connection has passed (for the log), or None."""
        phase = self.phase()
        limits = self.limits
        request = self.request
        if phase == "idle":
            if now - self.idle_since > limits.idle_s:
                return "idle"
        elif phase == "head" and isinstance(request, GuardedParser):
            # A head begun while an earlier request was served counts from its end.
            if now - max(request.started_at, self.idle_since) > limits.head_s:
                return "request head"
        elif phase == "body" and isinstance(request, GuardedParser):
            done = request.head_done_at or request.started_at
            if now - max(done, self.idle_since) > limits.body_s:
                return "request body"
        if self.total_outbufs_len and self.connected:
            mark = self.stall_mark
            if mark is None or mark[1] != self.sends:
                self.stall_mark = (now, self.sends)
            elif now - mark[0] > limits.send_stall_s:
                return "send"
        else:
            self.stall_mark = None
        return None


class GuardedServer(TcpWSGIServer):
    """Waitress's TCP server with deadlines, pending caps and the accept backoff."""

    channel_class = GuardedChannel

    def __init__(
        self,
        application: Any,
        sock: socket.socket,
        adj: Adjustments,
        dispatcher: ThreadedTaskDispatcher,
        policy: HeadPolicy,
        limits: GuardLimits,
        backoff: AcceptBackoff | None,
    ) -> None:
        self.policy = policy
        self.limits = limits
        self._backoff = backoff
        self._paused_until = 0.0
        self._next_tick = 0.0
        self.evicted = 0
        self.expired = 0
        #: Connections accepted on the reserve descriptor.
        self.reserve_uses = 0
        self._reserve: int | None = None
        self.restore_reserve()
        sockinfo = (sock.family, sock.type, sock.proto, sock.getsockname())
        super().__init__(
            application,
            map={},
            _sock=sock,
            dispatcher=dispatcher,
            adj=adj,
            bind_socket=False,
            sockinfo=sockinfo,
        )

    def run(self) -> None:
        """Waitress's loop, waking every ``tick_s`` (Waitress takes whole seconds only)."""
        try:
            wasyncore.loop(timeout=self.limits.tick_s, map=self._map, use_poll=True)
        except (SystemExit, KeyboardInterrupt):
            self.task_dispatcher.shutdown()

    def readable(self) -> bool:
        """Check deadlines every tick; accept unless at the limit or paused."""
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self.limits.tick_s
            self._enforce_deadlines(now)
            if self._reserve is None:
                self.restore_reserve()
            elif self.reserve_uses and now >= self._paused_until:
                self._end_served_outage()
        # Waitress's own maintenance (channel_timeout) is replaced by the deadlines:
        # keep it from running by keeping its schedule in the future.
        self.next_channel_cleanup = float("inf")
        accepting = bool(super().readable())
        return accepting and now >= self._paused_until

    def _enforce_deadlines(self, now: float) -> None:
        for channel in list(self.active_channels.values()):
            if not isinstance(channel, GuardedChannel):
                continue
            what = channel.deadline_passed(now)
            if what is not None:
                self.expired += 1
                logger.debug("closing %s: %s deadline passed", channel.addr, what)
                # Closed by the loop on its next pass (writable() is then true), never
                # in the middle of this poll's bookkeeping.
                channel.will_close = True

    def handle_accept(self) -> None:
        """Accept one connection; back off on descriptor exhaustion; admit it."""
        on_reserve = False
        try:
            accepted = self.accept()
        except OSError as ex:
            pause = self._backoff.failed(ex.errno) if self._backoff is not None else 0.0
            if pause:
                self._paused_until = time.monotonic() + pause
            elif self.adj.log_socket_errors:
                logger.warning("control API accept() failed: %s", ex)
            # The outage stays an outage (warned once, paused): the reserve serves one
            # waiting client through it.
            accepted = self._accept_on_reserve() if is_fd_exhaustion(ex.errno) else None
            if accepted is None:
                return
            on_reserve = True
        if accepted is None:
            return
        conn, addr = accepted
        if self._backoff is not None and not on_reserve:
            self._backoff.accepted()
        try:
            self.set_socket_options(conn)
        except OSError:
            conn.close()  # the client went away already
            if on_reserve:
                self.restore_reserve()
            return
        channel = self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)
        channel.on_reserve = on_reserve
        self._admit(channel)

    def restore_reserve(self) -> None:
        """Hold the reserve descriptor again, if it is not held and one is free."""
        if self._reserve is not None:
            return
        try:
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._reserve = None  # still out of descriptors: the next tick tries again

    def _end_served_outage(self) -> None:
        """End an outage the reserve served the waiting clients of.

        The outage ends at the next accept, but when the reserve took every client that
        waited there is none: so a descriptor to spare (one more besides the reserve)
        ends it too, as descriptors are back.
        """
        backoff = self._backoff
        if backoff is None or not backoff.in_outage:
            return
        try:
            probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        os.close(probe)
        backoff.accepted()

    def release_reserve(self) -> None:
        """Give the reserve descriptor up for good (the server is stopping)."""
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def _accept_on_reserve(self) -> tuple[socket.socket, Any] | None:
        """Give the reserve up and accept one connection on the descriptor it frees."""
        if self._reserve is None:
            return None
        self.release_reserve()
        try:
            accepted: tuple[socket.socket, Any] | None = self.accept()
        except OSError:
            accepted = None  # another thread took the descriptor first
        if accepted is None:
            self.restore_reserve()
            return None
        self.reserve_uses += 1
        return accepted

    def _admit(self, new: GuardedChannel) -> None:
        """Evict a pending connection if ``new`` puts its source or the server over a cap."""
        pending = [
            ch
            for ch in list(self.active_channels.values())
            if isinstance(ch, GuardedChannel) and ch is not new and ch.phase() in ("idle", "head")
        ]
        limits = self.limits
        own = [ch for ch in pending if ch.source == new.source]
        victims: list[GuardedChannel] = []
        if len(own) >= limits.max_pending_per_source:
            victims = own
        elif len(pending) >= limits.max_pending:
            by_source: dict[str, list[GuardedChannel]] = {}
            for ch in pending:
                by_source.setdefault(ch.source, []).append(ch)
            victims = max(by_source.values(), key=len)
        if victims:
            oldest = min(victims, key=lambda ch: ch.idle_since)
            oldest.will_close = True
            self.evicted += 1


def create_guarded_server(
    app: Any,
    sock: socket.socket,
    policy: HeadPolicy,
    *,
    limits: GuardLimits | None = None,
    backoff: AcceptBackoff | None = None,
    **adjustments: Any,
) -> GuardedServer:
    """A :class:`GuardedServer` for ``app`` on the bound ``sock``; ``adjustments`` are
    Waitress's (``threads``, ``ident``, ...). Call ``run()`` on a thread of its own."""
    limits = limits or GuardLimits()
    adj = Adjustments(
        sockets=[sock],
        connection_limit=limits.connection_limit,
        # Waitress refuses a declared length >= this and cuts a chunked body there.
        max_request_body_size=limits.max_body_bytes + 1,
        **adjustments,
    )
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    return GuardedServer(app, sock, adj, dispatcher, policy, limits, backoff)

