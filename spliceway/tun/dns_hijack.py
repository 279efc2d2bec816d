"""DNS hijack over TCP on the TUN: the queries of connections to port 53, answered here.

With ``TunStack(dns_tcp=True)`` the packet loop NATs every TCP connection whose
original destination port is 53 onto a listener of its own per family
(``stack.dns_listeners``; csrc/tun.h, "DNS over TCP") instead of the main one the
connection path serves. :class:`TunDnsTcp` serves those listeners with the engine's
:class:`~spliceway.dns.server.DnsResponder`, exactly as the DNS server serves its TCP
socket (:func:`~spliceway.dns.server.serve_tcp_client`: two-byte length framing, the
same bound on clients, idle timeout and counters), on the dispatcher's loop. Whatever
address the client asked, the engine answers: that is the hijack. Over UDP the TUN's
UDP actor (``actors/tun_udp.py``) does the same.

The listeners stay the stack's: :class:`TunDnsTcp` serves duplicates of them (asyncio
closes the sockets it serves when it stops), so the stack and this server may stop in
either order. Stop this one first all the same: a connection accepted after the stack
stopped has nobody behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from spliceway.dns.server import serve_tcp_client
from spliceway.support.fdlimit import AcceptBackoff

if TYPE_CHECKING:
    from spliceway.dns.server import DnsResponder
    from spliceway.support.loop import Dispatcher

__all__ = ["TunDnsTcp"]

logger = logging.getLogger(__name__)

#: The stream reader's limit: one message and its length prefix.
_LIMIT = 65536 + 2
#: Connections accepted per readiness event before the loop's other work runs.
_ACCEPT_BATCH = 16


class TunDnsTcp:
    """Serves TCP DNS with ``responder`` on ``sockets`` (listening, e.g.
    ``list(stack.dns_listeners.values())``) on ``dispatcher``'s loop.

    :meth:`start` and :meth:`stop` may be called from any thread, the dispatcher's
    included; :meth:`stop` is idempotent. Counters: ``responder.counters``
    (``tcp_connections``, ``tcp_queries``, ...), plus :attr:`connections` here.
    """

    def __init__(
        self,
        responder: DnsResponder,
        sockets: Sequence[socket.socket],
        dispatcher: Dispatcher,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """``warn(message)``: emits ``engine.warning`` ``fd_exhausted`` when a listener
        runs out of descriptors (once per outage; the line is logged either way)."""
        self.responder = responder
        self._dispatcher = dispatcher
        self._sockets = [sock.dup() for sock in sockets]
        for sock in self._sockets:
            sock.setblocking(False)
        #: Every connection's task (serve_tcp_client bounds the ones it serves).
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: set[asyncio.Task[Any]] = set()
        self._attached = False
        self._stopped = False
        #: Connections accepted (those past the client bound included).
        self.connections = 0
        # Out of descriptors, accept fails while the connection stays queued, so the
        # socket stays readable: its reader is removed for the backoff's pause.
        self._backoffs = [
            AcceptBackoff(
                f"TUN DNS hijack (TCP, {sock.family.name})",
                warn if warn is not None else lambda message: None,
            )
            for sock in self._sockets
        ]
        self._paused: dict[int, asyncio.TimerHandle] = {}

    @property
    def running(self) -> bool:
        return self._attached and not self._stopped

    @property
    def clients(self) -> int:
        """Connections being served now."""
        return len(self._clients)

    def start(self) -> None:
        """Start serving the listeners."""
        if self._attached or self._stopped:
            return
        try:
            self._dispatcher.run_sync(self._attach)
        except BaseException:
            self._close_sockets()
            raise

    def stop(self) -> None:
        """Stop serving: the listeners' copies closed, open connections cancelled."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._dispatcher.run_sync(self._detach)
        except Exception:  # the loop is gone: nothing runs on it any more
            logger.debug("TUN DNS TCP: detaching failed", exc_info=True)
            self._close_sockets()

    # -- on the dispatcher's loop --------------------------------------------------------

    def _attach(self) -> None:
        loop = self._dispatcher.loop
        try:
            for i, sock in enumerate(self._sockets):
                loop.add_reader(sock.fileno(), self._accept, i)
        except BaseException:
            self._detach()
            raise
        self._attached = True

    def _detach(self) -> None:
        loop = self._dispatcher.loop
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        self._backoffs.clear()  # stopped, no listener of it is out of descriptors
        for sock in self._sockets:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(sock.fileno())
        self._close_sockets()
        for task in list(self._tasks):
            task.cancel()

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self, index: int) -> None:
        listener = self._sockets[index]
        backoff = self._backoffs[index]
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as ex:
                delay = backoff.failed(ex.errno)
                if delay:
                    self._pause(index, delay)
                else:  # ECONNABORTED and the like: the next one may do
                    logger.debug("TUN DNS TCP: accept failed: %s", ex)
                return
            backoff.accepted()
            self.connections += 1
            task = self._dispatcher.loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._served, conn))

    def _pause(self, index: int, delay: float) -> None:
        loop = self._dispatcher.loop
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(self._sockets[index].fileno())
        self._paused[index] = loop.call_later(delay, self._resume, index)

    def _resume(self, index: int) -> None:
        self._paused.pop(index, None)
        if self._stopped:
            return
        # Readable at once if connections are still queued: _accept tries again.
        self._dispatcher.loop.add_reader(self._sockets[index].fileno(), self._accept, index)

    def _served(self, conn: socket.socket, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # Closed already, unless the task was cancelled before it ran.
        conn.close()

    async def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=_LIMIT)
        except BaseException:
            conn.close()
            raise
        await serve_tcp_client(reader, writer, self.responder, self._clients)
