"""TunUdpActor: the UDP sessions of the TUN's packet loop, as UDP flows.

The packet loop (:class:`~spliceway.native.tun.TunStack`, csrc/tun.c) hands every UDP
datagram the TUN captures to Python as a record naming its *session*: one (source,
destination) pair, ended by the loop when idle, when closed, or at shutdown. This
actor watches the stack's eventfd on the dispatcher loop, drains the records, and
makes each session one flow (``network: udp``, ``inbound {tag, protocol: "tun"}``)
from the original source to the original destination (a fake-ip destination stands
for its domain, as in ``actors/udp.py``), routed by the rules with ``network: udp``:

- ``direct``: a UDP socket of the session's own, marked (so it leaves by the physical
  egress, not back into the TUN) and connected to the target (resolved by the engine
  when it is a name); the replies go back into the TUN from the original destination
  (``stack.udp_send``);
- ``socks5`` / ``shadowsocks``: the proxy upstreams of ``actors/udp.py``
  (:mod:`spliceway.actors.udp_upstream`), one upstream association per outbound and
  client socket, as one SOCKS5 UDP ASSOCIATE would have;
- ``block`` (or an outbound without UDP): the datagrams are dropped (counted) and the
  flow completes at once, blocked (failed); the session lives on in the loop, silent,
  until it idles out, so a blocked sender does not make a flow per datagram.

Datagrams that arrive while the route is being decided wait (a bounded queue).
A session ends with the loop's end record (``idle``: close reason ``idle_timeout``;
``shutdown``: an ordinary end), after ``idle_timeout_s`` without a datagram either way
here (``idle_timeout``; the session is then closed in the loop), or with ``flows.close``
(cancelled, manual). Its ``flow.completed`` carries exact counts: ``packets_up`` /
``bytes_up`` what was relayed to the upstream, ``packets_down`` / ``bytes_down`` the
replies written to the TUN, ``inbound_rx_bytes`` / ``inbound_tx_bytes`` the payload bytes
read from and written to the TUN (from the loop's own counters once it ended the
session), ``outbound_*`` what crossed the upstream socket (headers and sealing of a
proxy included). Every stats tick (:class:`~spliceway.actors.udp.SampleUdp`) a
``flow.updated`` goes out for each flow whose counts moved.

With a :class:`~spliceway.dns.server.DnsResponder` (``dns``), a datagram to port 53 of
any destination is not a flow: the responder answers it (its wire cache at once, else
its coroutine, with at most ``MAX_PENDING`` queries pending, as the DNS server) and the
answer goes back into the TUN from the address the client asked; the session is closed
in the loop once its queries are answered. TCP queries are
:class:`~spliceway.tun.dns_hijack.TunDnsTcp`'s.

Nothing a client sends raises out of the actor: malformed DNS, a record for a session
it does not know, a reply the loop refuses are counted (:class:`TunUdpCounters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway.actors import udp_flow
from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.messages import CloseFlow, StopFlow
from spliceway.actors.udp import SampleUdp
from spliceway.actors.udp_upstream import (
    MAX_DATAGRAM,
    ProxyUpstream,
    ProxyUpstreams,
    is_ip,
    norm,
    upstream_key,
)
from spliceway.dns import InvalidHostname, ResolveError
from spliceway.dns.server import MAX_PENDING, SLOW
from spliceway.events.log import now_ms
from spliceway.flows import records
from spliceway.flows.hook import ask_about
from spliceway.native.tun import TunStackError, UdpRecord
from spliceway.support.socket_mark import apply_mark

if TYPE_CHECKING:
    from spliceway.actors.flow import FlowDeps
    from spliceway.dns import Resolver
    from spliceway.dns.server import DnsResponder
    from spliceway.engine.core import InboundSpec
    from spliceway.native.tun import TunStack

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "TunUdpActor", "TunUdpCounters", "TunUdpStats"]

DNS_PORT = 53
#: Records taken from the stack per readiness event (its eventfd stays readable while
#: more wait, so the loop's other work gets a turn in between).
_RECORDS_BATCH = 256
#: Datagrams read from one direct upstream socket per readiness event.
_RECV_BATCH = 64
#: Datagrams (and their bytes) a session keeps while its route is being decided.
_QUEUE_PACKETS = 64
_QUEUE_BYTES = 256 * 1024
_FORMERR = 1


@dataclass(slots=True, eq=False)
class TunUdpCounters:
    """What the actor did since it started (ints; any thread may read them).

    ``flows``: UDP flows started. ``datagrams_in``: datagram records taken from the
    stack (DNS queries included). ``datagrams_relayed``: sent to an upstream.
    ``datagrams_dropped``: not relayed (blocked or failed flow, full queue while
    routing, upstream send failed). ``replies`` / ``reply_failures``: replies written
    to the TUN / refused by the stack (session gone, too big). ``upstream_errors``:
    errors read from a direct upstream socket (ICMP unreachable). ``unknown_sessions``:
    records naming a session the actor does not know. ``errors``: records whose
    handling failed unexpectedly (logged). ``dns_queries``: datagrams to port 53
    answered by the responder; ``dns_answers``: answers written back;
    ``dns_dropped``: queries past the pending bound; ``dns_malformed``: queries the
    responder dropped (shorter than a header, or a response) or answered FORMERR;
    ``dns_send_failed``: answers the stack refused.
    """

    flows: int = 0
    datagrams_in: int = 0
    datagrams_relayed: int = 0
    datagrams_dropped: int = 0
    replies: int = 0
    reply_failures: int = 0
    upstream_errors: int = 0
    unknown_sessions: int = 0
    errors: int = 0
    dns_queries: int = 0
    dns_answers: int = 0
    dns_dropped: int = 0
    dns_malformed: int = 0
    dns_send_failed: int = 0

    def snapshot(self) -> dict[str, int]:
        """The counters as a document, in :data:`COUNTER_NAMES` order."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}


