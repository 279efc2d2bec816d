"""The DNS server's counters (:class:`DnsCounters`) and the document they give the
runtime snapshot's ``dns_server.counters`` (:class:`DnsCounterSnapshot`,
:data:`COUNTER_NAMES`, from which the OpenAPI component is made).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypedDict

__all__ = ["COUNTER_NAMES", "DnsCounterSnapshot", "DnsCounters"]


class DnsCounterSnapshot(TypedDict):
    """The runtime snapshot's ``dns_server.counters`` (:meth:`DnsCounters.snapshot`)."""

    queries: int
    udp_queries: int
    tcp_queries: int
    tcp_connections: int
    tcp_refused: int
    answered: int
    cache_hits: int
    noerror: int
    nxdomain: int
    servfail: int
    formerr: int
    notimp: int
    other_rcode: int
    dropped: int
    rate_limited: int
    send_failed: int
    truncated: int
    forwarded: int
    fake_ip_answers: int


#: The counters the runtime snapshot's ``dns_server.counters`` holds, in order.
COUNTER_NAMES: Final = tuple(DnsCounterSnapshot.__annotations__)


@dataclass(slots=True, eq=False)
class DnsCounters:
    """What the server did, since it started (read from any thread)."""

    cache_hits: int = 0
    dropped: int = 0
    fake_ip_answers: int = 0
    formerr: int = 0
    forwarded: int = 0
    notimp: int = 0
    nxdomain: int = 0
    other_rcode: int = 0
    queries: int = 0
    rate_limited: int = 0
    send_failed: int = 0
    servfail: int = 0
    slow_noerror: int = 0
    tcp_connections: int = 0
    tcp_queries: int = 0
    tcp_refused: int = 0
    truncated: int = 0

    def snapshot(self) -> DnsCounterSnapshot:
        """The counters as a document (``answered`` and ``noerror`` include cache hits)."""
        noerror = self.slow_noerror + self.cache_hits
        answered = (
            noerror + self.nxdomain + self.servfail + self.formerr + self.notimp + self.other_rcode
        )
        return {
            "queries": self.queries,
            "udp_queries": self.queries - self.tcp_queries,
            "tcp_queries": self.tcp_queries,
            "tcp_connections": self.tcp_connections,
            "tcp_refused": self.tcp_refused,
            "answered": answered,
            "cache_hits": self.cache_hits,
            "noerror": noerror,
            "nxdomain": self.nxdomain,
            "servfail": self.servfail,
            "formerr": self.formerr,
            "notimp": self.notimp,
            "other_rcode": self.other_rcode,
            "dropped": self.dropped,
            "rate_limited": self.rate_limited,
            "send_failed": self.send_failed,
            "truncated": self.truncated,
            "forwarded": self.forwarded,
            "fake_ip_answers": self.fake_ip_answers,
        }
