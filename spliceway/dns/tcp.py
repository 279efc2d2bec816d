"""The DNS server's TCP side: one client's queries over a stream (two-byte length
prefix, RFC 1035 4.2.2) and the bounds on TCP clients.

:func:`serve_tcp_client` serves the accepted connections of
:class:`~spliceway.dns.server.DnsServer` and the TUN's DNS hijack
(:mod:`spliceway.tun.dns_hijack`) alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from spliceway.dns.ratelimit import PARSED_QUERY_COST
from spliceway.dns.wire import MAX_QUERY_BYTES, _Slow, unanswerable

if TYPE_CHECKING:
    from spliceway.dns.server import DnsResponder

__all__ = ["MAX_TCP_CLIENTS", "MAX_TCP_PER_SOURCE", "TCP_IDLE_SECONDS", "serve_tcp_client"]

#: Open TCP connections; more are closed at once.
MAX_TCP_CLIENTS: Final = 256
#: Open TCP connections from one source address; more are closed at once, so one client
#: cannot hold every one of the :data:`MAX_TCP_CLIENTS` (each for up to
#: :data:`TCP_IDLE_SECONDS`).
MAX_TCP_PER_SOURCE: Final = 32
#: A TCP connection with no complete query for this long is closed.
TCP_IDLE_SECONDS: Final = 10.0


async def serve_tcp_client(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    responder: DnsResponder,
    clients: set[asyncio.Task[Any]],
    *,
    allow: Callable[[float], bool] | None = None,
) -> None:
    """Serve one TCP client's queries (two-byte length prefix, RFC 1035 4.2.2) until it
    closes, sends a query the responder drops, a message longer than
    :data:`MAX_QUERY_BYTES` (answered FORMERR from its header, unparsed) or one
    ``allow(cost)`` refuses (its rate limit, as :class:`~spliceway.dns.server.DnsServer`
    charges it over UDP: dropped, counted), or is idle :data:`TCP_IDLE_SECONDS`.

    ``clients`` holds the serving tasks of one server (at most :data:`MAX_TCP_CLIENTS`;
    a client past that is closed at once), so its owner can cancel them when it stops.
    Counted in ``responder.counters``. Used by :class:`~spliceway.dns.server.DnsServer`
    and by the TUN's DNS hijack (:mod:`spliceway.tun.dns_hijack`)."""
    counters = responder.counters
    counters.tcp_connections += 1
    task = asyncio.current_task()
    if task is None or len(clients) >= MAX_TCP_CLIENTS:
        counters.tcp_refused += 1
        writer.close()
        return
    clients.add(task)
    try:
        while True:
            async with asyncio.timeout(TCP_IDLE_SECONDS):
                size = int.from_bytes(await reader.readexactly(2), "big")
                # Read whole even when too long (at most 64 KiB, copied, never parsed):
                # closing on unread bytes would reset the connection under the answer.
                data = await reader.readexactly(size)
            counters.queries += 1
            counters.tcp_queries += 1
            if allow is not None and not allow(1):
                counters.rate_limited += 1
                return
            out: bytes | _Slow | None = responder.quick(data, True)
            if isinstance(out, _Slow):
                costly = allow is not None and not unanswerable(data)
                if costly and allow is not None and not allow(PARSED_QUERY_COST - 1):
                    counters.rate_limited += 1
                    return
                out = await responder.respond(data, True)
            if out is None:
                return  # dropped: nothing sensible follows on this stream
            writer.write(len(out).to_bytes(2, "big") + out)
            await writer.drain()
            if size > MAX_QUERY_BYTES:
                return  # a client that sends such messages is not worth keeping
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
        pass
    finally:
        clients.discard(task)
        writer.close()
