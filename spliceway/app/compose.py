"""The composition root: builds the engine core and the actors, sinks and TUN it runs.

Modelled on mopidy's ``commands.py``: the core (:mod:`spliceway.engine.core`) owns the
engine's state and its start/stop order and knows none of these classes; it reaches
them through :class:`~spliceway.engine.components.Wiring`, which this module
implements. Each actor gets a small frozen dependency object with only what it uses
(``FlowDeps``, ``ListenerPorts``, ``GroupPorts``, ``SamplerPorts``,
``SupervisorPorts``), built here from the core, never the core itself. The transports
(HTTP, IPC, gRPC) are built on top of the running core by ``spliceway.app.engine``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping
from typing import Any

import pykka

from spliceway.actors.bridge import RelayBridge
from spliceway.actors.dispatcher import Dispatcher
from spliceway.actors.flow import FlowActor, FlowDeps
from spliceway.actors.listener import ListenerPorts
from spliceway.actors.messages import StopFlow
from spliceway.actors.policy import GroupPorts
from spliceway.actors.providers import ProviderRefresherActor, RefresherPorts, StartRound
from spliceway.actors.stats import SamplerPorts
from spliceway.actors.supervisor import EngineSupervisor, SupervisorPorts
from spliceway.actors.tun import TunActor
from spliceway.actors.tun_udp import TunUdpActor
from spliceway.actors.udp import UdpAssociationActor, UdpRecords
from spliceway.config import Api, Config
from spliceway.connector.service import Connector
from spliceway.dns.server import DnsResponder
from spliceway.engine.components import LoopPort
from spliceway.engine.core import EngineCore
from spliceway.engine.generation import InboundSpec
from spliceway.engine.providers import RefreshPorts
from spliceway.events.log import EventLog
from spliceway.native.conn import ConnRecord, Deferred
from spliceway.native.tun import TunStack
from spliceway.tun.dns_hijack import TunDnsTcp
from spliceway.tun.service import TunParts, TunService, UdpStarter


def build_core(
    config: Config,
    config_path: str | None = None,
    *,
    on_runtime_changed: Callable[[Any], None] | None = None,
) -> EngineCore:
    """An engine core for ``config`` (not started), wired to the engine's actors."""
    return EngineCore(
        config, config_path, wiring=EngineWiring(), on_runtime_changed=on_runtime_changed
    )


class EngineWiring:
    """The core's :class:`~spliceway.engine.components.Wiring`: the classes it starts."""

    def connector(self, api: Api, log: EventLog) -> Connector:
        """The event sinks of ``api``."""
        return Connector(api, log)

    def dispatcher(self) -> Dispatcher:
        """A new, not yet started dispatcher."""
        return Dispatcher()

    def bridge(
        self,
        dispatcher: LoopPort,
        start_flow: Callable[[ConnRecord], pykka.ActorRef[Any]],
        take_deferred: Callable[[Deferred], None],
        slots: Mapping[int, Any],
        warn: Callable[[str], None],
    ) -> RelayBridge:
        """The relay bridge on ``dispatcher`` (one this wiring made)."""
        assert isinstance(dispatcher, Dispatcher)
        return RelayBridge(dispatcher, start_flow, take_deferred, slots, warn)

    def actors(self, core: EngineCore) -> StartedActors:
        """The actors' factory for this start of ``core``."""
        return StartedActors(core)

    def tun(self, parts: TunParts) -> TunService:
        """The TUN service."""
        return TunService(parts)


