"""The sockets of upstream DNS queries, marked while a TUN runs.

The resolver (:mod:`spliceway.dns.resolver`) and the DNS server's forwarding
(:mod:`spliceway.dns.server`) ask ``udp://`` / ``tcp://`` servers with dnspython. While
a TUN with ``auto_route`` runs, those queries must carry the engine's socket mark
(:mod:`spliceway.support.socket_mark`): unmarked, they would be routed into the TUN and come
back to the engine (``dns_hijack`` answers port 53 itself), a loop. The mark must be
on the socket before its first ``sendto``/``connect`` (the route is chosen then), and
dnspython creates its sockets itself with no hook in between; it does take a socket
(synchronous queries) or a backend that makes its sockets (asyncio queries):

- :class:`MarkedDo53Nameserver`: dnspython's ``Do53Nameserver`` whose synchronous
  queries run on sockets made here, and whose asyncio queries use :data:`BACKEND`.
- :data:`BACKEND`: an asyncio backend for ``dns.asyncquery`` whose sockets are made
  here (pass it as ``backend=``).

Every socket goes through :func:`spliceway.support.socket_mark.marked_socket`: with no TUN (mark
0) it is a plain socket, so the same code runs with and without a TUN. Only plain DNS
is served: a TLS socket (DoT) is refused with ``NotImplementedError``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import dns.asyncbackend
import dns.exception
import dns.inet
import dns.message
import dns.nameserver
import dns.query

from spliceway.support.socket_mark import marked_socket

__all__ = ["BACKEND", "MarkedDo53Nameserver", "marked_nonblocking"]

_T = TypeVar("_T")
_IN_PROGRESS = (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY)


def marked_nonblocking(af: int, socktype: int, source: Any = None) -> socket.socket:
    """A non-blocking socket (``SOCK_DGRAM`` or ``SOCK_STREAM``, not yet connected) of
    family ``af``, marked, bound to ``source`` if given."""
    sock = marked_socket(af, socktype)
    try:
        sock.setblocking(False)
        if source is not None:
            sock.bind(source)
    except BaseException:
        sock.close()
        raise
    return sock


def _source(af: int, source: str | None, source_port: int) -> tuple[str, int] | None:
    if source is None and not source_port:
        return None
    return (source if source is not None else dns.inet.any_for_af(af), source_port)


def _connect(sock: socket.socket, destination: Any, timeout: float) -> None:
    """Connect the non-blocking ``sock`` within ``timeout`` seconds, blocking the thread.

    A timeout is dnspython's ``Timeout`` (the resolver retries the server), anything
    else an ``OSError`` (the resolver gives the server up), as ``dns.query.tcp`` does.
    """
    err = sock.connect_ex(destination)
    if err in _IN_PROGRESS:
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        if not poller.poll(max(timeout, 0) * 1000):
            raise dns.exception.Timeout(timeout=timeout)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


class MarkedDo53Nameserver(dns.nameserver.Do53Nameserver):
    """``udp://`` / ``tcp://`` server whose queries leave on marked sockets."""

    def query(
        self,
        request: dns.message.QueryMessage,
        timeout: float,
        source: str | None,
        source_port: int,
        max_size: bool,
        one_rr_per_rrset: bool = False,
        ignore_trailing: bool = False,
    ) -> dns.message.Message:
        af = dns.inet.af_for_address(self.address)
        bind = _source(af, source, source_port)
        if max_size:
            started = time.monotonic()
            with marked_nonblocking(af, socket.SOCK_STREAM, bind) as sock:
                _connect(sock, (self.address, self.port), timeout)
                left = timeout - (time.monotonic() - started)
                if left <= 0:
                    raise dns.exception.Timeout(timeout=timeout)
                return dns.query.tcp(
                    request,
                    self.address,
                    timeout=left,
                    port=self.port,
                    one_rr_per_rrset=one_rr_per_rrset,
                    ignore_trailing=ignore_trailing,
                    sock=sock,
                )
        with marked_nonblocking(af, socket.SOCK_DGRAM, bind) as sock:
            return dns.query.udp(
                request,
                self.address,
                timeout=timeout,
                port=self.port,
                raise_on_truncation=True,
                one_rr_per_rrset=one_rr_per_rrset,
                ignore_trailing=ignore_trailing,
                ignore_errors=True,
                ignore_unexpected=True,
                sock=sock,
            )

    async def async_query(
        self,
        request: dns.message.QueryMessage,
        timeout: float,
        source: str | None,
        source_port: int,
        max_size: bool,
        backend: dns.asyncbackend.Backend,
        one_rr_per_rrset: bool = False,
        ignore_trailing: bool = False,
    ) -> dns.message.Message:
        # Whatever backend the resolver would use: this one marks its sockets.
        return await super().async_query(
            request,
            timeout,
            source,
            source_port,
            max_size,
            BACKEND,
            one_rr_per_rrset=one_rr_per_rrset,
            ignore_trailing=ignore_trailing,
        )


