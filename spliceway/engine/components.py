"""What the engine core starts without knowing the classes: the ports it wires through.

The core owns the engine's state and its start/stop order, but not the actors, the
event sinks or the TUN: those are built by the composition root
(:mod:`spliceway.app.compose`), which the core reaches through :class:`Wiring`
(mopidy's core likewise never imports its frontends). The protocols below are all the
core uses of what the wiring builds, so ``spliceway.engine`` imports nothing from
``spliceway.actors``, ``spliceway.api`` or ``spliceway.connector``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import pykka

    from spliceway.config import Api
    from spliceway.dns.server import DnsResponder
    from spliceway.engine.core import EngineCore
    from spliceway.engine.generation import InboundSpec
    from spliceway.events.log import EventLog
    from spliceway.native.conn import ConnPath, ConnRecord, Deferred
    from spliceway.native.relay import Counters, Relay
    from spliceway.tun.service import TunParts

T = TypeVar("T")


class LoopPort(Protocol):
    """The dispatcher: the event loop thread every actor and flow runs on."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The dispatcher's event loop."""
        ...

    def start(self) -> None:
        """Start the loop's thread."""
        ...

    def stop(self, timeout: float = ...) -> None:
        """Stop the loop and join its thread."""
        ...

    def run_sync(self, fn: Callable[[], Any], timeout: float = ...) -> Any:
        """Run ``fn`` on the loop and return its result (from another thread)."""
        ...


class BridgePort(Protocol):
    """The relay bridge: the C relay and connection path, and their reports."""

    @property
    def conn(self) -> ConnPath:
        """The C connection path."""
        ...

    @property
    def relay(self) -> Relay:
        """The C relay."""
        ...

    def attach(self) -> None:
        """Start watching the relay and the C path (on the dispatcher thread)."""
        ...

    def counters(self, handles: list[int]) -> list[Counters | None]:
        """Live counters of relayed flows."""
        ...

    def forget_listener(self, slot: int) -> None:
        """Listener ``slot`` stopped."""
        ...

    def shutdown(self) -> None:
        """Stop the C path and the relay."""
        ...

    def detach(self) -> None:
        """Deliver what is left and stop watching (dispatcher thread, after shutdown)."""
        ...


class EventSinks(Protocol):
    """The connector: the event sinks and their outbox."""

    @property
    def store(self) -> Any:
        """The open outbox, or None."""
        ...

    @property
    def api(self) -> Api:
        """The ``api`` section the sinks run."""
        ...

    @property
    def gate(self) -> Any:
        """The outbox's disk-space gate, or None."""
        ...

    def start(self) -> None:
        """Open the outbox and start the sinks."""
        ...

    def stop(self) -> None:
        """Stop the sinks."""
        ...

    def orphan_flow_ids(self) -> Iterable[str]:
        """Flows a killed run left open."""
        ...

    def complete_orphans(self) -> int:
        """Complete the flows a killed run left open."""
        ...

    def reconfigure(self, api: Api) -> None:
        """Add, restart and remove sinks for ``api``."""
        ...

    def status(self) -> list[dict[str, Any]]:
        """Every sink's status."""
        ...


class TunPort(Protocol):
    """The TUN inbound (``runtime.tun``, ``tun.start``)."""

    @property
    def running(self) -> bool:
        """Whether a TUN runs."""
        ...

    @property
    def managed_by_config(self) -> bool:
        """Whether the running TUN is ``runtime.tun``'s."""
        ...

    def route_inbounds(self) -> dict[str, tuple[int, ...]]:
        """The running TUN's inbound tags and listener slots."""
        ...

    def status(self) -> dict[str, Any]:
        """The ``tun`` resource."""
        ...

    def start(
        self, params: Mapping[str, Any], *, managed_by_config: bool, field_prefix: str = ...
    ) -> Any:
        """Start a TUN."""
        ...

    def stop(self) -> bool:
        """Stop the running TUN."""
        ...


class ActorPort(Protocol):
    """The actors of one start of the engine (built once the bridge exists)."""

    @property
    def flow_deps(self) -> Any:
        """What flow actors use of the engine (``actors.flow.FlowDeps``)."""
        ...

    def start_supervisor(self, sockets: list[socket.socket]) -> pykka.ActorRef[Any]:
        """Start the supervisor (listeners on ``sockets``, groups, the sampler)."""
        ...

    def start_provider_refresher(self, wait_s: float) -> pykka.ActorRef[Any]:
        """Start the providers' refresher and wait at most ``wait_s`` seconds for its first
        round (the URL providers without a cached copy)."""
        ...

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
        ...

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
        """Start the actor of a SOCKS5 UDP association."""
        ...

    def start_tun(
        self,
        stack: Any,
        specs: dict[int, Any],
        idle_timeout_ms: int,
        start_udp: Callable[[], pykka.ActorRef[Any] | None] | None,
        dns_tcp: Any,
    ) -> pykka.ActorRef[Any]:
        """Start the actor that gives a TUN stack's kernel listeners to the C path
        (``tun.service.TunParts.start_actor``)."""
        ...

    def start_tun_udp(
        self, spec: InboundSpec, stack: Any, dns: DnsResponder | None
    ) -> pykka.ActorRef[Any]:
        """Start the actor of a TUN's UDP sessions."""
        ...

    def stop_flow(self, ref: pykka.ActorRef[Any]) -> None:
        """Tell a flow's actor to end its flow (raises ``pykka.ActorDeadError``)."""
        ...

    def deliver_udp(self, ref: pykka.ActorRef[Any], batch: list[Any]) -> None:
        """Give a UDP association's actor its C records (raises ``pykka.ActorDeadError``)."""
        ...


class Wiring(Protocol):
    """What the composition root builds for the core (:mod:`spliceway.app.compose`)."""

    def connector(self, api: Api, log: EventLog) -> EventSinks:
        """The event sinks of ``api``."""
        ...

    def dispatcher(self) -> LoopPort:
        """A new, not yet started dispatcher."""
        ...

    def bridge(
        self,
        dispatcher: LoopPort,
        start_flow: Callable[[ConnRecord], pykka.ActorRef[Any]],
        take_deferred: Callable[[Deferred], None],
        slots: Mapping[int, Any],
        warn: Callable[[str], None],
    ) -> BridgePort:
        """The relay bridge, reporting C's flows to ``start_flow`` and ``take_deferred``
        and the listener slots' (``slots``) accept outages to ``warn``."""
        ...

    def actors(self, core: EngineCore) -> ActorPort:
        """The actors' factory for one start of ``core`` (after its bridge exists)."""
        ...

    def tun(self, parts: TunParts) -> TunPort:
        """The TUN service."""
        ...
