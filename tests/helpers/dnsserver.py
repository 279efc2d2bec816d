"""A tiny authoritative DNS server on 127.0.0.1 (UDP and TCP on one port), for tests.

It serves a zone given as ``{name: [addresses]}`` (IPv4 addresses answer A queries,
IPv6 ones AAAA), built with dnspython's message API. A name in the zone without
addresses of the asked type gets NOERROR/no data, a name outside it NXDOMAIN, and
``fail = True`` turns every answer into SERVFAIL, and a type in ``refuse`` (e.g.
``{"AAAA"}``) is answered REFUSED, as dnsmasq answers a type it holds no record of
for a name it knows only locally and cannot forward. Every query is recorded in
``queries`` as ``(name, type, transport)``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

_SOA = "ns.test. hostmaster.test. 1 3600 600 86400 30"


class DnsServer:
    """Authoritative answers for ``zone`` on ``127.0.0.1:port``, UDP and TCP."""

    def __init__(self, zone: Mapping[str, Sequence[str]], ttl: int = 300) -> None:
        self.zone = {_key(name): list(addrs) for name, addrs in zone.items()}
        self.ttl = ttl
        self.fail = False
        self.refuse: set[str] = set()
        self.queries: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._udp, self._tcp = _bind_pair()
        self.port: int = self._udp.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve_udp, name="test-dns-udp", daemon=True),
            threading.Thread(target=self._serve_tcp, name="test-dns-tcp", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def udp_url(self) -> str:
        """This server as a ``runtime.dns.servers`` item over UDP."""
        return f"udp://127.0.0.1:{self.port}"

    @property
    def tcp_url(self) -> str:
        """This server as a ``runtime.dns.servers`` item over TCP."""
        return f"tcp://127.0.0.1:{self.port}"

    def count(self, name: str | None = None) -> int:
        """Queries received (for ``name`` only, when given)."""
        with self._lock:
            return sum(1 for q in self.queries if name is None or q[0] == _key(name))

    def close(self) -> None:
        """Stop serving and join the threads."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self._udp.close()
        self._tcp.close()

    # -- answering ------------------------------------------------------------------

    def answer(self, query: dns.message.Message, transport: str) -> dns.message.Message:
        """The response to one query message."""
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = _key(question.name.to_text())
        rdtype = dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.queries.append((name, rdtype, transport))
        if self.fail:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response
        if rdtype in self.refuse:
            response.set_rcode(dns.rcode.REFUSED)
            return response
        if name not in self.zone:
            response.set_rcode(dns.rcode.NXDOMAIN)
        v6 = question.rdtype == dns.rdatatype.AAAA
        addrs = [a for a in self.zone.get(name, []) if (":" in a) == v6]
        if question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA) and addrs:
            response.answer.append(
                dns.rrset.from_text_list(
                    question.name, self.ttl, dns.rdataclass.IN, question.rdtype, addrs
                )
            )
        else:
            # Negative answers carry the SOA, as a real authoritative server's do.
            response.authority.append(
                dns.rrset.from_text_list("test.", 30, dns.rdataclass.IN, "SOA", [_SOA])
            )
        return response

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._udp], [], [], 0.05)[0]:
                continue
            wire, peer = self._udp.recvfrom(65535)
            response = self.answer(dns.message.from_wire(wire), "udp")
            self._udp.sendto(response.to_wire(), peer)

    def _serve_tcp(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._tcp], [], [], 0.05)[0]:
                continue
            conn, _ = self._tcp.accept()
            with conn:
                conn.settimeout(2)
                # dnspython sends one query per connection; serve until it hangs up.
                with contextlib.suppress(OSError, EOFError, dns.exception.DNSException):
                    while True:
                        query, _ = dns.query.receive_tcp(conn)
                        dns.query.send_tcp(conn, self.answer(query, "tcp"))


def _key(name: str) -> str:
    return name.rstrip(".").lower()


def _bind_pair() -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on the same free port, as a real DNS server has."""
    for _ in range(50):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            tcp.bind(("127.0.0.1", udp.getsockname()[1]))
        except OSError:
            udp.close()
            tcp.close()
            continue
        tcp.listen(16)
        return udp, tcp
    raise RuntimeError("no free port for both UDP and TCP")


@contextmanager
def dns_server(zone: Mapping[str, Sequence[str]], ttl: int = 300) -> Iterator[DnsServer]:
    """A running :class:`DnsServer` for the duration of the block."""
    server = DnsServer(zone, ttl)
    try:
        yield server
    finally:
        server.close()


def dead_udp_port() -> int:
    """A UDP port on 127.0.0.1 where nothing listens (a DNS server that never answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