#: :class:`TunUdpCounters`' fields, in order.
COUNTER_NAMES = tuple(f.name for f in fields(TunUdpCounters))


class TunUdpStats(NamedTuple):
    """Ask: the actor's counters (:meth:`TunUdpCounters.snapshot`) and open flows."""


@dataclass(slots=True, eq=False)
class _Session:
    """One session of the stack: its flow, and how its datagrams go."""

    id: int
    source: tuple[str, int]
    #: The destination the client sent to (replies come from it).
    key: tuple[str, int]
    #: Where it goes: ``key``, or the domain a fake-ip address stands for.
    target: tuple[str, int]
    state: records.FlowState
    #: "opening", "direct", "python"; "closed" once its flow completed (its datagrams
    #: are then dropped until the stack ends the session).
    action: str = "opening"
    #: The address its route was decided on (an ip_cidr rule needed it): dialled alone.
    address: str | None = None
    last_active: float = 0.0
    #: When its flow completed (a refused session is forgotten a hold later).
    closed_at: float = 0.0
    queue: deque[bytes] = field(default_factory=deque)
    queued_bytes: int = 0
    sock: socket.socket | None = None
    proxy: ProxyUpstream | None = None
    # Relayed to the upstream (payload), and what crossed the upstream socket.
    py_packets_up: int = 0
    py_bytes_up: int = 0
    py_wire_up: int = 0
    py_wire_down: int = 0
    # Read from the TUN (every datagram record) and written to it (replies).
    rx_packets: int = 0
    rx_bytes: int = 0
    packets_down: int = 0
    bytes_down: int = 0


