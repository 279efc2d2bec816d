"""EngineCore: the running engine's parts, wired together, and its start/stop order.

The public face is ``spliceway.Engine`` (engine.py); transports and the command
table reach the engine through an ``EngineCore``. Start order: the connector
(outbox lock and recovery, sink actors), bind every inbound (all or nothing),
dispatcher, relay bridge, supervisor (listeners, sampler), then ``engine.started``.
Stop reverses it, and every flow still open completes with exactly one
``flow.completed`` before ``engine.stopped``, which the sinks still take in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import pykka

from spliceway import __version__, policy, routing
from spliceway.actors.bridge import RelayBridge
from spliceway.actors.dispatcher import Dispatcher
from spliceway.actors.flow import FlowActor, FlowDeps
from spliceway.actors.messages import StopFlow, TakeDeferred
from spliceway.actors.supervisor import EngineSupervisor
from spliceway.config import Config
from spliceway.connector.service import Connector
from spliceway.connpath import ConnRecord, Deferred
from spliceway.dns import Resolver
from spliceway.errors import ApiError
from spliceway.events import EventLog, now_ms
from spliceway.inbound import Users
from spliceway.outbounds import (
    DirectOutbound,
    Outbound,
    build_outbound,
    build_relay,
)
from spliceway.route_publish import RoutePublisher
from spliceway.runtime import Counters, FlowTable, RouteState

logger = logging.getLogger(__name__)

BUILD_ID = f"spliceway-{__version__}"
_STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class InboundSpec:
    """What a listener and its flows need to know about their inbound."""

    index: int
    tag: str
    protocol: str
    sniff: bool
    sniff_timeout_ms: int
    users: Users


class EngineCore:
    """The engine's shared parts. Thread-safe to read; actors own the mutations."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self._refuse_unbuilt()
        self.build_id = BUILD_ID
        runtime = config.runtime
        self.log = EventLog(runtime.event_ring_capacity)
        self.connector = Connector(config.api, self.log)
        self.flow_id_prefix = f"{secrets.token_hex(4)}-"
        self.flows = FlowTable()
        #: Every FlowActor alive (they are not in pykka's registry).
        self.flow_actors: set[FlowActor] = set()
        self.counters = Counters()
        self.tcp_idle_timeout_ms = int(runtime.tcp_idle_timeout_seconds * 1000)
        self.resolver = Resolver(runtime.dns)
        self.outbounds: dict[str, Outbound] = {
            "direct": DirectOutbound("direct", resolver=self.resolver)
        }
        for spec in config.outbounds:
            self.outbounds[spec.tag] = build_outbound(spec, self.resolver)
        # A relay group is a leaf outbound whose hops are other outbounds.
        for group in config.outbound_groups:
            if group.kind == "relay":
                hops = [self.outbounds[m] for m in group.outbounds]
                self.outbounds[group.tag] = build_relay(group.tag, hops)
        latency_url = runtime.latency_test_url
        self.policies = policy.PolicyTable(
            [
                policy.initial_view(g, policy.probe_url_for(getattr(g, "url", None), latency_url))
                for g in config.outbound_groups
            ]
        )
        self.route_state = RouteState(
            mode=config.mode.kind,
            mode_outbound=config.mode.outbound,
            final=config.route.final,
            ruleset=routing.compile_rules(config.rules),
        )
        self.inbounds = [
            InboundSpec(
                index=i,
                tag=ib.tag,
                protocol=ib.protocol,
                sniff=ib.sniff,
                sniff_timeout_ms=ib.sniff_timeout_ms,
                users=Users(ib.users),
            )
            for i, ib in enumerate(config.inbounds)
        ]
        # Principals as C knows them: small integers, in first-seen order.
        self._principal_keys: list[str] = []
        for ib in config.inbounds:
            for user in ib.users or ():
                if user.principal_key not in self._principal_keys:
                    self._principal_keys.append(user.principal_key)
        self.principal_ids = {key: i for i, key in enumerate(self._principal_keys)}
        #: ListenerActor per inbound index, while accepting (deferred connections go there).
        self.listener_refs: dict[int, pykka.ActorRef[Any]] = {}
        self.routes = RoutePublisher(self)
        self.bound: list[tuple[str, int]] = []
        self.started_at_unix_ms = 0
        # Made in start(): its event loop holds a socket pair that only a started
        # engine's stop() closes, so an engine that never starts must not own one.
        self.dispatcher: Dispatcher
        self.bridge: RelayBridge
        self.supervisor: pykka.ActorRef[EngineSupervisor] | None = None
        #: One PolicyGroupActor per group, started by the supervisor.
        self.group_actors: dict[str, pykka.ActorRef[Any]] = {}
        self.running = False

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Bind every inbound and start the actors; raises ApiError on failure."""
        # The outbox first: a second engine on the same outbox must fail before binding.
        self.connector.start()
        try:
            sockets = self._bind_all()
        except BaseException:
            self.connector.stop()
            raise
        self.started_at_unix_ms = now_ms()
        self.dispatcher = Dispatcher()
        self.dispatcher.start()
        bridge: RelayBridge | None = None
        try:
            bridge = RelayBridge(self.dispatcher)
            self.dispatcher.run_sync(lambda: bridge.attach(self._start_c_flow, self._take_deferred))
            self.bridge = bridge
            #: What flow actors use of the engine (listeners hand it to theirs).
            self.flow_deps = FlowDeps(self)
            self.routes.publish()
            self.policies.on_publish = self.routes.publish
            self.resolver.on_answer = self._dns_answer
            # Before the actors start: a group's startup probe round must not be the
            # ring's first event.
            self.log.emit(
                "engine.started",
                {"build_id": self.build_id, "started_at_unix_ms": self.started_at_unix_ms},
            )
            self.supervisor = EngineSupervisor.start(self, sockets)
            # Its on_start runs on the dispatcher; a proxied read is answered only after it,
            # so the group actors (policies.* commands) exist once start() returns.
            self.supervisor.proxy().listeners.get(timeout=_STOP_GRACE_S)
        except BaseException:
            self._abort_start(sockets, bridge)
            raise
        self.running = True

    def stop(self, reason: str | None = None) -> None:
        """Stop accepting, complete every open flow, emit engine.stopped, join threads."""
        if not self.running:
            return
        self.running = False
        assert self.supervisor is not None
        with contextlib.suppress(pykka.ActorDeadError):
            self.supervisor.proxy().stop_listeners().get(timeout=_STOP_GRACE_S)
        for entry in self.flows.entries():
            with contextlib.suppress(pykka.ActorDeadError):
                entry.actor.tell(StopFlow())
        self._await_flows_drained()
        self._unhook_c_path()
        self.bridge.shutdown()
        self._await_flows_drained()
        self.dispatcher.run_sync(self.bridge.detach)
        with contextlib.suppress(pykka.ActorDeadError):
            self.supervisor.stop(timeout=_STOP_GRACE_S)
        # Flows still in their handshake have no record yet; stop them quietly.
        for actor in list(self.flow_actors):
            with contextlib.suppress(pykka.ActorDeadError):
                actor.actor_ref.stop(timeout=_STOP_GRACE_S)
        payload: dict[str, Any] = {"stopped_at_unix_ms": now_ms()}
        if reason is not None:
            payload["reason"] = reason
        self._finish(payload)

    def _finish(self, stopped: dict[str, Any] | None) -> None:
        """The last steps of a stop, or of a start undone: emit engine.stopped (with
        payload ``stopped``, unless None), stop the sinks and the dispatcher, and end every
        subscription after that event."""
        last = self.log.emit("engine.stopped", stopped) if stopped is not None else None
        self.connector.stop()
        self.dispatcher.stop()
        self.log.close_all(ended_by=last)

    def _abort_start(self, sockets: list[socket.socket], bridge: RelayBridge | None) -> None:
        """Undo a start that failed after binding: nothing may be left running or open."""
        if self.supervisor is not None:
            with contextlib.suppress(Exception):
                self.supervisor.stop(timeout=_STOP_GRACE_S)
            self.supervisor = None
        if bridge is not None:
            self._unhook_c_path()
            with contextlib.suppress(Exception):
                bridge.shutdown()
                self.dispatcher.run_sync(bridge.detach)
            # The relay (its completion eventfd) is freed with the last reference to it.
            with contextlib.suppress(AttributeError):
                del self.bridge
            with contextlib.suppress(AttributeError):
                del self.flow_deps
        for sock in sockets:
            sock.close()
        # Once engine.started went out, every start a consumer saw has its stop.
        self._finish({"stopped_at_unix_ms": now_ms()} if self.log.latest_sequence else None)

    # -- the C connection path ----------------------------------------------------------

    def _unhook_c_path(self) -> None:
        """Nothing feeds the C path from here on (tables, DNS answers): before it shuts down."""
        self.policies.on_publish = None
        self.resolver.on_answer = None
        self.routes.close()

    def principal_key(self, principal: int) -> str | None:
        """The principal_key C's principal id stands for (None for none)."""
        if 0 <= principal < len(self._principal_keys):
            return self._principal_keys[principal]
        return None

    def listener_users(self, index: int) -> list[tuple[str, str, int]] | None:
        """Inbound ``index``'s credentials as C takes them, None without authentication."""
        users = self.config.inbounds[index].users
        if users is None:
            return None
        return [(u.username, u.password, self.principal_ids[u.principal_key]) for u in users]

    def _start_c_flow(self, record: ConnRecord) -> pykka.ActorRef[Any]:
        """The FlowActor of a flow C started (dispatcher thread, from the bridge)."""
        inbound = self.inbounds[record.inbound]
        flow_id = f"{self.flow_id_prefix}{inbound.index}-{record.flow}"
        peer = (record.source_ip or "", record.source_port)
        return FlowActor.start(self.flow_deps, inbound, None, peer, flow_id, started=record)

    def _dns_answer(self, name: str, addresses: list[str], ttl_s: float) -> None:
        """Copy a resolver answer into C's cache: C then dials the name itself, trying
        the addresses in order within one deadline, as the Python path does."""
        self.bridge.conn.dns_put(name, addresses, int(ttl_s * 1000))

    def _take_deferred(self, deferred: Deferred) -> None:
        """Give a connection C deferred to its listener (closed if that has stopped)."""
        ref = self.listener_refs.get(deferred.inbound)
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(TakeDeferred(deferred))
                return
        os.close(deferred.fd)

    def _await_flows_drained(self) -> None:
        deadline = time.monotonic() + _STOP_GRACE_S
        while len(self.flows) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _refuse_unbuilt(self) -> None:
        missing = []
        if self.config.runtime.tun is not None:
            missing.append("runtime.tun (the TUN inbound is not built yet)")
        if self.config.runtime.dns.listen is not None:
            missing.append("runtime.dns.listen (the DNS server is not built yet)")
        if self.config.runtime.dns.answer.type == "fake_ip":
            missing.append("runtime.dns.answer fake_ip (fake-ip answers are not built yet)")
        if missing:
            raise ApiError("unsupported", "this build cannot run: " + "; ".join(missing))

    def _bind_all(self) -> list[socket.socket]:
        sockets: list[socket.socket] = []
        try:
            for i, ib in enumerate(self.config.inbounds):
                sockets.append(self._bind(i, ib.listen.address, ib.listen.port))
        except BaseException:
            for s in sockets:
                s.close()
            raise
        self.bound = [s.getsockname()[:2] for s in sockets]
        return sockets

    def _bind(self, index: int, address: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(min(socket.SOMAXCONN, 4096))
        except OSError as ex:
            sock.close()
            raise ApiError(
                "conflict",
                f"inbound {self.config.inbounds[index].tag!r} cannot listen on "
                f"{address}:{port}: {os.strerror(ex.errno or 0) if ex.errno else ex}",
                field_path=f"inbounds[{index}].listen",
            ) from ex
        return sock

    # -- state read by queries --------------------------------------------------------

    def stats_snapshot(self) -> dict[str, Any]:
        """The stats resource (docs/http-api.md), live."""
        c = self.counters
        up, down = c.completed_bytes_up, c.completed_bytes_down
        entries = self.flows.entries()
        relayed = [e for e in entries if e.handle is not None and e.base is not None]
        live = self.bridge.counters([e.handle for e in relayed if e.handle is not None])
        for entry, counters in zip(relayed, live, strict=True):
            if counters is not None and entry.base is not None:
                traffic = entry.base.with_relay(counters)
                up += traffic.bytes_up
                down += traffic.bytes_down
        for entry in entries:
            if entry.handle is None:
                up += entry.record["traffic"]["bytes_up"]
                down += entry.record["traffic"]["bytes_down"]
        return {
            "active_sessions": len(self.flows),
            "total_started": c.total_started,
            "completed_sessions": c.completed_sessions,
            "failed_sessions": c.failed_sessions,
            "blocked_sessions": c.blocked_sessions,
            "direct_sessions": c.direct_sessions,
            "chained_sessions": c.chained_sessions,
            "bytes_up": up,
            "bytes_down": down,
            "udp_upstream": dict(c.udp),
        }

    def leaf_outbound(self, tag: str) -> Outbound:
        """The outbound ``tag`` (an outbound or a group) uses now."""
        return self.outbounds[self.policies.resolve(tag)[-1]]

    def set_mode(self, mode: str, outbound: str | None) -> None:
        """Swap the routing mode (called by the supervisor after validation)."""
        old = self.route_state
        self.route_state = RouteState(mode, outbound, old.final, old.ruleset)
        self.routes.publish()
