"""The engine resolver: ``runtime.dns.servers`` in order, behind the answer cache.

Outbounds resolve every hostname through one :class:`Resolver` (the engine builds it
from ``runtime.dns``), so the configured servers and cache apply to direct targets
and to upstream proxy addresses alike.

Behaviour where the spec leaves room:

- Servers are tried in order. A timeout or an error (refused, SERVFAIL, network
  failure) moves on to the next server; a definitive negative answer (NXDOMAIN, or a
  name with neither A nor AAAA records) does not, and yields ``[]``. When every server
  failed, :class:`ResolveError` says why.
- The time budget is split fairly: each server gets the remaining time divided by the
  number of servers still to try, so a dead first server cannot use up the whole
  budget and the last server gets whatever is left.
- ``system`` is the C library's ``getaddrinfo`` (``/etc/hosts``, nsswitch,
  ``resolv.conf``). It reports no TTL, so its answers are cached for
  :data:`SYSTEM_TTL_SECONDS`, clamped by ``min/max_ttl_seconds`` like any other TTL.
  The synchronous :meth:`Resolver.lookup` cannot interrupt ``getaddrinfo``: for this
  server the C library's own timeouts apply.
- ``udp://`` and ``tcp://`` servers are queried with dnspython (A and AAAA; a truncated
  UDP answer is retried over TCP by dnspython). The cached TTL is the smallest TTL of
  the answer, CNAME chain included. Their sockets carry the TUN's mark while one runs
  (:mod:`spliceway.dns.transport`), so the queries go around the TUN; ``system``
  queries cannot be marked (see :mod:`spliceway.support.socket_mark`).
- Addresses come IPv4 first, then IPv6, without duplicates.
- Negative answers are not cached: a name that starts to exist is seen at once, and a
  miss costs one query, as it would without a cache.
- IP literals are returned as given, without a query. ``localhost`` and names under
  ``.localhost`` are the loopback addresses (RFC 6761 6.3), never sent to a server.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.rdatatype
import dns.resolver

from spliceway.config import DnsSettings, parse_dns_server
from spliceway.dns.cache import AnswerCache, CacheEntry
from spliceway.dns.transport import MarkedDo53Nameserver

__all__ = [
    "LOOPBACK_ADDRESSES",
    "SYSTEM_TTL_SECONDS",
    "Answer",
    "InvalidHostname",
    "ResolveError",
    "Resolver",
    "normalize_hostname",
]

#: Cache lifetime of a ``system`` answer, which carries no TTL (before clamping).
SYSTEM_TTL_SECONDS = 60
#: What ``localhost`` resolves to.
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1")

_MAX_NAME = 253
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)", re.ASCII)
# getaddrinfo's "this name has no address", as opposed to "could not find out".
_GAI_NEGATIVE = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


class ResolveError(Exception):
    """No server could answer for a name (every one timed out or failed)."""


class InvalidHostname(ResolveError, ValueError):
    """The name is not a syntactically valid hostname; no server was asked."""


def normalize_hostname(host: str) -> str:
    """``host`` as a lower-case ASCII name without trailing dot; raises InvalidHostname.

    Accepts letters, digits, ``-`` and ``_`` (used by real service names) in labels of
    1..63 characters, at most 253 characters in all; non-ASCII names are converted with
    IDNA.
    """
    if not isinstance(host, str) or not host:
        raise InvalidHostname("hostname is empty")
    name = host[:-1] if host.endswith(".") else host
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError as ex:
            raise InvalidHostname(f"{host!r} is not a valid hostname: {ex}") from None
    name = name.lower()
    if len(name) > _MAX_NAME:
        raise InvalidHostname(f"hostname is longer than {_MAX_NAME} characters")
    for label in name.split("."):
        if not _LABEL.fullmatch(label):
            raise InvalidHostname(f"{host!r} is not a valid hostname: bad label {label!r}")
    return name


def _ip_literal(host: str) -> bool:
    # inet_pton, not ipaddress: this runs for every dial and must stay cheap.
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
        return True
    return False


def _ordered(addresses: Iterable[str]) -> list[str]:
    """Unique addresses, IPv4 first, otherwise in the order given."""
    unique = list(dict.fromkeys(addresses))
    return [a for a in unique if ":" not in a] + [a for a in unique if ":" in a]


class _Answer(NamedTuple):
    """One server's answer; empty addresses mean a definitive negative answer."""

    addresses: list[str]
    ttl: float
    #: The negative answer says the name does not exist (NXDOMAIN), not only that it
    #: has no address.
    nxdomain: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """What :meth:`Resolver.resolve_answer` found: the addresses (IPv4 first) with how
    long a client may keep them, or a definitive negative answer."""

    addresses: tuple[str, ...]
    #: Seconds the answer stays valid: the cache entry's remaining lifetime, or the
    #: server's TTL without a cache; 0 for IP literals, ``localhost`` and negatives.
    ttl_seconds: int
    #: For an empty answer: the name does not exist (NXDOMAIN, or getaddrinfo's
    #: EAI_NONAME), as opposed to existing without A/AAAA records.
    nxdomain: bool = False


