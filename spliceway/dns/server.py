"""The engine's DNS server (``runtime.dns.listen``): UDP and TCP on one address.

It answers through the engine: A and AAAA with the resolver and its cache
(``answer.type: real``) or with addresses of the fake-ip pool (``fake_ip``), so a
client that resolves here and connects through the proxy is routed by name.

What it answers (where the spec leaves room, these are the choices):

- **A / AAAA, real:** the resolver's addresses of the asked family, with the cache
  entry's remaining TTL (the server's TTL without a cache). No address of that family
  but some of the other: NOERROR, empty (NODATA). A name that does not exist: NXDOMAIN
  (a name that is not a valid host name too). Every server failed: SERVFAIL.
- **A / AAAA, fake_ip:** the pool's address for the asked family with TTL
  :data:`FAKE_TTL_SECONDS` (1 s, as mihomo: a client re-asks soon, so an address the
  pool reuses once its range is full is not held long by the old name); the other
  family gets NOERROR, empty. ``localhost`` keeps its real loopback answer. A PTR
  query for a fake address answers its domain.
- **HTTPS / SVCB with fake_ip:** NOERROR, empty: their address hints would hand the
  client real addresses that bypass the fake ones.
- **Other types** (MX, TXT, SRV, PTR, ...): forwarded to the ``udp://`` / ``tcp://``
  servers of ``runtime.dns.servers`` in order (SERVFAIL when none answers); with only
  ``system`` there is nothing to forward to: NOTIMP. ANY, AXFR, IXFR: NOTIMP. The
  forwarded queries' sockets carry the TUN's mark while one runs, as the resolver's.
- **Not a standard query** (another opcode or class): NOTIMP; EDNS version above 0:
  BADVERS.
- **Refused by its header, before any parse** (:func:`screen`, unbound's checks): a
  question count other than 1, answer or authority records, an additional record
  other than one EDNS OPT of at most :data:`~spliceway.dns.wire.MAX_EDNS_OPTIONS`
  options, or more than :data:`MAX_QUERY_BYTES`: FORMERR; another opcode: NOTIMP. The
  answer is the header alone (ID, opcode and RD copied), never longer than the query.
  Shorter than a header, or QR set (a response: answering it could loop): dropped.
- **Malformed:** a message that passes but whose rest does not parse gets the same
  header-only FORMERR. All of these are counted; nothing raises, nothing is logged
  but a debug line a minute.

Answers go out with RA set and RD/CD copied. Over UDP an answer is limited to 512
bytes, or the client's EDNS payload size, and is truncated (TC, no records) past it;
over TCP (two-byte length prefix, RFC 1035 4.2.2) to 65535. EDNS answers advertise
a 1232-byte payload (DNS flag day 2020).

**Speed.** A positive answer is kept as wire bytes for :data:`WIRE_CACHE_SECONDS` (1 s)
under its question (name case-folded, type, class, EDNS or not), so a repeated query
is answered by checking the header and question by hand and joining the client's ID
and question to the stored records: no dnspython parse or render. Its TTLs may thus
read up to 1 s high. The wire cache is dropped when the resolver is replaced (a
reload) or a fake-ip mapping goes away (clear, reuse), and is off in real mode when
``runtime.dns.cache`` is ``null``. Everything else goes through dnspython.

**Bounds** (docs/dns.md, "Limits"): each source address gets
``runtime.dns.client_rate_limit`` queries a second (:class:`ClientRateLimit`; over it:
dropped, as unbound's ``ip-ratelimit``), at most :data:`MAX_PENDING` queries wait on
the slow path, :data:`~spliceway.dns.tcp.MAX_TCP_CLIENTS` TCP connections are served
(:data:`~spliceway.dns.tcp.MAX_TCP_PER_SOURCE` from one address), and the TCP
listener backs off when out of file descriptors (:class:`~spliceway.support.fdlimit.AcceptBackoff`).

The engine runs the server on a thread of its own (its own asyncio loop): on the
dispatcher's loop one costly message delayed every Python-path flow (a 64 KiB message
of 10,831 questions took dnspython 0.4 s). The resolver, its cache and the fake-ip
pool it shares with flow routing are thread-safe; everything else here is touched by
the server's thread alone. UDP datagrams are read up to 64 per readiness event.

Beside this module: the header screen and the wire cache's key (:mod:`spliceway.dns.wire`),
the per-client rate limit (:mod:`spliceway.dns.ratelimit`), the counters
(:mod:`spliceway.dns.counters`) and one TCP client's serving (:mod:`spliceway.dns.tcp`);
their public names are importable from here as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.PTR
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.reversename
import dns.rrset

from spliceway.dns.counters import COUNTER_NAMES, DnsCounters, DnsCounterSnapshot
from spliceway.dns.ratelimit import PARSED_QUERY_COST, ClientRateLimit, _Throttle
from spliceway.dns.resolver import Answer, InvalidHostname, ResolveError, normalize_hostname
from spliceway.dns.tcp import MAX_TCP_PER_SOURCE, serve_tcp_client
from spliceway.dns.transport import BACKEND
from spliceway.dns.wire import (
    _ID_FLAGS,
    _OPT,
    _RD_CD,
    ACCEPTED,
    MAX_QUERY_BYTES,
    SLOW,
    _Accepted,
    _fast_key,
    _header_reply,
    _Slow,
    screen,
    unanswerable,
)
from spliceway.errors import ApiError
from spliceway.support.fdlimit import AcceptBackoff
from spliceway.support.loop import Dispatcher

if TYPE_CHECKING:
    from spliceway.dns.fakeip import FakeIpPool
    from spliceway.dns.resolver import Resolver

__all__ = [
    "ACCEPTED",
    "COUNTER_NAMES",
    "FAKE_TTL_SECONDS",
    "MAX_QUERY_BYTES",
    "SLOW",
    "WIRE_CACHE_SECONDS",
    "ClientRateLimit",
    "DnsCounterSnapshot",
    "DnsCounters",
    "DnsResponder",
    "DnsServer",
    "bind_dns",
    "screen",
    "serve_tcp_client",
    "unanswerable",
]

logger = logging.getLogger(__name__)

#: TTL of a fake-ip answer.
FAKE_TTL_SECONDS: Final = 1
#: How long an answer is served from its wire bytes before it is built again.
WIRE_CACHE_SECONDS: Final = 1.0
#: Payload size advertised in EDNS answers.
EDNS_PAYLOAD: Final = 1232
#: Budget for resolving or forwarding one query.
QUERY_TIMEOUT_SECONDS: Final = 4.0
#: Queries answered at once on the slow path; more are dropped (and counted) until
#: some finish, so a flood of uncached names cannot grow memory without bound.
MAX_PENDING: Final = 1024
#: The UDP socket's receive buffer: a burst of large datagrams (three 64 KiB ones fill
#: the kernel's default 208 KiB) must not push good queries out while the thread waits.
UDP_RCVBUF: Final = 1 << 20
#: At most one log line about refused queries, and one traceback, per this many seconds.
LOG_INTERVAL_SECONDS: Final = 60.0

_WIRE_CACHE_MAX = 8192
_UDP_BATCH = 64
_ACCEPT_BATCH = 16
# One byte more than a query may have: a longer datagram reads as too long.
_UDP_RECV = MAX_QUERY_BYTES + 1
_NOT_SERVED = frozenset({dns.rdatatype.ANY, dns.rdatatype.AXFR, dns.rdatatype.IXFR})
_HINTED = frozenset({dns.rdatatype.HTTPS, dns.rdatatype.SVCB})
_ADDRESS_TYPES = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}


class DnsResponder:
    """Turns one query message into its answer; no sockets (see the module docstring).

    ``resolver`` and ``pool`` are read at every query, so a reload's replacements
    answer at once; ``pool`` returns None in real mode. :meth:`quick` is plain code and
    :meth:`respond` a coroutine. Two loops may use one responder at once (the DNS
    server's thread and the dispatcher's, for a TUN's ``dns_hijack``, so both count in
    one set of counters): resolutions in flight are shared per loop only, and the wire
    cache and counters are touched with single dict and attribute operations, which
    the interpreter lock keeps whole.
    """

    def __init__(
        self,
        resolver: Callable[[], Resolver],
        pool: Callable[[], FakeIpPool | None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolver = resolver
        self._pool = pool
        self._clock = clock
        self.counters = DnsCounters()
        #: key -> (flags without RD/CD, counts, records after the question, expires_at)
        self._wire: dict[bytes, tuple[int, bytes, bytes, float]] = {}
        #: What the wire cache was built from; a change empties it.
        self._wire_source: tuple[Any, Any, int] = (None, None, -1)
        #: Resolutions in flight by name: concurrent queries for one name share one.
        self._inflight: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Task[Answer]] = {}
        self.pending = 0
        self._refusals = _Throttle(LOG_INTERVAL_SECONDS)
        self._failures = _Throttle(LOG_INTERVAL_SECONDS)

    # -- the fast path ------------------------------------------------------------------

    def _wire_valid(self) -> bool:
        """Whether the wire cache may be used (empties it when its source changed)."""
        resolver, pool = self._resolver(), self._pool()
        source = (resolver, pool, -1 if pool is None else pool.generation)
        if source != self._wire_source:
            self._wire.clear()
            self._wire_source = source
        return pool is not None or resolver.cache is not None

    def quick(self, data: bytes, tcp: bool) -> bytes | _Slow:
        """The answer to ``data`` that needs no parse, or :data:`SLOW` (ask
        :meth:`respond`): a header-only refusal (:func:`screen`, counted) or the wire
        cache's answer. A message to drop gets SLOW too, uncounted: :meth:`respond`
        drops and counts it (see :func:`unanswerable` to skip that)."""
        # What _fast_key takes, screen() accepts: the common case is judged once.
        found = _fast_key(data, tcp) if len(data) <= MAX_QUERY_BYTES else None
        if found is None:
            judged = screen(data)
            if isinstance(judged, _Accepted):
                return SLOW
            reply, rcode = judged
            if reply is None:
                return SLOW
            self._refused(reply, rcode)
            return reply
        if not self._wire_valid():
            return SLOW
        key, qend, limit = found
        entry = self._wire.get(key)
        if entry is None:
            return SLOW
        flags, counts, tail, expires = entry
        if expires <= self._clock():
            # pop: the other loop (see the class) may have removed it meanwhile.
            self._wire.pop(key, None)
            return SLOW
        if qend + len(tail) > limit:
            return SLOW
        self.counters.cache_hits += 1
        qid, qflags = _ID_FLAGS.unpack_from(data)
        return _ID_FLAGS.pack(qid, flags | (qflags & _RD_CD)) + counts + data[12:qend] + tail

    def _keep_wire(self, data: bytes, tcp: bool, wire: bytes) -> None:
        """Keep ``wire`` (a positive answer to ``data``) for :meth:`quick`."""
        found = _fast_key(data, tcp)
        if found is None or not self._wire_valid():
            return
        key, qend, _ = found
        # The answer's question must be the query's byte for byte (case included):
        # quick() puts the client's question in front of the stored records.
        if wire[12:qend] != data[12:qend] or len(wire) < qend:
            return
        if len(self._wire) >= _WIRE_CACHE_MAX:
            self._wire.clear()
        flags = _ID_FLAGS.unpack_from(wire)[1] & ~_RD_CD
        expires = self._clock() + WIRE_CACHE_SECONDS
        self._wire[key] = (flags, wire[4:12], wire[qend:], expires)

    # -- the full path ------------------------------------------------------------------

    async def respond(self, data: bytes, tcp: bool) -> bytes | None:
        """The answer to ``data`` (``tcp``: it came over TCP), or None to drop it.

        Never raises: an unexpected error is answered SERVFAIL and logged, with its
        traceback at most once per :data:`LOG_INTERVAL_SECONDS` (a client could repeat
        the query that causes it)."""
        fast = self.quick(data, tcp)
        if not isinstance(fast, _Slow):
            return fast
        if unanswerable(data):
            self._refused(None, 0)
            return None
        try:
            return await self._respond(data, tcp)
        except Exception:
            if self._failures.ready():
                logger.exception(
                    "the DNS server failed to answer a query (%d more failures in the "
                    "previous %.0f s)",
                    self._failures.skipped,
                    LOG_INTERVAL_SECONDS,
                )
                self._failures.skipped = 0
            reply = _header_reply(data, dns.rcode.SERVFAIL)
            self._count(reply, dns.rcode.SERVFAIL)
            return reply

    def _refused(self, reply: bytes | None, rcode: int) -> None:
        """Count a message :func:`screen` refused; a debug line a minute at most."""
        self._count(reply, rcode)
        if self._refusals.ready():
            logger.debug(
                "the DNS server refused a malformed query (%s; %d more refused in the "
                "previous %.0f s)",
                "dropped" if reply is None else dns.rcode.to_text(dns.rcode.Rcode(rcode)),
                self._refusals.skipped,
                LOG_INTERVAL_SECONDS,
            )
            self._refusals.skipped = 0

    def _count(self, reply: bytes | None, rcode: int) -> None:
        c = self.counters
        if reply is None:
            c.dropped += 1
        elif rcode == dns.rcode.NOERROR:
            c.slow_noerror += 1
        elif rcode == dns.rcode.NXDOMAIN:
            c.nxdomain += 1
        elif rcode == dns.rcode.SERVFAIL:
            c.servfail += 1
        elif rcode == dns.rcode.FORMERR:
            c.formerr += 1
        elif rcode == dns.rcode.NOTIMP:
            c.notimp += 1
        else:
            c.other_rcode += 1

    async def _respond(self, data: bytes, tcp: bool) -> bytes | None:
        try:
            query = dns.message.from_wire(data)
        except Exception:  # dnspython raises many kinds for a bad message; none matters
            reply = _header_reply(data, dns.rcode.FORMERR)
            self._count(reply, dns.rcode.FORMERR)
            return reply
        if query.flags & dns.flags.QR:
            self._count(None, 0)
            return None
        limit = 65535 if tcp else max(512, query.payload if query.edns >= 0 else 512)
        response = dns.message.make_response(query, our_payload=EDNS_PAYLOAD)
        response.flags |= dns.flags.RA | (query.flags & dns.flags.CD)
        cacheable = await self._answer(query, response)
        wire = self._render(response, limit)
        rcode = response.rcode()
        self._count(wire, rcode)
        if cacheable and not (response.flags & dns.flags.TC):
            self._keep_wire(data, tcp, wire)
        return wire

    def _render(self, response: dns.message.Message, limit: int) -> bytes:
        """``response`` in wire form within ``limit`` bytes: truncated (TC set, no
        records) when it does not fit."""
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            self.counters.truncated += 1
            response.answer, response.authority, response.additional = [], [], []
            response.flags |= dns.flags.TC
            return response.to_wire(max_size=limit)

    async def _answer(self, query: dns.message.Message, response: dns.message.Message) -> bool:
        """Fill ``response``; True when it may be kept in the wire cache."""
        if query.opcode() != dns.opcode.QUERY:
            response.set_rcode(dns.rcode.NOTIMP)
            return False
        if query.edns > 0:
            response.set_rcode(dns.rcode.BADVERS)
            return False
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return False
        question = query.question[0]
        qtype = question.rdtype
        if question.rdclass != dns.rdataclass.IN or qtype in _NOT_SERVED:
            response.set_rcode(dns.rcode.NOTIMP)
            return False
        pool = self._pool()
        family = _ADDRESS_TYPES.get(qtype)
        if family is not None:
            return await self._answer_address(question.name, family, response, pool)
        if pool is not None:
            if qtype in _HINTED:
                return False  # NOERROR, no records
            if qtype == dns.rdatatype.PTR and self._answer_ptr(question.name, response, pool):
                return False
        await self._forward(query, response)
        return False

    async def _answer_address(
        self,
        qname: dns.name.Name,
        family: int,
        response: dns.message.Message,
        pool: FakeIpPool | None,
    ) -> bool:
        try:
            name = normalize_hostname(qname.to_text(omit_final_dot=True))
        except InvalidHostname:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return False
        rdtype = dns.rdatatype.A if family == 4 else dns.rdatatype.AAAA
        if pool is not None and name != "localhost" and not name.endswith(".localhost"):
            if pool.version == family:
                address = pool.lookup(name)
                self.counters.fake_ip_answers += 1
                response.answer.append(
                    dns.rrset.from_text(qname, FAKE_TTL_SECONDS, "IN", rdtype, address)
                )
            return True
        try:
            answer = await self._resolve(name)
        except ResolveError:
            response.set_rcode(dns.rcode.SERVFAIL)
            return False
        if not answer.addresses:
            if answer.nxdomain:
                response.set_rcode(dns.rcode.NXDOMAIN)
            return False
        wanted = [a for a in answer.addresses if (":" in a) == (family == 6)]
        if wanted:
            response.answer.append(
                dns.rrset.from_text_list(qname, answer.ttl_seconds, "IN", rdtype, wanted)
            )
        return True

    async def _resolve(self, name: str) -> Answer:
        """The resolver's answer for ``name``; concurrent callers share one resolution."""
        loop = asyncio.get_running_loop()
        # By loop and name: a task of the other loop (see the class) cannot be awaited.
        key = (loop, name)
        task = self._inflight.get(key)
        if task is None:
            task = loop.create_task(self._resolver().resolve_answer(name, QUERY_TIMEOUT_SECONDS))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        # shield: one caller's cancellation (server stop) must not fail the others.
        return await asyncio.shield(task)

    def _answer_ptr(
        self, qname: dns.name.Name, response: dns.message.Message, pool: FakeIpPool
    ) -> bool:
        """Answer a PTR query for a fake address with its domain; False if it is not one."""
        try:
            address = dns.reversename.to_address(qname)
        except (dns.exception.SyntaxError, ValueError):
            return False
        if not pool.contains(address):
            return False
        domain = pool.peek_domain(address)
        if domain is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            rrset = dns.rrset.from_text(qname, FAKE_TTL_SECONDS, "IN", "PTR", f"{domain}.")
            response.answer.append(rrset)
        return True

    async def _forward(self, query: dns.message.Message, response: dns.message.Message) -> None:
        """Ask the ``udp://`` / ``tcp://`` servers in order; their answer's sections go
        into ``response``. NOTIMP when there are none, SERVFAIL when none answered."""
        upstreams = self._resolver().upstreams
        if not upstreams:
            response.set_rcode(dns.rcode.NOTIMP)
            return
        deadline = time.monotonic() + QUERY_TIMEOUT_SECONDS
        outgoing = dns.message.make_query(query.question[0].name, query.question[0].rdtype)
        outgoing.flags = dns.flags.RD | (query.flags & dns.flags.CD)
        for i, (kind, ip, port) in enumerate(upstreams):
            budget = (deadline - time.monotonic()) / (len(upstreams) - i)
            if budget <= 0:
                break
            try:
                # BACKEND: the sockets carry the TUN's mark while one runs, so the
                # query goes around the TUN (spliceway.dns.transport).
                if kind == "tcp":
                    got = await dns.asyncquery.tcp(
                        outgoing, ip, timeout=budget, port=port, backend=BACKEND
                    )
                else:
                    got, _ = await dns.asyncquery.udp_with_fallback(
                        outgoing, ip, timeout=budget, port=port, backend=BACKEND
                    )
            except (dns.exception.DNSException, OSError, EOFError):
                continue
            if got.rcode() in (dns.rcode.SERVFAIL, dns.rcode.REFUSED):
                continue
            self.counters.forwarded += 1
            response.set_rcode(got.rcode())
            response.answer = got.answer
            response.authority = got.authority
            response.additional = [r for r in got.additional if r.rdtype != _OPT]
            return
        response.set_rcode(dns.rcode.SERVFAIL)


