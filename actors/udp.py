"""UdpAssociationActor: one SOCKS5 UDP ASSOCIATE (RFC 1928 section 7) and its UDP flows.

C moves the datagrams, Python decides. The association's client socket (bound to
the address the client reached the inbound on, told to it as BND.ADDR/BND.PORT)
belongs to the C datagram relay (:mod:`spliceway.native.udp`): it accepts datagrams
only from the client's IP and port (the declared one, or the first datagram's when
the client declared 0), drops fragments and malformed headers, and reports each new
destination. This actor answers each with a verdict, once the rules (``network:
udp``) have routed it:

- ``direct``: C sends to the resolved address over the association's upstream
  socket, and wraps the replies, without Python;
- ``socks5`` / ``shadowsocks``: C hands the datagrams to Python, which relays them
  through its own UDP ASSOCIATE with the upstream proxy, or seals each one (AEAD
  per packet, SIP004), and gives the replies back to C for the client (the proxy
  upstreams are :mod:`spliceway.actors.udp_upstream`'s, shared with the TUN);
- ``block``, or an outbound without UDP: C drops them (counted).

Each destination is a *flow* (``network: udp``) with the same lifecycle events as a
TCP one; its ``flow.completed`` carries C's exact counters. A destination idle for
``runtime.udp_upstream_idle_timeout_seconds`` ends; the association ends with its
TCP control connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway.actors import udp_flow
from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.messages import CloseFlow, StopFlow
from spliceway.actors.udp_upstream import (
    ProxyUpstream,
    ProxyUpstreams,
    is_ip,
    norm,
    upstream_key,
    v6,
)
from spliceway.dns import InvalidHostname, ResolveError
from spliceway.flows import records
from spliceway.flows.hook import ask_about
from spliceway.native import udp as udprelay
from spliceway.native.relay import RelayError
from spliceway.protocols import socks5
from spliceway.routing import hostnorm
from spliceway.support.socket_mark import apply_mark

if TYPE_CHECKING:
    from spliceway.actors.flow import FlowDeps
    from spliceway.dns import Resolver
    from spliceway.engine.core import InboundSpec

logger = logging.getLogger(__name__)


class UdpRecords(NamedTuple):
    """Records of the C relay for one association, in order."""

    records: list[udprelay.UdpRecord]


class SampleUdp(NamedTuple):
    """The stats sampler's tick: publish ``flow.updated`` for flows whose counts moved."""

    sampled_at_unix_ms: int


@dataclass(slots=True)
class _Dest:
    """One destination of the association: its flow, and how its datagrams go."""

    id: int
    #: The destination as the client addressed it (replies name it so).
    key: tuple[str, int]
    #: Where it goes: ``key``, or the domain a fake-ip address stands for.
    target: tuple[str, int]
    state: records.FlowState
    action: str = "opening"  # "opening", "direct", "python", "closed"
    #: The address its route was decided on (an ip_cidr rule needed it): dialled alone.
    address: str | None = None
    proxy: ProxyUpstream | None = None
    manual_close: bool = False
    # What Python relayed itself (proxy outbounds), added to C's counters.
    py_packets_up: int = 0
    py_bytes_up: int = 0
    py_wire_up: int = 0
    py_wire_down: int = 0


