"""spliceway.dns.transport: the sockets of upstream DNS queries, on real sockets.

The mark of a socket is read in-process with getsockopt(SO_MARK) (setting it needs
CAP_NET_ADMIN; those tests skip without it). That a marked query takes the marked
route is tests/integration/test_socket_mark.py; here: every kind of socket the
resolver and the DNS server's forwarding make carries the mark, and the queries made
on them behave as dnspython's own (answers, truncation to TCP, timeouts, refusals).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import pytest

from spliceway.config import DnsSettings
from spliceway.dns import Resolver
from spliceway.dns.transport import (
    BACKEND,
    MarkedDo53Nameserver,
    marked_nonblocking,
)
from spliceway.support import socket_mark as mark
from spliceway.tun.device import has_cap_net_admin
from spliceway.tun.options import ENGINE_MARK
from tests.helpers.dnsserver import DnsServer, dns_server
from tests.helpers.upstreams import black_hole, refused_port


def datagram_socket(af: int, source: tuple[str, int] | None = None) -> socket.socket:
    return marked_nonblocking(af, socket.SOCK_DGRAM, source)


def stream_socket(af: int) -> socket.socket:
    return marked_nonblocking(af, socket.SOCK_STREAM)


ZONE = {"both.test": ["10.1.0.1", "fd00::1"]}

needs_cap = pytest.mark.skipif(not has_cap_net_admin(), reason="SO_MARK needs CAP_NET_ADMIN")


@pytest.fixture
def marked() -> Iterator[int]:
    """The engine's mark set (as while a TUN runs), cleared afterwards."""
    mark.set_mark(ENGINE_MARK)
    try:
        yield ENGINE_MARK
    finally:
        mark.set_mark(0)


@pytest.fixture
def server() -> Iterator[DnsServer]:
    with dns_server(ZONE) as srv:
        yield srv


def mark_of(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, mark.SO_MARK)


@needs_cap
def test_sync_sockets_carry_the_current_mark(marked: int) -> None:
    for family in (socket.AF_INET, socket.AF_INET6):
        with datagram_socket(family) as udp, stream_socket(family) as tcp:
            assert mark_of(udp) == mark_of(tcp) == marked
            assert not udp.getblocking() and not tcp.getblocking()
    mark.set_mark(0)
    with datagram_socket(socket.AF_INET) as udp, stream_socket(socket.AF_INET) as tcp:
        assert mark_of(udp) == mark_of(tcp) == 0


def test_unmarked_sockets_need_no_privilege() -> None:
    mark.set_mark(0)
    with datagram_socket(socket.AF_INET, ("127.0.0.1", 0)) as udp:
        assert udp.getsockname()[0] == "127.0.0.1"  # the source is bound


@needs_cap
def test_async_backend_sockets_carry_the_current_mark(marked: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    async def main() -> tuple[int, int, tuple[str, int]]:
        udp = await BACKEND.make_socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = await BACKEND.make_socket(
            socket.AF_INET, socket.SOCK_STREAM, 0, None, listener.getsockname(), 5
        )
        try:
            return mark_of(udp.sock), mark_of(tcp.sock), await tcp.getpeername()
        finally:
            await udp.close()
            await tcp.close()

    with listener:
        udp_mark, tcp_mark, peer = asyncio.run(main())
        assert peer == listener.getsockname()
    assert udp_mark == tcp_mark == marked


@needs_cap
@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_resolver_answers_through_marked_sockets(
    server: DnsServer, marked: int, transport: str
) -> None:
    r = Resolver(DnsSettings.model_validate({"servers": [getattr(server, f"{transport}_url")]}))
    r.cache = None
    assert r.lookup("both.test") == ["10.1.0.1", "fd00::1"]
    assert asyncio.run(r.resolve("both.test")) == ["10.1.0.1", "fd00::1"]
    assert {q[2] for q in server.queries} == {transport}


class Truncating(DnsServer):
    """Answers every UDP query with TC set and no records: the client must use TCP."""

    def answer(self, query: dns.message.Message, transport: str) -> dns.message.Message:
        response = super().answer(query, transport)
        if transport == "udp":
            response.answer.clear()
            response.flags |= dns.flags.TC
        return response


def test_truncated_udp_answers_are_retried_over_tcp() -> None:
    srv = Truncating(ZONE)
    try:
        r = Resolver(DnsSettings.model_validate({"servers": [srv.udp_url], "cache": None}))
        assert r.lookup("both.test") == ["10.1.0.1", "fd00::1"]
        assert asyncio.run(r.resolve("both.test")) == ["10.1.0.1", "fd00::1"]

        async def forward() -> tuple[dns.message.Message, bool]:
            query = dns.message.make_query("both.test", "A")
            return await dns.asyncquery.udp_with_fallback(
                query, "127.0.0.1", timeout=5, port=srv.port, backend=BACKEND
            )

        answer, used_tcp = asyncio.run(forward())
        assert used_tcp and answer.rcode() == dns.rcode.NOERROR
        assert "10.1.0.1" in answer.answer[0].to_text()
        assert ("both.test", "A", "tcp") in srv.queries
    finally:
        srv.close()


def test_a_connect_that_times_out_is_a_dns_timeout() -> None:
    # dnspython keeps retrying a server that timed out (within the lifetime) but gives up
    # one that raised OSError: a timeout must stay dnspython's Timeout.
    ns = MarkedDo53Nameserver("127.0.0.1", 0)
    query = dns.message.make_query("both.test", "A")
    with black_hole() as port:
        ns.port = port
        with pytest.raises(dns.exception.Timeout):
            ns.query(query, 0.3, None, 0, True)

        async def connect() -> None:
            await BACKEND.make_socket(
                socket.AF_INET, socket.SOCK_STREAM, 0, None, ("127.0.0.1", port), 0.3
            )

        with pytest.raises(dns.exception.Timeout):
            asyncio.run(connect())


def test_a_refused_connect_is_an_os_error() -> None:
    ns = MarkedDo53Nameserver("127.0.0.1", refused_port())
    query = dns.message.make_query("both.test", "A")
    with pytest.raises(ConnectionRefusedError):
        ns.query(query, 2, None, 0, True)

    async def connect() -> None:
        await BACKEND.make_socket(
            socket.AF_INET, socket.SOCK_STREAM, 0, None, ("127.0.0.1", ns.port), 2
        )

    with pytest.raises(ConnectionRefusedError):
        asyncio.run(connect())


def test_tls_is_refused() -> None:
    async def connect() -> None:
        await BACKEND.make_socket(
            socket.AF_INET, socket.SOCK_STREAM, 0, None, ("127.0.0.1", 853), 1, object()
        )

    with pytest.raises(NotImplementedError):
        asyncio.run(connect())