class TunUdpActor(LoopActor):
    """The TUN stack's UDP sessions: flows, their relaying, and DNS hijack over UDP.

    ``resolver``: the engine's resolver, or a callable returning the current one (a
    reload replaces it; this actor lives as long as the TUN). ``dns``: answer port 53
    here (None: port 53 is a flow like any other). ``idle_timeout_s``: a session with
    no datagram either way for that long ends (``runtime.udp_upstream_idle_timeout_seconds``).
    ``counters``: where to count (a fresh :class:`TunUdpCounters` by default; the
    caller may pass its own to read it without asking). ``id_prefix``: flow ids are
    ``{id_prefix}u{n}`` (default: the engine's prefix and the inbound's slot).
    """

    registered = False

    def __init__(
        self,
        deps: FlowDeps,
        resolver: Resolver | Callable[[], Resolver],
        inbound: InboundSpec,
        stack: TunStack,
        dns: DnsResponder | None,
        idle_timeout_s: float,
        *,
        counters: TunUdpCounters | None = None,
        id_prefix: str | None = None,
    ) -> None:
        super().__init__(deps.dispatcher)
        self.deps = deps
        self._resolver: Callable[[], Resolver] = (
            (lambda: resolver) if hasattr(resolver, "resolve") else resolver  # type: ignore[assignment,return-value]
        )
        self.inbound = inbound
        self.stack = stack
        self.dns = dns
        self.idle_timeout_s = idle_timeout_s
        self.counters = counters if counters is not None else TunUdpCounters()
        if id_prefix is None:
            core = getattr(deps, "_core", None)
            engine_prefix = getattr(core, "flow_id_prefix", "tun-")
            id_prefix = f"{engine_prefix}{inbound.index}-"
        self.id_prefix = id_prefix
        self.sessions: dict[int, _Session] = {}
        #: DNS sessions -> their queries not answered yet.
        self.dns_sessions: dict[int, int] = {}
        self._dns_tasks: set[asyncio.Task[None]] = set()
        self.upstreams = ProxyUpstreams(
            deps.counters,
            deps.dispatcher,
            self._resolver,
            self._alive,
            self._deliver,
            self._proxy_lost,
        )
        self._fd: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._n = 0
        # Tracked with the flow actors: an engine stop ends it and its flows.
        deps.flow_actors.add(self)

    # -- lifecycle ------------------------------------------------------------------

    def on_start(self) -> None:
        """Watch the stack's records; take those already waiting."""
        try:
            fd = self.stack.fileno()  # TunStackError: the stack is not running
            self.dispatcher.loop.add_reader(fd, self._on_records)
        except BaseException:
            # pykka does not call on_stop after a failed on_start: leave nothing behind.
            self.on_stop()
            raise
        self._fd = fd
        self._schedule_sweep()
        self._on_records()

    def on_stop(self) -> None:
        """Complete every open flow (an ordinary end, as at engine stop), close the
        upstreams, stop watching the stack. The stack's sessions stay its own."""
        self.deps.flow_actors.discard(self)
        loop = self.dispatcher.loop
        if self._fd is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._fd)
            self._fd = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for sess in list(self.sessions.values()):
            self._complete(sess, None if sess.action != "opening" else records.CANCELLED)
        self.sessions.clear()
        self.upstreams.close_all()
        for task in list(self._dns_tasks):
            task.cancel()
        self.dns_sessions.clear()

    def on_failure(self, *exc_info: object) -> None:
        """Never leave sockets or flows behind after a bug."""
        self.on_stop()

    def _alive(self) -> bool:
        return not self.actor_stopped.is_set()

    # -- messages -------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """``SampleUdp`` (stats tick), ``CloseFlow`` (one flow, cancelled and manual),
        ``StopFlow`` (engine shutdown: every flow ends, and the actor),
        ``TunUdpStats`` (ask: the counters and the open flows)."""
        if isinstance(message, SampleUdp):
            self._sample(message.sampled_at_unix_ms)
        elif isinstance(message, CloseFlow):
            return self._close_flow(message.flow_id)
        elif isinstance(message, StopFlow):
            self.stop_now()
        elif isinstance(message, TunUdpStats):
            out: dict[str, Any] = self.counters.snapshot()
            out["open_flows"] = sum(1 for s in self.sessions.values() if s.action != "closed")
            return out
        return None

    def _close_flow(self, flow_id: str) -> bool:
        sess = next((s for s in self.sessions.values() if s.state.flow_id == flow_id), None)
        if sess is None or sess.action == "closed":
            return False
        sess.state.close_reason = records.MANUAL
        self._complete(sess, records.CANCELLED)
        self._close_in_stack(sess)
        return True

    def _sample(self, sampled_at: int) -> None:
        """A flow.updated for each relaying flow whose counts moved since the last."""
        for sess in self.sessions.values():
            if sess.action not in ("direct", "python"):
                continue
            s = sess.state
            t = s.traffic
            before = (t.bytes_up, t.bytes_down, t.packets_up, t.packets_down)
            self._take_counts(sess)
            if (t.bytes_up, t.bytes_down, t.packets_up, t.packets_down) == before:
                continue
            previous_at = s.sampled_at_unix_ms or s.started_at_unix_ms
            elapsed_ms = max(sampled_at - previous_at, 1)
            s.upload_bps = (t.bytes_up - before[0]) * 8000 // elapsed_ms
            s.download_bps = (t.bytes_down - before[1]) * 8000 // elapsed_ms
            s.sampled_at_unix_ms = sampled_at
            self._publish_updated(sess)

    # -- the stack's records ------------------------------------------------------------

    def _on_records(self) -> None:
        if self.actor_stopped.is_set() or self._fd is None:
            return
        try:
            batch = self.stack.records(_RECORDS_BATCH)
        except TunStackError:
            # The stack stopped under us: nothing more will come.
            with contextlib.suppress(ValueError, OSError):
                self.dispatcher.loop.remove_reader(self._fd)
            self._fd = None
            return
        for record in batch:
            try:
                self._on_record(record)
            except Exception:
                self.counters.errors += 1
                logger.exception("TUN UDP: handling a record failed")

    def _on_record(self, record: UdpRecord) -> None:
        if record.kind == "ended":
            self._on_ended(record)
            return
        self.counters.datagrams_in += 1
        sess = self.sessions.get(record.session)
        if sess is None:
            if record.session in self.dns_sessions or (
                self.dns is not None and record.dport == DNS_PORT
            ):
                self._on_dns(record)
                return
            if not record.new_session:
                # Its first datagram was taken by someone else (an earlier actor).
                self.counters.unknown_sessions += 1
            sess = self._open(record)
        sess.rx_packets += 1
        sess.rx_bytes += len(record.payload)
        sess.last_active = time.monotonic()
        if sess.action == "closed":
            self.counters.datagrams_dropped += 1
            return
        sess.state.last_activity_at_unix_ms = record.at_unix_ms
        if sess.action == "opening":
            if len(sess.queue) >= _QUEUE_PACKETS or (
                sess.queued_bytes + len(record.payload) > _QUEUE_BYTES
            ):
                self.counters.datagrams_dropped += 1
                return
            sess.queue.append(record.payload)
            sess.queued_bytes += len(record.payload)
            return
        self._send_up(sess, record.payload)

    def _on_ended(self, record: UdpRecord) -> None:
        sess = self.sessions.pop(record.session, None)
        if sess is None:
            if self.dns_sessions.pop(record.session, None) is None:
                self.counters.unknown_sessions += 1
            return
        # The stack's own counts of the session: exact, every datagram included.
        sess.rx_packets, sess.rx_bytes = record.packets_in, record.bytes_in
        sess.packets_down, sess.bytes_down = record.packets_out, record.bytes_out
        if sess.action == "closed":
            return
        if record.reason == "idle":
            sess.state.close_reason = records.IDLE_TIMEOUT
        self._complete(sess, None if sess.action != "opening" else records.CANCELLED)

    def _close_in_stack(self, sess: _Session) -> None:
        """End a flow's session in the stack (its end record follows); the idle sweep
        leaves it alone from now on, unless the client sends again meanwhile."""
        sess.last_active = float("inf")
        with contextlib.suppress(TunStackError):
            self.stack.udp_close(sess.id)

    # -- DNS ------------------------------------------------------------------------

    def _on_dns(self, record: UdpRecord) -> None:
        assert self.dns is not None
        c = self.counters
        c.dns_queries += 1
        responder = self.dns
        responder.counters.queries += 1
        self.dns_sessions[record.session] = self.dns_sessions.get(record.session, 0) + 1
        try:
            out = responder.quick(record.payload, False)
        except Exception:  # quick() is plain code on the bytes; a bug must not spread
            logger.exception("TUN DNS: the wire cache failed")
            out = SLOW
        if out is SLOW:
            if responder.pending >= MAX_PENDING:
                c.dns_dropped += 1
                responder.counters.dropped += 1
                self._dns_done(record.session)
                return
            task = self.dispatcher.loop.create_task(self._dns_slow(record))
            self._dns_tasks.add(task)
            task.add_done_callback(self._dns_tasks.discard)
            return
        assert isinstance(out, bytes)
        self._dns_answer(record, out)

    async def _dns_slow(self, record: UdpRecord) -> None:
        assert self.dns is not None
        self.dns.pending += 1
        try:
            out = await self.dns.respond(record.payload, False)
        finally:
            self.dns.pending -= 1
        if not self.actor_stopped.is_set():
            self._dns_answer(record, out)

    def _dns_answer(self, record: UdpRecord, out: bytes | None) -> None:
        c = self.counters
        if out is None or (len(out) >= 4 and out[3] & 0x0F == _FORMERR):
            c.dns_malformed += 1
        if out is not None:
            try:
                try:
                    self.stack.udp_send(record.session, out)
                except TunStackError as ex:
                    if ex.errno != errno.ENOENT:
                        raise
                    # The session was closed after its last answer: a late one.
                    self.stack.inject_udp(
                        (record.dst, record.dport), (record.src, record.sport), out
                    )
            except TunStackError:
                c.dns_send_failed += 1
                self.dns.counters.send_failed += 1  # type: ignore[union-attr]
            else:
                c.dns_answers += 1
        self._dns_done(record.session)

    def _dns_done(self, session: int) -> None:
        left = self.dns_sessions.get(session)
        if left is None:
            return  # ended meanwhile
        self.dns_sessions[session] = left = max(left - 1, 0)
        if not left:
            # Answered: free the session now rather than after the stack's idle time
            # (a resolver asks from a new port each time; sessions would pile up).
            with contextlib.suppress(TunStackError):
                self.stack.udp_close(session)

    # -- flows ----------------------------------------------------------------------

    def _open(self, record: UdpRecord) -> _Session:
        """A new session: its flow starts and is routed; the relaying follows."""
        deps = self.deps
        self._n += 1
        source = (str(record.src), record.sport)
        key = (str(record.dst), record.dport)
        target = key
        fake_ip: str | None = None
        pool = deps.fakeip
        if pool is not None:
            # A fake-ip address stands for the domain the client resolved (as for TCP).
            domain = pool.domain_of(key[0])
            if domain is not None:
                target, fake_ip = (domain, key[1]), key[0]
        state = records.FlowState(
            flow_id=f"{self.id_prefix}u{self._n}",
            inbound_tag=self.inbound.tag,
            inbound_protocol=self.inbound.protocol,
            source_ip=source[0],
            source_port=source[1],
            started_at_unix_ms=record.at_unix_ms,
            mode=deps.route_state.mode,
            network="udp",
            client_protocol="tun",
            target_host=target[0],
            target_port=target[1],
            fake_ip=fake_ip,
            last_activity_at_unix_ms=record.at_unix_ms,
        )
        state.traffic.packets_up = 0
        state.traffic.packets_down = 0
        sess = _Session(record.session, source, key, target, state, last_active=time.monotonic())
        self.sessions[record.session] = sess
        self.counters.flows += 1
        # Its datagrams queue (bounded) until the verdict.
        hook = udp_flow.hook_for(deps, state)
        if hook is None:
            self._start(sess, record.at_unix_ms)
        else:
            task = self.dispatcher.spawn(self._ask_hook(sess, hook, record.at_unix_ms))
            task.add_done_callback(_log_failure)
        return sess

    async def _ask_hook(self, sess: _Session, hook: Any, at_unix_ms: int) -> None:
        allow = await ask_about(hook, sess.state)
        if sess.action == "opening" and not self.actor_stopped.is_set():
            self._start(sess, at_unix_ms, allowed=allow)
        # else: ended while the hook was asked, quietly, as it never started

    def _start(self, sess: _Session, at_unix_ms: int, *, allowed: bool = True) -> None:
        """flow.started, the route, and the verdict's path (after resolving a domain
        target, a fake-ip one's, whose address an ip_cidr rule needs)."""
        if allowed and udp_flow.needs_address(self.deps, sess.state):
            task = self.dispatcher.spawn(self._start_resolved(sess, at_unix_ms))
            task.add_done_callback(_log_failure)
            return
        self._begin(sess, at_unix_ms, allowed=allowed)

    async def _start_resolved(self, sess: _Session, at_unix_ms: int) -> None:
        address = await udp_flow.rule_address(self._resolver(), sess.target[0])
        if sess.action == "opening" and not self.actor_stopped.is_set():
            sess.address = address
            self._begin(sess, at_unix_ms)
        # else: ended while it was resolved, quietly, as it never started

    def _begin(self, sess: _Session, at_unix_ms: int, *, allowed: bool = True) -> None:
        outbound, refusal = udp_flow.start(
            self.deps,
            self.actor_ref,
            sess.state,
            at_unix_ms,
            allowed=allowed,
            resolved_ip=sess.address,
        )
        if refusal is not None:
            self._complete(sess, *refusal)
        else:
            task = self.dispatcher.spawn(self._open_path(sess, outbound))
            task.add_done_callback(_log_failure)

    async def _open_path(self, sess: _Session, outbound: Any) -> None:
        try:
            if outbound.protocol == "direct":
                await self._open_direct(sess)
            else:
                await self._open_proxied(sess, outbound)
        except OSError as ex:
            if sess.action == "opening":
                self._fail(sess, records.Failure("connect", "connect_failed", str(ex)))

    def _fail(self, sess: _Session, failure: records.Failure) -> None:
        self._complete(sess, records.FAILED, failure)

    async def _open_direct(self, sess: _Session) -> None:
        host, port = sess.target
        if sess.address is not None:
            ip = norm(sess.address)  # what the route was decided on, alone
        elif is_ip(host):
            ip = norm(host)
        else:
            try:
                addresses = await self._resolver().resolve(host)
            except (InvalidHostname, ResolveError) as ex:
                addresses, error = [], str(ex)
            else:
                error = f"{host} has no address"
            if not addresses:
                if sess.action == "opening":
                    self._fail(sess, records.Failure("dns", "dns_failed", error))
                return
            ip = addresses[0]
        if sess.action != "opening" or self.actor_stopped.is_set():
            return
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            # Upstream datagrams leave by the physical egress while the TUN runs.
            apply_mark(sock)
            sock.setblocking(False)
            sock.connect((ip, port))  # only the target's replies, and a route now
            self.dispatcher.loop.add_reader(sock.fileno(), self._on_direct, sess)
        except BaseException:
            sock.close()
            raise
        sess.sock = sock
        udp = self.deps.counters.udp
        udp["created_associations"] += 1
        udp["active_associations"] += 1
        sess.action = "direct"
        self._routed(sess, resolved_ip=ip)

    async def _open_proxied(self, sess: _Session, outbound: Any) -> None:
        def wanted() -> bool:
            return sess.action == "opening" and not self.actor_stopped.is_set()

        # One upstream association per outbound and client socket: the destinations of
        # one socket are distinct, so the proxy's replies map back to one session each.
        key = upstream_key(outbound, sess.target, sess.source)
        proxy = await self.upstreams.open_for(outbound, key, wanted)
        if not wanted():
            return
        if proxy is None:
            self._fail(sess, udp_flow.no_association(outbound))
            return
        sess.action = "python"
        sess.proxy = proxy
        self.upstreams.attach(proxy, sess)
        self._routed(sess, proxy=outbound)

    def _routed(self, sess: _Session, **how: Any) -> None:
        """Routed (``udp_flow.routed``'s ``resolved_ip`` or ``proxy``); what queued while
        the verdict was awaited goes up now."""
        udp_flow.routed(self.deps, self.actor_ref, sess.state, **how)
        queue, sess.queue, sess.queued_bytes = sess.queue, deque(), 0
        for payload in queue:
            if sess.action not in ("direct", "python"):
                self.counters.datagrams_dropped += 1
                continue
            self._send_up(sess, payload)

    # -- relaying -------------------------------------------------------------------

    def _send_up(self, sess: _Session, payload: bytes) -> None:
        if sess.action == "python":
            sent = self.upstreams.send(sess.proxy, sess, payload)
        else:
            sent = self._send_direct(sess, payload)
        if sent:
            self.counters.datagrams_relayed += 1
        else:
            self.counters.datagrams_dropped += 1

    def _send_direct(self, sess: _Session, payload: bytes) -> bool:
        sock = sess.sock
        if sock is None:
            return False
        udp = self.deps.counters.udp
        try:
            try:
                sock.send(payload)
            except ConnectionRefusedError:
                # An ICMP unreachable for an earlier datagram, reported (and cleared)
                # instead of sending this one: the next try sends it.
                self.counters.upstream_errors += 1
                sock.send(payload)
        except OSError:
            # Buffer full, or the target unreachable again: UDP may lose it.
            udp["send_failures"] += 1
            return False
        udp["packets_sent"] += 1
        sess.py_packets_up += 1
        sess.py_bytes_up += len(payload)
        sess.py_wire_up += len(payload)
        return True

    def _on_direct(self, sess: _Session) -> None:
        sock = sess.sock
        if sock is None:
            return
        udp = self.deps.counters.udp
        for _ in range(_RECV_BATCH):
            try:
                data = sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionRefusedError:
                # An ICMP unreachable for an earlier datagram: the next may get through.
                self.counters.upstream_errors += 1
                continue
            except OSError:
                self.counters.upstream_errors += 1
                udp["recv_failures"] += 1
                return
            udp["packets_received"] += 1
            sess.py_wire_down += len(data)
            self._deliver(sess, data)
            if sess.sock is None:
                return

    def _deliver(self, sess: _Session, payload: bytes) -> bool:
        """A reply into the TUN, from the address the client sent to."""
        if sess.action == "closed":
            return False
        try:
            self.stack.udp_send(sess.id, payload)
        except TunStackError:
            # Ended (its end record follows), too big for the MTU, or the write failed.
            self.counters.reply_failures += 1
            return False
        self.counters.replies += 1
        sess.packets_down += 1
        sess.bytes_down += len(payload)
        sess.last_active = time.monotonic()
        sess.state.last_activity_at_unix_ms = now_ms()
        return True

    def _proxy_lost(self, sess: _Session, proxy: ProxyUpstream) -> None:
        self._complete(
            sess,
            records.FAILED,
            records.Failure("relay", "upstream_reset", f"proxy {proxy.tag} ended the association"),
        )

    # -- idle -------------------------------------------------------------------------

    def _schedule_sweep(self) -> None:
        period = max(0.05, min(1.0, self.idle_timeout_s / 4))
        self._timer = self.dispatcher.loop.call_later(period, self._sweep)

    def _sweep(self) -> None:
        """Flows idle for ``idle_timeout_s`` end (and their sessions in the stack)."""
        if self.actor_stopped.is_set():
            return
        now = time.monotonic()
        deadline = now - self.idle_timeout_s
        held = now - min(udp_flow.REFUSAL_HOLD_S, self.idle_timeout_s)
        for sess in list(self.sessions.values()):
            if sess.action in ("direct", "python"):
                if sess.last_active <= deadline:
                    sess.state.close_reason = records.IDLE_TIMEOUT
                    self._complete(sess, None)
                    self._close_in_stack(sess)
            elif (
                sess.action == "closed"
                and sess.last_active != float("inf")
                and (sess.last_active <= deadline or sess.closed_at <= held)
            ):
                # A refused sender gone quiet, or held long enough: the stack frees it,
                # and its next datagram is a new flow, routed anew.
                self._close_in_stack(sess)
        self._schedule_sweep()

    # -- completion and events ---------------------------------------------------------

    def _take_counts(self, sess: _Session) -> None:
        t = sess.state.traffic
        t.bytes_up = sess.py_bytes_up
        t.bytes_down = sess.bytes_down
        t.packets_up = sess.py_packets_up
        t.packets_down = sess.packets_down
        t.inbound_rx_bytes = sess.rx_bytes
        t.inbound_tx_bytes = sess.bytes_down
        t.outbound_rx_bytes = sess.py_wire_down
        t.outbound_tx_bytes = sess.py_wire_up

    def _complete(
        self, sess: _Session, outcome: str | None, failure: records.Failure | None = None
    ) -> None:
        s = sess.state
        if s.state == "completed":
            return
        chained = sess.action == "python"
        sess.action = "closed"
        sess.closed_at = time.monotonic()
        self.counters.datagrams_dropped += len(sess.queue)
        sess.queue.clear()
        sess.queued_bytes = 0
        idle = s.close_reason == records.IDLE_TIMEOUT
        if sess.sock is not None:
            with contextlib.suppress(ValueError, OSError):
                self.dispatcher.loop.remove_reader(sess.sock.fileno())
            sess.sock.close()
            sess.sock = None
            udp = self.deps.counters.udp
            udp["active_associations"] -= 1
            udp["closed_associations"] += 1
            if idle:
                udp["idle_timeouts"] += 1
        proxy, sess.proxy = sess.proxy, None
        if proxy is not None:
            self.upstreams.release(proxy, sess, idle=idle)
        self._take_counts(sess)
        if s.revision == 0:
            # Ended while the flow hook was asked: no record was published.
            s.state = "completed"
            return
        udp_flow.complete(self.deps, self.actor_ref, s, outcome, failure, chained=chained)

    def _publish_updated(self, sess: _Session) -> None:
        udp_flow.publish_updated(self.deps, self.actor_ref, sess.state)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("TUN UDP: opening a flow failed", exc_info=task.exception())
