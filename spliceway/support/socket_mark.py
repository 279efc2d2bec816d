"""Keeping the engine's own sockets out of its TUN: the socket mark.

While a TUN with ``auto_route`` runs, the first rule of :mod:`spliceway.tun.routing`
sends every packet carrying the engine's mark (SO_MARK) around the TUN rules, so
the engine's upstream connections, UDP upstreams, DNS queries, probes and webhook
deliveries leave by the physical egress (interface.md 4.6) instead of looping back
into the TUN they serve. sing-tun's ``default_mark`` and hev-socks5-tunnel's
``socks5.mark`` do the same.

:func:`apply_mark` is called on each socket the engine creates to reach the outside,
before ``connect``/``sendto`` (the route is chosen then). It does nothing while no
TUN runs (:func:`current_mark` is 0), so no socket pays for a TUN that is not there
and no privilege is needed then; SO_MARK itself needs CAP_NET_ADMIN, which a running
TUN implies.

Where each socket is created (each must call :func:`apply_mark`, or in C set
``SO_MARK`` to :func:`current_mark` when it is not 0):

- ``spliceway/flows/outbounds.py`` ``_open_tcp``: every Python TCP dial (direct, and the
  first hop to a socks5/http/shadowsocks server).
- ``csrc/conn.c`` ``start_connect``: the C connection path's upstream socket gets
  ``SO_MARK`` before ``connect`` from the mark C keeps (``sw_conn_set_mark``, read
  once per dial). ``RelayBridge`` subscribes ``ConnPath.set_mark`` (:func:`subscribe`,
  held weakly) when it creates the path and unsubscribes at shutdown. A socket the
  kernel refuses to mark is dialled unmarked and counted (``ConnPath.stats()``
  ``mark_failed``), not failed: the TUN's start has checked CAP_NET_ADMIN, so it
  does not happen while a TUN runs.
- ``actors/udp.py`` and ``actors/udp_upstream.py``: the association's upstream UDP
  sockets (the ones created with ``socket.socket(family, socket.SOCK_DGRAM)`` for
  direct and proxied UDP); the C UDP relay (``csrc/udp.c``) is handed these fds and
  creates none itself.
- ``spliceway/dns/resolver.py`` and ``spliceway/dns/server.py`` (forwarded query
  types): dnspython's UDP/TCP queries to ``udp://``/``tcp://`` servers run on sockets
  :mod:`spliceway.dns.transport` makes with :func:`marked_socket` (a ``Do53Nameserver``
  for the resolver, an asyncio backend for ``dns.asyncquery``). The ``system``
  resolver (getaddrinfo) cannot be marked: its queries follow ``dns_hijack`` back
  into the engine, so a TUN with ``dns_hijack`` needs an explicit server.
- ``connector/webhook.py``: ``socket.create_connection`` of each delivery.
- ``spliceway/flows/probe.py`` and ``spliceway/control/diagnostics.py``: probe connections (they
  dial through ``outbounds.open_tcp``, so they are covered there).
"""

from __future__ import annotations

import inspect
import socket
import weakref
from collections.abc import Callable

#: SO_MARK from <asm-generic/socket.h> (Python exposes it only from 3.12).
SO_MARK: int = getattr(socket, "SO_MARK", 36)

_mark = 0
#: Called with the new mark on every change: parts that create sockets outside Python
#: (the C connection path) keep their own copy of the mark. Bound methods are held
#: weakly, so a subscriber that is dropped without unsubscribing is not kept alive.
_subscribers: list[Callable[[], Callable[[int], None] | None]] = []


def current_mark() -> int:
    """The mark to put on outbound sockets now: 0 while no TUN routes the host."""
    return _mark


def set_mark(value: int) -> None:
    """Start (non-zero) or stop (0) marking; the TUN controller calls it around auto_route."""
    global _mark
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"mark {value} is not a 32-bit value")
    _mark = value
    for ref in list(_subscribers):
        fn = ref()
        if fn is None:
            _subscribers.remove(ref)
        else:
            fn(value)


def subscribe(fn: Callable[[int], None]) -> Callable[[], None]:
    """Call ``fn(mark)`` now and on every change; returns the function that unsubscribes.

    A bound method is held weakly (its object may go away without unsubscribing).
    """
    ref: Callable[[], Callable[[int], None] | None]
    if inspect.ismethod(fn):
        ref = weakref.WeakMethod(fn)
    else:

        def ref() -> Callable[[int], None]:
            return fn

    _subscribers.append(ref)
    fn(_mark)

    def unsubscribe() -> None:
        if ref in _subscribers:
            _subscribers.remove(ref)

    return unsubscribe


def apply_mark(sock: socket.socket | int) -> None:
    """Mark ``sock`` (a socket or a file descriptor) when a TUN runs; otherwise nothing.

    Raises ``OSError`` (EPERM) only if the process lost CAP_NET_ADMIN while a TUN runs,
    which the TUN's own start has excluded.
    """
    mark = _mark
    if not mark:
        return
    if isinstance(sock, int):
        s = socket.socket(fileno=sock)
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        finally:
            s.detach()
        return
    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)


def marked_socket(
    family: int = socket.AF_INET, type: int = socket.SOCK_STREAM, proto: int = 0
) -> socket.socket:
    """``socket.socket(family, type, proto)`` with :func:`apply_mark` applied."""
    sock = socket.socket(family, type, proto)
    try:
        apply_mark(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def create_connection(address: tuple[str, int], timeout: float | None = None) -> socket.socket:
    """``socket.create_connection(address, timeout)`` whose socket is marked before it
    connects (the standard one offers no hook between ``socket()`` and ``connect()``)."""
    if not _mark:
        return socket.create_connection(address, timeout)
    host, port = address
    last: OSError | None = None
    for family, type_, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, type_, proto)
        try:
            apply_mark(sock)
            if timeout is not None:
                sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as ex:
            sock.close()
            last = ex
    raise last if last is not None else OSError(f"no address for {host}")