async def _within(awaitable: Awaitable[_T], timeout: float | None) -> _T:
    if timeout is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise dns.exception.Timeout(timeout=timeout) from None


class _Wrapped:
    """What both kinds of socket answer the same way, from the wrapped ``sock``."""

    sock: socket.socket

    async def close(self) -> None:
        self.sock.close()

    async def getpeername(self) -> Any:
        return self.sock.getpeername()

    async def getsockname(self) -> Any:
        return self.sock.getsockname()

    async def getpeercert(self, timeout: float | None) -> Any:
        # dnspython asks only of TLS sockets, which are never made here (make_socket).
        raise NotImplementedError


class _Datagram(_Wrapped, dns.asyncbackend.DatagramSocket):
    """A marked UDP socket on the running asyncio loop."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, socket.SOCK_DGRAM)
        self.sock = sock

    async def sendto(self, what: bytes, destination: Any, timeout: float | None) -> int:
        loop = asyncio.get_running_loop()
        if destination is None:
            await _within(loop.sock_sendall(self.sock, what), timeout)
        else:
            await _within(loop.sock_sendto(self.sock, what, destination), timeout)
        return len(what)

    async def recvfrom(self, size: int, timeout: float | None) -> tuple[bytes, Any]:
        loop = asyncio.get_running_loop()
        return await _within(loop.sock_recvfrom(self.sock, size), timeout)


class _Stream(_Wrapped, dns.asyncbackend.StreamSocket):
    """A marked, connected TCP socket on the running asyncio loop."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, socket.SOCK_STREAM)
        self.sock = sock

    async def sendall(self, what: bytes, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        await _within(loop.sock_sendall(self.sock, what), timeout)

    async def recv(self, size: int, timeout: float | None) -> bytes:
        loop = asyncio.get_running_loop()
        return await _within(loop.sock_recv(self.sock, size), timeout)


# dnspython's asyncio backend (sleep, wait_for, datagram_connection_required...), with
# its sockets made here.
_AsyncioBackend: type[dns.asyncbackend.Backend] = type(dns.asyncbackend.get_backend("asyncio"))


class _MarkedBackend(_AsyncioBackend):  # type: ignore[misc, valid-type]
    async def make_socket(
        self,
        af: int,
        socktype: int,
        proto: int = 0,
        source: Any = None,
        destination: Any = None,
        timeout: float | None = None,
        ssl_context: Any = None,
        server_hostname: str | None = None,
    ) -> dns.asyncbackend.Socket:
        if ssl_context is not None:
            raise NotImplementedError("only plain DNS queries leave on marked sockets")
        if socktype == socket.SOCK_DGRAM:
            sock = marked_nonblocking(af, socktype, source)
            try:
                if destination is not None:
                    sock.connect(destination)  # UDP: no wait
            except BaseException:
                sock.close()
                raise
            return _Datagram(sock)
        if socktype == socket.SOCK_STREAM:
            if destination is None:
                raise ValueError("destination required for stream sockets")
            sock = marked_nonblocking(af, socktype, source)
            try:
                loop = asyncio.get_running_loop()
                await _within(loop.sock_connect(sock, destination), timeout)
            except BaseException:
                sock.close()
                raise
            return _Stream(sock)
        raise NotImplementedError(f"unsupported socket type {socktype}")


#: Pass as ``backend=`` to ``dns.asyncquery`` functions: their sockets are marked.
BACKEND: dns.asyncbackend.Backend = _MarkedBackend()