class UdpAssociationActor(LoopActor):
    """One UDP association: the verdicts on its destinations, and their flows."""

    registered = False

    def __init__(
        self,
        deps: FlowDeps,
        relay: udprelay.UdpRelay,
        register: Any,
        resolver: Resolver,
        inbound: InboundSpec,
        control: socket.socket,
        peer: tuple[str, int],
        declared_port: int,
        principal_key: str | None,
        auth_scheme: str | None,
        id_prefix: str,
        idle_timeout_s: float,
    ) -> None:
        super().__init__(deps.dispatcher)
        self.deps = deps
        self.relay = relay
        #: ``register(assoc_id, actor_ref or None)``: where the engine sends our records.
        self._register = register
        self.resolver = resolver
        self.inbound = inbound
        self.control: socket.socket | None = control
        self.peer = peer
        self.declared_port = declared_port
        self.principal_key = principal_key
        self.auth_scheme = auth_scheme
        self.id_prefix = id_prefix
        self.idle_timeout_s = idle_timeout_s
        self.assoc: int | None = None
        #: The C upstream (a dual-stack socket) the association's direct destinations share.
        self.direct_upstream: int | None = None
        #: The proxy outbounds' upstream associations (one per outbound).
        self.upstreams = ProxyUpstreams(
            deps.counters,
            deps.dispatcher,
            lambda: self.resolver,
            self._alive,
            self._deliver,
            self._proxy_lost,
        )
        self.dests: dict[int, _Dest] = {}
        self._n = 0
        # Tracked with the flow actors: an engine stop ends associations with no flow yet.
        deps.flow_actors.add(self)

    # -- lifecycle ------------------------------------------------------------------

    def on_start(self) -> None:
        """Bind the client socket, give it to C, tell the client where it is."""
        assert self.control is not None
        local_ip = self.control.getsockname()[0]
        family = socket.AF_INET6 if ":" in local_ip else socket.AF_INET
        sock = None
        try:
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.bind((local_ip, 0))
            port = sock.getsockname()[1]
            self.assoc = self.relay.add_association(
                sock.fileno(), self.peer[0], self.declared_port, self.idle_timeout_s
            )
            sock.detach()  # C's now
        except (OSError, RelayError, ValueError) as ex:
            if sock is not None:
                sock.close()
            self.deps.counters.udp["dropped_associations"] += 1
            logger.warning("UDP ASSOCIATE from %s refused: %s", self.peer, ex)
            self._send_control(socks5.reply(socks5.REP_GENERAL_FAILURE))
            self.stop_now()
            return
        self._register(self.assoc, self.actor_ref)
        # An IPv4 client of a dual-stack inbound is told an IPv4 address (ATYP 1), which
        # the socket bound to its IPv4-mapped form receives.
        self._send_control(socks5.reply(socks5.REP_SUCCEEDED, norm(local_ip), port))
        self.control.setblocking(False)
        self.dispatcher.loop.add_reader(self.control.fileno(), self._on_control)

    def _send_control(self, data: bytes) -> None:
        assert self.control is not None
        # One short reply into a fresh connection's empty buffer: it does not block.
        with contextlib.suppress(OSError):
            self.control.send(data)

    def on_stop(self) -> None:
        """End every destination's flow, the association in C, and the sockets."""
        self.deps.flow_actors.discard(self)
        loop = self.dispatcher.loop
        for dest in list(self.dests.values()):
            self._complete(dest, None if dest.action != "opening" else records.CANCELLED)
        self.upstreams.close_all()
        if self.assoc is not None:
            self._register(self.assoc, None)
            with contextlib.suppress(RelayError):
                self.relay.close_association(self.assoc)
        if self.control is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self.control.fileno())
            self.control.close()
            self.control = None

    def on_failure(self, *exc_info: object) -> None:
        """Never leave sockets or a C association behind after a bug."""
        self.on_stop()

    def _on_control(self) -> None:
        # The association ends with its TCP connection (EOF, reset, or stray bytes
        # read and ignored until then).
        assert self.control is not None
        try:
            data = self.control.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.stop_now()

    # -- messages -------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """C's records; ``CloseFlow`` (one destination's flow, cancelled and manual);
        ``StopFlow`` (engine shutdown: the association and all its flows end)."""
        if isinstance(message, UdpRecords):
            for record in message.records:
                self._on_record(record)
        elif isinstance(message, CloseFlow):
            dest = next(
                (d for d in self.dests.values() if d.state.flow_id == message.flow_id), None
            )
            if dest is None or self.assoc is None:
                return False
            dest.manual_close = True
            if dest.action == "opening":
                self._complete(dest, records.CANCELLED)
            with contextlib.suppress(RelayError):
                self.relay.close_dest(self.assoc, dest.id)
            return True
        elif isinstance(message, StopFlow):
            self.stop_now()
        elif isinstance(message, SampleUdp):
            self._sample(message.sampled_at_unix_ms)
        return None

    def _sample(self, sampled_at: int) -> None:
        """Every live destination's counters in one C call; a flow.updated for each that
        moved, with its throughput since the last sample."""
        if self.assoc is None or not self.dests:
            return
        try:
            live = self.relay.association_dests(self.assoc)
        except RelayError:
            return
        for dest_id, counters in (live or {}).items():
            dest = self.dests.get(dest_id)
            if dest is None or dest.action not in ("direct", "python"):
                continue
            s = dest.state
            t = s.traffic
            before = (t.bytes_up, t.bytes_down, t.packets_up, t.packets_down)
            self._take_counters(dest, counters)
            if (t.bytes_up, t.bytes_down, t.packets_up, t.packets_down) == before:
                continue
            previous_at = s.sampled_at_unix_ms or s.started_at_unix_ms
            elapsed_ms = max(sampled_at - previous_at, 1)
            s.upload_bps = (t.bytes_up - before[0]) * 8000 // elapsed_ms
            s.download_bps = (t.bytes_down - before[1]) * 8000 // elapsed_ms
            s.sampled_at_unix_ms = sampled_at
            s.last_activity_at_unix_ms = (
                counters.last_activity_unix_ms or s.last_activity_at_unix_ms
            )
            self._publish_updated(dest)

    def _on_record(self, record: udprelay.UdpRecord) -> None:
        if isinstance(record, udprelay.NewDest):
            self._open(record)
        elif isinstance(record, udprelay.Datagram):
            dest = self.dests.get(record.dest)
            if dest is not None and dest.action == "python":
                self.upstreams.send(dest.proxy, dest, record.payload)
        elif isinstance(record, udprelay.DestEnded):
            dest = self.dests.get(record.dest)
            if dest is not None:
                self._take_counters(dest, record.counters)
                self._ended(dest, record)
        elif isinstance(record, udprelay.UpstreamEnded):
            if record.upstream == self.direct_upstream:
                self.direct_upstream = None
        elif isinstance(record, udprelay.AssocEnded):
            self.assoc = None
            self.stop_now()

    # -- destinations ---------------------------------------------------------------

    def _open(self, new: udprelay.NewDest) -> None:
        """A new destination: its flow starts and is routed; a verdict follows."""
        deps = self.deps
        self._n += 1
        key = (new.host, new.port)
        # Every spelling of an address is that address (as for TCP; replies keep the key).
        target = (hostnorm.canonical_host(new.host), new.port)
        fake_ip: str | None = None
        pool = deps.fakeip
        if pool is not None:
            # A fake-ip address stands for the domain the client resolved (as for TCP).
            domain = pool.domain_of(target[0])
            if domain is not None:
                target, fake_ip = (domain, new.port), target[0]
        state = records.FlowState(
            flow_id=f"{self.id_prefix}u{self._n}",
            inbound_tag=self.inbound.tag,
            inbound_protocol=self.inbound.protocol,
            source_ip=self.peer[0],
            source_port=new.client_port,
            started_at_unix_ms=new.at_unix_ms,
            mode=deps.route_state.mode,
            network="udp",
            client_protocol="socks5",  # an association is SOCKS5's UDP ASSOCIATE
            target_host=target[0],
            target_port=target[1],
            fake_ip=fake_ip,
            principal_key=self.principal_key,
            auth_scheme=self.auth_scheme,
            last_activity_at_unix_ms=new.at_unix_ms,
        )
        state.traffic.packets_up = 0
        state.traffic.packets_down = 0
        dest = _Dest(new.dest, key, target, state)
        self.dests[new.dest] = dest
        # C holds the destination's datagrams (bounded) until the verdict.
        hook = udp_flow.hook_for(deps, state)
        if hook is None:
            self._start(dest, new.at_unix_ms)
        else:
            self.dispatcher.spawn(self._ask_hook(dest, hook, new.at_unix_ms))

    async def _ask_hook(self, dest: _Dest, hook: Any, at_unix_ms: int) -> None:
        allow = await ask_about(hook, dest.state)
        if dest.action == "opening" and dest.id in self.dests:
            self._start(dest, at_unix_ms, allowed=allow)
        # else: ended while the hook was asked, quietly, as it never started

    def _start(self, dest: _Dest, at_unix_ms: int, *, allowed: bool = True) -> None:
        """flow.started, the route, and the verdict's path (after resolving a domain
        target whose address an ip_cidr rule needs)."""
        if allowed and udp_flow.needs_address(self.deps, dest.state):
            self.dispatcher.spawn(self._start_resolved(dest, at_unix_ms))
            return
        self._begin(dest, at_unix_ms, allowed=allowed)

    async def _start_resolved(self, dest: _Dest, at_unix_ms: int) -> None:
        address = await udp_flow.rule_address(self.resolver, dest.target[0])
        if dest.action == "opening" and dest.id in self.dests:
            dest.address = address
            self._begin(dest, at_unix_ms)
        # else: ended while it was resolved, quietly, as it never started

    def _begin(self, dest: _Dest, at_unix_ms: int, *, allowed: bool = True) -> None:
        outbound, refusal = udp_flow.start(
            self.deps,
            self.actor_ref,
            dest.state,
            at_unix_ms,
            allowed=allowed,
            resolved_ip=dest.address,
        )
        if refusal is not None:
            self._refuse(dest, *refusal)
            return
        self.dispatcher.spawn(self._open_path(dest, outbound))

    def _refuse(self, dest: _Dest, outcome: str, failure: records.Failure | None = None) -> None:
        """Drop the destination's datagrams in C and complete its flow now; C forgets the
        destination after ``udp_flow.REFUSAL_HOLD_S``, so its next datagram is a new flow."""
        assoc = self.assoc
        if assoc is not None:
            with contextlib.suppress(RelayError):
                self.relay.set_drop(assoc, dest.id)
            hold = min(udp_flow.REFUSAL_HOLD_S, self.idle_timeout_s)
            self.dispatcher.loop.call_later(hold, self._forget, assoc, dest.id)
        self._complete(dest, outcome, failure)

    def _forget(self, assoc: int, dest_id: int) -> None:
        if self.assoc == assoc and dest_id not in self.dests:
            with contextlib.suppress(RelayError):
                self.relay.close_dest(assoc, dest_id)

    async def _open_path(self, dest: _Dest, outbound: Any) -> None:
        try:
            if outbound.protocol == "direct":
                await self._open_direct(dest)
            else:
                await self._open_proxied(dest, outbound)
        except RelayError as ex:
            if dest.action == "opening":
                self._refuse(
                    dest, records.FAILED, records.Failure("connect", "connect_failed", str(ex))
                )

    async def _open_direct(self, dest: _Dest) -> None:
        host, port = dest.target
        if dest.address is not None:
            ip = norm(dest.address)  # what the route was decided on, alone
        elif is_ip(host):
            ip = norm(host)
        else:
            try:
                addresses = await self.resolver.resolve(host)
            except (InvalidHostname, ResolveError) as ex:
                addresses, error = [], str(ex)
            else:
                error = f"{host} has no address"
            if not addresses:
                if dest.action == "opening":
                    self._refuse(dest, records.FAILED, records.Failure("dns", "dns_failed", error))
                return
            ip = addresses[0]
        if dest.action != "opening" or self.assoc is None:
            return
        upstream = self._direct_upstream()
        if not self.relay.set_direct(self.assoc, dest.id, upstream, v6(ip), port):
            return  # ended meanwhile: its DestEnded follows
        dest.action = "direct"
        udp_flow.routed(self.deps, self.actor_ref, dest.state, resolved_ip=ip)

    def _direct_upstream(self) -> int:
        """The association's C upstream for direct destinations (a dual-stack socket, so
        IPv4 and IPv6 targets share it), made on first use."""
        assert self.assoc is not None
        if self.direct_upstream is None:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                # Upstream datagrams leave by the physical egress while a TUN runs.
                apply_mark(sock)
                sock.bind(("::", 0))
                self.direct_upstream = self.relay.add_upstream(
                    self.assoc, sock.fileno(), self.idle_timeout_s
                )
            except BaseException:
                sock.close()
                raise
            sock.detach()  # C's now
        return self.direct_upstream

    async def _open_proxied(self, dest: _Dest, outbound: Any) -> None:
        def wanted() -> bool:
            return dest.action == "opening" and self.assoc is not None

        key = upstream_key(outbound, dest.target)
        proxy = await self.upstreams.open_for(outbound, key, wanted)
        if not wanted():
            return
        if proxy is None:
            self._refuse(dest, records.FAILED, udp_flow.no_association(outbound))
            return
        assert self.assoc is not None
        if not self.relay.set_python(self.assoc, dest.id):
            return
        dest.action = "python"
        dest.proxy = proxy
        self.upstreams.attach(proxy, dest)
        udp_flow.routed(self.deps, self.actor_ref, dest.state, proxy=outbound)

    def _ended(self, dest: _Dest, record: udprelay.DestEnded) -> None:
        s = dest.state
        if dest.manual_close:
            s.close_reason = records.MANUAL
            self._complete(dest, records.CANCELLED)
        elif record.reason == udprelay.End.IDLE:
            s.close_reason = records.IDLE_TIMEOUT
            self._complete(dest, None)
        elif record.reason == udprelay.End.ERROR:
            self._complete(
                dest,
                records.FAILED,
                records.Failure("relay", "upstream_error", f"UDP relay error {record.errno}"),
            )
        else:
            self._complete(dest, None)

    def _take_counters(self, dest: _Dest, c: udprelay.UdpCounters) -> None:
        """C's exact counters (plus what Python relayed itself) into the flow's record."""
        t = dest.state.traffic
        t.bytes_up = c.bytes_up + dest.py_bytes_up
        t.bytes_down = c.bytes_down
        t.packets_up = c.upstream_tx_packets + dest.py_packets_up
        t.packets_down = c.client_tx_packets
        t.inbound_rx_bytes = c.client_rx_bytes
        t.inbound_tx_bytes = c.client_tx_bytes
        t.outbound_rx_bytes = c.upstream_rx_bytes + dest.py_wire_down
        t.outbound_tx_bytes = c.upstream_tx_bytes + dest.py_wire_up

    def _complete(
        self, dest: _Dest, outcome: str | None, failure: records.Failure | None = None
    ) -> None:
        s = dest.state
        if s.state == "completed":
            return
        self.dests.pop(dest.id, None)
        if s.revision == 0:
            # Ended while the flow hook was asked: no record was published.
            dest.action = "closed"
            s.state = "completed"
            return
        proxy = dest.proxy
        if proxy is not None:
            self.upstreams.release(
                proxy, dest, idle=dest.state.close_reason == records.IDLE_TIMEOUT
            )
        if self.assoc is not None:
            # C's last counts of it: what it relayed, or what the client sent to a
            # destination refused (received, never sent on).
            with contextlib.suppress(RelayError):
                counters = self.relay.dest_counters(self.assoc, dest.id)
                if counters is not None:
                    self._take_counters(dest, counters)
        chained = dest.action == "python"
        dest.action = "closed"
        udp_flow.complete(self.deps, self.actor_ref, s, outcome, failure, chained=chained)

    def _publish_updated(self, dest: _Dest) -> None:
        udp_flow.publish_updated(self.deps, self.actor_ref, dest.state)

    # -- proxy upstreams (Python relays: actors/udp_upstream.py) -----------------------

    def _alive(self) -> bool:
        return not self.actor_stopped.is_set() and self.assoc is not None

    def _deliver(self, dest: _Dest, payload: bytes) -> bool:
        """A proxy's reply for ``dest``, to the client through C."""
        assert self.assoc is not None
        try:
            sent = self.relay.send_to_client(self.assoc, dest.id, payload)
        except RelayError:
            self.deps.counters.udp["send_failures"] += 1
            return False
        return sent is not None

    def _proxy_lost(self, dest: _Dest, proxy: ProxyUpstream) -> None:
        if self.assoc is not None:
            with contextlib.suppress(RelayError):
                self.relay.set_drop(self.assoc, dest.id)
        self._complete(
            dest,
            records.FAILED,
            records.Failure("relay", "upstream_reset", f"proxy {proxy.tag} ended the association"),
        )