class _SystemServer:
    """``system``: getaddrinfo."""

    label = "system"

    def lookup(self, name: str, timeout: float) -> _Answer:
        # The C call takes no timeout; resolv.conf's own options bound it.
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as ex:
            return self._negative(ex)
        return self._answer(infos)

    async def resolve(self, name: str, timeout: float) -> _Answer:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as ex:
            return self._negative(ex)
        return self._answer(infos)

    def query(self, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType, timeout: float) -> Any:
        """The answer message for one record type: getaddrinfo knows only addresses, so
        this asks the name servers of ``/etc/resolv.conf`` (what getaddrinfo's DNS step
        asks) with dnspython."""
        resolver = dns.resolver.Resolver(configure=True)
        resolver.cache = None
        return _message(resolver, qname, rdtype, timeout, tcp=False)

    @staticmethod
    def _negative(ex: socket.gaierror) -> _Answer:
        if ex.errno in _GAI_NEGATIVE:
            return _Answer([], 0, ex.errno == socket.EAI_NONAME)
        raise ex

    @staticmethod
    def _answer(infos: list[tuple[Any, ...]]) -> _Answer:
        return _Answer(_ordered(str(info[4][0]) for info in infos), SYSTEM_TTL_SECONDS)


# What a failing server may raise; anything else is a bug and propagates.
_SERVER_ERRORS = (dns.exception.DNSException, OSError)
#: The queries of a lookup, in the order their addresses come.
_FAMILIES = ("A", "AAAA")


class _Do53Server:
    """``udp://IP:PORT`` or ``tcp://IP:PORT``: dnspython's stub resolver on one server."""

    def __init__(self, kind: str, ip: str, port: int) -> None:
        self.label = f"{kind}://{ip}:{port}" if ":" not in ip else f"{kind}://[{ip}]:{port}"
        self.kind, self.ip, self.port = kind, ip, port
        self.tcp = kind == "tcp"
        self._sync = dns.resolver.Resolver(configure=False)
        self._async = dns.asyncresolver.Resolver(configure=False)
        for r in (self._sync, self._async):
            # Its sockets carry the TUN's mark while one runs (spliceway.dns.transport).
            r.nameservers = [MarkedDo53Nameserver(ip, port)]
            r.cache = None  # AnswerCache does the caching, with the configured clamps

    def lookup(self, name: str, timeout: float) -> _Answer:
        qname = dns.name.from_text(name)
        deadline = time.monotonic() + timeout
        results: list[Any] = []
        for rdtype in _FAMILIES:
            # One budget for both queries, as the asynchronous path runs them at once.
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise dns.exception.Timeout(timeout=timeout)
                results.append(self._sync.resolve(qname, rdtype, **self._query_args(left)))
            except _SERVER_ERRORS as ex:
                results.append(ex)
                if isinstance(ex, dns.exception.Timeout):
                    break  # a server that does not answer one will not answer the other
        return self._combine(results)

    async def resolve(self, name: str, timeout: float) -> _Answer:
        qname = dns.name.from_text(name)
        results = await asyncio.gather(
            *(self._async.resolve(qname, t, **self._query_args(timeout)) for t in _FAMILIES),
            return_exceptions=True,
        )
        return self._combine(list(results))

    def query(self, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType, timeout: float) -> Any:
        """The answer message of this server for one record type (``diagnostics.dns_query``)."""
        return _message(self._sync, qname, rdtype, timeout, tcp=self.tcp)

    def _query_args(self, timeout: float) -> dict[str, Any]:
        return {"lifetime": timeout, "tcp": self.tcp, "search": False,
                "raise_on_no_answer": False}  # fmt: skip

    @staticmethod
    def _combine(results: list[Any]) -> _Answer:
        """One answer from the A and the AAAA query. A family whose query failed (a
        server answering REFUSED or SERVFAIL for AAAA alone, as dnsmasq does for a name
        it only holds an A record of) does not spoil the other's addresses; the server
        failed only when no family gave an address and one failed."""
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, _SERVER_ERRORS):
                raise r  # a bug, not a server failure
        if any(isinstance(r, dns.resolver.NXDOMAIN) for r in results):
            return _Answer([], 0, True)
        answers = [r for r in results if isinstance(r, dns.resolver.Answer) and r.rrset]
        if answers:
            addresses = _ordered(str(rr.address) for a in answers for rr in a.rrset or ())
            ttl = min(a.chaining_result.minimum_ttl for a in answers)
            return _Answer(addresses, ttl)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return _Answer([], 0)


