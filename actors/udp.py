"""UdpAssociationActor: one SOCKS5 UDP ASSOCIATE (RFC 1928 section 7) and its UDP flows.

The association lives as long as its TCP control connection. It owns a UDP socket
bound to the address the client reached the inbound on (told to the client as
BND.ADDR/BND.PORT), accepts datagrams only from the client's IP (and port: the
declared one, or the first datagram's when the client declared 0), and keeps one
*flow* per destination: a FlowRecord with ``network: udp``, the same lifecycle
events as a TCP flow, packet and byte counts. Each destination is routed by the
rules (``network: udp``) when its first datagram arrives.

This is the Python relay: the reference the C datagram relay is measured and
tested against. It serves the ``direct``, ``socks5`` (a UDP ASSOCIATE of its own
with the upstream proxy), ``shadowsocks`` (AEAD per packet, SIP004) and ``block``
outbounds; a destination routed to an
outbound without UDP here fails, recorded with ``udp_unsupported``. Upstream
sockets are one per (association, outbound), closed with the association.
A destination idle for ``runtime.udp_upstream_idle_timeout_seconds`` completes,
and an upstream association none of whose destinations remain closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.messages import CloseFlow, StopFlow

from spliceway import records, routing
from spliceway.dns import InvalidHostname, ResolveError
from spliceway.events import now_ms
from spliceway.outbounds import DialError
from spliceway.protocols import ProtocolError, shadowsocks, socks5
from spliceway.runtime import FlowEntry

if TYPE_CHECKING:
    from spliceway.actors.flow import FlowDeps

    from spliceway.dns import Resolver
    from spliceway.engine_core import InboundSpec

logger = logging.getLogger(__name__)

#: Largest datagram read (a UDP payload cannot be larger).
_MAX_DATAGRAM = 65535
#: Datagrams read per readiness event before yielding to other actors.
_BATCH = 64


@dataclass(slots=True)
class _Upstream:
    """An *upstream association*: the UDP socket one outbound's destinations share
    (``direct``: datagrams go to each target; ``socks5``: to the proxy's relay, wrapped
    in the SOCKS5 header, over an association whose TCP control connection it holds)."""

    tag: str
    kind: str
    sock: socket.socket | None = None
    relay: tuple[str, int] | None = None
    control: socket.socket | None = None
    #: The shadowsocks outbound (its cipher and key seal each packet).
    outbound: Any = None
    #: Set once the proxy's association is up (socks5), or failed (None).
    ready: asyncio.Future[bool] | None = None
    #: Reply source -> destination.
    by_source: dict[tuple[str, int], _Dest] = field(default_factory=dict)


@dataclass(slots=True)
class _Dest:
    """One destination of the association: its flow, and where its datagrams go."""

    #: The destination as the client addressed it (replies name it so).
    key: tuple[str, int]
    #: Where it goes: ``key``, or the domain a fake-ip address stands for.
    target: tuple[str, int]
    state: records.FlowState
    action: str  # "opening", "relaying", "block", "closed"
    upstream: _Upstream | None = None
    address: tuple[str, int] | None = None
    last_active: float = 0.0
    #: Datagrams that arrived while the destination was opening (bounded).
    pending: list[bytes] | None = None


class UdpAssociationActor(LoopActor):
    """One UDP association: the client's datagrams, routed per destination."""

    registered = False

    def __init__(
        self,
        deps: FlowDeps,
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
        self.resolver = resolver
        self.inbound = inbound
        self.control: socket.socket | None = control
        self.peer = peer
        self.client_port = declared_port or None
        self.principal_key = principal_key
        self.auth_scheme = auth_scheme
        self.id_prefix = id_prefix
        self.idle_timeout_s = idle_timeout_s
        self.sock: socket.socket | None = None
        #: Upstream associations by outbound tag.
        self.upstreams: dict[str, _Upstream] = {}
        self.dests: dict[tuple[str, int], _Dest] = {}
        self._n = 0
        self._timer: Any = None
        self.dropped = 0
        # Tracked with the flow actors: an engine stop ends associations with no flow yet.
        deps.flow_actors.add(self)  # type: ignore[arg-type]

    # -- lifecycle ------------------------------------------------------------------

    def on_start(self) -> None:
        """Bind the relay socket, tell the client where it is, watch the control line."""
        assert self.control is not None
        loop = self.dispatcher.loop
        local_ip = self.control.getsockname()[0]
        family = socket.AF_INET6 if ":" in local_ip else socket.AF_INET
        counters = self.deps.counters.udp
        try:
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind((local_ip, 0))
        except OSError as ex:
            counters["dropped_associations"] += 1
            logger.warning("UDP ASSOCIATE from %s: cannot bind: %s", self.peer, ex)
            self._send_control(socks5.reply(socks5.REP_GENERAL_FAILURE))
            self.actor_ref.stop(block=False)
            return
        self.sock = sock
        self._send_control(socks5.reply(socks5.REP_SUCCEEDED, local_ip, sock.getsockname()[1]))
        self.control.setblocking(False)
        loop.add_reader(self.control.fileno(), self._on_control)
        loop.add_reader(sock.fileno(), self._on_client)
        self._arm_timer()

    def _send_control(self, data: bytes) -> None:
        assert self.control is not None
        try:
            self.control.setblocking(True)
            self.control.settimeout(5)
            self.control.sendall(data)
        except OSError:
            pass

    def on_stop(self) -> None:
        """Complete every destination's flow and close the sockets."""
        self.deps.flow_actors.discard(self)  # type: ignore[arg-type]
        loop = self.dispatcher.loop
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for dest in list(self.dests.values()):
            self._end(dest, records.CANCELLED if dest.action == "opening" else None)
        for up in list(self.upstreams.values()):
            self._close_upstream(up, idle=False)
        if self.sock is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.control is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self.control.fileno())
            self.control.close()
            self.control = None

    def on_failure(self, *exc_info: object) -> None:
        """Never leave sockets open after a bug."""
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
            self.actor_ref.stop(block=False)

    # -- client -> upstream ----------------------------------------------------------

    def _on_client(self) -> None:
        sock = self.sock
        if sock is None:
            return
        for _ in range(_BATCH):
            try:
                data, source = sock.recvfrom(_MAX_DATAGRAM)
            except BlockingIOError:
                return
            except OSError:
                self.deps.counters.udp["recv_failures"] += 1
                return
            self._from_client(data, source)

    def _from_client(self, data: bytes, source: tuple[Any, ...]) -> None:
        if source[0] != self.peer[0] or (
            self.client_port is not None and source[1] != self.client_port
        ):
            self.dropped += 1  # not the client that asked for this association
            return
        try:
            datagram = socks5.parse_udp_datagram(data)
        except ProtocolError:
            self.dropped += 1
            return
        if datagram.fragment != 0:
            self.dropped += 1  # fragmentation is optional (RFC 1928 section 7): not done
            return
        self.client_port = source[1]
        key = (datagram.host, datagram.port)
        dest = self.dests.get(key)
        if dest is None:
            dest = self._open(key)
        dest.last_active = self.dispatcher.loop.time()
        t = dest.state.traffic
        t.inbound_rx_bytes += len(data)
        t.packets_up = (t.packets_up or 0) + 1
        payload = datagram.payload
        if dest.action == "opening":
            assert dest.pending is not None
            if len(dest.pending) < 64:
                dest.pending.append(payload)
            else:
                self.dropped += 1
            return
        self._send_up(dest, payload)

    def _send_up(self, dest: _Dest, payload: bytes) -> None:
        up = dest.upstream
        if dest.action != "relaying" or up is None or up.sock is None:
            return
        if up.kind == "socks5":
            assert up.relay is not None
            wire, to = socks5.build_udp_datagram(*dest.target, payload), up.relay
        elif up.kind == "shadowsocks":
            assert up.relay is not None and up.outbound is not None
            ob = up.outbound
            wire = shadowsocks.seal_packet(ob.cipher, ob.master_key, *dest.target, payload)
            to = up.relay
        else:
            assert dest.address is not None
            wire, to = payload, dest.address
        try:
            up.sock.sendto(wire, to)
        except OSError:
            self.deps.counters.udp["send_failures"] += 1
            return
        t = dest.state.traffic
        t.bytes_up += len(payload)
        t.outbound_tx_bytes += len(wire)
        self.deps.counters.udp["packets_sent"] += 1

    async def _upstream(self, outbound: Any) -> _Upstream | None:
        """The upstream association of ``outbound``, opened or reused for a new
        destination (``stats.udp_upstream`` counts them); None when it cannot open."""
        counters = self.deps.counters.udp
        up = self.upstreams.get(outbound.tag)
        if up is not None:
            if up.ready is not None and not await up.ready:
                return None
            counters["reused_associations"] += 1
            return up
        up = _Upstream(outbound.tag, outbound.protocol)
        up.ready = self.dispatcher.loop.create_future()
        self.upstreams[outbound.tag] = up
        try:
            if up.kind in ("socks5", "shadowsocks"):
                if up.kind == "socks5":
                    up.control, up.relay = await outbound.udp_associate(self.dispatcher.loop)
                else:
                    up.outbound = outbound
                    up.relay = await self._server_address(outbound)
                family = socket.AF_INET6 if ":" in up.relay[0] else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_DGRAM)
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            else:
                # Dual-stack: one socket reaches IPv4 and IPv6 targets.
                sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", 0))
            sock.setblocking(False)
        except (OSError, DialError, ResolveError, InvalidHostname) as ex:
            logger.debug("UDP upstream %s failed: %s", outbound.tag, ex)
            counters["failed_association_attempts"] += 1
            self.upstreams.pop(outbound.tag, None)
            if up.control is not None:
                up.control.close()
            up.ready.set_result(False)
            return None
        if self.actor_stopped.is_set():
            sock.close()
            if up.control is not None:
                up.control.close()
            up.ready.set_result(False)
            return None
        up.sock = sock
        loop = self.dispatcher.loop
        loop.add_reader(sock.fileno(), self._on_upstream, up)
        if up.control is not None:
            up.control.setblocking(False)
            loop.add_reader(up.control.fileno(), self._on_upstream_control, up)
        counters["created_associations"] += 1
        counters["active_associations"] += 1
        up.ready.set_result(True)
        return up

    async def _server_address(self, outbound: Any) -> tuple[str, int]:
        """Where a shadowsocks server takes UDP: its address, resolved by the engine."""
        if _is_ip(outbound.server):
            return _norm(outbound.server), outbound.port
        addresses = await self.resolver.resolve(outbound.server)
        if not addresses:
            raise OSError(f"{outbound.server} has no address")
        return addresses[0], outbound.port

    def _on_upstream_control(self, up: _Upstream) -> None:
        # The proxy ended the association: its destinations cannot go on.
        assert up.control is not None
        try:
            if up.control.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        for dest in [d for d in self.dests.values() if d.upstream is up]:
            self._end(
                dest,
                records.FAILED,
                records.Failure("relay", "upstream_reset", f"proxy {up.tag} ended the association"),
            )
        self._close_upstream(up, idle=False)

    def _close_upstream(self, up: _Upstream, *, idle: bool) -> None:
        if self.upstreams.get(up.tag) is up:
            del self.upstreams[up.tag]
        loop = self.dispatcher.loop
        for sock in (up.sock, up.control):
            if sock is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock.fileno())
                sock.close()
        if up.sock is None:
            return
        up.sock = up.control = None
        counters = self.deps.counters.udp
        counters["active_associations"] -= 1
        counters["closed_associations"] += 1
        if idle:
            counters["idle_timeouts"] += 1

    # -- upstream -> client ----------------------------------------------------------

    def _on_upstream(self, up: _Upstream) -> None:
        sock = self.sock
        if up.sock is None or sock is None or self.client_port is None:
            return
        for _ in range(_BATCH):
            try:
                data, source = up.sock.recvfrom(_MAX_DATAGRAM)
            except BlockingIOError:
                return
            except OSError:
                self.deps.counters.udp["recv_failures"] += 1
                return
            if up.kind == "socks5":
                if source[:2] != up.relay and (_norm(source[0]), source[1]) != up.relay:
                    self.dropped += 1  # only the proxy's relay speaks on this socket
                    continue
                try:
                    reply = socks5.parse_udp_datagram(data)
                except ProtocolError:
                    self.dropped += 1
                    continue
                origin, payload = (_norm_host(reply.host), reply.port), reply.payload
            elif up.kind == "shadowsocks":
                if (_norm(source[0]), source[1]) != up.relay:
                    self.dropped += 1  # only the server speaks on this socket
                    continue
                assert up.outbound is not None
                try:
                    host, port, payload = shadowsocks.open_packet(
                        up.outbound.cipher, up.outbound.master_key, data
                    )
                except ProtocolError:
                    self.dropped += 1
                    continue
                origin = (_norm_host(host), port)
            else:
                origin, payload = (source[0], source[1]), data
            dest = up.by_source.get(origin)
            if dest is None:
                # A proxy reports the address it heard from, not the name it was given.
                dest = next(
                    (
                        d
                        for d in self.dests.values()
                        if d.upstream is up and d.target[1] == origin[1]
                    ),
                    None,
                )
            if dest is None:
                self.dropped += 1  # from nobody the client sent to
                continue
            self.deps.counters.udp["packets_received"] += 1
            # The reply names the destination as the client addressed it, so a client
            # that sent to a name matches the reply to its request.
            wire = socks5.build_udp_datagram(dest.key[0], dest.key[1], payload)
            try:
                sock.sendto(wire, (self.peer[0], self.client_port))
            except OSError:
                self.deps.counters.udp["send_failures"] += 1
                continue
            dest.last_active = self.dispatcher.loop.time()
            t = dest.state.traffic
            t.outbound_rx_bytes += len(data)
            t.bytes_down += len(payload)
            t.inbound_tx_bytes += len(wire)
            t.packets_down = (t.packets_down or 0) + 1

    # -- flows ----------------------------------------------------------------------

    def _open(self, key: tuple[str, int]) -> _Dest:
        """A new destination: its flow starts, is routed, and (for a name) resolves."""
        deps = self.deps
        self._n += 1
        started = now_ms()
        target = key
        pool = deps.fakeip
        if pool is not None:
            # A fake-ip address stands for the domain the client resolved (as for TCP).
            domain = pool.domain_of(key[0])
            if domain is not None:
                target = (domain, key[1])
        state = records.FlowState(
            flow_id=f"{self.id_prefix}u{self._n}",
            inbound_tag=self.inbound.tag,
            inbound_protocol=self.inbound.protocol,
            source_ip=self.peer[0],
            source_port=self.client_port or 0,
            started_at_unix_ms=started,
            mode=deps.route_state.mode,
            network="udp",
            target_host=target[0],
            target_port=target[1],
            principal_key=self.principal_key,
            auth_scheme=self.auth_scheme,
            last_activity_at_unix_ms=started,
        )
        state.traffic.packets_up = 0
        state.traffic.packets_down = 0
        dest = _Dest(key, target, state, "failed")
        self.dests[key] = dest
        deps.counters.total_started += 1
        self._publish(dest, "flow.started")
        facts = routing.FlowFacts(
            network="udp",
            host=target[0],
            port=target[1],
            source_ip=self.peer[0],
            source_port=self.client_port,
            inbound_tag=self.inbound.tag,
            principal_key=self.principal_key,
        )
        decision = deps.route_state.decide(facts)
        chain = (
            deps.policies.resolve(decision.target, target[0], self.peer[0])
            if decision.target
            else []
        )
        outbound = deps.outbounds.get(chain[-1]) if chain else None
        state.mode = decision.mode
        state.route_action = decision.action
        state.route_target = decision.target
        state.matched_rule = decision.matched_rule.to_dict() if decision.matched_rule else None
        if outbound is not None:
            state.selection_chain = chain
            state.outbound_tag = outbound.tag
            state.outbound_protocol = outbound.protocol
        if decision.action == "block" or outbound is None or outbound.protocol == "block":
            dest.action = "block"
            self._end(dest, records.BLOCKED)
            return dest
        if outbound.protocol not in ("direct", "socks5", "shadowsocks"):
            self._end(
                dest,
                records.FAILED,
                records.Failure(
                    "route",
                    "udp_unsupported",
                    f"outbound {outbound.tag!r} ({outbound.protocol}) does not relay UDP "
                    "in this build",
                ),
            )
            return dest
        dest.action = "opening"
        dest.pending = []
        self.dispatcher.spawn(self._open_path(dest, outbound))
        return dest

    async def _open_path(self, dest: _Dest, outbound: Any) -> None:
        """Resolve (direct) and open the upstream association, then send what waited."""
        ip = None
        if outbound.protocol == "direct":
            if _is_ip(dest.target[0]):
                ip = _norm(dest.target[0])
            else:
                try:
                    addresses = await self.resolver.resolve(dest.target[0])
                except Exception as ex:  # InvalidHostname, ResolveError: the flow fails
                    addresses, error = [], str(ex)
                else:
                    error = f"{dest.target[0]} has no address"
                if not addresses:
                    if dest.action == "opening":
                        self._end(dest, records.FAILED, records.Failure("dns", "dns_failed", error))
                    return
                ip = addresses[0]
        up = await self._upstream(outbound)
        if dest.action != "opening" or self.actor_stopped.is_set():
            return
        if up is None:
            self._end(
                dest,
                records.FAILED,
                records.Failure(
                    "connect", "connect_failed", f"no UDP association through {outbound.tag!r}"
                ),
            )
            return
        dest.upstream = up
        s = dest.state
        if ip is not None:
            dest.address = (_v6(ip), dest.target[1])
            up.by_source[dest.address] = dest
            s.resolved_ip = ip
            s.remote_host, s.remote_port = dest.target
        else:
            up.by_source[(_norm_host(dest.target[0]), dest.target[1])] = dest
            s.remote_host, s.remote_port = outbound.server, outbound.port
            s.relay_chain = [outbound.tag]
        dest.action = "relaying"
        s.state = "active"
        if outbound.chained:
            self.deps.counters.chained_sessions += 1
        else:
            self.deps.counters.direct_sessions += 1
        self._publish(dest, "flow.routed")
        pending, dest.pending = dest.pending or [], None
        for payload in pending:
            self._send_up(dest, payload)

    def _end(
        self, dest: _Dest, outcome: str | None, failure: records.Failure | None = None
    ) -> None:
        s = dest.state
        if s.state == "completed":
            return
        self.dests.pop(dest.key, None)
        up = dest.upstream
        if up is not None:
            for source in [k for k, d in up.by_source.items() if d is dest]:
                del up.by_source[source]
        dest.action = "closed"
        s.state = "completed"
        chained = up is not None and up.kind != "direct"
        s.outcome = outcome or (records.CHAINED_RELAYED if chained else records.DIRECT_RELAYED)
        s.failure = failure
        if failure is not None:
            s.close_reason = records.UPSTREAM_ERROR if outcome == records.FAILED else None
        s.ended_at_unix_ms = max(now_ms(), s.started_at_unix_ms)
        c = self.deps.counters
        c.completed_sessions += 1
        c.completed_bytes_up += s.traffic.bytes_up
        c.completed_bytes_down += s.traffic.bytes_down
        if s.outcome == records.FAILED:
            c.failed_sessions += 1
        elif s.outcome == records.BLOCKED:
            c.blocked_sessions += 1
        self._publish(dest, "flow.completed")

    def _publish(self, dest: _Dest, event_type: str) -> None:
        s = dest.state
        s.revision += 1
        record = s.render()
        deps = self.deps
        if s.state == "completed":
            deps.flows.remove(s.flow_id)
        else:
            deps.flows.put(
                s.flow_id, FlowEntry(self.actor_ref, record, s.inbound_tag, s.principal_key)
            )
        deps.log.emit(
            event_type,
            records.lifecycle_payload(s, record),
            principal_key=s.principal_key,
            occurred_at_unix_ms=s.ended_at_unix_ms if event_type == "flow.completed" else None,
        )

    # -- idle -----------------------------------------------------------------------

    def _arm_timer(self) -> None:
        interval = max(0.05, min(1.0, self.idle_timeout_s / 4))
        self._timer = self.dispatcher.loop.call_later(interval, self._on_timer)

    def _on_timer(self) -> None:
        if self.actor_stopped.is_set():
            return
        now = self.dispatcher.loop.time()
        for dest in list(self.dests.values()):
            if dest.action == "relaying" and now - dest.last_active >= self.idle_timeout_s:
                dest.state.close_reason = records.IDLE_TIMEOUT
                self._end(dest, None)
        for up in list(self.upstreams.values()):
            if up.sock is not None and not any(d.upstream is up for d in self.dests.values()):
                self._close_upstream(up, idle=True)
        self._arm_timer()

    def on_receive(self, message: Any) -> Any:
        """``CloseFlow``: end one destination's flow (cancelled, manual); ``StopFlow``
        (engine shutdown): end the association and every flow in it."""
        if isinstance(message, CloseFlow):
            dest = next(
                (d for d in self.dests.values() if d.state.flow_id == message.flow_id), None
            )
            if dest is None:
                return False
            dest.state.close_reason = records.MANUAL
            self._end(dest, records.CANCELLED)
            return True
        if isinstance(message, StopFlow):
            self.stop_now()
        return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _v6(ip: str) -> str:
    """``ip`` as the dual-stack upstream socket names it (IPv4 as ``::ffff:a.b.c.d``)."""
    addr = ipaddress.ip_address(ip)
    return f"::ffff:{addr}" if addr.version == 4 else str(addr)


def _norm_host(host: str) -> str:
    """A reply or destination host in the form replies are matched by."""
    return _norm(host) if _is_ip(host) else host.lower()


def _norm(ip: str) -> str:
    """An address as the socket API reports it (IPv4-mapped IPv6 unwrapped)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)