def bind_dns(address: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket (listening) on ``address:port``; with port 0, one free port
    for both. ApiError ``conflict`` on ``runtime.dns.listen`` when it cannot be bound."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    last: OSError | None = None
    # Port 0: the UDP socket's port may be taken for TCP; a few new ports, then give up.
    for _ in range(8 if port == 0 else 1):
        udp = socket.socket(family, socket.SOCK_DGRAM)
        tcp = socket.socket(family, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):  # a smaller buffer still works
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
            udp.bind((address, port))
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((address, udp.getsockname()[1]))
            tcp.listen(128)
            udp.setblocking(False)
            tcp.setblocking(False)
            return udp, tcp
        except OSError as ex:
            udp.close()
            tcp.close()
            last = ex
    assert last is not None
    raise ApiError(
        "conflict",
        f"the DNS server cannot listen on {address}:{port}: "
        f"{last.strerror if last.strerror else last}",
        field_path="runtime.dns.listen",
    ) from last


class DnsServer:
    """Serves a :class:`DnsResponder` on a bound UDP and TCP socket pair (``bind_dns``),
    on its own thread's asyncio loop (what the engine does), or on ``dispatcher``'s
    loop when one is given (it is then the caller's to start and stop;
    benchmarks/bench_dns.py --flows compares the two). The sockets are the server's
    from the constructor on, closed by :meth:`stop` (or by :meth:`start` when it fails).

    ``rate_limit``: queries a second answered from one source address
    (:class:`ClientRateLimit`; None: no limit). ``warn(message)`` is called when the
    TCP listener runs out of file descriptors (once per outage: ``engine.warning``
    ``fd_exhausted``); it then pauses accepting (:class:`~spliceway.support.fdlimit.AcceptBackoff`)
    and keeps serving what it has."""

    def __init__(
        self,
        udp: socket.socket,
        tcp: socket.socket,
        responder: DnsResponder,
        dispatcher: Dispatcher | None = None,
        *,
        rate_limit: int | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._udp = udp
        self._tcp = tcp
        self.responder = responder
        self.counters = responder.counters
        #: Per-source token buckets, over UDP and TCP alike.
        self.rate_limit = ClientRateLimit(rate_limit)
        #: The (address, port) bound: the same port for UDP and TCP.
        self.bound: tuple[str, int] = udp.getsockname()[:2]
        self._own_loop = dispatcher is None
        self._dispatcher = dispatcher if dispatcher is not None else Dispatcher("spliceway-dns")
        self._backoff = AcceptBackoff(
            f"the DNS server (TCP, {self.bound[0]}:{self.bound[1]})",
            warn if warn is not None else lambda message: None,
        )
        self._accept_paused: asyncio.TimerHandle | None = None
        #: Open TCP connections by source address.
        self._tcp_sources: dict[str, int] = {}
        self._tcp_clients: set[asyncio.Task[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running = False

    def start(self) -> None:
        """Start serving; returns once both sockets are served."""
        if self._own_loop:
            self._dispatcher.start()
        try:
            self._dispatcher.run_sync(self._attach)
        except BaseException:
            if self._own_loop:
                self._dispatcher.stop()
            self._close_sockets()
            raise
        self._running = True

    def stop(self) -> None:
        """Stop serving, close the sockets and join the thread (idempotent)."""
        if self._running:
            self._running = False
            with contextlib.suppress(Exception):
                self._dispatcher.run_sync(self._detach)
        if self._own_loop:
            self._dispatcher.stop()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._udp, self._tcp):
            with contextlib.suppress(OSError):
                sock.close()

    # -- on the server's loop ------------------------------------------------------------

    def _attach(self) -> None:
        loop = self._dispatcher.loop
        loop.add_reader(self._udp.fileno(), self._udp_readable)
        try:
            loop.add_reader(self._tcp.fileno(), self._tcp_acceptable)
        except BaseException:
            loop.remove_reader(self._udp.fileno())
            raise

    def _detach(self) -> None:
        loop = self._dispatcher.loop
        if self._accept_paused is not None:
            self._accept_paused.cancel()
            self._accept_paused = None
        for sock in (self._udp, self._tcp):
            with contextlib.suppress(Exception):
                loop.remove_reader(sock.fileno())
        for task in [*self._tasks, *self._tcp_clients]:
            task.cancel()

    def _udp_readable(self) -> None:
        sock, responder, counters = self._udp, self.responder, self.counters
        quick, allow = responder.quick, self.rate_limit.allow
        # Several datagrams per wakeup: a loop round per datagram would cost more than
        # answering it from the wire cache.
        for _ in range(_UDP_BATCH):
            try:
                data, addr = sock.recvfrom(_UDP_RECV)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # An ICMP error queued on the socket (a client gone): nothing to read.
                continue
            counters.queries += 1
            if not allow(addr[0]):
                # Dropped, not REFUSED, as unbound's ip-ratelimit: a UDP source may be
                # forged, and any answer would go to the address it names.
                counters.rate_limited += 1
                continue
            out = quick(data, False)
            if not isinstance(out, _Slow):
                self._send(out, addr)
            elif unanswerable(data):
                counters.dropped += 1  # no task for it: nothing to answer
            elif not allow(addr[0], PARSED_QUERY_COST - 1):
                counters.rate_limited += 1
            elif responder.pending >= MAX_PENDING:
                counters.dropped += 1
            else:
                self._spawn(self._udp_slow(data, addr))

    def _send(self, data: bytes, addr: Any) -> None:
        try:
            self._udp.sendto(data, addr)
        except OSError:
            # Socket buffer full or the client unreachable: UDP may lose it.
            self.counters.send_failed += 1

    def _spawn(self, coro: Any) -> None:
        task = self._dispatcher.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _udp_slow(self, data: bytes, addr: Any) -> None:
        self.responder.pending += 1
        try:
            out = await self.responder.respond(data, False)
        finally:
            self.responder.pending -= 1
        if out is not None:
            self._send(out, addr)

    def _tcp_acceptable(self) -> None:
        # Accepted here rather than by asyncio's server: out of descriptors, its accept
        # loop logs an error and retries every second for as long as that lasts.
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = self._tcp.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as ex:
                pause = self._backoff.failed(ex.errno)
                if pause:
                    self._pause_accepting(pause)
                # else ECONNABORTED and the like: the next connection may do.
                return
            self._backoff.accepted()
            self._spawn_tcp(conn, addr[0])

    def _pause_accepting(self, seconds: float) -> None:
        # The failed connection stays queued, so the socket stays readable: without its
        # reader for the pause, the loop would spin on it.
        loop = self._dispatcher.loop
        with contextlib.suppress(Exception):
            loop.remove_reader(self._tcp.fileno())
        self._accept_paused = loop.call_later(seconds, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._accept_paused = None
        if self._running:
            self._dispatcher.loop.add_reader(self._tcp.fileno(), self._tcp_acceptable)

    def _spawn_tcp(self, conn: socket.socket, source: str) -> None:
        open_now = self._tcp_sources.get(source, 0)
        if open_now >= MAX_TCP_PER_SOURCE:
            self.counters.tcp_connections += 1
            self.counters.tcp_refused += 1
            conn.close()
            return
        self._tcp_sources[source] = open_now + 1
        conn.setblocking(False)
        task = self._dispatcher.loop.create_task(self._tcp_client(conn, source))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._tcp_done(t, conn, source))

    def _tcp_done(self, task: asyncio.Task[Any], conn: socket.socket, source: str) -> None:
        self._tasks.discard(task)
        # Closed here too: a task cancelled before it ran never closes its socket.
        conn.close()
        left = self._tcp_sources.pop(source, 1) - 1
        if left > 0:
            self._tcp_sources[source] = left

    async def _tcp_client(self, conn: socket.socket, source: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=65536 + 2)
        except OSError:
            return  # gone already
        allow = self.rate_limit.allow
        await serve_tcp_client(
            reader,
            writer,
            self.responder,
            self._tcp_clients,
            allow=lambda cost: allow(source, cost),
        )