def _message(
    resolver: dns.resolver.Resolver,
    qname: dns.name.Name,
    rdtype: dns.rdatatype.RdataType,
    timeout: float,
    *,
    tcp: bool,
) -> dns.message.Message:
    """The server's whole answer message, NXDOMAIN and empty answers included (they are
    answers); SERVFAIL, REFUSED and timeouts raise as server failures."""
    try:
        answer = resolver.resolve(
            qname, rdtype, lifetime=timeout, tcp=tcp, search=False, raise_on_no_answer=False
        )
    except dns.resolver.NXDOMAIN as ex:
        return ex.response(qname)
    assert answer.response is not None
    return answer.response


_Server = _SystemServer | _Do53Server


class Resolver:
    """Resolves hostnames with the servers and cache of one ``runtime.dns`` section.

    :meth:`lookup` is for threads (thread-safe, blocking); :meth:`resolve` is for an
    asyncio loop and never blocks it. Both return the addresses (IPv4 first), ``[]``
    when the name definitively has none, and raise :class:`InvalidHostname` for a
    malformed name and :class:`ResolveError` when no server could answer.
    ``clock`` (monotonic seconds) drives the cache, so tests can move time.
    """

    def __init__(
        self,
        settings: DnsSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_answer: Callable[[str, list[str], float], None] | None = None,
    ) -> None:
        self._servers: list[_Server] = []
        for spec in settings.servers:
            kind, ip, port = parse_dns_server(spec)
            if kind == "system":
                self._servers.append(_SystemServer())
            else:
                assert ip is not None and port is not None
                self._servers.append(_Do53Server(kind, ip, port))
        c = settings.cache
        self.cache: AnswerCache | None = (
            None
            if c is None
            else AnswerCache(c.max_entries, c.min_ttl_seconds, c.max_ttl_seconds, clock)
        )
        #: Told of every answer the cache keeps, as (name, addresses, clamped ttl seconds):
        #: the engine copies single-address answers into the C connection path's cache.
        self._on_answer = on_answer

    # -- resolution -----------------------------------------------------------------

    def lookup(self, host: str, timeout: float = 5.0) -> list[str]:
        """Resolve ``host`` within about ``timeout`` seconds, blocking the calling thread."""
        name, known = self._prepare(host)
        if known is not None:
            return known
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for i, server in enumerate(self._servers):
            budget = self._budget(deadline, i)
            if budget is None:
                break
            try:
                return self._keep(name, server.lookup(name, budget))
            except _SERVER_ERRORS as ex:
                failures.append(f"{server.label}: {_reason(ex)}")
        raise self._failed(name, failures)

    async def resolve(self, host: str, timeout: float = 5.0) -> list[str]:
        """Resolve ``host`` on the running asyncio loop, within about ``timeout`` seconds."""
        name, known = self._prepare(host)
        if known is not None:
            return known
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for i, server in enumerate(self._servers):
            budget = self._budget(deadline, i)
            if budget is None:
                break
            try:
                return self._keep(name, await server.resolve(name, budget))
            except _SERVER_ERRORS as ex:
                failures.append(f"{server.label}: {_reason(ex)}")
        raise self._failed(name, failures)

    async def resolve_answer(self, host: str, timeout: float = 5.0) -> Answer:
        """As :meth:`resolve`, with the answer's lifetime and its kind of negative (what
        the engine's DNS server answers with)."""
        name, known = self._prepare(host)
        if known is not None:
            entry = None if self.cache is None else self.cache.peek(name)
            return Answer(tuple(known), 0 if entry is None else entry.ttl_seconds)
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for i, server in enumerate(self._servers):
            budget = self._budget(deadline, i)
            if budget is None:
                break
            try:
                answer = await server.resolve(name, budget)
            except _SERVER_ERRORS as ex:
                failures.append(f"{server.label}: {_reason(ex)}")
                continue
            addresses = self._keep(name, answer)
            if not addresses:
                return Answer((), 0, answer.nxdomain)
            ttl = answer.ttl if self.cache is None else self.cache.clamp_ttl(answer.ttl)
            return Answer(tuple(addresses), int(ttl))
        raise self._failed(name, failures)

    def query(self, name: str, rdtype: str, timeout: float = 5.0) -> dns.message.Message:
        """Ask the servers in order, bypassing the cache, for ``rdtype`` records of
        ``name``; the first answer message (NOERROR or NXDOMAIN) wins. Raises
        ``ValueError`` for a malformed name or an unknown type and :class:`ResolveError`
        when every server failed. Blocks the calling thread."""
        try:
            qname = dns.name.from_text(name)
        except dns.exception.DNSException as ex:
            raise InvalidHostname(f"invalid name {name!r}: {ex}") from ex
        try:
            qtype = dns.rdatatype.from_text(rdtype)
        except dns.exception.DNSException as ex:
            raise ValueError(f"unknown record type {rdtype!r}") from ex
        if dns.rdatatype.is_metatype(qtype):
            raise ValueError(f"{rdtype!r} is a meta type, not a record type")
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for i, server in enumerate(self._servers):
            budget = self._budget(deadline, i)
            if budget is None:
                break
            try:
                return server.query(qname, qtype, budget)
            except _SERVER_ERRORS as ex:
                failures.append(f"{server.label}: {_reason(ex)}")
        raise self._failed(qname.to_text(omit_final_dot=True), failures)

    @property
    def upstreams(self) -> list[tuple[str, str, int]]:
        """The ``udp://`` / ``tcp://`` servers as ``(kind, ip, port)``, in order (where the
        DNS server forwards the query types the resolver does not answer)."""
        return [(s.kind, s.ip, s.port) for s in self._servers if isinstance(s, _Do53Server)]

    def _prepare(self, host: str) -> tuple[str, list[str] | None]:
        """The normalized name, and its addresses when no server needs asking."""
        if isinstance(host, str) and _ip_literal(host):
            return host, [host]
        name = normalize_hostname(host)
        if name == "localhost" or name.endswith(".localhost"):
            return name, list(LOOPBACK_ADDRESSES)
        if self.cache is not None:
            cached = self.cache.get(name)
            if cached is not None:
                return name, list(cached)
        return name, None

    def _budget(self, deadline: float, index: int) -> float | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        return remaining / (len(self._servers) - index)

    def _keep(self, name: str, answer: _Answer) -> list[str]:
        addresses, ttl, _ = answer
        if addresses and self.cache is not None:
            self.cache.put(name, addresses, ttl)
            if self._on_answer is not None:
                self._on_answer(name, addresses, self.cache.clamp_ttl(ttl))
        return addresses

    @staticmethod
    def _failed(name: str, failures: list[str]) -> ResolveError:
        why = "; ".join(failures) if failures else "timed out before any server answered"
        return ResolveError(f"cannot resolve {name}: {why}")

    # -- the cache, for diagnostics ------------------------------------------------------

    @property
    def cache_enabled(self) -> bool:
        """Whether ``runtime.dns.cache`` is configured."""
        return self.cache is not None

    def cache_entry(self, domain: str) -> CacheEntry | None:
        """The live cache entry of ``domain`` (LRU order untouched), or None."""
        return None if self.cache is None else self.cache.peek(domain)

    def cache_entries(self, limit: int | None = None) -> list[CacheEntry]:
        """Live cache entries, most recently used first, at most ``limit``."""
        return [] if self.cache is None else self.cache.entries(limit)

    def cache_flush(self) -> int:
        """Empty the cache; the number of live entries it held (0 without a cache)."""
        return 0 if self.cache is None else self.cache.clear()

    def cache_count(self) -> int:
        """The number of live cache entries (0 without a cache)."""
        return 0 if self.cache is None else len(self.cache)


def _reason(ex: BaseException) -> str:
    if isinstance(ex, TimeoutError):
        return "timed out"
    return str(ex) or type(ex).__name__
