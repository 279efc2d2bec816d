"""EngineCore: the running engine's state and its start/stop order.

The public face is ``spliceway.Engine`` (app/engine.py); transports and the command
table reach the engine through an ``EngineCore``. What a reload replaces is one
:class:`~spliceway.engine.generation.Generation`, published by one assignment to
``core.generation``. The actors, the event sinks and the TUN are built by the
composition root (:mod:`spliceway.app.compose`) through the core's
:class:`~spliceway.engine.components.Wiring`. Start order: the connector
(outbox lock and recovery, sink actors), bind every inbound and the DNS server's
address (all or nothing), dispatcher, relay bridge, ``engine.started``, the DNS
server, supervisor (listeners, sampler), the TUN of ``runtime.tun``.
Stop reverses it, and every flow still open completes with exactly one
``flow.completed`` before ``engine.stopped``, which the sinks still take in.
Two mixins carry parts of it: the TUN's wiring (tun_wiring.py) and the live counters
the stats resource and the metrics read (stats.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pykka

from spliceway import __version__
from spliceway.config import Config
from spliceway.dns import Resolver
from spliceway.dns.server import DnsResponder
from spliceway.dns.service import FAKEIP_WARNING, DnsService
from spliceway.engine import assembly
from spliceway.engine.components import ActorPort, BridgePort, LoopPort, TunPort, Wiring
from spliceway.engine.generation import ActiveInbound, Generation, InboundSpec, build_generation
from spliceway.engine.providers import Providers
from spliceway.engine.reconcile import Plan, Reconciler
from spliceway.engine.route_publish import RoutePublisher
from spliceway.engine.runtime import Counters, FlowTable, RouteState
from spliceway.engine.stats import UDP_DROP_REASONS, StatsViews
from spliceway.engine.tun_wiring import TunWiring
from spliceway.errors import ApiError
from spliceway.events.log import EventLog, now_ms
from spliceway.events.logring import LogRing
from spliceway.flows.hook import WARNING_CODE, FlowHookClient, HookSettings
from spliceway.flows.outbounds import Outbound
from spliceway.native.conn import AUTH_SCHEMES, ConnRecord, Deferred
from spliceway.native.udp import UdpRelay
from spliceway.protocols import socks5
from spliceway.routing import policy
from spliceway.routing.process_lookup import LocalAddresses, ProcessLookup
from spliceway.support.atomic_file import remove_stale_staged
from spliceway.support.fdlimit import warning_emitter

__all__ = [
    "BUILD_ID",
    "UDP_DROP_REASONS",
    "ActiveInbound",
    "EngineCore",
    "InboundSpec",
    "bind_listener",
]

logger = logging.getLogger(__name__)

BUILD_ID = f"spliceway-{__version__}"
_STOP_GRACE_S = 10.0
#: How long start() waits for the first fetch of URL providers that have no cached copy.
PROVIDER_START_WAIT_S = 3.0


class EngineCore(TunWiring, StatsViews):
    """The engine's shared parts. Thread-safe to read; actors own the mutations.

    ``wiring`` builds what the core starts (actors, sinks, TUN);
    ``on_runtime_changed`` is called with the runtime section after a reload that
    changed it (the CLI re-applies logging).
    """

    def __init__(
        self,
        config: Config,
        config_path: str | None = None,
        *,
        wiring: Wiring,
        on_runtime_changed: Callable[[Any], None] | None = None,
    ) -> None:
        self._wiring = wiring
        self.config_path = config_path
        self.build_id = BUILD_ID
        runtime = config.runtime
        self.log = EventLog(runtime.event_ring_capacity)
        #: Recent ``spliceway.*`` log records (``GET /api/v1/logs``), kept while running;
        #: the level is read per record so a reload's ``runtime.log_level`` applies at once.
        self.logs = LogRing(lambda: self.generation.config.runtime.log_level)
        self.connector = wiring.connector(config.api, self.log)
        self.flow_id_prefix = f"{secrets.token_hex(4)}-"
        self.flows = FlowTable()
        #: Every FlowActor alive (they are not in pykka's registry).
        self.flow_actors: set[Any] = set()
        self.counters = Counters()
        self.routes = RoutePublisher(self)
        #: Serials of generations: one per build (and per ``mode.set``).
        self._serials = itertools.count(1)
        #: Every provider's content and status; their cached copies are read here, so the
        #: first generation routes through what they last had (module engine.providers).
        self.providers = Providers()
        #: The running configuration as written: its groups name providers, which the
        #: generation's configuration has merged in (the reconciler applies it again when
        #: a provider's content changes).
        self.source_config = config
        merged = self.providers.materialise(config)
        config = merged.config
        #: What a reload replaces, whole (module spliceway.engine.generation). Readers
        #: take it once; it is written by :meth:`_publish_generation` alone.
        self.generation: Generation = build_generation(
            next(self._serials),
            config,
            assembly.build_routing(config, on_answer=self.dns_answer),
            (),
            self.republish,
            merged.origins,
            merged.members,
        )
        #: Every listener slot's spec, also of listeners a reload stopped (their last
        #: flows' records still name the slot), until the slot is used again.
        self.inbound_slots: dict[int, InboundSpec] = {
            i: InboundSpec.of(i, ib) for i, ib in enumerate(config.inbounds)
        }
        # Principals as C knows them: small integers, in first-seen order, never reused.
        self._principal_keys: list[str] = []
        self.principal_ids: dict[str, int] = {}
        self.learn_principals(config)
        self._deferred_ids = itertools.count(1)
        #: Serialises config.apply / config.apply_runtime / SIGHUP reloads and stop().
        self.apply_lock = threading.Lock()
        #: The listening socket of each running listener slot (its ListenerActor owns it;
        #: a reload duplicates it for a changed inbound on the same address).
        self.listen_sockets: dict[int, socket.socket] = {}
        self.reconciler = Reconciler(self, on_runtime_changed)
        #: The fake-ip pool and the DNS server (``runtime.dns``); they read the resolver
        #: through the core, so a reload's new one answers at once. The server runs on a
        #: thread of its own: no query, however costly, delays the dispatcher's flows
        #: (docs/dns.md).
        self.dns = DnsService(
            lambda: self.generation.resolver,
            self._dns_warning,
            warn_fd_exhausted=warning_emitter(self.log),
        )
        self.started_at_unix_ms = 0
        #: UDP associations by the C relay's id (their actors take its records).
        #: The TUN's UDP actor is among them, under ``("tun", tag)``.
        self.udp_assocs: dict[Any, pykka.ActorRef[Any]] = {}
        #: The DNS responder for a TUN's dns_hijack when no DNS server runs.
        self._tun_responder: DnsResponder | None = None
        #: ``runtime.process_lookup``'s lookups (its worker thread starts with the first).
        self.process_lookup = ProcessLookup(on_local_change=self.republish)
        #: Readable when this host's addresses change (the lookup's locality snapshot).
        self._address_watch: socket.socket | None = None
        # Made in start(): its event loop holds a socket pair that only a started
        # engine's stop() closes, so an engine that never starts must not own one.
        self.dispatcher: LoopPort
        self.bridge: BridgePort
        #: Whether C's connection path takes DNS answers (from start until it closes).
        self._c_path_open = False
        #: The actors' factory of this start (made once the bridge exists).
        self._actors: ActorPort | None = None
        self.supervisor: pykka.ActorRef[Any] | None = None
        #: The providers' refresher (actors.providers), from the end of start() on.
        self.provider_refresher: pykka.ActorRef[Any] | None = None
        #: One PolicyGroupActor per group, started by the supervisor.
        self.group_actors: dict[str, pykka.ActorRef[Any]] = {}
        #: The flow hook's client (``api.flow_hook``), on the dispatcher loop; None without
        #: a hook. Flows read it when they ask, so a reload's replacement takes effect at
        #: once; the route table defers the inbounds it selects (route_publish).
        self.flow_hook: FlowHookClient | None = None
        #: Clients a reload replaced, closed once their outstanding asks are settled.
        self._retired_hooks: set[FlowHookClient] = set()
        #: The TUN inbound (``runtime.tun``, ``tun.start``); made in start().
        self.tun: TunPort | None = None
        self.running = False

    # -- the current generation (read-only views; readers of several take it once) ---

    @property
    def config(self) -> Config:
        """The running configuration."""
        return self.generation.config

    @property
    def parts(self) -> assembly.RoutingParts:
        """The running configuration's routing parts."""
        return self.generation.parts

    @property
    def resolver(self) -> Resolver:
        """The resolver of ``runtime.dns``."""
        return self.generation.resolver

    @property
    def outbounds(self) -> dict[str, Outbound]:
        """Every leaf outbound by tag."""
        return self.generation.outbounds

    @property
    def policies(self) -> policy.PolicyTable:
        """The group views."""
        return self.generation.policies

    @property
    def route_state(self) -> RouteState:
        """The routing inputs (mode, final, rules)."""
        return self.generation.route_state

    @property
    def tcp_idle_timeout_ms(self) -> int:
        """``runtime.tcp_idle_timeout_seconds`` in milliseconds."""
        return self.generation.tcp_idle_timeout_ms

    @property
    def active_inbounds(self) -> tuple[ActiveInbound, ...]:
        """Listening inbounds in config order."""
        return self.generation.active_inbounds

    @property
    def flow_deps(self) -> Any:
        """What flow actors use of the engine (from start on)."""
        if self._actors is None:
            raise AttributeError("flow_deps")
        return self._actors.flow_deps

    @property
    def inbounds(self) -> list[InboundSpec]:
        """The listening inbounds' specs, in config order."""
        return [a.spec for a in self.active_inbounds]

    def route_inbounds(self, g: Generation | None = None) -> dict[str, tuple[int, ...]]:
        """Every inbound tag a rule may name and its listener slots (a TUN has two), in
        generation ``g`` (the current one by default)."""
        active = (g or self.generation).active_inbounds
        out: dict[str, tuple[int, ...]] = {a.spec.tag: (a.spec.index,) for a in active}
        if self.tun is not None:
            out.update(self.tun.route_inbounds())
        return out

    @property
    def bound(self) -> list[tuple[str, int]]:
        """The addresses the listening inbounds are bound to, in config order."""
        return [a.bound for a in self.active_inbounds]

    # -- publishing generations ------------------------------------------------------

    def republish(self) -> None:
        """Recompile C's route table from the current generation, if anything changed
        (the callback of the policy table, the process lookup and the TUN): through the
        publisher's attribute, so whatever publishes is looked up at each call."""
        self.routes.publish()

    def _publish_generation(self, g: Generation) -> None:
        """Make ``g`` the current generation: the one place that assigns it."""
        self.generation = g
        self.logs.configuration_changed()

    def install(self, plan: Plan) -> Generation:
        """Publish the generation of a prepared reload (dispatcher thread, before the new
        listeners start: their first flows route by it) and recompile C's route table;
        returns the previous generation, which :meth:`restore` puts back."""
        previous = self.generation
        new = plan.config
        self.learn_principals(new)
        g = build_generation(
            next(self._serials),
            new,
            plan.parts,
            tuple(ActiveInbound(spec, bound) for spec, bound in plan.listeners.active),
            self.republish,
            plan.origins,
            plan.provider_members,
        )
        if new.api.flow_hook != previous.config.api.flow_hook:
            # Before the publish below: the table defers the new hook's inbounds.
            self.replace_flow_hook(new)
        self._publish_generation(g)
        self.routes.publish()
        return previous

    def restore(self, previous: Generation) -> None:
        """Put ``previous`` back (a reload whose listener failed to start): the flow hook
        of its configuration if the reload had changed it, and its route table."""
        hook_changed = previous.config.api.flow_hook != self.generation.config.api.flow_hook
        self._publish_generation(previous)
        if hook_changed:
            self.replace_flow_hook(previous.config)
        self.routes.publish()

    def learn_principals(self, config: Config) -> None:
        """Give every principal_key of ``config`` a C principal id (kept ones keep theirs)."""
        for ib in config.inbounds:
            for user in ib.users or ():
                if user.principal_key not in self.principal_ids:
                    self.principal_ids[user.principal_key] = len(self._principal_keys)
                    self._principal_keys.append(user.principal_key)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Bind every inbound and start the actors; raises ApiError on failure."""
        # A crashed engine's TUN routes and rules (strict_route's kill switch among them)
        # go first, whether or not this one runs a TUN: one failed open when none.
        self._sweep_tun_leftovers()
        if self.config_path is not None:
            # What an apply killed mid-way left beside the file (docs/reload.md).
            remove_stale_staged(os.path.realpath(self.config_path))
        # The outbox first: a second engine on the same outbox must fail before binding.
        self.connector.start()
        # No flow of this run may take the id of one a killed run left open (completed
        # below): ids are this prefix, random per start, and one more is drawn on a match.
        recovered = self.connector.orphan_flow_ids()
        while any(flow_id.startswith(self.flow_id_prefix) for flow_id in recovered):
            self.flow_id_prefix = f"{secrets.token_hex(4)}-"
        try:
            sockets = self._bind_all()
            try:
                dns_plan = self.dns.prepare(self.generation.config.runtime.dns)
            except BaseException:
                for sock in sockets:
                    sock.close()
                raise
        except BaseException:
            self.connector.stop()
            raise
        # From here a failed start ends in _finish, which detaches it again.
        self.logs.attach()
        self.started_at_unix_ms = now_ms()
        self.dispatcher = self._wiring.dispatcher()
        self.dispatcher.start()
        bridge: BridgePort | None = None
        try:
            bridge = self._wiring.bridge(
                self.dispatcher,
                self._start_c_flow,
                self._take_deferred,
                self.inbound_slots,
                warning_emitter(self.log),
            )
            self.dispatcher.run_sync(bridge.attach)
            self.bridge = bridge
            self._c_path_open = True
            self.udp = UdpRelay(
                loops=1, busy_poll_us=self.generation.config.runtime.udp_busy_poll_us
            )
            self.dispatcher.run_sync(
                lambda: self.dispatcher.loop.add_reader(self.udp.fileno(), self._on_udp_ready)
            )
            self._watch_addresses()
            #: The actors of this start (flow actors' dependencies among them).
            self._actors = self._wiring.actors(self)
            # Before the first table: it defers the inbounds the hook selects.
            self.flow_hook = self._new_flow_hook(self.generation.config)
            self.routes.publish()
            # Before the actors start: a group's startup probe round must not be the
            # ring's first event.
            self.log.emit(
                "engine.started",
                {"build_id": self.build_id, "started_at_unix_ms": self.started_at_unix_ms},
            )
            # After engine.started, before any flow: the flows a killed run left open.
            self.connector.complete_orphans()
            # After engine.started: a damaged fake-ip file's warning follows it.
            self.dns.install(dns_plan)
            self.supervisor = self._actors.start_supervisor(sockets)
            # Its on_start runs on the dispatcher; a proxied read is answered only after it,
            # so the group actors (policies.* commands) exist once start() returns.
            self.supervisor.proxy().listeners.get(timeout=_STOP_GRACE_S)
            self.tun = self._wiring.tun(self._tun_parts())
            tun = self.generation.config.runtime.tun
            if tun is not None:
                self.tun.start(
                    tun.model_dump(exclude_none=True),
                    managed_by_config=True,
                    field_prefix="runtime.tun.",
                )
        except BaseException:
            dns_plan.discard()
            self._abort_start(sockets, bridge)
            raise
        self.running = True
        # Once running: a first fetch applies its content as a reload does.
        self.provider_refresher = self._actors.start_provider_refresher(PROVIDER_START_WAIT_S)

    def stop(self, reason: str | None = None) -> None:
        """Stop accepting, complete every open flow, emit engine.stopped, join threads."""
        # After an apply in progress, and no apply after it.
        with self.apply_lock:
            if not self.running:
                return
            self.running = False
        assert self.supervisor is not None
        # Downloads in flight end now (they run on the dispatcher, which stops below).
        self.providers.close()
        if self.provider_refresher is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.provider_refresher.stop(timeout=_STOP_GRACE_S)
            self.provider_refresher = None
        self._stop_tun()
        with contextlib.suppress(pykka.ActorDeadError):
            self.supervisor.proxy().stop_listeners().get(timeout=_STOP_GRACE_S)
        # No new names either; the fake-ip table is written out.
        self.dns.stop()
        actors = self._actors
        assert actors is not None
        for entry in self.flows.entries():
            with contextlib.suppress(pykka.ActorDeadError):
                actors.stop_flow(entry.actor)
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
        self._close_udp()
        # After the flows: one still asking was stopped above, so closing fails none open.
        self._close_flow_hooks()
        self._close_process_lookup()
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
        self.logs.detach()

    def _abort_start(self, sockets: list[socket.socket], bridge: BridgePort | None) -> None:
        """Undo a start that failed after binding: nothing may be left running or open."""
        self._stop_tun()
        self._close_udp()
        self.dns.stop()
        if self.supervisor is not None:
            with contextlib.suppress(Exception):
                self.supervisor.stop(timeout=_STOP_GRACE_S)
            self.supervisor = None
        self._close_flow_hooks()
        self._close_process_lookup()
        if bridge is not None:
            self._unhook_c_path()
            with contextlib.suppress(Exception):
                bridge.shutdown()
                self.dispatcher.run_sync(bridge.detach)
            # The relay (its completion eventfd) is freed with the last reference to it.
            with contextlib.suppress(AttributeError):
                del self.bridge
            self._actors = None
        for sock in sockets:
            sock.close()
        # Once engine.started went out, every start a consumer saw has its stop.
        self._finish({"stopped_at_unix_ms": now_ms()} if self.log.latest_sequence else None)

    # -- the C connection path ----------------------------------------------------------

    def _unhook_c_path(self) -> None:
        """Nothing feeds the C path from here on (tables, DNS answers): before it shuts down."""
        self._c_path_open = False
        self.routes.close()

    # -- the flow hook ------------------------------------------------------------------

    def _new_flow_hook(self, config: Config) -> FlowHookClient | None:
        """A client for ``config``'s flow hook on the dispatcher loop (it connects at the
        first ask), or None without one."""
        hook = config.api.flow_hook
        if hook is None:
            return None
        settings = HookSettings.from_config(hook)
        return FlowHookClient(settings, self.dispatcher.loop, self._hook_warning)

    def _dns_warning(self, message: str) -> None:
        """A fake-ip table that could not be read back whole, as ``engine.warning``."""
        self.log.emit("engine.warning", {"code": FAKEIP_WARNING, "message": message})

    def _hook_warning(self, message: str) -> None:
        """The client's outage report, as ``engine.warning`` (dispatcher thread)."""
        logger.warning("%s", message)
        self.log.emit("engine.warning", {"code": WARNING_CODE, "message": message})

    def replace_flow_hook(self, config: Config) -> None:
        """Switch to ``config``'s flow hook (a reload; dispatcher thread, before the route
        table is republished). New flows ask the new client at once; the old one keeps
        its connection until every ask already sent to it has its answer or timed out,
        so no flow loses a verdict to the swap."""
        old, self.flow_hook = self.flow_hook, self._new_flow_hook(config)
        if old is None:
            return
        if not old.pending:
            old.close()
            return
        self._retired_hooks.add(old)
        # No ask outlives its timeout: after it, every one the old client had is settled.
        self.dispatcher.loop.call_later(
            old.settings.timeout_ms / 1000 + 0.05, self._retire_flow_hook, old
        )

    def _retire_flow_hook(self, client: FlowHookClient) -> None:
        if client in self._retired_hooks:
            self._retired_hooks.discard(client)
            client.close()

    def _close_flow_hooks(self) -> None:
        """Close the hook's client and any a reload retired (stop, or an undone start)."""
        clients = [*self._retired_hooks, self.flow_hook]
        self._retired_hooks.clear()
        self.flow_hook = None
        for client in clients:
            if client is not None:
                client.close()

    def principal_key(self, principal: int) -> str | None:
        """The principal_key C's principal id stands for (None for none)."""
        if 0 <= principal < len(self._principal_keys):
            return self._principal_keys[principal]
        return None

    def listener_users(self, spec: InboundSpec) -> list[tuple[str, str, int]] | None:
        """An inbound's credentials as C takes them, None without authentication."""
        users = spec.source.users
        if users is None:
            return None
        return [(u.username, u.password, self.principal_ids[u.principal_key]) for u in users]

    def _start_c_flow(self, record: ConnRecord) -> pykka.ActorRef[Any]:
        """The FlowActor of a flow C started (dispatcher thread, from the bridge)."""
        inbound = self.inbound_slots[record.inbound]
        flow_id = f"{self.flow_id_prefix}{inbound.index}-{record.flow}"
        peer = (record.source_ip or "", record.source_port)
        assert self._actors is not None
        return self._actors.start_flow(inbound, None, peer, flow_id, started=record)

    def dns_answer(self, name: str, addresses: list[str], ttl_s: float) -> None:
        """Copy a resolver answer into C's cache: C then dials the name itself, trying
        the addresses in order within one deadline, as the Python path does. Every
        resolver the engine builds is told to call this; answers before the C path
        exists, or after it closed, are not copied."""
        if self._c_path_open:
            self.bridge.conn.dns_put(name, addresses, int(ttl_s * 1000))

    def _take_deferred(self, deferred: Deferred) -> None:
        """Finish a connection C accepted and handed back before its handshake, in a
        FlowActor (dispatcher thread). Its listener may have been replaced by a reload
        meanwhile: the connection is still served, under the inbound that accepted it.
        """
        inbound = self.inbound_slots.get(deferred.inbound)
        if inbound is None or not self.running:
            os.close(deferred.fd)
            return
        client = socket.socket(fileno=deferred.fd)
        flow_id = self.deferred_flow_id(inbound.index)
        peer = (deferred.source_ip or "", deferred.source_port)
        if deferred.command == socks5.CMD_UDP_ASSOCIATE:
            if not inbound.udp:
                # C parsed the request and answered nothing yet: refused as Python's
                # handshake refuses it (accept_handshake's ``udp``).
                with contextlib.suppress(OSError):
                    client.send(socks5.reply(socks5.REP_COMMAND_NOT_SUPPORTED))
                client.close()
                return
            self.start_association(
                inbound,
                client,
                peer,
                deferred.port,
                self.principal_key(deferred.principal),
                AUTH_SCHEMES.get(deferred.auth),
                flow_id,
            )
            return
        assert self._actors is not None
        self._actors.start_flow(inbound, client, peer, flow_id, deferred=deferred)

    def _on_udp_ready(self) -> None:
        """The C UDP relay has records: each association's go to its actor, in order."""
        by_assoc: dict[int, list[Any]] = {}
        for record in self.udp.drain():
            by_assoc.setdefault(record.assoc, []).append(record)
        actors = self._actors
        assert actors is not None
        for assoc, batch in by_assoc.items():
            ref = self.udp_assocs.get(assoc)
            if ref is not None:
                with contextlib.suppress(pykka.ActorDeadError):
                    actors.deliver_udp(ref, batch)

    def register_association(self, assoc: int, ref: pykka.ActorRef[Any] | None) -> None:
        """Send association ``assoc``'s C records to ``ref`` (None: no longer)."""
        if ref is None:
            self.udp_assocs.pop(assoc, None)
        else:
            self.udp_assocs[assoc] = ref

    def _close_udp(self) -> None:
        """Stop the C UDP relay (after every association actor has stopped)."""
        relay = getattr(self, "udp", None)
        if relay is None or relay.closed:
            return

        def close() -> None:
            with contextlib.suppress(ValueError, OSError):
                self.dispatcher.loop.remove_reader(relay.fileno())
            relay.close()

        self.dispatcher.run_sync(close)
        # Its loops' threads and descriptors are freed with the last reference to it.
        del self.udp

    def start_association(
        self,
        inbound: InboundSpec,
        control: socket.socket,
        peer: tuple[str, int],
        declared_port: int,
        principal_key: str | None,
        auth_scheme: str | None,
        id_prefix: str,
    ) -> None:
        """A SOCKS5 UDP ASSOCIATE whose handshake is done: its actor replies and relays
        (dispatcher thread)."""
        assert self._actors is not None
        self._actors.start_association(
            inbound, control, peer, declared_port, principal_key, auth_scheme, f"{id_prefix}-"
        )

    def _await_flows_drained(self) -> None:
        deadline = time.monotonic() + _STOP_GRACE_S
        # A flow C started whose record waits for its process lookup is not listed yet;
        # it is, with its end, within the lookup's bounded wait.
        while (len(self.flows) or self.process_lookup.holding) and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- process lookup ---------------------------------------------------------------

    def _watch_addresses(self) -> None:
        """Take this host's addresses now and follow their changes (for the locality
        test of ``runtime.process_lookup``: a client on this host is looked up)."""
        lookup = self.process_lookup
        try:
            watch = LocalAddresses.watch_socket()
        except OSError as ex:
            logger.warning("cannot follow this host's address changes: %s", ex)
            watch = None
        # After subscribing: a change from here on is seen by the next refresh.
        lookup.refresh_local()
        if watch is None:
            return
        self._address_watch = watch

        def changed() -> None:
            # Drain the notifications; one refresh (off the loop) covers them all.
            with contextlib.suppress(OSError):
                while watch.recv(65536):
                    pass
            lookup.refresh_local_later()

        self.dispatcher.run_sync(lambda: self.dispatcher.loop.add_reader(watch.fileno(), changed))

    def _close_process_lookup(self) -> None:
        """Stop following addresses and stop the lookup worker (after the flows)."""
        watch, self._address_watch = self._address_watch, None
        if watch is not None:
            with contextlib.suppress(Exception):
                self.dispatcher.run_sync(lambda: self.dispatcher.loop.remove_reader(watch.fileno()))
            watch.close()
        self.process_lookup.close()

    def _bind_all(self) -> list[socket.socket]:
        sockets: list[socket.socket] = []
        try:
            for i, ib in enumerate(self.generation.config.inbounds):
                sockets.append(bind_listener(ib.listen.address, ib.listen.port, ib.tag, i))
        except BaseException:
            for s in sockets:
                s.close()
            raise
        # The start's first generation, completed with what it listens on.
        self._publish_generation(
            self.generation.with_active_inbounds(
                tuple(
                    ActiveInbound(self.inbound_slots[i], s.getsockname()[:2])
                    for i, s in enumerate(sockets)
                )
            )
        )
        return sockets

    def deferred_flow_id(self, inbound_index: int) -> str:
        """The id of a flow Python starts (``<prefix><inbound>-d<n>``): a connection C
        handed over, or a later request on a kept-alive http connection."""
        return f"{self.flow_id_prefix}{inbound_index}-d{next(self._deferred_ids)}"

    def leaf_outbound(self, tag: str) -> Outbound:
        """The outbound ``tag`` (an outbound or a group) uses now."""
        g = self.generation
        return g.outbounds[g.policies.resolve(tag)[-1]]

    def set_mode(self, mode: str, outbound: str | None) -> None:
        """Swap the routing mode (called by the supervisor after validation): a new
        generation under the new routing state."""
        g = self.generation
        old = g.route_state
        state = RouteState(mode, outbound, old.final, old.ruleset)
        self._publish_generation(g.with_route_state(next(self._serials), state))
        self.routes.publish()


def bind_listener(address: str, port: int, tag: str, index: int) -> socket.socket:
    """A listening TCP socket for inbound ``tag`` (``inbounds[index]``); ApiError
    ``conflict`` naming the inbound when the address cannot be bound."""
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
            f"inbound {tag!r} cannot listen on {address}:{port}: "
            f"{os.strerror(ex.errno) if ex.errno else ex}",
            field_path=f"inbounds[{index}].listen",
        ) from ex
    return sock
