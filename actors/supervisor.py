"""EngineSupervisor: owns the listeners, the policy group actors, the stats sampler
and the routing mode, and installs a reload's new configuration."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.actors.dispatcher import Dispatcher, LoopActor
from spliceway.actors.listener import ListenerActor, ListenerPorts
from spliceway.actors.policy import GroupPorts, PolicyGroupActor
from spliceway.actors.stats import SamplerPorts, StatsSamplerActor
from spliceway.errors import ApiError

if TYPE_CHECKING:
    from spliceway.dns.service import DnsPlan
    from spliceway.engine.generation import Generation, InboundSpec
    from spliceway.engine.reconcile import Plan
    from spliceway.events.log import EventLog


@dataclass(frozen=True, slots=True)
class SupervisorPorts:
    """What the supervisor uses of the engine: its tables of running things (which it
    alone writes), the ports of the actors it starts, and the core's operations."""

    dispatcher: Dispatcher
    log: EventLog
    #: The engine's current generation.
    generation: Callable[[], Generation]
    #: Every listener slot's spec (also of stopped listeners' slots).
    inbound_slots: dict[int, InboundSpec]
    #: The listening socket of each running listener slot.
    listen_sockets: dict[int, socket.socket]
    #: One PolicyGroupActor per group.
    group_actors: dict[str, pykka.ActorRef[Any]]
    listener: ListenerPorts
    group: GroupPorts
    sampler: SamplerPorts
    #: Swap the routing mode (a new generation).
    set_mode: Callable[[str, str | None], None]
    #: Publish a prepared reload's generation; returns the previous one.
    install: Callable[[Plan], Generation]
    #: Put a previous generation back.
    restore: Callable[[Generation], None]
    #: Empty C's DNS cache (a reload replaced the resolver).
    dns_flush: Callable[[], None]
    #: Install a reload's fake-ip pool and DNS server.
    install_dns: Callable[[DnsPlan], None]


class EngineSupervisor(LoopActor):
    """Starts and stops the engine's long-lived actors; serialises mode changes and
    reloads with them (all on the dispatcher thread, where flows decide)."""

    def __init__(self, ports: SupervisorPorts, sockets: list[socket.socket]) -> None:
        super().__init__(ports.dispatcher)
        self.ports = ports
        self._sockets = sockets
        #: ListenerActor by listener slot.
        self.listeners: dict[int, pykka.ActorRef[Any]] = {}
        self.sampler: pykka.ActorRef[Any] | None = None

    def on_start(self) -> None:
        """Start the group actors, then one ListenerActor per bound inbound, and the sampler."""
        ports = self.ports
        g = ports.generation()
        # Groups first: the first accepted flow may already route through one.
        for view in g.policies.views():
            ports.group_actors[view.tag] = PolicyGroupActor.start(ports.group, view)
        specs = [a.spec for a in g.active_inbounds]
        for spec, sock in zip(specs, self._sockets, strict=True):
            self._start_listener(spec, sock)
        self._sockets = []
        self._start_sampler()

    def _start_listener(self, spec: InboundSpec, sock: socket.socket) -> bool:
        """Start accepting on ``sock`` as slot ``spec.index``; False (socket closed) if C
        refused it."""
        self.ports.inbound_slots[spec.index] = spec
        self.ports.listen_sockets[spec.index] = sock
        ref = ListenerActor.start(self.ports.listener, spec, sock)
        # on_start ran here, on this thread: a listener C refused is dead already.
        if not ref.is_alive():
            self.ports.listen_sockets.pop(spec.index, None)
            return False
        self.listeners[spec.index] = ref
        return True

    def _stop_listener(self, slot: int) -> None:
        ref = self.listeners.pop(slot, None)
        self.ports.listen_sockets.pop(slot, None)
        if ref is not None:
            # Told from this thread to an idle actor: handled at once, so C no longer
            # accepts on the slot and its socket is closed when this returns.
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)

    def _start_sampler(self) -> None:
        interval = self.ports.generation().config.runtime.stats_interval_ms
        self.sampler = StatsSamplerActor.start(self.ports.sampler, interval)

    def stop_listeners(self) -> None:
        """Stop accepting new connections (first step of shutdown)."""
        for slot in list(self.listeners):
            self._stop_listener(slot)

    def set_mode(self, mode: str, outbound: str | None) -> bool:
        """Switch the routing mode for new flows."""
        self.ports.set_mode(mode, outbound)
        return True

    def reconfigure(self, plan: Plan) -> None:
        """Install a prepared reload (see spliceway.engine.reconcile); ApiError with nothing
        changed when a new listener cannot start."""
        ports = self.ports
        change = plan.listeners
        # A listener giving its socket to a new slot stops first: the two never accept
        # side by side, and the new one's registration with C reports connections
        # already waiting, so none is stranded.
        for slot in change.shared:
            self._stop_listener(slot)
        # The generation before the new listeners: C accepts on those at once, and must
        # route their first flows by the new table (their inbound rules, the hook).
        previous = ports.install(plan)
        started: list[int] = []
        for spec, sock in change.start:
            if not self._start_listener(spec, sock):
                for slot in started:
                    self._stop_listener(slot)
                ports.restore(previous)
                for slot, spare in change.shared.items():
                    self._start_listener(ports.inbound_slots[slot], spare.dup())
                raise ApiError(
                    "internal",
                    f"inbound {spec.tag!r} could not start accepting (see the log)",
                )
            started.append(spec.index)
        self._swap_actors(plan, previous)
        for slot in change.retire:
            if slot not in change.shared:
                self._stop_listener(slot)

    def _swap_actors(self, plan: Plan, previous: Generation) -> None:
        """Replace the actors that serve the new generation (cannot fail half-way)."""
        ports = self.ports
        new, parts, old = plan.config, plan.parts, previous.config
        # Groups: a kept one keeps its actor (and probe timer); others start afresh.
        for tag in list(ports.group_actors):
            if tag not in parts.kept_groups:
                ref = ports.group_actors.pop(tag)
                with contextlib.suppress(pykka.ActorDeadError):
                    ref.stop(block=False)
        for view in parts.views:
            if view.tag not in ports.group_actors:
                ports.group_actors[view.tag] = PolicyGroupActor.start(ports.group, view)
        if parts.resolver is not previous.resolver:
            # The new resolver reports its answers from its construction on.
            ports.dns_flush()
        if plan.dns is not None:
            ports.install_dns(plan.dns)
        if new.runtime.stats_interval_ms != old.runtime.stats_interval_ms:
            if self.sampler is not None:
                with contextlib.suppress(pykka.ActorDeadError):
                    self.sampler.stop(block=False)
            self._start_sampler()
        if new.runtime.event_ring_capacity != old.runtime.event_ring_capacity:
            ports.log.resize(new.runtime.event_ring_capacity)

    def on_stop(self) -> None:
        """Stop the actors this supervisor started."""
        self.stop_listeners()
        if self.sampler is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.sampler.stop(block=False)
            self.sampler = None
        for ref in self.ports.group_actors.values():
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