class StartedActors:
    """Starts the actors of one run of the engine, each with its ports."""

    def __init__(self, core: EngineCore) -> None:
        assert isinstance(core.dispatcher, Dispatcher)
        assert isinstance(core.bridge, RelayBridge)
        self._core = core
        self._dispatcher = core.dispatcher
        self._bridge = core.bridge
        #: What flow actors use of the engine (listeners' flows, associations, the TUN's).
        self.flow_deps = FlowDeps(
            bridge=core.bridge,
            counters=core.counters,
            dispatcher=core.dispatcher,
            flow_actors=core.flow_actors,
            flows=core.flows,
            group_actors=core.group_actors,
            log=core.log,
            principal_key=core.principal_key,
            process_lookup=core.process_lookup,
            routes=core.routes,
            generation=lambda: core.generation,
            hook=lambda: core.flow_hook,
            fake_ip_pool=lambda: core.dns.pool,
            new_flow_id=core.deferred_flow_id,
            start_association=core.start_association,
        )

    def start_supervisor(self, sockets: list[socket.socket]) -> pykka.ActorRef[Any]:
        """Start the supervisor, which starts the listeners on ``sockets``, the group
        actors and the stats sampler."""
        core = self._core
        ports = SupervisorPorts(
            dispatcher=self._dispatcher,
            log=core.log,
            generation=lambda: core.generation,
            inbound_slots=core.inbound_slots,
            listen_sockets=core.listen_sockets,
            group_actors=core.group_actors,
            listener=ListenerPorts(
                dispatcher=self._dispatcher,
                bridge=self._bridge,
                idle_timeout_ms=lambda: core.generation.tcp_idle_timeout_ms,
                listener_users=core.listener_users,
            ),
            group=GroupPorts(
                dispatcher=self._dispatcher,
                log=core.log,
                policies=lambda: core.generation.policies,
                leaf_outbound=core.leaf_outbound,
            ),
            sampler=SamplerPorts(
                dispatcher=self._dispatcher,
                bridge=self._bridge,
                flows=core.flows,
                log=core.log,
                udp_assocs=core.udp_assocs,
                stats_snapshot=core.stats_snapshot,
            ),
            set_mode=core.set_mode,
            install=core.install,
            restore=core.restore,
            dns_flush=self._bridge.conn.dns_flush,
            install_dns=core.dns.install,
        )
        return EngineSupervisor.start(ports, sockets)

    def start_provider_refresher(self, wait_s: float) -> pykka.ActorRef[Any]:
        """Start the providers' refresher and wait at most ``wait_s`` seconds for its first
        round (the URL providers without a cached copy: fetched now, so a reachable
        subscription is in the engine's first routes; a slow one is applied when done)."""
        core = self._core
        ports = RefresherPorts(
            providers=core.providers,
            refresh=RefreshPorts(
                log=core.log,
                loop=lambda: self._dispatcher.loop,
                outbound=core.leaf_outbound,
                reload=lambda force: core.reconciler.refresh(force=force),
                members=lambda name: [
                    tag for tag, origin in core.generation.origins.items() if origin == name
                ],
                record=lambda tag, health: core.generation.policies.record_probe(tag, health),
            ),
            source=lambda: core.source_config,
        )
        ref = ProviderRefresherActor.start(ports)
        future = ref.ask(StartRound(), block=False)
        with contextlib.suppress(pykka.Timeout):
            future.get(timeout=wait_s)
        return ref

    def start_flow(
        self,
        inbound: InboundSpec,
        client: socket.socket | None,
        peer: tuple[str, int],
        flow_id: str,
        *,
        deferred: Deferred | None = None,
        started: ConnRecord | None = None,
    ) -> pykka.ActorRef[Any]:
        """Start the FlowActor of one TCP flow."""
        return FlowActor.start(
            self.flow_deps, inbound, client, peer, flow_id, deferred=deferred, started=started
        )

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
        """Start the actor of a SOCKS5 UDP association (it replies and relays)."""
        core = self._core
        g = core.generation
        UdpAssociationActor.start(
            self.flow_deps,
            core.udp,
            core.register_association,
            g.resolver,
            inbound,
            control,
            peer,
            declared_port,
            principal_key,
            auth_scheme,
            id_prefix,
            g.config.runtime.udp_upstream_idle_timeout_seconds,
        )

    def start_tun(
        self,
        stack: TunStack,
        specs: dict[int, Any],
        idle_timeout_ms: int,
        start_udp: UdpStarter | None,
        dns_tcp: TunDnsTcp | None,
    ) -> pykka.ActorRef[Any]:
        """Start the actor that gives a TUN stack's kernel listeners to the C path."""
        return TunActor.start(
            self._dispatcher, self._bridge.conn, stack, specs, idle_timeout_ms, start_udp, dns_tcp
        )

    def start_tun_udp(
        self, spec: InboundSpec, stack: Any, dns: DnsResponder | None
    ) -> pykka.ActorRef[Any]:
        """Start the actor of a TUN's UDP sessions."""
        core = self._core
        return TunUdpActor.start(
            self.flow_deps,
            lambda: core.generation.resolver,
            spec,
            stack,
            dns,
            core.generation.config.runtime.udp_upstream_idle_timeout_seconds,
        )

    def stop_flow(self, ref: pykka.ActorRef[Any]) -> None:
        """Tell a flow's actor to end its flow."""
        ref.tell(StopFlow())

    def deliver_udp(self, ref: pykka.ActorRef[Any], batch: list[Any]) -> None:
        """Give a UDP association's actor its C records, in order."""
        ref.tell(UdpRecords(batch))
